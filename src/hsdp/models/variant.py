"""Weight variants (``--variant fp16``): the files that diffusers' and transformers' ``from_pretrained(variant=...)``
load instead of the default weights.

A variant's files carry its name before the extension: ``diffusion_pytorch_model.fp16.safetensors``, the shards
``model.fp16-00001-of-00002.safetensors`` with their index ``model.safetensors.index.fp16.json``. A component that
has no file of the variant loads its default weights (diffusers does the same for a pipeline's components). Without
``--variant`` only the default weights are read, never a variant beside them.

:func:`with_variant` makes the variant an ordinary folder for every loader: ``$HSDP_CACHE/variant/<key>/`` mirrors
the model with links, the variant's files linked under the default names and its index rewritten to them, so the
engine, the trainer and the planner read it as any other folder (as single-file checkpoints are,
:mod:`hsdp.models.single_file`). Links only: nothing is copied.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hsdp.models.cache_folder import build_once
from hsdp.models.description import is_pipeline, pipeline_index
from hsdp.models.tiny import default_cache_dir
from hsdp.safetensors_index import VARIANT_INDEX, default_name, variant_of

__all__ = ["with_variant"]

def with_variant(folder: str | Path, variant: str) -> Path:
    """A folder that is ``folder`` with the ``variant`` weights in place of the default ones, wherever a component
    has them. Raises ``ValueError`` naming the variants the folder has when no file is of ``variant``."""
    folder = Path(folder)
    components = _component_folders(folder)
    found = {c: files for c in components if (files := [f for f in c.iterdir() if variant_of(f.name) == variant])}
    if not found:
        others = sorted({v for c in components for f in c.iterdir() if (v := variant_of(f.name))})
        raise ValueError(
            f"--variant {variant}: {folder} has no weights of that variant (files such as "
            f"diffusion_pytorch_model.{variant}.safetensors or model.{variant}.safetensors); "
            + (f"its variants: {', '.join(others)}" if others else "it has default weights only: drop --variant")
        )
    variants = {c.resolve(): files for c, files in found.items()}
    return build_once(default_cache_dir() / "variant" / _key(folder, variant), lambda view: _mirror(folder, view, variants))


def _component_folders(folder: Path) -> list[Path]:
    if not is_pipeline(folder):
        return [folder]
    index = pipeline_index(folder)
    return [folder / name for name in index if not name.startswith("_") and (folder / name).is_dir()]


def _mirror(source: Path, target: Path, variants: dict[Path, list[Path]]) -> None:
    """Link ``source``'s entries into ``target``; in a component folder with variant files, those replace the
    default weights under the default names."""
    target.mkdir(exist_ok=True)
    chosen = variants.get(source.resolve())
    for entry in source.iterdir():
        if entry.name.startswith(".") and entry.name != ".gitattributes":
            continue
        if entry.is_dir() and entry.resolve() in variants:
            _mirror(entry, target / entry.name, variants)
        elif chosen is None or not _is_weight(entry.name):
            (target / entry.name).symlink_to(entry.resolve())
    for file in chosen or ():
        if VARIANT_INDEX.match(file.name):
            index = json.loads(file.read_text())
            index["weight_map"] = {k: default_name(v) for k, v in index["weight_map"].items()}
            (target / default_name(file.name)).write_text(json.dumps(index, indent=2))
        else:
            (target / default_name(file.name)).symlink_to(file.resolve())


def _is_weight(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")) or bool(
        VARIANT_INDEX.match(name)
    )


def _key(folder: Path, variant: str) -> str:
    """Changes when the folder's files do (name, size, time), so an updated model gets a new view."""
    digest = hashlib.sha256(f"{folder.resolve()}\0{variant}".encode())
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.relative_to(folder)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return f"{folder.name}-{variant}-{digest.hexdigest()[:16]}"
