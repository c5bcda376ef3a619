"""A folder under ``$HSDP_CACHE`` that one process per node builds and every other process finds complete."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["build_once"]


def build_once(folder: Path, fill: Callable[[Path], None]) -> Path:
    """``folder``, built by ``fill(staging)`` unless it is complete already. Under a file lock (one process per
    node builds; the others wait and find it), into a temporary sibling renamed into place with a ``.complete``
    marker, so an interrupted build is never taken for the folder."""
    from filelock import FileLock

    if (folder / ".complete").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / ".complete").exists():
            return folder
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            fill(staging)
            (staging / ".complete").write_text("")
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder
