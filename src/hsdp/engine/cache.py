"""Step caches from diffusers' own hooks (``transformer.enable_cache(config)``), safe under every layout.

A cache is named on the command line (``--cache first-block``) and configured with the fields of its diffusers
config class (``--cache-config '{"threshold": 0.1}'``); :func:`cache_problems` checks both, and that the
pipeline's denoiser can use it, before any rank starts.

Which ranks must agree on a skip. FSDP2 gathers a block's weights in a pre-hook of the block's ``__call__``,
and diffusers' cache hooks replace the block's ``forward`` (inside ``__call__``): a skipped block is still
called, so its all-gather runs on every rank whatever the decision, and ranks that compute different things
(the two CFG-parallel branches, request-parallel ranks) decide alone, each exactly as one process would for its
branch or request. The collectives inside a block are Ulysses' all-to-alls: the ranks that split one forward's
sequence must skip together. Every cache here but the first-block cache decides from values all ranks hold (the
step counter, the timestep, the config's ratios). The first-block cache compares the first block's output
residual with the previous step's, a statistic of the rank's own tokens; :class:`StepCache` replaces that
decision with one computed from the sums of all ranks that run the same forward (one all-reduce of two float64
numbers per request per step), so the ratio is the whole sequence's, as in one process, and identical on every
rank.

Batched requests. diffusers' first-block cache takes one decision for the whole denoiser batch, so a request
batched beside another would skip when its neighbour does. :class:`StepCache` decides per request (the rows
that request owns, both guidance branches when the pipeline batches them, as when it runs alone); when the
requests of a batch disagree the remaining blocks run for the whole batch, and the rows of the requests that
skip get what skipping gives them (the head block's output plus their cached tail residual) and keep their
cached residuals, so each request's output and cache state equal its run alone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hsdp.suggest import did_you_mean

logger = logging.getLogger("hsdp")

__all__ = ["CACHE_CLASSES", "available_caches", "cache_problems", "build_cache_config", "StepCache"]

CACHE_CLASSES = {
    "first-block": "FirstBlockCacheConfig",
    "taylorseer": "TaylorSeerCacheConfig",
    "magcache": "MagCacheConfig",
    "pab": "PyramidAttentionBroadcastConfig",
    "fastercache": "FasterCacheConfig",
}
"""``--cache`` names -> diffusers config classes (those the installed diffusers has are offered)."""

DEFAULT_FIELDS = {
    "pab": {"spatial_attention_block_skip_range": 2},
    "taylorseer": {"taylor_factors_dtype": None},
}
"""Fields the engine fills when the caller leaves them out. Pyramid Attention Broadcast cannot run without one
skip range: recompute spatial attention every second call, as in its paper's setting. TaylorSeer keeps its
Taylor factors in the features' own dtype (``None``) rather than diffusers' default bfloat16: rounding a float32
feature to bfloat16 is a step function, so a 1-ulp difference in the features (a request batched beside another:
CPU GEMMs round differently for another batch size) moves the stored factor by a whole bfloat16 ulp (2^-8 to
2^-7 of the value, 2^16 float32 ulps) when the feature sits next to a rounding midpoint (tiny-wan: 1.4e-3 on
pixels, batched against alone). In the features' dtype the extrapolation of order N, at offset s from the last
computed step and gaps of at least D between computed steps, moves the 1 ulp by at most sum_k (2s/D)^k / k!
ulps (3 for order 1 at s = D = 1; tests/test_engine_cache.py), so a batched request stays within 1e-5 of alone.
For a bfloat16 model the two defaults are the same."""

ENGINE_FIELDS = frozenset({"current_timestep_callback", "num_inference_steps"})
"""Fields the engine sets per call: the pipeline's current timestep, and MagCache's step count (the call's)."""


def available_caches() -> dict[str, type]:
    """``--cache`` name -> config class, for the caches the installed diffusers offers."""
    import diffusers.hooks

    classes = {name: getattr(diffusers.hooks, cls, None) for name, cls in CACHE_CLASSES.items()}
    return {name: cls for name, cls in classes.items() if cls is not None}


def _coerce(value: Any, default: Any) -> Any:
    """JSON values into the field's type: dtype names (``"bfloat16"``) and lists for tuple fields."""
    if isinstance(default, torch.dtype) and isinstance(value, str):
        dtype = getattr(torch, value, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f'{value!r} is not a torch dtype (e.g. "bfloat16", "float32")')
        return dtype
    if isinstance(default, tuple) and isinstance(value, list):
        return tuple(value)
    return value


def build_cache_config(
    name: str,
    fields: dict[str, Any] | None = None,
    *,
    timestep: Callable[[], Any] = lambda: 0,
    num_inference_steps: int | None = None,
) -> Any:
    """The diffusers config object for cache ``name``: the caller's ``fields`` over :data:`DEFAULT_FIELDS`,
    with the engine's fields filled (``timestep`` returns the pipeline's current timestep). ``ValueError`` for
    an unknown name or field, or a value the class rejects."""
    classes = available_caches()
    if name not in classes:
        raise ValueError(f"--cache {name}: unknown cache; available: {', '.join(classes)}{did_you_mean(name, classes)}")
    cls = classes[name]
    declared = {f.name: f for f in dataclasses.fields(cls)}
    values = {**DEFAULT_FIELDS.get(name, {}), **(fields or {})}
    unknown = sorted(set(values) - set(declared))
    engine_set = sorted(set(values) & ENGINE_FIELDS)
    if unknown or engine_set:
        accepted = ", ".join(sorted(set(declared) - ENGINE_FIELDS))
        what = (
            f"takes no {', '.join(unknown)}" if unknown else f"{', '.join(engine_set)} is set by the engine"
        )
        raise ValueError(f"--cache-config: {cls.__name__} {what}; it takes {accepted}")
    kwargs = {}
    for key, value in values.items():
        field = declared[key]
        default = field.default if field.default is not dataclasses.MISSING else None
        try:
            kwargs[key] = _coerce(value, default)
        except ValueError as exc:
            raise ValueError(f"--cache-config {key}: {exc}") from exc
    if "current_timestep_callback" in declared:
        kwargs["current_timestep_callback"] = timestep
    if "num_inference_steps" in declared and num_inference_steps is not None:
        kwargs["num_inference_steps"] = num_inference_steps
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--cache {name} --cache-config: {cls.__name__} rejects it: {exc}") from exc


def _meta_denoiser(folder) -> nn.Module:
    """The denoiser built on the meta device from its config: structure only, no memory, no weights read."""
    from hsdp.models.description import class_for_folder

    cls = class_for_folder(folder)
    with torch.device("meta"):
        return cls.from_config(cls.load_config(folder))


def cache_problems(name: str | None, fields: dict[str, Any] | None, info, parallel=None) -> list[str]:
    """Why cache ``name`` with ``fields`` cannot run on the pipeline ``info`` describes under the layout
    ``parallel`` (empty when it can): an unknown name or field, a value the config class rejects, a denoiser that
    is not a diffusers ``CacheMixin`` or lacks the layers the cache hooks, a pipeline whose guidance the cache
    does not handle, CFG parallel with a cache that shares one state between the guidance branches."""
    if name is None:
        return (
            [f"--cache-config is given without --cache (one of {', '.join(available_caches())})"]
            if fields
            else []
        )
    try:
        config = build_cache_config(name, fields, num_inference_steps=None)
    except ValueError as exc:
        return [str(exc)]
    if info.kind != "diffusion":
        return [f"--cache {name}: step caches apply to diffusers pipelines; {info.class_name} is a causal LM"]
    if name == "fastercache" and info.separate_uncond_pass:
        return [
            f"--cache fastercache: {info.class_name} runs guidance as a separate unconditional denoiser call, and "
            "diffusers' FasterCache approximates the unconditional half of one batched (cond, uncond) call; use "
            "--cache first-block, taylorseer, magcache or pab"
        ]
    problems = []
    for denoiser in info.denoisers:
        model = _meta_denoiser(info.path / denoiser)
        if not hasattr(model, "enable_cache"):
            problems.append(
                f"--cache {name}: the {denoiser} of {info.class_name} ({type(model).__name__}) has no diffusers "
                "step-cache support (it is not a CacheMixin); drop --cache"
            )
            continue
        try:
            model.enable_cache(config)
        except (ValueError, IndexError, KeyError, AttributeError, TypeError) as exc:
            problems.append(
                f"--cache {name}: the {denoiser} of {info.class_name} ({type(model).__name__}) cannot use it "
                f"({type(exc).__name__}: {exc}); try another cache or drop --cache"
            )
            continue
        hooks = [
            h
            for m in model.modules()
            if getattr(m, "_diffusers_hook", None)
            for h in m._diffusers_hook.hooks.values()
        ]
        if (
            parallel is not None
            and parallel.cfg_parallel_size == 2
            and not all(hasattr(h, "state_manager") for h in hooks)
        ):
            problems.append(
                f"--cache {name} with --cfg-parallel-size 2: that cache keeps one state for both guidance branches "
                "(one process runs the unconditional call after the conditional one and reuses what that call "
                "left), so splitting the branches across ranks would change its result; use --cache first-block, "
                "taylorseer or magcache (state per branch), or --cfg-parallel-size 1"
            )
        if not hooks:
            problems.append(
                f"--cache {name}: its layer-name patterns match no module of the {denoiser} "
                f"({type(model).__name__}), so it would skip nothing; set the patterns in --cache-config (e.g. "
                'TaylorSeer\'s "cache_identifiers": ["blocks\\\\.\\\\d+\\\\.attn\\\\d"]) or pick another cache'
            )
    return problems


def agreement_group(config, meshes) -> dist.ProcessGroup | None:
    """The ranks that run the same forward of the same request and guidance branch, which must skip together:
    none for request-parallel ranks (each runs its own request), the sequence-parallel ranks of one CFG branch,
    else every rank (HSDP alone: all ranks compute the same forward)."""
    if config.request_parallel or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if meshes.compute is None or config.cfg_parallel_size == 1:
        return dist.group.WORLD
    axes = [a for a in ("ring", "ulysses") if meshes.compute[a].size() > 1]
    if not axes:
        return None
    mesh = meshes.compute[tuple(axes)]
    return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()


def _register_sharded_blocks(model: nn.Module) -> None:
    """diffusers' cache hooks look a block's class up in its ``TransformerBlockRegistry``; FSDP2 swaps each
    sharded block's class for an ``FSDP<Name>`` subclass, so register those under their base's metadata."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    for cls in {type(m) for m in model.modules() if isinstance(m, FSDPModule)}:
        for base in cls.__mro__[1:]:
            try:
                metadata = TransformerBlockRegistry.get(base)
            except ValueError:
                continue
            TransformerBlockRegistry.register(cls, dataclasses.replace(metadata))
            break


def _enable_inside_context_parallel(model: nn.Module, config: Any) -> None:
    """``model.enable_cache(config)`` with diffusers' context-parallel hooks (Ulysses' split of the first block's
    input, gather of the output) kept outermost: a cache hook added after them would wrap the split and compare
    the whole sequence's input with one rank's share of the output."""
    parallel = getattr(model, "_parallel_config", None)
    context_parallel = parallel.context_parallel_config if parallel is not None else None
    if context_parallel is None:
        model.enable_cache(config)
        return
    from diffusers.hooks.context_parallel import apply_context_parallel, remove_context_parallel

    remove_context_parallel(model, model._cp_plan)
    model.enable_cache(config)
    apply_context_parallel(model, context_parallel, model._cp_plan)


def _library_class(module: nn.Module) -> type:
    """The model's own class behind FSDP2's ``FSDP<Name>`` (or ``replicate``'s) subclass."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("torch."))


@dataclasses.dataclass
class CacheStats:
    """What the cache did during one call, on this rank."""

    name: str
    unit: str
    """The class of the modules the cache hooks (the denoiser's blocks, or their attention layers)."""
    calls: int = 0
    computed: int = 0
    overruled: int = 0
    """First-block cache: decisions where this rank's own tokens alone would have decided otherwise."""

    @property
    def skipped(self) -> int:
        return self.calls - self.computed

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "skipped": self.skipped}


