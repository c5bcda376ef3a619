"""Rank-side glue for the layouts: overlap of FSDP all-gathers, Ulysses through diffusers, CFG parallel.

* **Forward prefetch**: each FSDP unit starts the next unit's all-gather before its own compute, so the weights
  of block ``i + 1`` travel while block ``i`` runs (applied by :func:`hsdp.sharding.apply_hsdp_to_model`).
  Keeping weights gathered across denoising steps is ``ParallelConfig(reshard_after_forward=False)``: every
  unit, root included, stays unsharded after its first forward, so later steps do no all-gather.
* **Ulysses**: :func:`hsdp.context_parallel.enable_ulysses` (below the engine: training uses it too).
* **CFG parallel**: :class:`CFGParallelTransformer` stands in for each denoiser inside the unchanged diffusers
  pipeline, for any pipeline that runs guidance as separate labelled ``cond`` / ``uncond`` calls. On the
  conditional call, cfg rank 0 computes the conditional branch and cfg rank 1 the unconditional one; the two
  results are all-gathered, the conditional one returned and the unconditional one handed back on the
  pipeline's following unconditional call, which therefore costs nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hsdp.config import ParallelConfig, ShardingStrategy

__all__ = ["overlap_options", "CFGParallelTransformer"]


def overlap_options(config: ParallelConfig, *, forward_prefetch: bool) -> dict:
    """Sharding options for :func:`hsdp.loading.load_pretrained`: explicit forward prefetch one unit ahead
    (nothing to prefetch when weights are replicated, unless they are copied in from host memory)."""
    moves = config.sharding_strategy is not ShardingStrategy.NO_SHARD or config.offload_layers is not None
    prefetch = forward_prefetch and moves
    return {"forward_prefetch": 1 if prefetch else 0}


def _same(a: Any, b: Any) -> bool:
    """Whether two call arguments carry the same value (identity first: the usual case costs nothing)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


_OMITTED = object()
"""Stands for an argument the conditional call passes and the unconditional one leaves out."""


def _tensor_of(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output.sample


class CFGParallelTransformer(nn.Module):
    """Stands in for a denoiser whose pipeline runs guidance as two labelled calls per step,
    ``cache_context("cond")`` then ``cache_context("uncond")``, and computes them on two rank groups at once.

    Which arguments make the unconditional call differ from the conditional one (negative prompt embeddings,
    masks, pooled embeddings, text ids, ...) is learned from the pipeline itself on the first step, which runs
    both calls in full on every rank. From the second step on, the conditional call computes the conditional
    branch on cfg rank 0 and the unconditional one on cfg rank 1 (with the learned arguments), all-gathers the
    two, returns the conditional result and keeps the other for the unconditional call that follows, which then
    costs nothing. That call's arguments are checked against the prediction, so a pipeline whose unconditional
    inputs change between steps fails loudly instead of returning a wrong image.
    """

    def __init__(self, transformer: nn.Module, cfg_mesh: DeviceMesh):
        super().__init__()
        self.transformer = transformer
        self._group = cfg_mesh.get_group()
        self._branch_index = cfg_mesh.get_local_rank()
        self._branch = "cond"
        self._cond_kwargs: dict[str, Any] | None = None
        self._uncond_overrides: dict[str, Any] | None = None
        self._pending_uncond: torch.Tensor | None = None
        self.parallel_steps = 0
        """Steps whose two branches ran on the two cfg ranks (for tests and logs)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # config, dtype, device, attention processors...: the wrapped model's
            return getattr(self._modules["transformer"], name)

    def reset(self) -> None:
        """Forget what was learned (a new request may bring other conditioning inputs)."""
        self._cond_kwargs = self._uncond_overrides = self._pending_uncond = None
        self.parallel_steps = 0

    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs) -> Iterator[None]:
        """The pipeline names the branch of each call ("cond" / "uncond"); remember it, then delegate."""
        self._branch = name
        with self.transformer.cache_context(name, **kwargs):
            yield

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.update({f"__arg{i}": a for i, a in enumerate(args)})
        if self._branch == "uncond":
            return self._uncond(kwargs)
        self._pending_uncond = None  # an earlier step whose unconditional call never came
        self._cond_kwargs = kwargs
        if self._uncond_overrides is None:
            return self._call(kwargs)
        if self._branch_index == 0:
            local = _tensor_of(self._call(kwargs, return_dict=False)).contiguous()
        else:  # under the unconditional branch's name, so a step cache keeps that branch's state, as in one process
            with self.transformer.cache_context("uncond"):
                local = _tensor_of(self._call(self._uncond_kwargs(kwargs), return_dict=False)).contiguous()
        both = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(both, local, group=self._group)
        self._pending_uncond = both[1]
        self.parallel_steps += 1
        return self._wrap(both[0], kwargs)

    def _uncond(self, kwargs: dict[str, Any]) -> Any:
        cond = self._cond_kwargs
        if cond is None:
            raise RuntimeError("CFG parallel: an unconditional call came without a conditional one before it")
        if self._uncond_overrides is None:  # first step: learn which arguments carry the unconditional inputs
            self._uncond_overrides = {
                k: v for k, v in kwargs.items() if k not in cond or not _same(v, cond[k])
            } | {k: _OMITTED for k in cond.keys() - kwargs.keys()}
            return self._call(kwargs)
        expected = self._uncond_kwargs(cond)
        changed = sorted(
            k for k in expected.keys() | kwargs.keys() if not _same(kwargs.get(k), expected.get(k))
        )
        if changed or self._pending_uncond is None:
            raise RuntimeError(
                f"CFG parallel: the unconditional pass's {', '.join(changed) or 'call'} did not match what the "
                "first step showed, so the branch computed ahead is not the one asked for; run this pipeline "
                "with --cfg-parallel-size 1"
            )
        out, self._pending_uncond = self._pending_uncond, None
        return self._wrap(out, kwargs)

    def _uncond_kwargs(self, cond: dict[str, Any]) -> dict[str, Any]:
        """The unconditional call's arguments predicted from a conditional call's: the learned overrides applied,
        the arguments it left out dropped."""
        assert self._uncond_overrides is not None
        merged = {**cond, **self._uncond_overrides}
        return {k: v for k, v in merged.items() if v is not _OMITTED}

    def _call(self, kwargs: dict[str, Any], **override: Any) -> Any:
        args = [
            kwargs[k] for k in sorted((k for k in kwargs if k.startswith("__arg")), key=lambda k: int(k[5:]))
        ]
        named = {k: v for k, v in kwargs.items() if not k.startswith("__arg")}
        return self.transformer(*args, **{**named, **override})

    @staticmethod
    def _wrap(tensor: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        if kwargs.get("return_dict", True) is False:
            return (tensor,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=tensor)
