"""Weights kept in the quantized bytes a checkpoint stores (GGUF blocks, ComfyUI's ``fp8_scaled``), sharded and
all-gathered in those bytes and dequantized per layer at compute, as diffusers computes with them in one process.

A converted single file (:mod:`hsdp.models.single_file`) stores each such weight under its diffusers name in its
stored bytes (GGUF: ``uint8 [rows, blocks per row * block bytes]``, blocks running along the last dim; fp8-scaled:
``float8_e4m3fn [rows, cols]``), and names its format in the file's ``__metadata__`` under :data:`LAYOUT_KEY`. GGUF
blocks run along a row, so row ``i`` of the stored bytes is row ``i`` of the weight: FSDP2 shards dim 0 of both
alike, and a rank reads, holds and gathers only its whole rows. :class:`StoredQuantWeight` is the parameter FSDP2
shards (the ops ``fully_shard``, ``to_empty`` and the loader use, on its one inner tensor);
``fsdp_post_all_gather`` dequantizes the gathered bytes into the compute dtype:

- GGUF with diffusers' own ``dequantize_gguf_tensor`` then ``.to(compute_dtype)``, what diffusers' ``GGUFLinear``
  does in every forward (``GGUFQuantizationConfig(compute_dtype=...)``; the compute dtype is the model's dtype);
- fp8-scaled as ComfyUI's scaled-fp8 layers do: ``weight.to(dtype) * scale_weight.to(dtype)``.

Weights diffusers dequantizes once at load (``_keep_in_fp32_modules`` into fp32), weights that are not an
``nn.Linear``'s, and weights whose rows do not divide by the shard size (FSDP2 would pad their bytes) are
dequantized by the same function while a rank reads its rows (:func:`decode_rows`), into the parameter's dtype.
Inference only: the stored weights are frozen.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

logger = logging.getLogger("hsdp")

__all__ = [
    "LAYOUT_KEY",
    "StoredFormat",
    "StoredQuantWeight",
    "read_layout",
    "dequantize",
    "decode_rows",
    "keep_stored",
    "stored_linears",
    "stored_bytes_of",
]

LAYOUT_KEY = "hsdp_stored_quant"
"""The safetensors ``__metadata__`` entry: JSON ``{key: {"format": "gguf"|"fp8_scaled", "type": ..., "shape":
[...], "scale": float}}`` for every tensor kept in its stored bytes."""
aten = torch.ops.aten


@dataclass(frozen=True)
class StoredFormat:
    """How one weight is stored: ``format`` ``gguf`` (``quant_type``, a ``gguf.GGMLQuantizationType`` name) or
    ``fp8_scaled`` (``scale``, the per-tensor ``scale_weight``); ``shape`` the weight's own (dequantized) shape."""

    format: str
    shape: tuple[int, ...]
    quant_type: str | None = None
    scale: float | None = None

    def to_json(self) -> dict:
        out: dict[str, Any] = {"format": self.format, "shape": list(self.shape)}
        if self.quant_type is not None:
            out["type"] = self.quant_type
        if self.scale is not None:
            out["scale"] = self.scale
        return out

    @staticmethod
    def from_json(entry: Mapping) -> StoredFormat:
        return StoredFormat(entry["format"], tuple(entry["shape"]), entry.get("type"), entry.get("scale"))

    @property
    def label(self) -> str:
        return f"GGUF {self.quant_type}" if self.format == "gguf" else "fp8_scaled"


def read_layout(metadata: Mapping[str, str] | None) -> dict[str, StoredFormat]:
    """The stored formats a safetensors header's ``__metadata__`` names (empty: a plain checkpoint)."""
    if not metadata or LAYOUT_KEY not in metadata:
        return {}
    return {k: StoredFormat.from_json(v) for k, v in json.loads(metadata[LAYOUT_KEY]).items()}


