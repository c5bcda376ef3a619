"""8-bit weight shards: ``nn.Linear`` weights stored in int8 (or fp8) with one scale per output channel,
all-gathered in 8 bits through FSDP2's tensor-subclass hooks and dequantized after the gather.

FSDP2 shards dim 0 of a parameter, which for ``nn.Linear.weight`` is the output channel, so a scale per output
channel (``amax(|row|) / 127``) is computed from the rows a rank holds: quantizing a shard gives exactly the
bytes that quantizing the whole weight and slicing it would. :class:`QuantizedWeight` is the parameter FSDP2
shards; it implements the few tensor ops ``fully_shard``, ``to_empty`` and the sharded loader use (split, slice,
``new_zeros``, ``empty_like``, ``copy_``) on its two inner tensors, and ``copy_`` from a floating tensor
quantizes, so :func:`hsdp.loading.load_pretrained` quantizes each rank's rows as it reads them.
``fsdp_pre_all_gather`` hands FSDP2 the 8-bit rows and their fp32 scales (FSDP2 packs mixed dtypes into one
byte buffer: 1 byte per weight plus 4 per row, about 0.5x of bf16), and ``fsdp_post_all_gather`` dequantizes
into the compute dtype, which the unchanged ``nn.Linear.forward`` then uses.

Inference only: the 8-bit weights are frozen and have no gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from hsdp.suggest import did_you_mean

logger = logging.getLogger("hsdp")

__all__ = [
    "WEIGHT_DTYPES",
    "QuantizedWeight",
    "quantize_rows",
    "dequantize_rows",
    "fake_quantize",
    "quantize_linear_weights",
    "quantizable_linears",
    "rows_split_evenly",
    "quantized_bytes",
    "quantized_share",
    "weight_dtype_problem",
]

WEIGHT_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
"""``--weight-dtype`` value -> the storage dtype of the quantized shards."""
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_SCALE_DTYPE = torch.float32
aten = torch.ops.aten


def quantize_rows(weight: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization: ``(q, scale)`` with ``q * scale ~= weight``; ``scale`` is ``[rows, 1]``
    fp32. A row of zeros gets scale 1 (any scale reproduces it; 0 would divide by zero)."""
    qmax = _QMAX[qdtype]
    w = weight.to(_SCALE_DTYPE)
    amax = w.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    scaled = (w / scale).clamp(-qmax, qmax)
    q = scaled.round().to(qdtype) if qdtype == torch.int8 else scaled.to(qdtype)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype``; the one formula the sharded path and the single-process reference share (the
    product is fp32: 8-bit values convert exactly, then one rounding into ``dtype``)."""
    return _product(q, scale).to(dtype)


def _product(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # int8 x fp32 promotes to fp32 in the multiply itself; float8 has no type promotion, so it converts first.
    return torch.mul(q if q.dtype == torch.int8 else q.to(_SCALE_DTYPE), scale)


def fake_quantize(weight: torch.Tensor, qdtype: torch.dtype) -> torch.Tensor:
    """``weight`` after a quantize-dequantize round trip, in its own dtype (the single-process reference)."""
    return dequantize_rows(*quantize_rows(weight, qdtype), weight.dtype)


class QuantizedWeight(torch.Tensor):
    """A 2-D weight stored as 8-bit rows (``qdata``) and fp32 per-row scales (``scale``); its dtype is the
    compute dtype it dequantizes to. Only FSDP2 and the loader handle it; the module sees the gathered,
    dequantized weight during forward."""

    qdata: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, shape: Any = None):
        return torch.Tensor._make_wrapper_subclass(
            cls, shape if shape is not None else qdata.shape, dtype=dtype, device=qdata.device
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, shape: Any = None):
        self.qdata = qdata
        self.scale = scale

    def __repr__(self) -> str:
        return f"QuantizedWeight(shape={tuple(self.shape)}, storage={self.qdata.dtype}, dtype={self.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["qdata", "scale"], (self.dtype, self.shape)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> QuantizedWeight:
        dtype, shape = meta
        return QuantizedWeight(inner["qdata"], inner["scale"], dtype, shape)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"{func} is not supported on an 8-bit weight shard (--weight-dtype); call dequantize() first"
            )
        return handler(*args, **(kwargs or {}))

    @property
    def stored_bytes(self) -> int:
        """Bytes this tensor holds: 8-bit rows plus their scales."""
        return self.qdata.numel() * self.qdata.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self) -> torch.Tensor:
        return dequantize_rows(self.qdata, self.scale, self.dtype)

    def _like(self, qdata: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight(qdata, scale, self.dtype)

    # -- FSDP2 all-gather extension ----------------------------------------------------------------------
    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: MixedPrecisionPolicy,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        return (self.qdata.contiguous(), self.scale.contiguous()), None

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: None,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        qdata, scale = all_gather_outputs
        result = None
        with torch.no_grad():
            if (
                out is not None
            ):  # a later gather: FSDP2 re-allocated the full weight; fill it in place, rounding
                out.copy_(_product(qdata, scale))  # the fp32 product into its dtype as dequantize_rows does
            else:
                full = dequantize_rows(qdata, scale, param_dtype)
                result = (full, (full,))
        # The 8-bit copy is not needed once dequantized: free it now rather than at reshard, so a unit kept
        # gathered (resident) holds only its compute-dtype weights. FSDP2 re-allocates it before the next gather.
        for tensor in all_gather_outputs:
            tensor.untyped_storage().resize_(0)
        return result


def _rows_only(dim: int) -> None:
    if dim != 0:
        raise NotImplementedError(f"an 8-bit weight shard splits only along its rows (dim 0), not dim {dim}")


def _split(x: QuantizedWeight, split: int | list[int], dim: int = 0) -> list[QuantizedWeight]:
    _rows_only(dim)
    return [x._like(q, s) for q, s in zip(x.qdata.split(split), x.scale.split(split), strict=True)]


def _slice(
    x: QuantizedWeight, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1
) -> QuantizedWeight:
    _rows_only(dim)
    return x._like(x.qdata[start:end:step], x.scale[start:end:step])


def _new_zeros(x: QuantizedWeight, size: list[int], **kwargs: Any) -> QuantizedWeight:
    device = kwargs.get("device") or x.device
    qdata = torch.zeros(size, dtype=x.qdata.dtype, device=device)
    return x._like(qdata, torch.zeros(size[0], 1, dtype=_SCALE_DTYPE, device=device))


def _empty_like(x: QuantizedWeight, **kwargs: Any) -> QuantizedWeight:
    device = kwargs.get("device") or x.device
    return x._like(torch.empty_like(x.qdata, device=device), torch.empty_like(x.scale, device=device))


def _copy(dst: QuantizedWeight, src: torch.Tensor, non_blocking: bool = False) -> QuantizedWeight:
    if isinstance(src, QuantizedWeight):
        q, scale = src.qdata, src.scale
    else:  # a floating tensor, e.g. this rank's rows read from a checkpoint: quantize them
        q, scale = quantize_rows(src.reshape(dst.shape), dst.qdata.dtype)
    dst.qdata.copy_(q)
    dst.scale.copy_(scale)
    return dst


def _view(x: QuantizedWeight, size: list[int]) -> QuantizedWeight:
    # FSDP2 keeps a flat view of each padded shard (``_sharded_param_data``); with the all-gather extension it
    # only holds it, so the flat view shares the inner tensors.
    if list(size) not in ([-1], [x.numel()], list(x.shape)):
        raise NotImplementedError(f"an 8-bit weight shard cannot be viewed as {list(size)}")
    return QuantizedWeight(x.qdata, x.scale, x.dtype, torch.Size([x.numel()]) if len(size) == 1 else x.shape)


def _detach(x: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(x.qdata, x.scale, x.dtype, x.shape)


def _to_copy(x: QuantizedWeight, **kwargs: Any) -> QuantizedWeight:
    # FSDP2's CPU offload moves shards between host and device; a change of dtype is not a move.
    if kwargs.get("dtype") not in (None, x.dtype):
        raise NotImplementedError(
            f"an 8-bit weight shard (--weight-dtype) cannot be cast to {kwargs['dtype']}"
        )
    device = kwargs.get("device") or x.device
    return QuantizedWeight(x.qdata.to(device), x.scale.to(device), x.dtype, x.shape)


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


def weight_dtype_problem(weight_dtype: str | None, device_type: str, *, training: bool = False) -> str | None:
    """Why ``--weight-dtype`` cannot be used here, or None. fp8 needs fp8 kernels (CUDA compute capability
    8.9+: Ada, Hopper and later); 8-bit weights are frozen, so training is refused."""
    if weight_dtype is None:
        return None
    if weight_dtype not in WEIGHT_DTYPES:
        return (f"--weight-dtype {weight_dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}"
                f"{did_you_mean(weight_dtype, WEIGHT_DTYPES)}")  # fmt: skip
    if training:
        return (
            f"--weight-dtype {weight_dtype} stores frozen 8-bit weights for inference; training needs "
            "full-precision weights: drop --weight-dtype"
        )
    if weight_dtype == "fp8":
        capable = device_type == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
        if not capable:
            where = device_type if device_type != "cuda" else f"cuda {torch.cuda.get_device_capability()}"
            return (
                f"--weight-dtype fp8 needs a device with fp8 kernels (CUDA compute capability 8.9 or newer); "
                f"this machine runs on {where}: use --weight-dtype int8"
            )
    return None


def quantizable_linears(
    model: nn.Module, *, skip: Collection[nn.Parameter] = ()
) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` modules of ``model`` whose weight :func:`quantize_linear_weights` stores in 8 bits when its
    rows split evenly over the shard size: not in ``skip``, not tied to another module, floating point. The one
    rule both quantizing and the planner's 8-bit budget (:mod:`hsdp.planning`) use."""
    skip_ids = {id(p) for p in skip}
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    found = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or not isinstance(weight, nn.Parameter):
            continue
        if id(weight) in skip_ids or uses[id(weight)] > 1 or not weight.is_floating_point():
            continue
        found.append((name, module))
    return found


