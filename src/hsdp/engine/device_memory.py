"""``--device-memory SIZE``: residency and prefetch of every sharded component, planned from a per-rank budget.

The same planner as ``hsdp plan`` (:func:`hsdp.planning.residency_for_budget` over
:func:`hsdp.planning.profile_model`'s meta-device profiles): the main component (a pipeline's denoiser, or the LM) keeps as many
blocks gathered between forwards as the budget allows and prefetches one block ahead; other sharded components
gather with one block of prefetch, and components the engine keeps whole count in full on every rank. With
``--weight-dtype int8`` the sharded ``nn.Linear`` weights count as 8-bit shards and gathers, dequantized into the
compute dtype while their block is gathered (the rule of :mod:`hsdp.quantize`). Planned in
the caller from the model's config files alone, before any process starts, so a budget below the smallest
layout is refused at once, with the smallest layout that would fit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hsdp.config import DTYPES, ConfigError, ParallelConfig
from hsdp.planning import (
    Estimate,
    Hardware,
    Layout,
    ModelProfile,
    PlanError,
    Workload,
    estimate,
    format_size,
    main_component,
    profile_model,
    residency_for_budget,
)

logger = logging.getLogger("hsdp")

__all__ = ["DeviceMemoryPlan", "plan_device_memory", "engine_profiles"]

_MAX_SHARD = 1024


@dataclass(frozen=True)
class DeviceMemoryPlan:
    budget: int
    """Bytes per rank (``--device-memory``)."""
    component: str
    """The component whose blocks stay gathered (the main one)."""
    resident_modules: tuple[str, ...]
    prefetch: int
    blocks: int
    """Blocks of the main component."""
    estimate: Estimate
    """The planner's per-rank prediction for this choice."""
    weight_dtype: str | None = None
    """``--weight-dtype`` the plan counted (8-bit shards), or None."""

    def load_options(self) -> dict[str, dict]:
        """Component -> sharding options for :func:`hsdp.loading.load_pretrained` (others keep the defaults)."""
        return {
            self.component: {"resident_modules": self.resident_modules, "forward_prefetch": self.prefetch}
        }

    def describe(self) -> str:
        e = self.estimate
        shards = f" with {self.weight_dtype} weight shards" if self.weight_dtype else ""
        return (
            f"--device-memory {format_size(self.budget)}{shards}: {self.component} keeps {len(self.resident_modules)} of "
            f"{self.blocks} blocks gathered, prefetch {self.prefetch}; predicted peak per rank "
            f"{format_size(e.total)} (weights {format_size(e.weights)}, gathered {format_size(e.gather)}, "
            f"activations {format_size(e.activations)})"
        )


def engine_profiles(path: Path, dtype: str | None, sharded: Sequence[str]) -> list[ModelProfile]:
    """Profiles of a model folder as the engine loads it: components it does not shard count whole."""
    return profile_model(str(path), DTYPES[dtype] if dtype else None, sharded)


def plan_device_memory(
    profiles: Sequence[ModelProfile],
    config: ParallelConfig,
    budget: int,
    work: Workload,
    weight_dtype: str | None = None,
    *,
    prefetch: bool = True,
) -> DeviceMemoryPlan:
    """The most resident blocks that fit ``budget`` bytes per rank (``weight_dtype``: with 8-bit weight shards);
    ``ValueError`` naming ``--device-memory``, what the layout needs and the smallest layout that would fit when
    nothing does. ``prefetch=False`` (``--no-prefetch``) keeps the planned residency without prefetch: the
    estimate counts one prefetched block's buffer, so it stays an upper bound."""
    config = config.resolved()
    try:
        policy = residency_for_budget(profiles, config, budget, work, weight_dtype=weight_dtype)
    except PlanError:
        raise ValueError(_refusal(profiles, config, budget, work, weight_dtype)) from None
    main = main_component(profiles)
    return DeviceMemoryPlan(
        budget=budget,
        component=main.name,
        resident_modules=policy.resident_modules,
        prefetch=policy.prefetch if prefetch else 0,
        blocks=len(main.blocks),
        estimate=policy.estimate,
        weight_dtype=weight_dtype,
    )


def _refusal(
    profiles: Sequence[ModelProfile],
    config: ParallelConfig,
    budget: int,
    work: Workload,
    weight_dtype: str | None,
) -> str:
    hw = Hardware(budget)
    need = estimate(profiles, Layout(config, 1, 0, weight_dtype), work, hw)
    message = (
        f"--device-memory {format_size(budget)} is below what {config.describe()} needs fully sharded: "
        f"{format_size(need.total)} per rank (weights {format_size(need.weights)}, gathered "
        f"{format_size(need.gather)}, activations {format_size(need.activations)} for {work.seq_len} tokens)"
    )
    shard = config.hsdp_shard_size * 2
    while shard <= _MAX_SHARD:
        try:
            wider = dataclasses.replace(
                config, hsdp_shard_size=shard, sharding_strategy=None, reshard_after_forward=None
            ).resolved()
        except ConfigError:  # e.g. a combined layout whose shard size follows its Ulysses / CFG degrees
            break
        fits = estimate(profiles, Layout(wider, 1, 0, weight_dtype), work, hw)
        if fits.fits:
            return (
                f"{message}. The smallest layout that fits is --hsdp-shard-size {shard} "
                f"({wider.world_size} ranks, {format_size(fits.total)} per rank); or give --device-memory "
                f"{format_size(need.total)} or more"
            )
        shard *= 2
    return (
        f"{message}; no wider --hsdp-shard-size fits: give --device-memory {format_size(need.total)} or more"
    )
