"""Stopping a training run at a step boundary when a scheduler asks (preemption, a job's time limit).

SLURM and Kubernetes stop a job with SIGTERM and, a grace period later, SIGKILL. SLURM signals every process of
the job's steps; Kubernetes only the container's first process; ``kill PID`` one process. So every process that
takes part records the signal and goes on (:func:`stop_requests`): a rank reads the record at its next step
boundary, where the ranks agree on it in the step's own loss all-reduce (one rank's request stops all of them at
the same step, so no rank waits in a collective the others left), save a checkpoint and return. A caller that
spawned the ranks passes the signal on to them (:meth:`StopRequest.forward_to`), for the schedulers that
signal only it. ``hsdp train`` then names the checkpoint and exits :data:`STOP_EXIT`.

The handlers ask the kernel to restart interrupted system calls (``siginterrupt(False)``): a signal landing in a
collective's socket read or a checkpoint's file write must not turn into an error there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterable, Iterator

from hsdp.signals import STOP_EXIT  # hsdp train's exit status once it stopped with its checkpoint saved

__all__ = ["STOP_SIGNALS", "STOP_EXIT", "StopRequest", "stop_requests", "requested", "signal_name"]

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM,)
"""What stops a run at its next step boundary: SLURM's and Kubernetes' stop signal (and SLURM's
``--signal=TERM@SECONDS`` ahead of a time limit)."""



class StopRequest:
    """The stop signal this process received (None: none yet); later ones change nothing."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._pids: list[int] = []

    def forward_to(self, pids: Iterable[int]) -> None:
        """Pass a stop signal on to ``pids`` (spawned ranks): the one already received now, later ones as they come."""
        self._pids = list(pids)
        if self.signum is not None:
            self._forward(self.signum)

    def _record(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        self._forward(signum)

    def _forward(self, signum: int) -> None:
        for pid in self._pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


_current: StopRequest | None = None


def signal_name(signum: int | None) -> str:
    """``SIGTERM``; for a rank stopped by another rank's signal, says so."""
    return "a stop signal to another rank" if signum is None else signal.Signals(signum).name


def requested() -> int | None:
    """The stop signal this process received while :func:`stop_requests` was active, or None."""
    return None if _current is None else _current.signum


@contextlib.contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """Record :data:`STOP_SIGNALS` for the block instead of dying of them (read with :func:`requested`). Only the
    main thread can install handlers; elsewhere the signals keep their meaning."""
    global _current
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request._record) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.siginterrupt(sig, False)
    outer, _current = _current, request
    try:
        yield request
    finally:
        _current = outer
        for sig, handler in previous.items():
            signal.signal(sig, handler)
