"""SIGTERM where a command has no handling of its own: the checks, the loading, the ranks' start.

SLURM and Kubernetes stop a job with SIGTERM (and SIGKILL a grace period later), ``kill PID`` too. Python's default
for it ends the process on the spot: no message, ``finally`` blocks skipped (a built-in model half written into its
staging folder stays there), spawned ranks left to notice on their own that their caller is gone. While
:func:`sigterm_raises` is active the signal raises :class:`Stopped` instead, which unwinds the stack as Ctrl-C's
``KeyboardInterrupt`` does (it is one: whatever stops ranks at once on Ctrl-C does so here too), and the ``hsdp``
command exits :data:`STOP_EXIT` naming the signal. Where a command handles the signal itself (``hsdp train``'s
step boundary, :mod:`hsdp.train.stop`; ``hsdp serve``'s drain) its handler replaces this one for that block.
A rank under torchrun keeps the signal's default: its agent stops it (:func:`hsdp.cli.main`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["STOP_EXIT", "Stopped", "sigterm_raises"]

STOP_EXIT = 128 + signal.SIGTERM
"""The exit status of a command stopped by SIGTERM: 143, as a shell reports a process ended by it (Ctrl-C's is 130)."""


class Stopped(KeyboardInterrupt):
    """A stop signal arrived (:func:`sigterm_raises`); ``signum`` names it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`Stopped` in the block, once: a second one (SLURM signals every process of a job, a
    caller passes it on) does not interrupt the clean-up of the first. Main thread only (elsewhere the signal keeps
    its meaning); the previous handler is back after the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[int] = []

    def stop(signum: int, frame: object) -> None:
        if not raised:
            raised.append(signum)
            raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
