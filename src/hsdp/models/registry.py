"""The built-in models' registry: each ``hsdp.models.tiny_*`` module registers its writers here on import.

Below :mod:`hsdp.models.builtin` (which imports every registering module, then resolves names), so a registering
module can be imported on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

__all__ = ["BUILTIN_MODELS", "BUILTIN_VERSIONS", "register_builtin"]

BUILTIN_MODELS: dict[str, Callable[[Path], None]] = {}
"""name -> function that writes the model into an empty folder."""
BUILTIN_VERSIONS: dict[str, str] = {}
"""name -> the version its ``.complete`` marker holds; bump it when what the writer writes changes."""


def register_builtin(name: str, version: str = "") -> Callable[[Callable[[Path], None]], Callable[[Path], None]]:
    def decorator(writer: Callable[[Path], None]) -> Callable[[Path], None]:
        BUILTIN_MODELS[name] = writer
        BUILTIN_VERSIONS[name] = version
        return writer

    return decorator
