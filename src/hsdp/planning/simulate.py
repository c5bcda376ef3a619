"""Run the real sharding code at any world size in one process, to check the planner's per-rank numbers.

torch ships a ``fake`` process-group backend whose collectives return at once. With it the default group can
claim 1,024 ranks from one process; the meshes are built on it (outside any ``FakeTensorMode``: mesh creation
there fails with ``DataDependentOutputException``), the model is built on the ``meta`` device, and the real
:func:`hsdp.sharding.apply_hsdp_to_model` runs ``fully_shard`` on it. FSDP2 then holds, for this rank, exactly
the padded shard storage it would allocate on a real cluster; :func:`simulate` reads those sizes back, and
:func:`simulate_comm` runs a step on fake tensors to count every collective and its bytes at that scale.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hsdp.config import ParallelConfig
from hsdp.distributed import forget_group_state, local_device
from hsdp.measure.comm import CommReport, measure_comm
from hsdp.mesh import ParallelMeshes, build_meshes
from hsdp.sharding import apply_hsdp_to_model

__all__ = ["SimulatedRank", "simulate", "simulate_comm", "allocated_bytes"]


@dataclass(frozen=True)
class SimulatedRank:
    """What FSDP2 allocated on one simulated rank."""

    world_size: int
    rank: int
    sharded_bytes: int
    """Padded shard storage of every FSDP-managed parameter (what the rank allocates for them)."""
    replicated_bytes: int
    """Parameters FSDP2 left whole, plus buffers."""
    unit_bytes: dict[str, int] = field(default_factory=dict)
    """Padded shard storage per FSDP unit (qualified module name, ``""`` for the root)."""
    seconds: float = 0.0

    @property
    def weights(self) -> int:
        return self.sharded_bytes + self.replicated_bytes


def allocated_bytes(model: nn.Module) -> tuple[dict[str, int], int]:
    """(padded shard bytes per FSDP unit, bytes of parameters and buffers not managed by FSDP) of a sharded model.

    Reads FSDP2's own per-parameter ``padded_sharded_param_size``: the storage it allocates, not the unpadded
    local view that ``DTensor.to_local()`` shows; an 8-bit shard (:class:`hsdp.quantize.QuantizedWeight`, never
    padded) counts its 8-bit rows and scales.
    """
    from hsdp.quantize import QuantizedWeight

    units: dict[str, int] = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group  # private: the only place the padded size lives
        if group is not None:
            units[name] = sum(
                local.stored_bytes
                if isinstance(local := p.sharded_param.to_local(), QuantizedWeight)
                else p.padded_sharded_param_size.numel() * p.sharded_param.element_size()
                for p in group.fsdp_params
            )
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))
    whole += sum(b.numel() * b.element_size() for b in model.buffers())
    return units, whole


@contextlib.contextmanager
def _fake_world(config: ParallelConfig, rank: int) -> Iterator[ParallelMeshes]:
    """This process as rank ``rank`` of a fake process group of ``config.world_size`` ranks, with its meshes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("simulation needs a process without a process group; run it outside the workers")
    if not 0 <= rank < config.world_size:
        raise ValueError(f"rank={rank} is outside the simulated world of {config.world_size} ranks")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=config.world_size)
    try:
        yield build_meshes(config)  # outside FakeTensorMode: mesh creation fails inside it
    finally:
        dist.destroy_process_group()
        forget_group_state()


def _sharded(
    build: Callable[[], nn.Module], config: ParallelConfig, meshes: ParallelMeshes, **kwargs
) -> nn.Module:
    with torch.device("meta"):
        model = build()
    apply_hsdp_to_model(model, config, meshes=meshes, **kwargs)
    return model


def simulate(
    build: Callable[[], nn.Module],
    config: ParallelConfig,
    *,
    rank: int = 0,
    training: bool = False,
    resident_modules: tuple[str, ...] = (),
    weight_dtype: str | None = None,
) -> SimulatedRank:
    """Shard ``build()`` (called under ``torch.device("meta")``) as rank ``rank`` of ``config.world_size``
    (``weight_dtype``: with 8-bit weight shards, as :func:`hsdp.sharding.apply_hsdp_to_model` stores them).

    Needs a process with no process group of its own (it creates and destroys the fake one).
    """
    config = config.resolved()
    start = time.perf_counter()
    with _fake_world(config, rank) as meshes:
        model = _sharded(
            build,
            config,
            meshes,
            training=training,
            resident_modules=resident_modules,
            weight_dtype=weight_dtype,
        )
        units, whole = allocated_bytes(model)
    return SimulatedRank(
        world_size=config.world_size,
        rank=rank,
        sharded_bytes=sum(units.values()),
        replicated_bytes=whole,
        unit_bytes=units,
        seconds=time.perf_counter() - start,
    )


def simulate_comm(
    build: Callable[[], nn.Module],
    config: ParallelConfig,
    step: Callable[[nn.Module], object],
    *,
    rank: int = 0,
    training: bool = False,
    weight_dtype: str | None = None,
) -> CommReport:
    """Collectives of one ``step(model)`` at ``config.world_size`` ranks, counted by :class:`~hsdp.measure.comm.CommCounter`.

    FSDP2 will not run with meta parameters, so the sharded model is materialised as fake tensors
    (``FakeTensorMode``: shapes and dtypes, no storage) and ``step`` runs there too; build its inputs inside
    ``step`` so they are fake as well. The fake backend's collectives move nothing, but every call, with its
    real sizes, passes through the counter.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = config.resolved()
    with _fake_world(config, rank) as meshes:
        model = _sharded(build, config, meshes, training=training, weight_dtype=weight_dtype)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device=local_device())
            return measure_comm(model, lambda: step(model), training=training)[1]