class StepCache:
    """The cache of the runner's denoisers on one rank: enabled per call (a call may change the cache or its
    step count), counted, and with the first-block decision agreed over ``group``."""

    def __init__(self, denoisers: list[nn.Module], group: dist.ProcessGroup | None):
        self.denoisers = denoisers
        self.group = group
        self._key: tuple | None = None
        self.stats: CacheStats | None = None
        self._requests = 1
        self._wrapped: list[tuple[Any, str, Callable]] = []
        """(hook function reference, attribute, the function it held before counting): undone before
        ``disable_cache``, which puts a hook's original forward back on the module."""

    def prepare(
        self,
        name: str | None,
        fields: dict | None,
        pipe,
        num_inference_steps: int | None,
        *,
        requests: int = 1,
    ) -> None:
        """Enable cache ``name`` for the next call (or none), resetting its state and counters. The call runs
        ``requests`` requests as one batch: the first-block cache decides per request."""
        self._requests = requests
        key = (name, repr(sorted((fields or {}).items())), num_inference_steps) if name else None
        if key != self._key:
            for fn_ref, attribute, fn in reversed(self._wrapped):  # a function wrapped twice: outer one first
                setattr(fn_ref, attribute, fn)
            self._wrapped = []
            for model in self.denoisers:
                if model.is_cache_enabled:
                    model.disable_cache()
            self.stats = None
            if name is not None:
                self.stats = CacheStats(name, "")
                for model in self.denoisers:
                    _register_sharded_blocks(model)
                    config = build_cache_config(
                        name,
                        fields,
                        timestep=lambda: pipe.current_timestep,
                        num_inference_steps=num_inference_steps,
                    )
                    _enable_inside_context_parallel(model, config)
                    self._instrument(model)
            self._key = key
        if self.stats is not None:
            for model in self.denoisers:
                model._reset_stateful_cache()
            self.stats = dataclasses.replace(self.stats, calls=0, computed=0, overruled=0)

    def _instrument(self, model: nn.Module) -> None:
        """Count every hooked module's calls and real computations; agree first-block decisions."""
        from diffusers.hooks.first_block_cache import FBCBlockHook, FBCHeadBlockHook

        units: Counter[str] = Counter()
        for module in model.modules():
            registry = getattr(module, "_diffusers_hook", None)
            if registry is None or module is model:
                continue
            for hook in registry.hooks.values():
                if getattr(hook, "fn_ref", None) is None or hook.fn_ref.original_forward is None:
                    continue
                units[_library_class(module).__name__] += 1
                self._wrap(hook.fn_ref, lambda fn: self._counted(fn, "calls"))
                self._wrap(hook.fn_ref, lambda fn: self._counted(fn, "computed"), "original_forward")
                if isinstance(hook, FBCHeadBlockHook):
                    hook._should_compute_remaining_blocks = self._agreed_decision(hook)
                    self._wrap(hook.fn_ref, _keep_skipped_head_residuals(hook))
                elif isinstance(hook, FBCBlockHook) and hook.is_tail:
                    self._wrap(hook.fn_ref, _finish_skipped_rows(hook))
        assert self.stats is not None
        self.stats.unit = units.most_common(1)[0][0] if units else "module"

    def _wrap(self, fn_ref, wrapper: Callable[[Callable], Callable], attribute: str = "forward") -> None:
        """Replace a hook's function by ``wrapper(function)``, remembered so that :meth:`prepare` can undo it."""
        fn = getattr(fn_ref, attribute)
        self._wrapped.append((fn_ref, attribute, fn))
        setattr(fn_ref, attribute, wrapper(fn))

    def _counted(self, fn: Callable, counter: str) -> Callable:
        def call(*args, **kwargs):
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)
            return fn(*args, **kwargs)

        return call

    def _agreed_decision(self, hook) -> Callable[[torch.Tensor], bool]:
        """FBC's decision (``mean|r - r_prev| / mean|r_prev| > threshold``) per request, from sums over every rank
        of the group: each request's whole-sequence statistic, the same numbers on each rank. Returns whether the
        remaining blocks run; when the batch's requests disagree they run, and the rows of the requests that skip
        are marked on the cache state for :func:`_keep_skipped_head_residuals` and :func:`_finish_skipped_rows`."""
        group = self.group

        @torch.compiler.disable
        def should_compute(residual: torch.Tensor) -> bool:
            state = hook.state_manager.get_state()
            state.hsdp_skipped = None
            previous = state.head_block_residual
            if previous is None:  # the first call of this branch: every rank of the group is at the same point
                return True
            layout = _branches_by_requests(residual.shape[0], self._requests)
            per_row = torch.stack(
                [
                    (residual - previous).abs().flatten(1).sum(1, dtype=torch.float64),
                    previous.abs().flatten(1).sum(1, dtype=torch.float64),
                ],
                dim=1,
            )
            local = per_row.view(*layout, 2).sum(dim=0)  # (requests, 2)
            sums = local.clone()
            if group is not None:
                dist.all_reduce(sums, group=group)
            compute = sums[:, 0] > hook.threshold * sums[:, 1]
            self.stats.overruled += int((compute != (local[:, 0] > hook.threshold * local[:, 1])).sum())
            if bool(compute.all()) or not bool(compute.any()):
                return bool(compute[0])
            skipped = ~compute.repeat(layout[0])
            state.hsdp_skipped = _SkippedRows(skipped, previous, state.tail_block_residuals)
            return True

        return should_compute


