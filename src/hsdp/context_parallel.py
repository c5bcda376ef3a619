"""Ulysses / ring sequence parallel for diffusers models, used by inference and training alike.

diffusers' ``enable_parallelism(ContextParallelConfig(..., mesh=...))`` runs on our ``compute`` mesh, whose ``ring``
/ ``ulysses`` axes it slices itself; HSDP overlays the same ranks. The model's ``_cp_plan`` says where the sequence
is split and gathered again; its all-gather's backward keeps each rank's own chunk of the gradient, so under
training every rank's parameter gradients cover its share of the sequence (the trainer scales for that).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from hsdp.config import ParallelConfig
from hsdp.mesh import ParallelMeshes

__all__ = ["enable_ulysses", "has_cp_plan"]


def has_cp_plan(model_class: type) -> bool:
    """Whether a diffusers model class says how to split its sequence (``_cp_plan``)."""
    return bool(getattr(model_class, "_cp_plan", None))


@contextlib.contextmanager
def _accelerator_count_at_least_one() -> Iterator[None]:
    """diffusers computes ``rank % torch.accelerator.device_count()``, which divides by zero on a CPU-only build;
    report one device for the duration of the call only."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def enable_ulysses(model: nn.Module, config: ParallelConfig, meshes: ParallelMeshes) -> None:
    """Sequence-parallel attention for a diffusers transformer over the layout's ring x ulysses axes."""
    from diffusers import ContextParallelConfig

    cp_config = ContextParallelConfig(
        ulysses_degree=config.ulysses_degree, ring_degree=config.ring_degree, mesh=meshes.compute
    )
    with _accelerator_count_at_least_one():
        model.enable_parallelism(config=cp_config)
