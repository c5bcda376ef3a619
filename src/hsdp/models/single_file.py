"""Single-file checkpoints (the files ComfyUI loads: one ``.safetensors`` per denoiser or VAE in the original key
layout) over a base pipeline that gives the rest: ``hsdp generate --model BASE --transformer FILE``.

The keys are converted by diffusers' own converters (the ``checkpoint_mapping_fn`` that ``from_single_file`` uses
for the component's class, from ``diffusers.loaders.single_file_model.SINGLE_FILE_LOADABLE_CLASSES``; hsdp keeps no
key map). The converted component is written once, as a diffusers component folder, into
``$HSDP_CACHE/single-file/<key>/`` beside links to the base's other components; the sharded loaders then read that
folder as any other, each rank only its own slices. The converter first runs on empty (meta) tensors of the file's
header: when it only renames keys (Wan), the converted file is the same data bytes under a new header, copied in
chunks, so no process holds the file's tensors; a converter that computes tensors (a fused qkv split) runs on the
whole file once, in the process that converts (the command's launcher, or one process per node under a lock),
before any rank starts. The converted folder is reused while the file, the base and diffusers' version stay the
same.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from hsdp.models.description import INDEX_FILE, is_pipeline, pipeline_index
from hsdp.models.tiny import default_cache_dir

__all__ = ["SINGLE_FILE_FLAGS", "SingleFileError", "with_single_files"]


class SingleFileError(ValueError):
    """A single file whose converted keys or shapes do not match the component's model."""

SINGLE_FILE_FLAGS = {"transformer": "--transformer", "transformer_2": "--transformer-2", "vae": "--vae"}
"""Pipeline component -> the command-line flag that replaces it with a single file."""


def with_single_files(base: str | os.PathLike, files: Mapping[str, str | os.PathLike]) -> Path:
    """A pipeline folder: ``base``'s components, with each of ``files`` (``{component: single file}``) converted by
    diffusers' converter for that component's class. Raises ``ValueError`` naming the flag and what to pass."""
    from filelock import FileLock

    base = Path(base)
    index = _model_index(base, files)
    for component, file in files.items():
        _check(base, index, component, Path(file))
    folder = default_cache_dir() / "single-file" / _key(base, files)
    if (folder / ".complete").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):  # one process per node converts; the others find the folder
        if (folder / ".complete").exists():
            return folder
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            for entry in base.iterdir():
                if entry.name not in files:
                    (staging / entry.name).symlink_to(entry.resolve())
            for component, file in files.items():
                _convert(Path(file), index[component][1], base / component, staging / component)
            (staging / ".complete").write_text("")
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _flag(component: str) -> str:
    return SINGLE_FILE_FLAGS.get(component, component)


def _model_index(base: Path, files: Mapping[str, object]) -> dict:
    if not is_pipeline(base):
        flags = ", ".join(_flag(c) for c in files)
        raise ValueError(
            f"{flags} replace(s) a component of a diffusers pipeline; {base} has no {INDEX_FILE}: pass --model "
            "a pipeline folder or hub name that gives the rest of the pipeline"
        )
    return pipeline_index(base)


def _check(base: Path, index: dict, component: str, file: Path) -> None:
    entry = index.get(component)
    if not (isinstance(entry, list) and len(entry) == 2 and entry[1]):
        named = sorted(k for k, v in index.items() if isinstance(v, list) and v[1])
        raise ValueError(f"{_flag(component)} {file}: the pipeline in {base} has no {component} (its components: {named})")
    if not file.is_file():
        raise ValueError(f"{_flag(component)} {file}: no such file")
    if file.suffix != ".safetensors":
        raise ValueError(f"{_flag(component)} {file}: a .safetensors file is needed (single-file checkpoints as ComfyUI loads them)")


