"""The rank side of :mod:`hsdp.launch`: what a worker process runs (:func:`_worker_main`: join the process group,
then run the functions the caller sends), and what functions running on a rank use to talk to the caller while a
call lasts (:func:`heartbeat`, :func:`emit_event`) and to keep state between calls (:func:`worker_state`)."""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from hsdp.distributed import watch_process

logger = logging.getLogger("hsdp")

__all__ = [
    "heartbeat",
    "emit_event",
    "event_sink",
    "worker_state",
    "rendezvous_store",
    "error_report",
    "HEARTBEAT_INTERVAL_S",
]

_STATE: dict[str, Any] = {}


_RENDEZVOUS: list[dist.Store] = []


_EVENT_SINK: list[Callable[[Any], None]] = []


_HEARTBEAT: list[Callable[[], None]] = []


HEARTBEAT_INTERVAL_S = 0.5


_ALIVE = "alive"


def heartbeat() -> None:
    """Tell the caller this rank is computing (at most every ``HEARTBEAT_INTERVAL_S``): long phases without
    progress events (prompt encoding, a VAE decode) are then not mistaken for a hang. A no-op outside a
    :class:`WorkerGroup` call; cheap enough for a forward hook on every module."""
    if _HEARTBEAT:
        _HEARTBEAT[-1]()


def emit_event(payload: Any) -> None:
    """Hand ``payload`` to the caller's ``on_event`` callback while the current call still runs (progress of a
    long call); a no-op where nobody listens."""
    if _EVENT_SINK:
        _EVENT_SINK[-1](payload)


@contextlib.contextmanager
def event_sink(sink: Callable[[Any], None]):
    """Route :func:`emit_event` to ``sink`` for the duration of the block (ranks run in the caller's process)."""
    _EVENT_SINK.append(sink)
    try:
        yield
    finally:
        _EVENT_SINK.pop()


def worker_state() -> dict[str, Any]:
    """Per-process storage that survives between calls (the loaded model, the optimizer, ...)."""
    return _STATE


def rendezvous_store() -> dist.Store:
    """This rank's client of its :class:`WorkerGroup`'s rendezvous store (the caller holds the other end,
    :attr:`WorkerGroup.store`): small flags the caller sets while a call runs go through it."""
    if not _RENDEZVOUS:
        raise RuntimeError("rendezvous_store() is only available in a rank of a WorkerGroup")
    return _RENDEZVOUS[0]


_COMMUNICATION_WORDS = ("gloo", "nccl", "collective", "process group", "timed out", "connection")


def error_report(exc: BaseException) -> dict:
    """What the caller needs to judge a rank's exception: the traceback, the exception line, and whether it is
    ordinary (raised by the function's own logic) rather than a communication failure that may leave the
    process group unusable."""
    import torch.distributed as torch_dist

    text = f"{type(exc).__name__}: {exc}"
    communication = isinstance(exc, torch_dist.DistError) or any(
        w in text.lower() for w in _COMMUNICATION_WORDS
    )
    return {
        "traceback": traceback.format_exc(),
        "error": text,
        "ordinary": isinstance(exc, Exception) and not communication,
    }


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _rank_heartbeat(conn: Connection) -> Callable[[], None]:
    last = [0.0]

    def beat() -> None:
        now = time.monotonic()
        if now - last[0] >= HEARTBEAT_INTERVAL_S:
            last[0] = now
            conn.send((_ALIVE, None))

    return beat