def _branches_by_requests(rows: int, requests: int) -> tuple[int, int]:
    """(guidance branches, requests) of a denoiser batch of ``rows`` rows for ``requests`` requests: the
    pipeline stacks one row per request (diffusers takes one generator per output, so a call with several
    requests makes one output each) and repeats that block per guidance branch it batches (``torch.cat``)."""
    if rows % requests:
        raise RuntimeError(
            f"first-block cache: the denoiser's batch of {rows} rows does not split into {requests} requests"
        )
    return rows // requests, requests


@dataclasses.dataclass(frozen=True)
class _SkippedRows:
    """The rows whose requests skip at this step while the batch computes, and their cached residuals."""

    rows: torch.Tensor
    head_residual: torch.Tensor
    tail_residuals: tuple


def _rows_where(rows: torch.Tensor, skipped: torch.Tensor, computed: torch.Tensor) -> torch.Tensor:
    """``skipped``'s rows where ``rows`` is set, else ``computed``'s."""
    return torch.where(rows.view(-1, *[1] * (computed.ndim - 1)), skipped, computed)


def _keep_skipped_head_residuals(hook) -> Callable[[Callable], Callable]:
    """Wrapper of the head block's hooked forward: the rows that skip keep the head residual they compare with
    (alone, a skipped step stores nothing)."""

    def wrapper(fn: Callable) -> Callable:
        def call(*args, **kwargs):
            output = fn(*args, **kwargs)
            state = hook.state_manager.get_state()
            skipped = getattr(state, "hsdp_skipped", None)
            if skipped is not None:
                state.head_block_residual = _rows_where(
                    skipped.rows, skipped.head_residual, state.head_block_residual
                )
            return output

        return call

    return wrapper