def _key(base: Path, files: Mapping[str, str | os.PathLike]) -> str:
    import diffusers

    parts = [str(base.resolve()), diffusers.__version__]
    for component, file in sorted(files.items()):
        stat = Path(file).stat()
        parts += [component, str(Path(file).resolve()), str(stat.st_size), str(stat.st_mtime_ns)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _convert(file: Path, class_name: str, base_component: Path, target: Path) -> None:
    """``file`` in diffusers' layout for ``class_name``, through diffusers' own converter, as a component folder."""
    import diffusers
    import torch
    from diffusers.loaders.single_file_model import (
        SINGLE_FILE_LOADABLE_CLASSES,
        _should_convert_state_dict_to_diffusers,
    )
    from safetensors.torch import load_file, save_file

    flag = _flag(target.name)
    mapping = SINGLE_FILE_LOADABLE_CLASSES.get(class_name)
    if mapping is None:
        raise ValueError(
            f"{flag} {file}: diffusers {diffusers.__version__} has no single-file converter for {class_name}; "
            f"it converts {', '.join(sorted(SINGLE_FILE_LOADABLE_CLASSES))}"
        )
    cls = getattr(diffusers, class_name)
    config = cls.load_config(base_component)
    with torch.device("meta"):
        expected = cls.from_config(config).state_dict()
    target.mkdir()
    shutil.copyfile(base_component / "config.json", target / "config.json")
    out = target / "diffusion_pytorch_model.safetensors"

    def convert(checkpoint: dict) -> dict:
        if _should_convert_state_dict_to_diffusers(expected, checkpoint):
            checkpoint = mapping["checkpoint_mapping_fn"](config=config, checkpoint=dict(checkpoint))
        _check_keys(flag, file, class_name, expected, checkpoint)
        return checkpoint

    header = _read_header(file)
    stored = {k: torch.empty(v["shape"], dtype=_torch_dtype(v["dtype"]), device="meta")
              for k, v in header.items() if k != "__metadata__"}  # fmt: skip
    try:  # on empty (meta) tensors: which stored tensor each converted key is, without reading any data
        renames = _renames(stored, convert(stored))
    except SingleFileError:
        raise
    except Exception:  # a converter that needs the values
        renames = None
    if renames is not None and _covers(header, renames.values()):
        _write_renamed(file, header, renames, out)  # streamed: no process holds the file's tensors
        return
    checkpoint = convert(load_file(file))  # a converter that computes tensors (splits, reshapes): the whole file
    save_file({k: v.contiguous() for k, v in checkpoint.items()}, out)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, _DTYPES.get(name, "float32"))  # the dtype matters to no rename; shapes do


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}  # fmt: skip


def _read_header(file: Path) -> dict:
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size))


def _renames(stored: dict, converted: dict) -> dict[str, str] | None:
    """``{new key: stored key}`` when the converter only renamed (every converted tensor is a stored tensor
    object, each used once); None when it computed any tensor."""
    by_id = {id(t): k for k, t in stored.items()}
    renames = {new: by_id.get(id(t)) for new, t in converted.items()}
    if None in renames.values() or len(set(renames.values())) != len(renames):
        return None
    return renames


def _covers(header: dict, kept) -> bool:
    """Whether the kept tensors are all of the file's tensors (a dropped one would leave a hole safetensors refuses)."""
    return set(kept) == {k for k in header if k != "__metadata__"}


def _write_renamed(file: Path, header: dict, renames: dict[str, str], out: Path) -> None:
    """``file`` with its keys renamed: a new header over the same data bytes, copied in chunks."""
    new_header = {new: header[old] for new, old in renames.items()}
    if "__metadata__" in header:
        new_header["__metadata__"] = header["__metadata__"]
    encoded = json.dumps(new_header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(file, "rb") as src, open(out, "wb") as dst:
        src.seek(8 + int.from_bytes(src.read(8), "little"))
        dst.write(len(encoded).to_bytes(8, "little") + encoded)
        shutil.copyfileobj(src, dst, 16 << 20)


def _check_keys(flag: str, file: Path, class_name: str, expected: Mapping, converted: Mapping) -> None:
    missing = sorted(set(expected) - set(converted))
    unexpected = sorted(set(converted) - set(expected))
    wrong = [k for k in set(expected) & set(converted) if tuple(expected[k].shape) != tuple(converted[k].shape)]
    if missing or unexpected or wrong:
        raise SingleFileError(
            f"{flag} {file}: after diffusers' conversion for {class_name}, {len(missing)} keys are missing (e.g. "
            f"{missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}), {len(wrong)} of another shape "
            f"(e.g. {sorted(wrong)[:3]}); is it a checkpoint of this model, in the base's size?"
        )