def _quiet_progress_bars() -> None:
    """tqdm (diffusers' and transformers' progress bars) makes a multiprocessing lock, a POSIX semaphore that
    a killed worker leaves behind (the resource tracker warns and unlinks it only when the caller exits); a
    worker's bars need only a thread lock."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


class _CallerStream:
    """One of the caller's standard streams (its file descriptor at the rank's start), handed to the rank.

    Pickled with the rank's arguments as a descriptor the start method passes along (like a ``Pipe`` end), so a
    rank forked from a forkserver writes where the caller's stdout/stderr point now, not where they pointed
    when the forkserver started."""

    def __init__(self, fd: int, dup_fd: Any = None):
        self.fd = fd
        self._dup_fd = dup_fd

    def __reduce__(self):
        return _CallerStream, (self.fd, reduction.DupFd(self.fd))

    def adopt(self) -> None:
        """In the rank: make the caller's stream this process's ``self.fd``."""
        received = self._dup_fd.detach()
        if received != self.fd:
            os.dup2(received, self.fd)
            os.close(received)


def _worker_main(
    rank: int,
    world_size: int,
    host: str,
    conn: Connection,
    env: dict[str, str],
    caller_pid: int,
    collective_timeout_s: float,
    cwd: str,
    streams: list[_CallerStream],
    close_fds: list[int],
    shield_sigterm: bool = False,
) -> None:
    # What this rank was born with is never collected here. A rank forked from the caller holds a copy of the
    # caller's memory, garbage cycles it had not collected yet included (a closed engine's process groups and
    # stores); freeing one of those C++ objects in the rank, without the threads it had in the caller, aborts the
    # process ("Fatal Python error: Aborted" while garbage-collecting in a compose-tier rank's unload). Objects a
    # reference count frees still go; the copies otherwise stay shared with the caller's pages.
    gc.freeze()
    for fd in close_fds:  # a rank forked from the caller: the caller's ends of the pipes
        with contextlib.suppress(OSError):
            os.close(fd)
    # A rank forked from a forkserver has the forkserver's environment, directory and streams: take the caller's.
    for stream in streams:
        stream.adopt()
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.chdir(cwd)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        # torch is already imported here (unpickling this function imports it), so the variable alone is too
        # late; oversubscribed OpenMP threads spin and make small ops 100x slower on a busy host.
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # A terminal's Ctrl-C reaches every process of its group, the ranks included: the caller decides what it means
    # (a server finishes the running batch, a command stops its ranks), where a rank interrupted on its own would
    # die mid-job or mid-collective (and a server would take it for a failed worker and restart its engine).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM likewise where the caller stops gracefully on it (a server: systemd's stop and `timeout` signal the
    # whole group); otherwise its default, whatever handler a rank forked from the caller (a user's script, a
    # service) or the forkserver left: a rank is stopped as a spawned one is, not by the caller's shutdown code.
    signal.signal(signal.SIGTERM, signal.SIG_IGN if shield_sigterm else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # a caller's block is inherited
    # Never outlive the caller. Under a forkserver the parent is the forkserver, not the caller: watch its pid.
    watch_process(caller_pid, "the caller")
    _quiet_progress_bars()
    from hsdp.distributed import destroy_distributed, init_distributed, skip_collection_at_exit
    from hsdp.logging_utils import configure_logging

    configure_logging(rank)
    try:
        port = conn.recv()  # the caller makes its store once every rank has started
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=_td(collective_timeout_s))
        init_distributed(rank=rank, world_size=world_size, store=store, timeout_s=collective_timeout_s)
        _RENDEZVOUS.append(store)
        conn.send(("ready", None))
    except Exception as exc:
        conn.send(("err", error_report(exc)))
        return
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                break
            if message is None:
                break
            fn, args, kwargs = message
            _HEARTBEAT.append(_rank_heartbeat(conn))
            try:
                with event_sink(lambda payload: conn.send(("event", payload))):
                    result = fn(*args, **kwargs)
                conn.send(("ok", result))
            except BaseException as exc:  # DCP's CheckpointException derives from BaseException
                conn.send(("err", error_report(exc)))
            finally:
                _HEARTBEAT.pop()
    finally:
        _STATE.clear()
        _RENDEZVOUS.clear()
        destroy_distributed()
        conn.close()
        skip_collection_at_exit()
