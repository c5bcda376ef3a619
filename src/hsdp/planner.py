"""``hsdp plan``: will the model fit, and how fast, answered from its config alone.

The model is built on the meta device (no weights are read) and split into the FSDP units the real sharding
code would make (the same shard plan, leaf-first ownership, parameters FSDP2 cannot shard kept whole). Every
per-rank figure is then exact arithmetic over parameter shapes, including FSDP2's padding of dim 0 to a
multiple of the shard size, so :mod:`hsdp.simulate` can check it against what ``fully_shard`` allocates at
1,024 ranks. Activations and step time are estimates (a transformer-shaped formula and a roofline over the
``--device-tflops`` / ``--link-gbps`` figures); the rest is exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hsdp.config import DTYPES, ConfigError, ParallelConfig, ShardingStrategy
from hsdp.plans import resolve_plan
from hsdp.sharding import _unshardable_params

__all__ = [
    "PlanError",
    "parse_size",
    "format_size",
    "UnitProfile",
    "ModelProfile",
    "profile_module",
    "profile_model",
    "build_meta_model",
    "component_folders",
    "main_component",
    "Workload",
    "Hardware",
    "Layout",
    "Estimate",
    "estimate",
    "candidate_layouts",
    "plan",
    "ResidencyPolicy",
    "residency_for_budget",
    "add_arguments",
    "run",
]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS |= {"t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class PlanError(ValueError):
    """A planning input a user can fix (size, device count, model folder); the message says how."""


def parse_size(text: str | int, flag: str = "--device-memory") -> int:
    """``"24GiB"`` / ``"80GB"`` / ``"512MiB"`` / ``"1e9"`` -> bytes; anything else is a :class:`PlanError`."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise PlanError(f"{flag}={text!r} is not a positive size; write e.g. 24GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def format_size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# -- model profile -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class UnitProfile:
    """One FSDP unit: the parameters it owns, as ``(dim0, numel // dim0, element bytes)``."""

    name: str
    params: tuple[tuple[int, int, int], ...]

    @property
    def numel(self) -> int:
        return sum(d0 * rest for d0, rest, _ in self.params)

    @property
    def nbytes(self) -> int:
        return sum(d0 * rest * b for d0, rest, b in self.params)

    def shard_bytes(self, shard: int, elem: int | None = None) -> int:
        """Bytes FSDP2 allocates per rank: dim 0 padded to a multiple of ``shard``, one chunk each."""
        return sum(math.ceil(d0 / shard) * rest * (elem or b) for d0, rest, b in self.params)

    def gathered_bytes(self, shard: int, elem: int | None = None) -> int:
        """Size of the padded all-gather output (in ``elem`` bytes per value, or the stored dtype)."""
        return sum(math.ceil(d0 / shard) * shard * rest * (elem or b) for d0, rest, b in self.params)

    def unsharded_bytes(self, elem: int | None = None) -> int:
        return sum(d0 * rest * (elem or b) for d0, rest, b in self.params)


@dataclass(frozen=True)
class ModelProfile:
    """A model (or pipeline component) as the planner sees it: FSDP units plus what stays whole."""

    name: str
    class_name: str
    kind: str
    """``diffusion`` (a DiT: CFG and Ulysses apply), ``causal_lm`` or ``encoder``."""
    blocks: tuple[UnitProfile, ...]
    """Units the shard plan selects, in forward (module) order."""
    root: UnitProfile
    """Parameters left to the root unit."""
    replicated_bytes: int
    """Parameters FSDP2 does not shard (ignored modules, 0-d or integer) plus buffers: whole on every rank."""
    hidden: int
    ffn: int
    layers: int
    heads: int
    vocab: int
    num_params: int
    """Every parameter, sharded or not (tied weights once)."""

    @property
    def units(self) -> tuple[UnitProfile, ...]:
        return (*self.blocks, self.root)

    @property
    def param_bytes(self) -> int:
        return sum(u.nbytes for u in self.units) + self.replicated_bytes

    @property
    def sharded_params(self) -> int:
        return sum(u.numel for u in self.units)