def quantized_share(modules: Iterable[nn.Module]) -> dict[str, int | float]:
    """How much of the ``nn.Linear`` weights of loaded ``modules`` (sharded or not) is stored in 8 bits: the
    number of such weights, how many are quantized, and the fraction of their elements that is. The rest kept
    the compute dtype (see :func:`quantize_linear_weights`), so this is what ``--weight-dtype`` actually saved."""
    weights = quantized = elements = quantized_elements = 0
    for module in modules:
        for layer in module.modules():
            weight = getattr(layer, "weight", None)
            if not isinstance(layer, nn.Linear) or not isinstance(weight, torch.Tensor):
                continue
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            weights += 1
            elements += weight.numel()
            if isinstance(local, QuantizedWeight):
                quantized += 1
                quantized_elements += weight.numel()
    return {
        "linear_weights": weights,
        "quantized_weights": quantized,
        "quantized_fraction": quantized_elements / elements if elements else 0.0,
    }


def rows_split_evenly(rows: int, shard_size: int) -> bool:
    """Whether a weight of ``rows`` rows is stored in 8 bits over ``shard_size`` ranks: FSDP2 pads uneven shards,
    and its all-gather extension then needs every gathered tensor in the weight's padded shape, which the
    per-row scales cannot have."""
    return rows % shard_size == 0


