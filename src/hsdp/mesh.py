"""Device meshes built from a :class:`~hsdp.config.ParallelConfig`, with named axes.

One object owns the meshes (torchtitan's ``ParallelDims`` habit): ``fsdp`` is what ``fully_shard`` shards over
(1-D ``("shard",)`` or 2-D ``("replicate", "shard")``), ``compute`` holds the ``("cfg", "ring", "ulysses")``
axes that split one request, and ``tp`` is the tensor-parallel axis. In combined mode HSDP overlays the
compute-parallel ranks, so ``fsdp`` and ``compute`` are two views of the same ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hsdp.config import ParallelConfig
from hsdp.distributed import device_type
from hsdp.distributed import rank as global_rank

__all__ = ["ParallelMeshes", "build_meshes"]


@dataclass(frozen=True)
class ParallelMeshes:
    config: ParallelConfig
    fsdp: DeviceMesh | None
    compute: DeviceMesh | None
    tp: DeviceMesh | None

    @property
    def rank(self) -> int:
        return global_rank()

    @cached_property
    def data_parallel_rank(self) -> int:
        """Index of this rank among the ranks that hold the same weights slice (for request parallel)."""
        if self.fsdp is None:
            return 0
        if self.fsdp.ndim == 1:
            return self.fsdp.get_local_rank()
        return self.fsdp.get_local_rank("replicate") * self.fsdp.size(1) + self.fsdp.get_local_rank("shard")

    def axis(self, name: str) -> DeviceMesh | None:
        """The 1-D mesh of one named axis (``shard``, ``replicate``, ``cfg``, ``ring``, ``ulysses``, ``tp``)."""
        for mesh in (self.fsdp, self.compute):
            if mesh is not None and name in (mesh.mesh_dim_names or ()):
                return mesh[name]
        if name == "tp":
            return self.tp
        return None


def build_meshes(config: ParallelConfig) -> ParallelMeshes:
    """Build every mesh the layout needs on this machine's device type. Needs an initialised process group."""
    config = config.resolved()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != config.world_size:
        raise ValueError(
            f"the layout needs world_size={config.world_size} ({config.describe()}), but the process group has "
            f"{world} ranks; launch {config.world_size} processes or change the parallel flags"
        )
    if world == 1 and not config.use_hsdp:
        return ParallelMeshes(config, fsdp=None, compute=None, tp=None)
    if not dist.is_initialized():
        raise RuntimeError(
            "build_meshes needs torch.distributed to be initialised (see hsdp.init_distributed)"
        )
    fsdp, compute, tp = _device_meshes(_mesh_shape(config))
    return ParallelMeshes(config, fsdp=fsdp, compute=compute, tp=tp)


_MeshShape = tuple[int, int, int, int, int, int, bool]
_Meshes = tuple[DeviceMesh | None, DeviceMesh | None, DeviceMesh | None]
_BUILT: dict[_MeshShape, tuple[dist.ProcessGroup, _Meshes]] = {}
"""Meshes already built in this process by shape, with the default group they were built under: the process groups
of a layout are created once and reused by every later model on that layout (a long-lived worker, a test session),
never accumulated. An entry is reused only under that same default group object. Group *names* do not tell: torch
numbers groups from 0 again after the default group is destroyed, so a mesh of a destroyed group (the planner's
fake one, copied into ranks forked after it) would resolve its names to the new groups and keep its old
coordinate: a rank would fill its shards with another rank's rows."""


def _mesh_shape(config: ParallelConfig) -> _MeshShape:
    return (
        config.hsdp_replicate_size,
        config.hsdp_shard_size,
        config.cfg_parallel_size,
        config.ring_degree,
        config.ulysses_degree,
        config.tensor_parallel_size,
        config.use_hsdp,
    )


def _device_meshes(shape: _MeshShape) -> _Meshes:
    world = dist.group.WORLD
    if (built := _BUILT.get(shape)) is not None and built[0] is world:
        return built[1]
    replicate, shard, cfg, ring, ulysses, tp_size, use_hsdp = shape
    kind = device_type()
    fsdp_shape, fsdp_names = (
        ((shard,), ("shard",)) if replicate == 1 else ((replicate, shard), ("replicate", "shard"))
    )
    fsdp = compute = tp = None
    if tp_size > 1:
        if not use_hsdp:
            fsdp_shape, fsdp_names = (dist.get_world_size() // tp_size,), ("dp",)
        world_mesh = init_device_mesh(kind, (*fsdp_shape, tp_size), mesh_dim_names=(*fsdp_names, "tp"))
        tp = world_mesh["tp"]
        fsdp = world_mesh[fsdp_names] if use_hsdp else None
    else:
        if cfg * ring * ulysses > 1:
            compute = init_device_mesh(kind, (cfg, ring, ulysses), mesh_dim_names=("cfg", "ring", "ulysses"))
        if use_hsdp:
            fsdp = init_device_mesh(kind, fsdp_shape, mesh_dim_names=fsdp_names)
    _BUILT[shape] = (world, (fsdp, compute, tp))
    return fsdp, compute, tp
