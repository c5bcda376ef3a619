"""Process-group setup that picks the device and backend from the machine: CUDA + NCCL, or CPU + gloo."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import logging
import os
import select
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger("hsdp")



def collective_timeout_s() -> float:
    """Seconds a collective may wait for a peer: ``HSDP_COLLECTIVE_TIMEOUT`` (default 300), read when a group is made,
    so a process that sets it after importing hsdp (a notebook, a command forked from a preloaded process) gets it."""
    return float(os.environ.get("HSDP_COLLECTIVE_TIMEOUT", "300"))


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


def copy_ahead(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` without making the host wait: to an accelerator from pinned memory, asynchronously
    (a copy from pageable memory waits until the device has run the work queued before it); on the CPU as is."""
    if device.type == "cpu" or tensor.device == device:
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


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
    timeout_s: float | None = None,
) -> torch.device:
    """Join (or create) the default process group; returns this rank's device.

    Without arguments it reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...); a rank
    started by torchrun then exits once its agent is gone (:func:`_watch_torchrun_agent`). Every collective gets
    ``timeout_s`` (default :func:`collective_timeout_s`), so a dead peer surfaces as an error instead of a hang. The groups are torn down at exit
    (:func:`destroy_distributed`) if the caller has not done so.
    """
    device = local_device()
    if dist.is_initialized():
        return device
    if store is None:
        _watch_torchrun_agent()
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    backend = dist.get_default_backend_for_device(device)
    kwargs: dict = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s or collective_timeout_s())}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world_size)
    forget_group_state()  # anything cached so far belongs to an older group (or the parent this rank forked from)
    dist.init_process_group(**kwargs)
    _tear_down_at_exit()
    logger.debug("rank %d/%d joined %s on %s", dist.get_rank(), dist.get_world_size(), backend, device)
    return device


_agent_watched = False


def _watch_torchrun_agent() -> None:
    """Under torchrun, exit this rank once its agent (the parent process) is gone. torchrun's agent stops its ranks
    when it stops, but not when it is killed (SIGKILL, the OOM killer): its ranks would run on with no agent, a
    serving rank 0 answering HTTP and holding its ``--output-dir``. Once per process; not under another launcher,
    whose ranks may outlive their parent on purpose."""
    global _agent_watched
    if "TORCHELASTIC_RUN_ID" in os.environ and not _agent_watched:
        watch_process(os.getppid(), "this rank's torchrun agent")
        _agent_watched = True


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` runs: not when it is gone, a zombie (exited, only its parent's wait missing), or
    the pid now belongs to someone else's process."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    return True


def watch_process(pid: int, what: str) -> None:
    """End this process (status 1) as soon as process ``pid`` (``what``, for the log) is gone, from a daemon
    thread: a pidfd, readable once that process exits, where the kernel has them; else a poll every second."""

    def watch() -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # not Linux >= 5.3, or the process already exited
            while pid_running(pid):
                time.sleep(1.0)
        else:
            select.select([pidfd], [], [])
        logger.error("%s (pid %d) is gone; exiting", what, pid)
        os._exit(1)

    threading.Thread(target=watch, name=f"watch-{pid}", daemon=True).start()


_teardown_registered = False


def _tear_down_at_exit() -> None:
    """A script that never calls :func:`destroy_distributed` (a user's, a documented snippet) still exits cleanly:
    its gloo workers could otherwise abort the process at interpreter exit after all its work succeeded (see
    there). Once per process; a no-op at exit when the caller already tore down."""
    global _teardown_registered
    if not _teardown_registered:
        atexit.register(destroy_distributed)
        _teardown_registered = True


def destroy_distributed() -> None:
    """Tear down every process group (the default one, DeviceMesh sub-groups, the checkpointer's gloo group) and
    wait until their gloo worker threads are idle, so the process exits cleanly.

    The group objects outlive ``destroy_process_group`` whenever something still holds them (a sharded model's
    FSDP state and DeviceMeshes do), and so do their worker threads. A worker lets go of a finished collective's
    tensors a moment after the caller sees it complete; freeing a tensor Python has already dropped takes the GIL.
    If that moment falls inside interpreter shutdown (a busy host deschedules the worker), the thread is ended
    mid-C++ and the runtime aborts the process ("terminate called without an active exception", SIGABRT) after
    all work succeeded, so the launcher reports a failed job.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_group_state()
    _wait_for_idle_gloo_workers()


def forget_group_state() -> None:
    """Drop what DTensor cached for process groups that are gone. Its sharding propagation caches key on meshes,
    and meshes compare equal by their ranks, not by their groups: a mesh of the next group of the same shape would
    be answered with an output spec holding the old mesh, and with it the old rank's coordinate (after the
    planner's fake rank 1, a real rank 0 filled its shards with rank 1's rows). Call after a default group is
    destroyed and before one is created; ``torch.distributed.tensor.debug`` is where torch exposes the clearing."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def skip_collection_at_exit() -> None:
    """Let this process exit without the interpreter's final garbage collections over what it imported.

    At exit Python runs full collections over every live object; after torch, transformers and diffusers are
    imported that takes about a second on a busy 2-core host, paid by every command and every rank for memory the
    OS takes back anyway. ``gc.freeze()`` moves the live objects out of the collector's reach: reference counting
    still frees them, so files are flushed and closed, finalizers and ``atexit`` handlers run. Only for a process
    about to exit: in one that goes on, cycles created before the freeze would never be collected.
    """
    gc.freeze()


_GLOO_WORKER = "pt_gloo_runloop"
"""Thread name of ProcessGroupGloo's worker threads."""


def _wait_for_idle_gloo_workers(timeout_s: float = 5.0) -> None:
    """Release the GIL until no gloo worker thread is runnable for a few polls in a row.

    A worker still letting go of a collective is runnable, or waits for the GIL, which it gets while this thread
    sleeps; an idle one sleeps on its queue. Linux only (``/proc``); elsewhere this returns at once.
    """
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 3 and time.monotonic() < deadline:
        time.sleep(0.002)
        quiet = 0 if any(_runnable_gloo_worker(task) for task in tasks.iterdir()) else quiet + 1
    if quiet < 3:
        logger.warning("gloo worker threads still busy %.0f s after destroying the process groups", timeout_s)


def _runnable_gloo_worker(task: Path) -> bool:
    try:
        if (task / "comm").read_text().strip() != _GLOO_WORKER:
            return False
        stat = (task / "stat").read_text()
    except OSError:  # the thread ended between listing and reading
        return False
    return stat[stat.rindex(")") + 2] == "R"  # the state follows "pid (comm) "


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
