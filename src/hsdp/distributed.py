"""Process-group setup that picks the device and backend from the machine: CUDA + NCCL, or CPU + gloo."""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger("hsdp")

DEFAULT_TIMEOUT_S = float(os.environ.get("HSDP_COLLECTIVE_TIMEOUT", "300"))


def device_type() -> str:
    """The accelerator type this process should use ("cuda", "xpu", ...), or "cpu" when there is none."""
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return "cpu"


def local_device() -> torch.device:
    """This rank's device: one accelerator per local rank, or the CPU."""
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(kind, local_rank % torch.accelerator.device_count())


def available_devices() -> int | None:
    """How many accelerators this host has, or None on a CPU-only host (where any world size can run)."""
    if device_type() == "cpu":
        return None
    return torch.accelerator.device_count()


def init_distributed(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    store: dist.Store | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> torch.device:
    """Join (or create) the default process group; returns this rank's device.

    Without arguments it reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...). Every
    collective gets ``timeout_s``, so a dead peer surfaces as an error instead of a hang.
    """
    device = local_device()
    if dist.is_initialized():
        return device
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    backend = dist.get_default_backend_for_device(device)
    kwargs: dict = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)
    logger.debug("rank %d/%d joined %s on %s", dist.get_rank(), dist.get_world_size(), backend, device)
    return device


def destroy_distributed() -> None:
    """Tear the process group down explicitly; gloo can abort at interpreter exit otherwise."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
