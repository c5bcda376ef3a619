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
from collections.abc import Mapping
from pathlib import Path

from hsdp.models.cache_folder import build_once
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
    base = Path(base)
    index = _model_index(base, files)
    for component, file in files.items():
        _check(base, index, component, Path(file))
    def convert(staging: Path) -> None:
        for entry in base.iterdir():
            if entry.name not in files:
                (staging / entry.name).symlink_to(entry.resolve())
        for component, file in files.items():
            _convert(Path(file), index[component][1], base / component, staging / component)

    # One process per node converts; the others find the folder.
    return build_once(default_cache_dir() / "single-file" / _key(base, files), convert)


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
    if file.suffix not in (".safetensors", ".gguf"):
        raise ValueError(f"{_flag(component)} {file}: a .safetensors or .gguf file is needed (single-file checkpoints as ComfyUI loads them)")


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
        empty = cls.from_config(config)
    expected = empty.state_dict()
    linears = {f"{n}.weight" for n, m in empty.named_modules() if isinstance(m, torch.nn.Linear)}
    target.mkdir()
    shutil.copyfile(base_component / "config.json", target / "config.json")
    out = target / "diffusion_pytorch_model.safetensors"

    header = None if file.suffix == ".gguf" else _read_header(file)  # (a GGUF file has no safetensors header)

    def convert(checkpoint: dict) -> dict:
        if _should_convert_state_dict_to_diffusers(expected, checkpoint):
            checkpoint = mapping["checkpoint_mapping_fn"](config=config, checkpoint=dict(checkpoint))
        _check_keys(flag, file, class_name, expected, checkpoint, header)
        return checkpoint

    if file.suffix == ".gguf":
        _convert_gguf(file, flag, convert, linears, out)
        return
    if _is_fp8_scaled(header):
        _convert_fp8_scaled(file, flag, header, convert, out)
        return
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
    try:  # a converter that computes tensors (splits, reshapes): the whole file
        checkpoint = convert(load_file(file))
    except (KeyError, IndexError, ValueError, RuntimeError) as exc:
        if isinstance(exc, SingleFileError):
            raise
        raise SingleFileError(
            f"{flag} {file}: diffusers' converter for {class_name} does not read its keys ({type(exc).__name__}: "
            f"{str(exc)[:120]}); {_closest(header)}"
        ) from exc
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


def _check_keys(
    flag: str, file: Path, class_name: str, expected: Mapping, converted: Mapping, header: Mapping = None
) -> None:
    missing = sorted(set(expected) - set(converted))
    unexpected = sorted(set(converted) - set(expected))
    # A GGUF tensor's shape is that of its stored bytes; its own shape is ``quant_shape`` (diffusers' GGUFParameter).
    wrong = [k for k in set(expected) & set(converted)
             if tuple(expected[k].shape) != tuple(getattr(converted[k], "quant_shape", converted[k].shape))]  # fmt: skip
    if missing or unexpected or wrong:
        hint = f"; {_closest(header)}" if header is not None and (missing or unexpected) else ""
        raise SingleFileError(
            f"{flag} {file}: after diffusers' conversion for {class_name}, {len(missing)} keys are missing (e.g. "
            f"{missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}), {len(wrong)} of another shape "
            f"(e.g. {sorted(wrong)[:3]}); is it a checkpoint of this model, in the base's size?{hint}"
        )


# -- Quantized single files, kept in their stored bytes (hsdp.stored_quant) ----------------------------------------


