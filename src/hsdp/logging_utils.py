"""Log format shared by the caller and the worker ranks: ``INFO 11-21 23:58:01 [rank0] message``."""

from __future__ import annotations

import logging
import os
import sys


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
    logger.setLevel(level or os.environ.get("HSDP_LOG_LEVEL", "INFO"))
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
