"""The layouts ``hsdp plan`` weighs: every valid layout over the devices, budgeted residency for inference, and
the recommendation (the fastest estimate that fits).

Each candidate is estimated per rank by :func:`hsdp.planning.estimate.estimate` over the meta-device profiles of
:mod:`hsdp.planning.profile`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hsdp.config import ConfigError, ParallelConfig
from hsdp.planning.estimate import Estimate, Hardware, Layout, Workload, estimate
from hsdp.planning.profile import (
    ModelProfile,
    PlanError,
    format_ms,
    format_size,
    main_component,
    profile_module,
)
from hsdp.quantize import WEIGHT_DTYPES, weight_dtype_problem

__all__ = ["candidate_layouts", "Plan", "plan", "ResidencyPolicy", "residency_for_budget"]


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


@dataclass(frozen=True)
class ResidencyPolicy:
    resident_modules: tuple[str, ...]
    """Qualified names of the blocks to keep gathered (``reshard_after_forward=False``)."""
    prefetch: int
    """Forward prefetch depth for the sharded blocks."""
    estimate: Estimate


def residency_for_budget(
    model: nn.Module | ModelProfile | Sequence[ModelProfile],
    config: ParallelConfig,
    budget: int,
    work: Workload | None = None,
    hw: Hardware | None = None,
    weight_dtype: str | None = None,
) -> ResidencyPolicy:
    """Memory-budgeted inference: keep as many blocks gathered as ``budget`` bytes per device allow.

    A model that almost fits then pays almost no communication: resident blocks are gathered once and kept
    (``reshard_after_forward=False``), the rest are sharded and all-gathered each step with one block of forward
    prefetch. Pass the result to
    ``apply_hsdp_to_model(..., resident_modules=policy.resident_modules, forward_prefetch=policy.prefetch)``
    (with the same ``weight_dtype``: 8-bit shards and gathers, :mod:`hsdp.quantize`).
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
    # One block of prefetch costs little memory in FSDP2 (the previous all-gather buffer lives until the next
    # copy-out anyway; +6 % peak measured in benchmarks/plan_accuracy.py's model), so every layout with blocks
    # left to gather prefetches one, and the estimate counts its buffer.
    fitting = [
        k
        for k in range(len(main.blocks) + 1)
        if estimate(profiles, Layout(config, 1, k, weight_dtype), work, hw).fits
    ]
    if not fitting:
        need = estimate(profiles, Layout(config, weight_dtype=weight_dtype), work, hw).total
        raise PlanError(
            f"{config.describe()} needs {format_size(need)} per device even fully sharded, over the budget of "
            f"{format_size(budget)}; shard over more ranks, use --param-dtype bf16 or --cpu-offload"
        )
    resident = max(fitting)
    best = Layout(config, 0 if resident == len(main.blocks) else 1, resident, weight_dtype)
    return ResidencyPolicy(
        resident_modules=tuple(u.name for u in main.blocks[: best.resident]),
        prefetch=best.prefetch,
        estimate=estimate(profiles, best, work, hw),
    )


def candidate_layouts(
    profiles: Sequence[ModelProfile],
    devices: int,
    work: Workload,
    hw: Hardware,
    param_dtype: str | None = None,
    weight_dtype: str | None = None,
) -> list[Layout]:
    """Every valid layout over ``devices`` ranks, each as FSDP2's defaults and, for inference, with the
    budgeted residency and prefetch; CPU-offload variants are added where the layout does not fit without.
    With ``weight_dtype`` (8-bit shards, inference) only the layouts that shard over 2 or more ranks."""
    main = main_component(profiles)
    layouts: list[Layout] = []
    for config in _base_configs(main, devices, work, param_dtype):
        sharded = config.use_hsdp and config.hsdp_shard_size > 1
        if weight_dtype is not None and not sharded:
            continue
        layouts.append(Layout(config, weight_dtype=weight_dtype))
        if work.training and sharded and _has_frozen(profiles):  # LoRA: the base whole, never gathered
            layouts.append(Layout(dataclasses.replace(config, frozen_whole=True, _resolved=False).resolved()))
        if not work.training and sharded:
            try:
                policy = residency_for_budget(profiles, config, hw.device_memory, work, hw, weight_dtype)
                if (policy.estimate.layout.prefetch, policy.estimate.layout.resident) != (0, 0):
                    layouts.append(policy.estimate.layout)
            except PlanError:
                pass
        if config.use_hsdp and not estimate(profiles, layouts[-1], work, hw).fits:
            if (layerwise := _offload_layers_layout(profiles, config, work, hw, weight_dtype)) is not None:
                layouts.append(layerwise)
            offload = dataclasses.replace(config, cpu_offload=True, _resolved=False).resolved()
            layouts.append(Layout(offload, weight_dtype=weight_dtype))
    return layouts


def _offload_layers_layout(
    profiles: Sequence[ModelProfile], config: ParallelConfig, work: Workload, hw: Hardware, weight_dtype: str | None
) -> Layout | None:
    """``--offload-layers K`` with the most blocks on the device that fits (the fewest bytes copied in per step),
    prefetching one block ahead for inference as the engine does; None when even K = 0 does not fit."""
    blocks = len(main_component(profiles).blocks)
    for k in range(blocks - 1, -1, -1):
        layered = dataclasses.replace(config, offload_layers=k, _resolved=False).resolved()
        layout = Layout(layered, 0 if work.training else 1, weight_dtype=weight_dtype)
        if estimate(profiles, layout, work, hw).fits:
            return layout
    return None


def _has_frozen(profiles: Sequence[ModelProfile]) -> bool:
    """Whether training leaves parameters frozen (a LoRA's base): the case ``--frozen-whole`` is for."""
    return any(u.frozen().params for p in profiles for u in p.units)


def _check_weight_dtype(weight_dtype: str, devices: int, work: Workload) -> None:
    """8-bit shards plan for inference over 2 or more devices (whether the target device has fp8 kernels is
    checked where the model runs)."""
    if weight_dtype not in WEIGHT_DTYPES or work.training:  # the name first, then training
        raise PlanError(weight_dtype_problem(weight_dtype, "cpu", training=work.training))
    if devices < 2:
        raise PlanError(
            f"--weight-dtype {weight_dtype} stores FSDP shards in 8 bits: plan 2 or more --devices"
        )


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
    weight_dtype: str | None = None,
) -> Plan:
    """Estimate every candidate layout and pick the fastest that fits (inference: lowest step time of one
    request, then throughput; training: highest throughput), fewer bytes per device breaking ties.
    ``weight_dtype`` (``int8`` / ``fp8``): 8-bit weight shards (inference only)."""
    main = main_component(profiles)
    if not main.blocks:
        raise PlanError(
            f"the shard plan matches no module of {main.class_name} ({main.name}), so it cannot be sharded: give "
            "the model _no_split_modules naming its block class, or register a plan in hsdp.shard_rules"
        )
    if weight_dtype is not None:
        _check_weight_dtype(weight_dtype, devices, work)
    estimates = [
        estimate(profiles, lay, work, hw)
        for lay in candidate_layouts(profiles, devices, work, hw, param_dtype, weight_dtype)
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
        f"{format_ms(best.step_s)} ms per step, {format_size(best.total)} of {format_size(hw.device_memory)} per device, "
        f"{format_size(best.allgather_bytes + best.reduce_scatter_bytes + best.allreduce_bytes)} of collectives per rank per step"
    )
    return Plan(tuple(profiles), devices, work, hw, tuple(estimates), best, reason)