def main_component(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """The component that runs every step: a pipeline's diffusion transformer, else the largest."""
    return max(profiles, key=lambda p: (p.kind == "diffusion", p.num_params))


def _config_int(config: dict, *keys: str, default: int = 0) -> int:
    for key in keys:
        if isinstance(config.get(key), int):
            return config[key]
    return default


def profile_module(model: nn.Module, name: str = "model", config: dict | None = None) -> ModelProfile:
    """Profile a module (on meta or real) by the plan :func:`hsdp.sharding.apply_hsdp_to_model` would use."""
    plan = resolve_plan(model)
    targets = [n for n, m in model.named_modules() if n and plan.should_shard(n, m)]
    # The very rule apply_hsdp_to_model uses for parameters left whole (ignored, 0-d, integer, odd dtype).
    whole = (
        set(_unshardable_params(model, plan, training=False))
        if targets
        else {n for n, _ in model.named_parameters()}
    )
    owned: dict[str, list[tuple[int, int, int]]] = {n: [] for n in [*targets, ""]}
    replicated = sum(b.numel() * b.element_size() for b in model.buffers())
    for pname, param in model.named_parameters():
        if pname in whole:
            replicated += param.numel() * param.element_size()
            continue
        # fully_shard runs leaf-first, so the deepest selected module that contains a parameter owns it.
        owner = max((t for t in targets if pname.startswith(t + ".")), key=len, default="")
        owned[owner].append((param.shape[0], param.numel() // max(1, param.shape[0]), param.element_size()))
    if config is None:  # a transformers PretrainedConfig, or a diffusers FrozenDict
        found = getattr(model, "config", None)
        config = found.to_dict() if hasattr(found, "to_dict") else dict(found or {})
    heads = _config_int(config, "num_attention_heads", "num_heads", "n_head")
    hidden = _config_int(config, "hidden_size", "d_model", "n_embd")
    if not hidden and heads:
        hidden = heads * _config_int(config, "attention_head_dim", "head_dim", default=64)
    class_name = type(model).__name__
    if "Transformer" in class_name and hasattr(model, "register_to_config"):
        kind = "diffusion"
    elif class_name.endswith("ForCausalLM"):
        kind = "causal_lm"
    else:
        kind = "encoder"
    return ModelProfile(
        name=name,
        class_name=class_name,
        kind=kind,
        blocks=tuple(UnitProfile(t, tuple(owned[t])) for t in targets if owned[t]),
        root=UnitProfile("", tuple(owned[""])),
        replicated_bytes=replicated,
        hidden=hidden,
        ffn=_config_int(config, "intermediate_size", "ffn_dim", "d_ff", "n_inner", default=4 * hidden),
        layers=_config_int(config, "num_hidden_layers", "num_layers", "n_layer", default=len(targets)),
        heads=heads,
        vocab=_config_int(config, "vocab_size"),
        num_params=sum(p.numel() for p in model.parameters()),
    )


def _cast_meta(model: nn.Module, dtype: torch.dtype) -> None:
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    for mname, module in model.named_modules():
        if any(k in mname.split(".") for k in keep):
            continue
        for pname, param in module.named_parameters(recurse=False):
            if param.is_floating_point():
                setattr(module, pname, nn.Parameter(param.to(dtype), requires_grad=param.requires_grad))


def _stored_dtype(folder: Path, config: dict) -> torch.dtype:
    from hsdp.loading import CheckpointError, read_checkpoint_index

    try:
        dtype = read_checkpoint_index(folder).floating_dtype
    except CheckpointError:  # a config-only folder still plans, at the config's dtype
        dtype = None
    return dtype or DTYPES.get(str(config.get("torch_dtype", "")).removeprefix("torch."), torch.float32)


def build_meta_model(folder: Path, dtype: torch.dtype | None = None) -> tuple[nn.Module, dict]:
    """The model a folder's ``config.json`` describes, on the meta device at its stored dtype, and that config."""
    from hsdp.loading import CheckpointError, model_class_for

    try:
        cls = model_class_for(folder)
        config = json.loads((folder / "config.json").read_text())
    except (CheckpointError, OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read model folder {folder}: {exc}") from exc
    try:
        with torch.device("meta"):
            if hasattr(cls, "from_config") and not hasattr(cls, "_from_config"):  # diffusers
                model = cls.from_config(cls.load_config(folder))
            else:
                from transformers import AutoConfig

                hf_config = AutoConfig.from_pretrained(folder)
                model = cls._from_config(hf_config)
                config = hf_config.to_dict()
    except Exception as exc:  # a config the library rejects: say which file, keep the library's reason
        raise PlanError(f"cannot build {cls.__name__} from {folder / 'config.json'}: {exc}") from exc
    _cast_meta(model, dtype or _stored_dtype(folder, config))
    return model, config


def component_folders(name_or_path: str) -> list[tuple[str, Path]]:
    """``[(name, folder)]``: the folder itself, or each model component of a diffusers pipeline folder."""
    from hsdp.models.builtin import resolve_model

    for module in ("hsdp.models.tiny_wan",):  # built-ins register themselves on import
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    try:
        folder = resolve_model(name_or_path)
    except FileNotFoundError as exc:
        raise PlanError(str(exc)) from exc
    index_file = folder / "model_index.json"
    if not index_file.exists():
        return [(folder.name, folder)]
    try:
        index = json.loads(index_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read {index_file}: {exc}") from exc
    # Schedulers and tokenizers have no config.json; components set to null (Wan's transformer_2) are skipped.
    found = [
        (key, folder / key)
        for key, value in index.items()
        if isinstance(value, list)
        and value[0] in ("diffusers", "transformers")
        and (folder / key / "config.json").exists()
    ]
    if not found:
        raise PlanError(f"{folder} is a pipeline folder, but none of its components has a model config.json")
    return found


def profile_model(name_or_path: str, dtype: torch.dtype | None = None) -> list[ModelProfile]:
    """Profiles of a model folder, a diffusers pipeline folder (one per model component) or a built-in name."""
    profiles = []
    for name, folder in component_folders(name_or_path):
        model, config = build_meta_model(folder, dtype)
        profiles.append(profile_module(model, name, config))
    return profiles


# -- per-rank estimate of one layout -------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    training: bool = False
    batch: int = 1
    """Samples per rank group (per rank in training)."""
    seq_len: int = 1024
    """Tokens per sample (for a DiT: latent patches per frame stack)."""
    guidance: bool = True
    """Diffusion inference runs two guidance branches (classifier-free guidance) per step."""


@dataclass(frozen=True)
class Hardware:
    device_memory: int
    device_tflops: float = 300.0
    """Sustained dense TFLOP/s of one device at the compute dtype."""
    link_gbps: float = 100.0
    """Collective bandwidth per rank in GB/s (NVLink-class inside a node, far less across nodes)."""
    host_gbps: float = 25.0
    """Host <-> device copy bandwidth in GB/s (CPU offload)."""


@dataclass(frozen=True)
class Layout:
    config: ParallelConfig
    prefetch: int = 0
    """Blocks all-gathered ahead of the one computing (FSDP2 explicit forward prefetch)."""
    resident: int = 0
    """Blocks kept gathered between steps (inference with ``reshard_after_forward=False``)."""

    @property
    def label(self) -> str:
        c = self.config
        parts = []
        if c.use_hsdp:
            parts.append(f"hsdp {c.hsdp_replicate_size}x{c.hsdp_shard_size}")
            if c.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP:
                parts.append("grad-op")
        else:
            parts.append("replicated")
        for flag, value in (
            ("cfg", c.cfg_parallel_size),
            ("usp", c.ulysses_degree),
            ("tp", c.tensor_parallel_size),
        ):
            if value > 1:
                parts.append(f"{flag}{value}")
        if c.cpu_offload:
            parts.append("offload")
        if self.resident:
            parts.append(f"resident {self.resident}")
        if self.prefetch:
            parts.append(f"prefetch {self.prefetch}")
        return " ".join(parts)


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    weights: int
    gather: int
    grads: int
    optimizer: int
    activations: int
    host: int
    allgather_bytes: int
    reduce_scatter_bytes: int
    allreduce_bytes: int
    step_s: float
    samples_per_s: float
    device_memory: int

    @property
    def total(self) -> int:
        """Peak bytes per device. Gradients fill in as backward frees the activations and gathered weights,
        so a training step peaks in whichever phase holds more."""
        return self.weights + self.optimizer + max(self.grads, self.gather + self.activations)

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory

    def to_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "layout"}
        c = self.layout.config
        out.update(
            layout=self.layout.label,
            total=self.total,
            fits=self.fits,
            prefetch=self.layout.prefetch,
            resident_blocks=self.layout.resident,
            config={f.name: getattr(c, f.name) for f in dataclasses.fields(c) if not f.name.startswith("_")},
        )
        out["config"]["sharding_strategy"] = c.sharding_strategy.value if c.sharding_strategy else None
        return out


def _shard_size(config: ParallelConfig) -> int:
    return config.hsdp_shard_size if config.use_hsdp else 1


def _forward_window(p: ModelProfile, shard: int, elem: int | None, prefetch: int) -> int:
    """Peak gathered bytes around one block in forward, besides the root's weights.

    FSDP2 frees an all-gather's output buffer only after the *next* unit's copy-out (so the copy-out can overlap
    the next all-gather), and explicit prefetch issues the next all-gathers before that. Around block ``i``:
    its unsharded weights, the previous unit's buffer (the root's for the first block), its own buffer and the
    buffers of the ``prefetch - 1`` further blocks already in flight.
    """
    order = [p.root, *p.blocks]
    buffers = [u.gathered_bytes(shard, elem) for u in order]
    return max(
        (
            order[i].unsharded_bytes(elem) + buffers[i - 1] + sum(buffers[i : i + max(1, prefetch)])
            for i in range(1, len(order))
        ),
        default=0,
    )


def _weights_and_comm(p: ModelProfile, layout: Layout, training: bool) -> dict[str, int]:
    """Exact per-rank bytes of one component: sharded storage, gather buffers, grads, optimizer, comm."""
    c = layout.config
    s, r = _shard_size(c), (c.hsdp_replicate_size if c.use_hsdp else 1)
    ce = DTYPES[c.param_dtype].itemsize if c.param_dtype else None
    re_ = DTYPES[c.reduce_dtype].itemsize if c.reduce_dtype else ce
    shards = sum(u.shard_bytes(s) for u in p.units)
    out = dict(weights=p.replicated_bytes, host=0, gather=0, grads=0, optimizer=0, ag=0, rs=0, ar=0)
    out["host" if c.cpu_offload else "weights"] += shards
    gathers = s > 1 or ce is not None  # a whole unmixed model computes in place
    frac = (s - 1) / s
    if not training:
        resident, moving = p.blocks[: layout.resident], [*p.blocks[layout.resident :], p.root]
        if gathers:
            out["gather"] = (
                sum(u.unsharded_bytes(ce) for u in resident)
                + p.root.unsharded_bytes(ce)
                + _forward_window(p, s, ce, layout.prefetch)
            )
            out["ag"] = int(frac * sum(u.gathered_bytes(s, ce) for u in moving))
        return out
    # Training: sharded grads (param dtype) and two AdamW states per sharded value.
    out["host" if c.cpu_offload else "grads"] += shards + p.replicated_bytes
    out["host" if c.cpu_offload else "optimizer"] += 2 * (shards + p.replicated_bytes)
    if gathers:
        # Backward of the largest unit, with every activation still saved: its gathered weights, the next unit's
        # (FSDP2 prefetches it in backward) unless every unit stayed gathered from forward, and its unsharded
        # gradients (the reduce-scatter buffer replaces them as that layer's activations are freed).
        biggest = max(p.blocks or p.units, key=lambda u: u.unsharded_bytes(ce))
        root = p.root.unsharded_bytes(ce) + p.root.gathered_bytes(s, re_)
        grads = biggest.gathered_bytes(s, re_)
        if c.reshard_after_forward is False:  # SHARD_GRAD_OP
            out["gather"] = sum(u.unsharded_bytes(ce) for u in p.blocks) + root + grads
        else:
            out["gather"] = root + biggest.unsharded_bytes(ce) + biggest.gathered_bytes(s, ce) + grads
        passes = 1 if c.reshard_after_forward is False else 2
        out["ag"] = int(passes * frac * sum(u.gathered_bytes(s, ce) for u in p.units))
        out["rs"] = int(frac * sum(u.gathered_bytes(s, re_) for u in p.units))
    if r > 1:  # HSDP: the reduce-scattered shards are all-reduced across the replica groups
        out["ar"] = int(2 * (r - 1) / r * sum(u.shard_bytes(s, re_) for u in p.units))
    return out


def _activations(p: ModelProfile, layout: Layout, work: Workload) -> tuple[int, float]:
    """(activation bytes per rank, tokens this rank computes per step). Estimated, transformer-shaped."""
    c = layout.config
    elem = DTYPES[c.param_dtype].itemsize if c.param_dtype else (p.root.params or p.blocks[0].params)[0][2]
    branches = 2 if p.kind == "diffusion" and work.guidance and not work.training else 1
    tokens = work.batch * work.seq_len * branches / c.compute_parallel_size
    per_token = (4 * p.hidden + 2 * p.ffn) * elem
    if work.training:
        per_token = p.layers * (12 * p.hidden + 4 * p.ffn) * elem
    if p.kind == "causal_lm":
        per_token += p.vocab * (elem + 8 if work.training else elem)
    return int(tokens * per_token), tokens


def estimate(profiles: Sequence[ModelProfile], layout: Layout, work: Workload, hw: Hardware) -> Estimate:
    """Per-rank memory, bytes moved and a roofline step time for one layout.

    Components of a pipeline all hold their shards; they run one at a time, so gather buffers are the largest
    one's. Activations, collectives and time are those of the main component (the largest), which runs every
    step.
    """
    main = main_component(profiles)
    parts = {
        p.name: _weights_and_comm(p, layout if p is main else Layout(layout.config), work.training)
        for p in profiles
    }
    m = parts[main.name]
    c = layout.config
    acts, tokens = _activations(main, layout, work)
    flops = (
        (6 if work.training else 2)
        * tokens
        * (main.num_params + 2 * work.seq_len * main.hidden * main.layers)
    )
    compute = flops / (hw.device_tflops * 1e12)
    fsdp_comm = (m["ag"] + m["rs"] + m["ar"]) / (hw.link_gbps * 1e9)
    u = c.sequence_parallel_size
    # Ulysses: four all-to-alls of the activations per layer, on the critical path.
    a2a = 4 * main.layers * tokens * main.hidden * 2 * (u - 1) / u / (hw.link_gbps * 1e9) if u > 1 else 0.0
    offload = sum(x["host"] for x in parts.values()) / (hw.host_gbps * 1e9) * (2 if work.training else 1)
    overlap = layout.prefetch > 0 or work.training  # FSDP2 overlaps backward's all-gathers by default
    step = (
        (max(compute, fsdp_comm) if overlap else compute + fsdp_comm)
        + a2a
        + (offload if c.cpu_offload else 0)
    )
    groups = c.data_parallel_size if (c.request_parallel or work.training) else 1
    return Estimate(
        layout=layout,
        weights=sum(x["weights"] for x in parts.values()),
        gather=max(x["gather"] for x in parts.values()),
        grads=m["grads"],
        optimizer=m["optimizer"],
        activations=acts,
        host=sum(x["host"] for x in parts.values()),
        allgather_bytes=m["ag"],
        reduce_scatter_bytes=m["rs"],
        allreduce_bytes=m["ar"],
        step_s=step,
        samples_per_s=work.batch * max(1, groups) / step if step else 0.0,
        device_memory=hw.device_memory,
    )


# -- candidates and the recommendation -----------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _valid(**kwargs) -> ParallelConfig | None:
    try:
        return ParallelConfig(**kwargs).resolved()
    except ConfigError:
        return None


def _base_configs(
    main: ModelProfile, devices: int, work: Workload, param_dtype: str | None
) -> list[ParallelConfig]:
    common = dict(param_dtype=param_dtype)
    out: list[ParallelConfig | None] = []
    for shard in _divisors(devices):
        rep = devices // shard
        out.append(
            _valid(
                use_hsdp=True,
                hsdp_shard_size=shard,
                hsdp_replicate_size=rep,
                request_parallel=not work.training and devices > 1,
                **common,
            )
        )
        if work.training and rep == 1 and shard > 1:
            out.append(
                _valid(use_hsdp=True, hsdp_shard_size=shard, sharding_strategy="SHARD_GRAD_OP", **common)
            )
    if main.kind == "diffusion" and not work.training and devices > 1:
        for cfg in (1, 2) if work.guidance else (1,):
            uly = devices // cfg
            if devices % cfg or (main.heads and main.heads % uly) or work.seq_len % uly:
                continue
            out.append(_valid(ulysses_degree=uly, cfg_parallel_size=cfg, **common))
            for rep in _divisors(devices)[:-1]:
                out.append(
                    _valid(
                        use_hsdp=True,
                        ulysses_degree=uly,
                        cfg_parallel_size=cfg,
                        hsdp_replicate_size=rep,
                        **common,
                    )
                )
    return [c for c in out if c is not None]


def residency_for_budget(
    model: nn.Module | ModelProfile | Sequence[ModelProfile],
    config: ParallelConfig,
    budget: int,
    work: Workload | None = None,
    hw: Hardware | None = None,
) -> ResidencyPolicy:
    """Memory-budgeted inference: keep as many blocks gathered as ``budget`` bytes per device allow.

    A model that almost fits then pays almost no communication: resident blocks are gathered once and kept
    (``reshard_after_forward=False``), the rest are sharded and all-gathered each step with one block of forward
    prefetch when its buffer fits, none otherwise. Pass the result to
    ``apply_hsdp_to_model(..., resident_modules=policy.resident_modules, forward_prefetch=policy.prefetch)``.
    Raises :class:`PlanError` when not even the fully sharded layout fits.
    """
    profiles = (
        [profile_module(model)]
        if isinstance(model, nn.Module)
        else list(model)
        if isinstance(model, Sequence)
        else [model]
    )
    work, hw = work or Workload(), dataclasses.replace(hw or Hardware(budget), device_memory=budget)
    config = config.resolved()
    main = main_component(profiles)
    best = None
    for prefetch in (1, 0):
        fitting = [
            k
            for k in range(len(main.blocks) + 1)
            if estimate(profiles, Layout(config, prefetch, k), work, hw).fits
        ]
        if fitting:
            best = Layout(config, prefetch, max(fitting))
            break
    if best is None:
        need = estimate(profiles, Layout(config), work, hw).total
        raise PlanError(
            f"{config.describe()} needs {format_size(need)} per device even fully sharded without prefetch, over the "
            f"budget of {format_size(budget)}; shard over more ranks, use --param-dtype bf16 or --cpu-offload"
        )
    if best.resident == len(main.blocks):  # everything resident: nothing left to prefetch
        best = Layout(config, 0, best.resident)
    return ResidencyPolicy(
        resident_modules=tuple(u.name for u in main.blocks[: best.resident]),
        prefetch=best.prefetch,
        estimate=estimate(profiles, best, work, hw),
    )


@dataclass(frozen=True)
class ResidencyPolicy:
    resident_modules: tuple[str, ...]
    """Qualified names of the blocks to keep gathered (``reshard_after_forward=False``)."""
    prefetch: int
    """Forward prefetch depth for the sharded blocks."""
    estimate: Estimate


def candidate_layouts(
    profiles: Sequence[ModelProfile],
    devices: int,
    work: Workload,
    hw: Hardware,
    param_dtype: str | None = None,
) -> list[Layout]:
    """Every valid layout over ``devices`` ranks, each as FSDP2's defaults and, for inference, with the
    budgeted residency and prefetch; CPU-offload variants of sharded layouts are added when they alone fit."""
    main = main_component(profiles)
    layouts: list[Layout] = []
    for config in _base_configs(main, devices, work, param_dtype):
        layouts.append(Layout(config))
        sharded = config.use_hsdp and config.hsdp_shard_size > 1
        if not work.training and sharded:
            try:
                policy = residency_for_budget(profiles, config, hw.device_memory, work, hw)
                if (policy.estimate.layout.prefetch, policy.estimate.layout.resident) != (0, 0):
                    layouts.append(policy.estimate.layout)
            except PlanError:
                pass
        if sharded and not estimate(profiles, layouts[-1], work, hw).fits:
            layouts.append(Layout(dataclasses.replace(config, cpu_offload=True, _resolved=False).resolved()))
    return layouts


@dataclass(frozen=True)
class Plan:
    profiles: tuple[ModelProfile, ...]
    devices: int
    workload: Workload
    hardware: Hardware
    estimates: tuple[Estimate, ...]
    recommended: Estimate | None
    reason: str

    def to_dict(self) -> dict:
        return dict(
            model=[
                dict(
                    name=p.name,
                    class_name=p.class_name,
                    params=p.num_params,
                    param_bytes=p.param_bytes,
                    fsdp_units=len(p.units),
                )
                for p in self.profiles
            ],
            devices=self.devices,
            workload=dataclasses.asdict(self.workload),
            hardware=dataclasses.asdict(self.hardware),
            layouts=[e.to_dict() for e in self.estimates],
            recommended=self.recommended.layout.label if self.recommended else None,
            reason=self.reason,
        )


def plan(
    profiles: Sequence[ModelProfile],
    devices: int,
    work: Workload,
    hw: Hardware,
    param_dtype: str | None = None,
) -> Plan:
    """Estimate every candidate layout and pick the fastest that fits (inference: lowest step time of one
    request, then throughput; training: highest throughput), fewer bytes per device breaking ties."""
    estimates = [
        estimate(profiles, lay, work, hw)
        for lay in candidate_layouts(profiles, devices, work, hw, param_dtype)
    ]
    fitting = [e for e in estimates if e.fits]
    if work.training:
        key = lambda e: (-e.samples_per_s, e.total)  # noqa: E731
        goal = "highest estimated throughput"
    else:
        key = lambda e: (round(e.step_s, 9), -e.samples_per_s, e.total)  # noqa: E731
        goal = "lowest estimated step time for one request"
    if not fitting:
        smallest = min(estimates, key=lambda e: e.total)
        return Plan(
            tuple(profiles),
            devices,
            work,
            hw,
            tuple(estimates),
            None,
            f"nothing fits in {format_size(hw.device_memory)} per device; the smallest layout "
            f"({smallest.layout.label}) needs {format_size(smallest.total)} per device: use more devices, "
            "a larger device, or --param-dtype bf16",
        )
    best = min(fitting, key=key)
    reason = (
        f"{goal} among the {len(fitting)} of {len(estimates)} layouts that fit: "
        f"{best.step_s * 1e3:.2f} ms per step, {format_size(best.total)} of {format_size(hw.device_memory)} per device, "
        f"{format_size(best.allgather_bytes + best.reduce_scatter_bytes + best.allreduce_bytes)} of collectives per rank per step"
    )
    return Plan(tuple(profiles), devices, work, hw, tuple(estimates), best, reason)


# -- the command ---------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="model folder (HF or diffusers pipeline / component) or a built-in name"
    )
    parser.add_argument("--devices", type=int, required=True, help="number of devices (ranks) to plan for")
    parser.add_argument("--device-memory", required=True, help="memory per device, e.g. 24GiB, 80GB")
    parser.add_argument(
        "--reserve",
        default="10%",
        help="memory kept free for the runtime, communication buffers and fragmentation: a size or a percentage",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--infer", dest="training", action="store_false", help="plan inference (default)")
    mode.add_argument("--train", dest="training", action="store_true", help="plan training (AdamW)")
    parser.set_defaults(training=False)
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (default 1024)")
    parser.add_argument(
        "--batch", type=int, default=1, help="samples per request (inference) or per rank (training)"
    )
    parser.add_argument(
        "--no-guidance", dest="guidance", action="store_false", help="diffusion without CFG branches"
    )
    parser.add_argument("--dtype", default=None, help="stored weight dtype (default: the checkpoint's)")
    parser.add_argument(
        "--param-dtype", default=None, help="compute dtype of gathered weights (mixed precision)"
    )
    parser.add_argument("--device-tflops", type=float, default=300.0, help="sustained TFLOP/s per device")
    parser.add_argument("--link-gbps", type=float, default=100.0, help="collective bandwidth per rank, GB/s")
    parser.add_argument("--host-gbps", type=float, default=25.0, help="host-device copy bandwidth, GB/s")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _check_args(args: argparse.Namespace) -> None:
    problems = [
        f"{flag}={value} must be >= 1"
        for flag, value in (("--devices", args.devices), ("--seq-len", args.seq_len), ("--batch", args.batch))
        if value < 1
    ]
    problems += [
        f"{flag}={value} must be > 0"
        for flag, value in (
            ("--device-tflops", args.device_tflops),
            ("--link-gbps", args.link_gbps),
            ("--host-gbps", args.host_gbps),
        )
        if not value > 0
    ]
    problems += [
        f"{flag}={value!r} is not a dtype; use one of {', '.join(sorted(DTYPES))}"
        for flag, value in (("--dtype", args.dtype), ("--param-dtype", args.param_dtype))
        if value is not None and value not in DTYPES
    ]
    if problems:
        raise PlanError("; ".join(problems))


def _parse_reserve(text: str, memory: int) -> int:
    if str(text).strip().endswith("%"):
        try:
            percent = float(str(text).strip()[:-1])
        except ValueError:
            percent = -1.0
        if not 0 <= percent < 100:
            raise PlanError(f"--reserve={text!r}: a percentage must be in [0, 100), e.g. 10%")
        return int(memory * percent / 100)
    reserve = parse_size(text, "--reserve")
    if reserve >= memory:
        raise PlanError(f"--reserve={text} leaves nothing of --device-memory={format_size(memory)}")
    return reserve


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.2f}" if ms >= 0.01 else f"{ms:.1e}"


def _table(result: Plan) -> str:
    rows = [
        (
            "layout",
            "weights",
            "gather",
            "grads+opt",
            "activations",
            "total",
            "fits",
            "all-gather",
            "reduce",
            "step ms",
            "samples/s",
        )
    ]
    for e in result.estimates:
        mark = "yes" if e.fits else "no"
        if e is result.recommended:
            mark = "yes *"
        rows.append(
            (
                e.layout.label,
                format_size(e.weights),
                format_size(e.gather),
                format_size(e.grads + e.optimizer),
                format_size(e.activations),
                format_size(e.total),
                mark,
                format_size(e.allgather_bytes),
                format_size(e.reduce_scatter_bytes + e.allreduce_bytes),
                _ms(e.step_s),
                f"{e.samples_per_s:.1f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def run(args: argparse.Namespace) -> int:
    try:
        _check_args(args)
        memory = parse_size(args.device_memory)
        reserve = _parse_reserve(args.reserve, memory)
        hw = Hardware(memory - reserve, args.device_tflops, args.link_gbps, args.host_gbps)
        work = Workload(
            training=args.training, batch=args.batch, seq_len=args.seq_len, guidance=args.guidance
        )
        profiles = profile_model(args.model, DTYPES[args.dtype] if args.dtype else None)
        result = plan(profiles, args.devices, work, hw, args.param_dtype)
    except PlanError as exc:
        print(f"hsdp plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        for p in result.profiles:
            print(
                f"{p.name}: {p.class_name}, {p.num_params:,} parameters, {format_size(p.param_bytes)}, {len(p.blocks)} blocks"
                + ("" if p.blocks else " (kept whole on every rank)")
            )
        mode = "training" if work.training else "inference"
        print(
            f"{mode} on {args.devices} devices of {format_size(memory)} ({format_size(hw.device_memory)} usable, "
            f"--reserve {args.reserve}), batch {work.batch} x {work.seq_len} tokens\n"
        )
        print(_table(result))
        print()
    if result.recommended is None:
        print(f"hsdp plan: {result.reason}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"recommended: {result.recommended.layout.label} ({result.reason})")
    return 0
