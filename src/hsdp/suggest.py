"""The closest known name to a mistyped one (difflib), worded the same by every message that offers it: the
command line's flags and values, a config's names, an HTTP body's fields."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest", "did_you_mean"]


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name most like ``name`` (difflib's ratio, at least 0.6), or None."""
    return next(iter(difflib.get_close_matches(name, [str(k) for k in known], n=1)), None)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean native?"`` for the closest known name, or ``""`` when none is close."""
    match = closest(name, known)
    return f"; did you mean {match}?" if match else ""