def quantized_bytes(rows: int, cols: int, weight_dtype: str) -> int:
    """Bytes of ``rows`` rows of ``cols`` 8-bit values and their per-row scales: what a rank stores for its shard
    of a quantized weight, and (over all rows) what the all-gather moves."""
    return rows * cols * WEIGHT_DTYPES[weight_dtype].itemsize + rows * _SCALE_DTYPE.itemsize


def quantize_linear_weights(
    model: nn.Module, weight_dtype: str, *, shard_size: int, skip: Collection[nn.Parameter] = ()
) -> list[str]:
    """Replace the weight of every ``nn.Linear`` of ``model`` by a :class:`QuantizedWeight`, in place, before
    ``fully_shard``; returns the qualified names of the weights replaced.

    A weight on the meta device stays empty (the loader fills it, quantizing each rank's rows as it reads
    them); a real one is quantized now. Left in the compute dtype: weights in ``skip`` (those FSDP2 keeps
    replicated), weights tied to another module (an embedding shares its table with the LM head), and weights
    whose rows do not split evenly over ``shard_size`` ranks (FSDP2 pads such shards, and its all-gather
    extension then needs every gathered tensor to have the weight's padded shape, which the scales cannot).
    """
    qdtype = WEIGHT_DTYPES[weight_dtype]
    replaced, uneven = [], []
    for name, module in quantizable_linears(model, skip=skip):
        weight = module.weight
        if not rows_split_evenly(weight.shape[0], shard_size):
            uneven.append(name)
            continue
        with torch.no_grad():
            if weight.is_meta:
                q = torch.empty(weight.shape, dtype=qdtype, device="meta")
                scale = torch.empty(weight.shape[0], 1, dtype=_SCALE_DTYPE, device="meta")
            else:
                q, scale = quantize_rows(weight, qdtype)
        module.weight = nn.Parameter(QuantizedWeight(q, scale, weight.dtype), requires_grad=False)
        replaced.append(f"{name}.weight")
    if uneven:
        logger.warning(
            "--weight-dtype %s: %d Linear weights keep the compute dtype, their rows not dividing by the shard "
            "size %d: %s",
            weight_dtype,
            len(uneven),
            shard_size,
            ", ".join(uneven[:5]),
        )
    logger.info("--weight-dtype %s: %d Linear weights stored in 8 bits", weight_dtype, len(replaced))
    return replaced
