"""Export folders: hsdp writes into them and never takes away what it did not write.

An export (``hsdp train --export DIR``: a model folder, a pipeline folder, a LoRA file) is written into a temporary
sibling, then moved into ``DIR`` by :func:`commit`, which leaves a manifest (:data:`MANIFEST`) naming every file it
put there and the run that wrote them. ``DIR`` may be absent, empty, or hold exactly what an earlier export of the
same run wrote (a restart after the export, ``--resume auto`` re-run after the last step): only then are the
manifest's files replaced. Anything else in ``DIR`` (the user's notes, another adapter, a run's checkpoints) is
refused by :func:`export_problem` before any rank starts, and again by :func:`commit`, which removes only listed
files, never a whole folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = ["MANIFEST", "export_problem", "commit", "staging_dir"]

MANIFEST = ".hsdp-export.json"


def _files(folder: Path) -> set[str]:
    """Every file (and link) under ``folder``, relative, POSIX-style; the manifest left out."""
    found = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink()}
    return found - {MANIFEST}


def _manifest(folder: Path) -> dict | None:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), list) else None


def export_problem(folder: str | Path, run: str, flag: str = "--export") -> str | None:
    """Why ``folder`` cannot take an export of ``run`` (a string naming the run), or None: it is absent, empty, or
    holds only what an earlier export of ``run`` wrote (its manifest lists every file there)."""
    folder = Path(folder)
    if not folder.exists():
        return None
    if not folder.is_dir():
        return f"{flag} {folder} is a file; choose a folder (it is created)"
    present = _files(folder)
    if not present and not any(folder.iterdir()):
        return None
    manifest = _manifest(folder)
    if manifest is None:
        return f"{flag} {folder} exists and is not empty; remove it or choose another folder (nothing was overwritten)"
    if manifest.get("run") != run:
        return (
            f"{flag} {folder} holds the export of another run ({manifest.get('run')}); remove it or choose another "
            "folder (nothing was overwritten)"
        )
    foreign = sorted(present - set(manifest["files"]))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return (
            f"{flag} {folder} holds files an export did not write ({shown}); move them out or choose another folder "
            "(nothing was overwritten)"
        )
    return None


def staging_dir(out_dir: str | Path) -> Path:
    """The temporary sibling an export of ``out_dir`` is written into (emptied first)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)  # an interrupted export's: a name only hsdp uses
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, out_dir: str | Path, run: str, flag: str = "--export") -> Path:
    """Move what ``tmp`` holds into ``out_dir`` with a manifest naming ``run``; the files an earlier export of
    ``run`` left there are replaced, nothing else is touched. ``ValueError`` (and nothing moved) when ``out_dir``
    holds anything else."""
    out_dir = Path(out_dir)
    problem = export_problem(out_dir, run, flag)
    if problem:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(problem)
    written = sorted(_files(tmp))
    (tmp / MANIFEST).write_text(json.dumps({"run": run, "files": written}, indent=1) + "\n")
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return out_dir
    old = _manifest(out_dir)
    listed = old["files"] if old else []
    for name in listed:
        (out_dir / name).unlink(missing_ok=True)
    parents = {parent for name in listed for parent in (out_dir / name).parents if out_dir in parent.parents}
    for folder in sorted(parents, key=lambda p: -len(p.parts)):  # deepest first
        if folder.is_dir() and not any(folder.iterdir()):  # it held only listed files
            folder.rmdir()
    for name in [*written, MANIFEST]:
        target = out_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / name, target)
    shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