def _convert_gguf(file: Path, flag: str, convert, linears: set[str], out: Path) -> None:
    """A GGUF file read as diffusers' ``load_gguf_checkpoint`` reads it (quantized tensors as ``GGUFParameter``s of
    their stored bytes, F32 / F16 as tensors), converted by diffusers' converter, written as safetensors with the
    quantized tensors in their stored bytes and their types in the header (:data:`hsdp.stored_quant.LAYOUT_KEY`).
    The tensors are the file's memory map: nothing is read until written, one tensor at a time."""
    import warnings

    import gguf
    import torch
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES, GGUFParameter

    from hsdp.stored_quant import LAYOUT_KEY, StoredFormat

    types = gguf.GGMLQuantizationType
    stored = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the memory map is read-only; nothing writes to it
        for tensor in gguf.GGUFReader(file).tensors:
            qtype, data = tensor.tensor_type, torch.from_numpy(tensor.data)
            if qtype in (types.F32, types.F16):
                stored[tensor.name] = data
            elif qtype == types.BF16:  # stored as bytes; the same values as diffusers' BF16 "dequantization"
                stored[tensor.name] = data.view(torch.bfloat16)
            elif qtype in SUPPORTED_GGUF_QUANT_TYPES:
                stored[tensor.name] = GGUFParameter(data, quant_type=qtype)
            else:
                names = ", ".join(t.name for t in SUPPORTED_GGUF_QUANT_TYPES if t not in (types.BF16,))
                raise SingleFileError(
                    f"{flag} {file}: tensor {tensor.name} is GGUF {qtype.name}, a type diffusers cannot dequantize, so "
                    f"hsdp cannot shard and dequantize it either; use a file quantized to one of {names} (e.g. Q8_0, "
                    "Q5_K, Q4_K), or the .safetensors checkpoint"
                )
    converted = convert(stored)
    layout = {}
    for key, value in converted.items():
        if not isinstance(value, GGUFParameter):
            continue
        if key not in linears:  # diffusers' GGUFLinear is the only layer that dequantizes
            raise SingleFileError(
                f"{flag} {file}: tensor {key} is GGUF {value.quant_type.name} but is no nn.Linear weight; diffusers "
                "dequantizes GGUF only in Linear layers, and its blocks cannot be sharded as this tensor's rows: "
                "use a file that stores it as F32 / F16 / BF16 (as GGUF converters do for norms, biases and convolutions)"
            )
        layout[key] = StoredFormat("gguf", tuple(value.quant_shape), quant_type=value.quant_type.name)
    tensors = {k: v.as_tensor() if isinstance(v, GGUFParameter) else v for k, v in converted.items()}
    _write_streamed(out, {k: (_st_dtype(v.dtype), list(v.shape), _bytes_of(v)) for k, v in tensors.items()},
                    {LAYOUT_KEY: json.dumps({k: f.to_json() for k, f in layout.items()})})  # fmt: skip


def _is_fp8_scaled(header: dict) -> bool:
    """ComfyUI's ``fp8_scaled`` layout: a ``scaled_fp8`` marker and a ``scale_weight`` beside each fp8 weight."""
    return "scaled_fp8" in header or any(k.endswith(".scale_weight") for k in header)


def _convert_fp8_scaled(file: Path, flag: str, header: dict, convert, out: Path) -> None:
    """An ``fp8_scaled`` file: the fp8 weights kept in their bytes under diffusers' names, each weight's
    ``scale_weight`` in the header (:data:`hsdp.stored_quant.LAYOUT_KEY`); ``scale_input`` (used only by fp8 matmuls,
    which ComfyUI's default path does not run) and the marker dropped. Needs a converter that only renames."""
    import torch
    from safetensors import safe_open

    from hsdp.stored_quant import LAYOUT_KEY, StoredFormat

    extra = {k for k in header if k == "scaled_fp8" or k.endswith((".scale_weight", ".scale_input"))}
    weights = {k: v for k, v in header.items() if k != "__metadata__" and k not in extra}
    scales = {}
    with safe_open(file, framework="pt") as handle:
        for key in (k for k in extra if k.endswith(".scale_weight")):
            scale = handle.get_tensor(key)
            if scale.numel() != 1:
                raise SingleFileError(f"{flag} {file}: {key} has shape {list(scale.shape)}; fp8_scaled files scale each weight by one number")
            scales[key.removesuffix(".scale_weight") + ".weight"] = float(scale.float().item())
    stand_ins = {k: torch.empty(v["shape"], dtype=_torch_dtype(v["dtype"]), device="meta") for k, v in weights.items()}
    renames = _renames(stand_ins, convert(stand_ins))
    if renames is None:
        raise SingleFileError(
            f"{flag} {file}: an fp8_scaled file is read for models whose diffusers converter only renames keys (Wan); "
            "this converter computes tensors: pass the file's bf16 / fp16 checkpoint"
        )
    layout = {new: StoredFormat("fp8_scaled", tuple(weights[old]["shape"]), scale=scales[old])
              for new, old in renames.items() if old in scales and weights[old]["dtype"] == "F8_E4M3"}  # fmt: skip
    start = 8 + int.from_bytes(file.open("rb").read(8), "little")

    def region(old: str):
        begin, end = weights[old]["data_offsets"]
        return (file, start + begin, end - begin)

    entries = {new: (weights[old]["dtype"], weights[old]["shape"], region(old)) for new, old in renames.items()}
    _write_streamed(out, entries, {LAYOUT_KEY: json.dumps({k: f.to_json() for k, f in layout.items()})})


