"""This rank's memory, read the same way by ``generate``, ``train``, ``serve`` and the benchmarks.

On an accelerator: the caching allocator's counters (``max_memory_allocated`` since the last reset), what the
planner predicts. On the CPU: the process's resident set; its peak is Linux's high-water mark ``VmHWM``, which
:func:`reset_peak_memory` resets to the current RSS (``/proc/self/clear_refs``). Where that cannot be read, the
peak is ``ru_maxrss`` over the process's lifetime, and the reading's ``kind`` says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from hsdp.distributed import local_device

__all__ = ["MemoryReading", "peak_memory", "reset_peak_memory", "resident_memory"]

_STATUS = Path("/proc/self/status")


class MemoryReading(NamedTuple):
    bytes: int
    kind: str
    """What was counted (``cuda max_memory_allocated``, ``cpu peak RSS``, ...), for tables and metrics labels."""


def _status_bytes(field: str) -> int:
    line = next(line for line in _STATUS.read_text().splitlines() if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024  # the kernel writes kB


def peak_memory(device: torch.device | str | None = None) -> MemoryReading:
    """Peak memory since the last :func:`reset_peak_memory` (or since the process started)."""
    device = torch.device(device) if device is not None else local_device()
    if device.type != "cpu":
        return MemoryReading(
            int(torch.accelerator.max_memory_allocated(device)), f"{device.type} max_memory_allocated"
        )
    with contextlib.suppress(OSError, StopIteration):
        return MemoryReading(_status_bytes("VmHWM"), "cpu peak RSS")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return MemoryReading(peak if sys.platform == "darwin" else peak * 1024, "cpu peak RSS (process lifetime)")


def resident_memory(device: torch.device | str | None = None) -> int:
    """Bytes held now: accelerator memory allocated, or this process's RSS on the CPU (0 if unknown)."""
    device = torch.device(device) if device is not None else local_device()
    if device.type != "cpu":
        return int(torch.accelerator.memory_allocated(device))
    with contextlib.suppress(OSError, StopIteration):
        return _status_bytes("VmRSS")
    return 0


def reset_peak_memory(device: torch.device | str | None = None, *, release_freed: bool = True) -> None:
    """Start a new peak measurement (a ``generate`` call, a training step).

    On the CPU, ``release_freed`` first hands the heap that is free but still mapped back to the system
    (``malloc_trim``), so the new peak starts from live memory. That costs more than it reads: the trim itself, and
    every page the process then touches again faults back in, zeroed (about 20 % of a small training step on the
    CPU). A caller that resets often (each training step) trims once and then passes ``release_freed=False``: the
    peak is then the process's resident set as it runs, heap the allocator keeps for reuse included.
    """
    device = torch.device(device) if device is not None else local_device()
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)
        return
    if release_freed:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back, so RSS follows live memory
    with contextlib.suppress(OSError):  # Linux: reset the RSS high-water mark to the current RSS
        Path("/proc/self/clear_refs").write_text("5")


def device_capacity(devices: int) -> tuple[int, str]:
    """Memory one of ``devices`` local devices has, and where the figure comes from: an accelerator's total memory
    (device 0 of whichever torch finds: CUDA, XPU, ...), else the host's physical memory divided among that many
    CPU ranks, which share it."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None:
        properties = torch.get_device_module(accelerator.type).get_device_properties(0)
        return properties.total_memory, f"this machine's {accelerator.type} device 0"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // devices, f"this machine's host memory shared by {devices} CPU rank(s)"
