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

__all__ = ["ParallelMeshes", "build_meshes"]


@dataclass(frozen=True)
class ParallelMeshes:
    config: ParallelConfig
    fsdp: DeviceMesh | None
    compute: DeviceMesh | None
    tp: DeviceMesh | None

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

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


def _fsdp_shape(config: ParallelConfig) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if config.hsdp_replicate_size == 1:
        return (config.hsdp_shard_size,), ("shard",)
    return (config.hsdp_replicate_size, config.hsdp_shard_size), ("replicate", "shard")


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
    kind = device_type()
    fsdp = compute = tp = None
    if config.tensor_parallel_size > 1:
        shape, names = (
            _fsdp_shape(config) if config.use_hsdp else ((world // config.tensor_parallel_size,), ("dp",))
        )
        world_mesh = init_device_mesh(
            kind, (*shape, config.tensor_parallel_size), mesh_dim_names=(*names, "tp")
        )
        tp = world_mesh["tp"]
        fsdp = world_mesh[names] if config.use_hsdp else None
        return ParallelMeshes(config, fsdp=fsdp, compute=None, tp=tp)
    if config.compute_parallel_size > 1:
        compute = init_device_mesh(
            kind,
            (config.cfg_parallel_size, config.ring_degree, config.ulysses_degree),
            mesh_dim_names=("cfg", "ring", "ulysses"),
        )
    if config.use_hsdp:
        shape, names = _fsdp_shape(config)
        fsdp = init_device_mesh(kind, shape, mesh_dim_names=names)
    return ParallelMeshes(config, fsdp=fsdp, compute=compute, tp=tp)