_ST_DTYPES = {v: k for k, v in _DTYPES.items()}


def _st_dtype(dtype) -> str:
    return _ST_DTYPES[str(dtype).removeprefix("torch.")]


def _bytes_of(tensor):
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def _write_streamed(out: Path, entries: dict, metadata: dict[str, str]) -> None:
    """A safetensors file of ``{key: (dtype, shape, data)}``, ``data`` an array of the bytes or ``(file, offset,
    size)``, written one tensor at a time (in 16 MiB chunks from a file), so no process holds them all."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for key, (dtype, shape, data) in entries.items():
        size = data[2] if isinstance(data, tuple) else data.nbytes
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(out, "wb") as dst:
        dst.write(len(encoded).to_bytes(8, "little") + encoded)
        for _, _, data in entries.values():
            if not isinstance(data, tuple):
                dst.write(memoryview(data))
                continue
            source, begin, size = data
            with open(source, "rb") as src:
                src.seek(begin)
                while size > 0:
                    chunk = src.read(min(size, 16 << 20))
                    dst.write(chunk)
                    size -= len(chunk)


_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
_GENERIC = {"weight", "bias", "scale", "norm", "0", "1", "2"}  # parts every family's keys have


def _closest(header: Mapping) -> str:
    """The model family diffusers' own key markers (``single_file_utils.CHECKPOINT_KEY_NAMES``, what
    ``from_single_file`` infers a checkpoint's type from) say the file's keys are closest to, and a sample of the
    keys: a marker key present names its family; else the family whose marker names share the most parts with the
    file's key names."""
    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES

    keys = sorted(k for k in header if k != "__metadata__")
    stripped = {next((k.removeprefix(p) for p in _PREFIXES if k.startswith(p)), k) for k in keys}
    parts = {part for k in stripped for part in k.split(".") if not part.isdigit()}
    best, best_score = None, 0.0
    for family, markers in CHECKPOINT_KEY_NAMES.items():
        for marker in [markers] if isinstance(markers, str) else markers:
            bare = next((marker.removeprefix(p) for p in _PREFIXES if marker.startswith(p)), marker)
            named = [part for part in bare.split(".") if not part.isdigit() and part not in _GENERIC]
            score = 2.0 if bare in stripped else sum(p in parts for p in named) / max(len(named), 1)
            if score > best_score and score >= 0.5:
                best, best_score = f"'{family}' ({marker})", score
    shown = ", ".join(keys[:4]) + (f" ... ({len(keys)} keys)" if len(keys) > 4 else "")
    if best is None:
        return f"its keys match no family diffusers' single-file loaders know ({shown})"
    how = "has the marker key of" if best_score == 2.0 else f"is closest ({best_score:.0%} of a marker's names) to"
    return (
        f"by diffusers' single-file key markers the file {how} {best}; its keys: {shown}. Pass --model a base "
        "pipeline of that family, or a file of this one"
    )