def _finish_skipped_rows(hook) -> Callable[[Callable], Callable]:
    """Wrapper of the tail block's hooked forward: the rows that skip leave with the head block's output plus
    their cached tail residuals (diffusers' skip, operand for operand) and keep those residuals."""

    def wrapper(fn: Callable) -> Callable:
        def call(*args, **kwargs):
            output = fn(*args, **kwargs)
            state = hook.state_manager.get_state()
            skipped = getattr(state, "hsdp_skipped", None)
            if skipped is None:
                return output
            state.hsdp_skipped = None
            head = state.head_block_output
            heads = (head[0], head[1]) if isinstance(head, list) else (head, None)
            cached = skipped.tail_residuals
            metadata = hook._metadata
            if isinstance(output, tuple):
                output = list(output)
                indices = (metadata.return_hidden_states_index, metadata.return_encoder_hidden_states_index)
                for index, residual, head_output in zip(indices, cached, heads, strict=True):
                    if index is not None:
                        output[index] = _rows_where(skipped.rows, residual + head_output, output[index])
                output = tuple(output)
            else:
                output = _rows_where(skipped.rows, cached[0] + heads[0], output)
            state.tail_block_residuals = tuple(
                None if new is None else _rows_where(skipped.rows, old, new)
                for old, new in zip(cached, state.tail_block_residuals, strict=True)
            )
            return output

        return call

    return wrapper
