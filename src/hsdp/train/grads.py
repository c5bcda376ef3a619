"""Gradient helpers for models that mix FSDP-sharded (DTensor) and replicated (plain) parameters.

``torch.nn.utils.clip_grad_norm_`` refuses a mix of DTensor and plain gradients, and FSDP's ignored parameters
get no gradient reduction at all. Here the global norm is computed per group of gradients that share a mesh and
placements (each group's norm is reduced over its own mesh), plain gradients count once (they are identical on
every rank after :func:`all_reduce_plain_grads`), and the groups are combined as a root of summed squares.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["global_grad_norm", "clip_grad_norm_", "all_reduce_plain_grads"]


def _grads(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


@torch.no_grad()
def all_reduce_plain_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Average the gradients of non-DTensor parameters over all ranks (FSDP does not reduce ignored params).

    Tensor-parallel peers hold identical copies of these gradients, so the world average is the data-parallel
    average.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    grads = [g for g in _grads(params) if not isinstance(g, DTensor)]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of all gradients of the whole (unsharded) model, the same on every rank (fp32 scalar)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in _grads(params):
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    total_sq = None
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            # Offloaded shards (--cpu-offload, --offload-layers) have their norm in host memory; reduce it on the
            # mesh's device, where its collectives run (NCCL has no host tensors).
            local = norm.to_local().to(norm.device_mesh.device_type)
            norm = DTensor.from_local(local, norm.device_mesh, norm.placements).full_tensor()
        sq = norm.float() ** 2
        total_sq = sq if total_sq is None else total_sq + sq.to(total_sq.device)
    if total_sq is None:
        return torch.zeros(())
    return total_sq.sqrt()


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most ``max_norm``; returns the norm before clipping.

    Same formula as ``torch.nn.utils.clip_grad_norm_``: ``coef = min(1, max_norm / (norm + 1e-6))``.
    """
    params = list(params)
    total = global_grad_norm(params)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in _grads(params):
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(device=local.device, dtype=local.dtype))
    return total