def dequantize(qdata: torch.Tensor, fmt: StoredFormat, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows -> their values in ``dtype``: the one formula the sharded path and the single-process
    reference share."""
    if fmt.format == "gguf":
        import gguf
        from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

        quant_type = gguf.GGMLQuantizationType[fmt.quant_type]
        return dequantize_gguf_tensor(GGUFParameter(qdata, quant_type=quant_type)).to(dtype)
    scale = torch.tensor(fmt.scale, dtype=torch.float32, device=qdata.device)
    return qdata.to(dtype) * scale.to(dtype)


def decode_rows(chunk: torch.Tensor, fmt: StoredFormat, dtype: torch.dtype, region: tuple[slice, ...]) -> torch.Tensor:
    """``region`` of a weight from the stored bytes of its rows ``region[0]`` (``chunk``): dequantized, then the
    columns of the region kept."""
    return dequantize(chunk, fmt, dtype)[(slice(None), *region[1:])]


def stored_bytes_of(fmt: StoredFormat) -> int:
    """Bytes the whole weight takes in its stored format (what ``hsdp plan`` counts and the all-gather moves)."""
    rows, cols = fmt.shape[0], _prod(fmt.shape[1:])
    if fmt.format == "gguf":
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt.quant_type]]
        return rows * cols // block * size
    return rows * cols  # one byte per fp8 value


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


class StoredQuantWeight(torch.Tensor):
    """A weight held as its stored rows (``qdata``); its shape and dtype are the weight's own and the compute dtype.
    Only FSDP2 and the loader handle it; the module sees the gathered, dequantized weight during forward."""

    qdata: torch.Tensor
    fmt: StoredFormat

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, fmt: StoredFormat, dtype: torch.dtype, shape: Any = None):
        shape = shape if shape is not None else torch.Size([qdata.shape[0], *fmt.shape[1:]])
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, fmt: StoredFormat, dtype: torch.dtype, shape: Any = None):
        self.qdata = qdata
        self.fmt = fmt

    def __repr__(self) -> str:
        return f"StoredQuantWeight(shape={tuple(self.shape)}, {self.fmt.label}, dtype={self.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["qdata"], (self.fmt, self.dtype, self.shape)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> StoredQuantWeight:
        fmt, dtype, shape = meta
        return StoredQuantWeight(inner["qdata"], fmt, dtype, shape)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(f"{func} is not supported on a stored-quantized weight shard; call dequantize()")
        return handler(*args, **(kwargs or {}))

    @property
    def stored_bytes(self) -> int:
        return self.qdata.numel() * self.qdata.element_size()

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.qdata, self.fmt, self.dtype)

    def _like(self, qdata: torch.Tensor) -> StoredQuantWeight:
        return StoredQuantWeight(qdata, self.fmt, self.dtype)

    # -- FSDP2 all-gather extension: gather the stored bytes, dequantize after ---------------------------------
    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module,
        mp_policy: MixedPrecisionPolicy,
    ) -> tuple[tuple[torch.Tensor], None]:  # fmt: skip
        return (self.qdata.contiguous(),), None

    def fsdp_post_all_gather(
        self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: None, param_dtype: torch.dtype, *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:  # fmt: skip
        (qdata,) = all_gather_outputs
        result = None
        with torch.no_grad():
            # Into the layout's compute dtype (training's mixed precision), else the parameter's own.
            full = dequantize(qdata, self.fmt, param_dtype or self.dtype)
            if out is not None:  # a later gather: FSDP2 re-allocated the full weight; fill it in place
                # With the same values as before (the same bytes), so autograd, which saved this tensor in forward
                # for backward (a LoRA base's matmul), must not see a new version of it.
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_(full)
            else:
                result = (full, (full,))
        # The stored copy is not needed once dequantized (FSDP2 re-allocates it before the next gather).
        qdata.untyped_storage().resize_(0)
        return result


def _rows_only(dim: int) -> None:
    if dim != 0:
        raise NotImplementedError(f"a stored-quantized weight shard splits only along its rows (dim 0), not dim {dim}")


def _split(x: StoredQuantWeight, split: int | list[int], dim: int = 0) -> list[StoredQuantWeight]:
    _rows_only(dim)
    return [x._like(q) for q in x.qdata.split(split)]


def _slice(x: StoredQuantWeight, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1):
    _rows_only(dim)
    return x._like(x.qdata[start:end:step])


def _new_zeros(x: StoredQuantWeight, size: list[int], **kwargs: Any) -> StoredQuantWeight:
    device = kwargs.get("device") or x.device
    return x._like(torch.zeros(size[0], *x.qdata.shape[1:], dtype=x.qdata.dtype, device=device))


def _empty_like(x: StoredQuantWeight, **kwargs: Any) -> StoredQuantWeight:
    return x._like(torch.empty_like(x.qdata, device=kwargs.get("device") or x.device))


def _copy(dst: StoredQuantWeight, src: torch.Tensor, non_blocking: bool = False) -> StoredQuantWeight:
    # From another shard, or this rank's stored rows as read from the checkpoint (the same bytes).
    dst.qdata.copy_(src.qdata if isinstance(src, StoredQuantWeight) else src.reshape(dst.qdata.shape))
    return dst


def _view(x: StoredQuantWeight, size: list[int]) -> StoredQuantWeight:
    # FSDP2 keeps a flat view of each shard (``_sharded_param_data``); with the all-gather extension it only holds it.
    if list(size) not in ([-1], [x.numel()], list(x.shape)):
        raise NotImplementedError(f"a stored-quantized weight shard cannot be viewed as {list(size)}")
    return StoredQuantWeight(x.qdata, x.fmt, x.dtype, torch.Size([x.numel()]) if len(size) == 1 else x.shape)


def _detach(x: StoredQuantWeight) -> StoredQuantWeight:
    return StoredQuantWeight(x.qdata, x.fmt, x.dtype, x.shape)


def _to_copy(x: StoredQuantWeight, **kwargs: Any) -> StoredQuantWeight:
    if kwargs.get("dtype") not in (None, x.dtype):
        raise NotImplementedError(f"a stored-quantized weight shard ({x.fmt.label}) cannot be cast to {kwargs['dtype']}")
    device = kwargs.get("device") or x.device
    return StoredQuantWeight(x.qdata.to(device), x.fmt, x.dtype, x.shape)


_OPS: dict[Any, Callable[..., Any]] = {
    aten.split.Tensor: _split,
    aten.slice.Tensor: _slice,
    aten.new_zeros.default: _new_zeros,
    aten.empty_like.default: _empty_like,
    aten.copy_.default: _copy,
    aten.view.default: _view,
    aten.detach.default: _detach,
    aten._to_copy.default: _to_copy,
}


def stored_linears(model: nn.Module, layout: Mapping[str, StoredFormat]) -> dict[str, int]:
    """The weights of ``layout`` kept in their stored bytes when their rows split evenly over the shard size ->
    the bytes of one stored row: ``nn.Linear`` weights outside ``_keep_in_fp32_modules`` (diffusers dequantizes
    those at load, into fp32). The one rule both loading (:func:`keep_stored`) and ``hsdp plan`` use."""
    keep_fp32 = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    found = {}
    for name, module in model.named_modules():
        key = f"{name}.weight" if name else "weight"
        fmt = layout.get(key)
        if fmt is not None and isinstance(module, nn.Linear) and not keep_fp32.intersection(key.split(".")):
            found[key] = stored_bytes_of(fmt) // fmt.shape[0]
    return found


def keep_stored(
    model: nn.Module, layout: Mapping[str, StoredFormat], *, shard_size: int, skip: Collection[nn.Parameter] = ()
) -> list[str]:
    """Replace, in place and before ``fully_shard``, each ``nn.Linear`` weight of ``layout`` by an empty (meta)
    :class:`StoredQuantWeight` in the parameter's dtype; returns the names replaced. Left as they are (the loader
    dequantizes their rows as it reads them): weights in ``skip`` (kept whole), in ``_keep_in_fp32_modules``
    (diffusers dequantizes those at load, into fp32), and weights whose rows do not divide by ``shard_size``."""
    skip_ids = {id(p) for p in skip}
    replaced, uneven = [], []
    for key, row_bytes in stored_linears(model, layout).items():
        module, fmt = model.get_submodule(key.removesuffix(".weight").removesuffix("weight")), layout[key]
        if id(module.weight) in skip_ids:
            continue
        if fmt.shape[0] % shard_size:
            uneven.append(key)
            continue
        qdtype = torch.uint8 if fmt.format == "gguf" else torch.float8_e4m3fn
        qdata = torch.empty(fmt.shape[0], row_bytes, dtype=qdtype, device="meta")
        module.weight = nn.Parameter(StoredQuantWeight(qdata, fmt, module.weight.dtype), requires_grad=False)
        replaced.append(key)
    if uneven:
        logger.warning(
            "%d stored-quantized weights are dequantized at load, their rows not dividing by the shard size %d: %s",
            len(uneven), shard_size, ", ".join(uneven[:5]),
        )  # fmt: skip
    logger.info("%d Linear weights kept in their stored bytes (GGUF / fp8_scaled)", len(replaced))
    return replaced
