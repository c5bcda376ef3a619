"""What a safetensors checkpoint holds, read from its headers only: every tensor's file, shape and dtype.

Below both :mod:`hsdp.loading` (which checks a checkpoint against the model before allocating anything) and
:mod:`hsdp.conversions` (which maps stored keys onto the model's with transformers' conversions), so neither imports
the other for it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

__all__ = ["CheckpointError", "TensorEntry", "CheckpointIndex", "default_name", "read_checkpoint_index", "variant_of"]

# Weight variants (``from_pretrained(variant="fp16")``): ``diffusion_pytorch_model.fp16.safetensors``, the shards
# ``model.fp16-00001-of-00002.safetensors`` and their index ``model.safetensors.index.fp16.json``.
VARIANT_WEIGHT = re.compile(r"^(?P<stem>[^.]+)\.(?P<variant>[A-Za-z0-9_]+)(?P<shard>-\d+-of-\d+)?\.(?P<ext>safetensors|bin)$")
VARIANT_INDEX = re.compile(r"^(?P<stem>[^.]+)\.(?P<ext>safetensors|bin)\.index\.(?P<variant>[A-Za-z0-9_]+)\.json$")


def variant_of(name: str) -> str | None:
    """The variant a weight or weight-index file name belongs to (``fp16``), or None for default weights."""
    match = VARIANT_WEIGHT.match(name) or VARIANT_INDEX.match(name)
    return match["variant"] if match else None


def default_name(name: str) -> str:
    """The name ``name`` (a variant's file) has in the default weights: ``model.fp16-00001-of-00002.safetensors``
    -> ``model-00001-of-00002.safetensors``, ``model.safetensors.index.fp16.json`` -> ``model.safetensors.index.json``."""
    if match := VARIANT_WEIGHT.match(name):
        return f"{match['stem']}{match['shard'] or ''}.{match['ext']}"
    if match := VARIANT_INDEX.match(name):
        return f"{match['stem']}.{match['ext']}.index.json"
    return name


_INDEX_NAMES = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # fp8_scaled single files (hsdp.stored_quant)
    "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or does not match the model."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor of a safetensors checkpoint (one file or an index of shards), read from headers only."""

    folder: Path
    tensors: dict[str, TensorEntry]

    @property
    def floating_dtype(self) -> torch.dtype | None:
        return next((e.dtype for e in self.tensors.values() if e.dtype.is_floating_point), None)


def _checkpoint_files(folder: Path) -> list[Path]:
    for name in _INDEX_NAMES:
        index = folder / name
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
            files = [folder / f for f in sorted(set(weight_map.values()))]
            missing = [str(f) for f in files if not f.exists()]
            if missing:
                raise CheckpointError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
            return files
    found = sorted(folder.glob("*.safetensors"))
    files = [f for f in found if variant_of(f.name) is None]  # a variant beside the default weights is not read
    if not files:
        variants = sorted({v for f in found if (v := variant_of(f.name))})
        hint = f"; it holds the variant(s) {', '.join(variants)}: pass --variant {variants[0]}" if variants else ""
        raise CheckpointError(f"no *.safetensors checkpoint in {folder}{hint}")
    return files


def read_checkpoint_index(folder: str | Path) -> CheckpointIndex:
    """Read the headers of every checkpoint file in ``folder``; raises :class:`CheckpointError` naming the file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    tensors: dict[str, TensorEntry] = {}
    for file in _checkpoint_files(folder):
        try:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    sl = handle.get_slice(key)
                    tensors[key] = TensorEntry(
                        file, tuple(sl.get_shape()), _SAFETENSORS_DTYPES[sl.get_dtype()]
                    )
        except (SafetensorError, OSError, KeyError) as exc:
            raise CheckpointError(f"{file}: unreadable or corrupt safetensors file ({exc})") from exc
    return CheckpointIndex(folder, tensors)
