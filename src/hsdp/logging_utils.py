"""Log format shared by the caller and the worker ranks: ``INFO 11-21 23:58:01 [rank0] message``."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time


class _Stderr(logging.StreamHandler):
    """A handler on ``sys.stderr`` as it is when a record is written, not when logging was set up: a process that
    swaps it later (pytest's capture, a caller redirecting it) would otherwise get "I/O operation on closed file"."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; the current sys.stderr is always used
        pass


def configure_logging(rank: int | None = None, level: str | None = None) -> None:
    """Send the ``hsdp`` logger to stderr with a rank tag; level from ``HSDP_LOG_LEVEL`` (default INFO)."""
    logger = logging.getLogger("hsdp")
    logger.setLevel((level or os.environ.get("HSDP_LOG_LEVEL") or "INFO").upper())
    tag = "main" if rank is None else f"rank{rank}"
    formatter = logging.Formatter(f"%(levelname)s %(asctime)s [{tag}] %(message)s", datefmt="%m-%d %H:%M:%S")
    for handler in logger.handlers:
        if getattr(handler, "_hsdp", False):
            handler.setFormatter(formatter)
            return
    handler = _Stderr()
    handler._hsdp = True  # type: ignore[attr-defined]
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    logger.propagate = False


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
"""What ``--log-level`` takes (``HSDP_LOG_LEVEL`` takes the same names, any case)."""


def process_age_s() -> float:
    """Seconds since this process started (the interpreter's own start-up included), from ``/proc``; since this
    module was imported where ``/proc`` is missing."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(0.0, uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


class StartupProgress:
    """The start-up of a command (imports, checks, the ranks' start and rendezvous, loading), phase by phase.

    Every phase is logged at debug with its time and the time since the process started (``--log-level debug``:
    the per-phase timer). A user also sees where a slow start-up is: on a terminal a bar over the phases, whose
    description names the running one; elsewhere (a log file, a service manager) an info line for each phase
    that took at least :attr:`LONG_S`. Only the caller shows it (ranks log their own lines), and it makes no
    thread: ranks forked from the caller must find it with one (:func:`hsdp.launch.group.fork_problem`)."""

    LONG_S = 3.0

    def __init__(self) -> None:
        self._bar = None
        self._done = 0

    def _show_bar(self) -> bool:
        return sys.stderr.isatty() and logging.getLogger("hsdp").isEnabledFor(logging.INFO)

    def begin(self, phase: str) -> None:
        """``phase`` starts now (the bar shows it)."""
        if not self._show_bar():
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(desc="start-up", total=None, unit="phase", leave=False, file=sys.stderr)
        self._bar.set_description_str(f"start-up: {phase}")

    def end(self, phase: str, seconds: float) -> None:
        """``phase`` took ``seconds``."""
        logger = logging.getLogger("hsdp")
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)
        long = seconds >= self.LONG_S and self._bar is None
        logger.log(
            logging.INFO if long else logging.DEBUG,
            "start-up: %s took %.2fs (%.2fs since the process started)",
            phase,
            seconds,
            process_age_s(),
        )

    def close(self) -> None:
        """Start-up is over: the bar goes (what follows has its own)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


STARTUP = StartupProgress()
"""This process's start-up (the caller's)."""


@contextlib.contextmanager
def phase(name: str):
    """Time a start-up phase of the caller: :class:`StartupProgress` shows and logs it."""
    STARTUP.begin(name)
    started = time.monotonic()
    try:
        yield
    finally:
        STARTUP.end(name, time.monotonic() - started)
