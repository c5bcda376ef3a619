"""How the ``hsdp`` command turns an exception that escapes a subcommand into a message and an exit code.

One map for every subcommand, so the same mistake ends every command the same way: what a user can fix
(a flag, a config, a missing file) is 2, a worker process that failed is 1, Ctrl-C is 130 (the shell's
128 + SIGINT), SIGTERM 143 (:mod:`hsdp.signals`). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from hsdp.launch import WorkerError
from hsdp.signals import STOP_EXIT, Stopped

USAGE_EXIT = 2
WORKER_EXIT = 1
INTERRUPT_EXIT = 130

# Checked in order: the first matching class decides. ConfigError, PlanError and TrainConfigError are
# ValueErrors, so they need no entry of their own.
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (ValueError, USAGE_EXIT),
    (FileNotFoundError, USAGE_EXIT),
    (WorkerError, WORKER_EXIT),
    (Stopped, STOP_EXIT),  # a KeyboardInterrupt: before it
    (KeyboardInterrupt, INTERRUPT_EXIT),
)
HANDLED: tuple[type[BaseException], ...] = tuple(cls for cls, _ in EXIT_CODES)


def exit_code(exc: BaseException) -> int:
    """The exit code for ``exc``, one of the :data:`HANDLED` classes."""
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    raise TypeError(f"{type(exc).__name__} has no exit code; it should propagate") from exc


def format_problem(command: str, exc: BaseException) -> str:
    """``hsdp <command>: <message>``; a multi-problem error keeps its own list on the following lines."""
    message = "interrupted" if type(exc) is KeyboardInterrupt else str(exc)
    return f"hsdp {command}: {message}"
