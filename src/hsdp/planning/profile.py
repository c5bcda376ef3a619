"""What the planner knows of a model, read from its config alone: FSDP units and their parameter shapes.

The model is built on the meta device (no weights are read) and split into the units the real sharding code
would make: the same shard plan, leaf-first ownership of parameters, and the same rule for parameters left
whole. Every per-rank byte count derived from a :class:`ModelProfile` is exact arithmetic over these shapes,
including FSDP2's padding of dim 0 to a multiple of the shard size. A model's kind comes from the class its
folder's ``config.json`` names (or the module's own class), never from the class name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hsdp.config import DTYPES
from hsdp.quantize import quantizable_linears, quantized_bytes, rows_split_evenly
from hsdp.shard_rules import resolve_plan
from hsdp.sharding import _unshardable_params
from hsdp.stored_quant import stored_linears

__all__ = [
    "PlanError",
    "parse_size",
    "format_size",
    "format_ms",
    "UnitProfile",
    "ModelProfile",
    "main_component",
    "model_kind",
    "profile_module",
    "parameter_units",
    "build_meta_model",
    "component_folders",
    "profile_model",
    "profile_whole",
]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS |= {"t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class PlanError(ValueError):
    """A planning input a user can fix (size, device count, model folder); the message says how."""


def parse_size(text: str | int, flag: str = "--device-memory") -> int:
    """``"24GiB"`` / ``"80GB"`` / ``"512MiB"`` / ``"1e9"`` -> bytes; anything else is a :class:`PlanError`."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise PlanError(f"{flag}={text!r} is not a positive size; write e.g. 24GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def format_size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.2f}" if ms >= 0.01 else f"{ms:.1e}"


# -- model profile -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class UnitProfile:
    """One FSDP unit: the parameters it owns, as ``(dim0, numel // dim0, element bytes)``."""

    name: str
    params: tuple[tuple[int, int, int], ...]
    linear: tuple[bool, ...] = ()
    """Per parameter: an ``nn.Linear`` weight ``--weight-dtype`` stores in 8 bits when its rows split evenly over
    the shard size (:func:`hsdp.quantize.quantizable_linears`); empty: none is."""
    trainable: tuple[bool, ...] = ()
    """Per parameter: trained (gradients, AdamW state); empty: every one is (LoRA freezes the base)."""
    stored: tuple[int, ...] = ()
    """Per parameter: the bytes of one stored row of a weight kept in a GGUF / fp8-scaled checkpoint's bytes when
    its rows split evenly over the shard size (:func:`hsdp.stored_quant.stored_linears`), 0 otherwise; empty: none."""

    def trained(self) -> UnitProfile:
        """The unit's trained parameters only: what has gradients and optimizer state."""
        if not self.trainable or all(self.trainable):
            return self
        return self._only([i for i, t in enumerate(self.trainable) if t])

    def frozen(self) -> UnitProfile:
        """The unit's parameters that train nothing (a LoRA's base); empty when every one trains."""
        return self._only([i for i, t in enumerate(self.trainable) if not t])

    def _only(self, keep: list[int]) -> UnitProfile:
        linear = tuple(self.linear[i] for i in keep) if self.linear else ()
        stored = tuple(self.stored[i] for i in keep) if self.stored else ()
        return UnitProfile(self.name, tuple(self.params[i] for i in keep), linear, stored=stored)

    @property
    def numel(self) -> int:
        return sum(d0 * rest for d0, rest, _ in self.params)

    @property
    def nbytes(self) -> int:
        """Stored bytes: a GGUF / fp8-scaled weight's stored rows, any other parameter in its dtype."""
        stored = self.stored or (0,) * len(self.params)
        return sum(d0 * s if s else d0 * rest * b for s, (d0, rest, b) in zip(stored, self.params, strict=True))

    def _eight_bit(self, shard: int, weight_dtype: str | None) -> list[bool]:
        """Which parameters are stored and all-gathered in 8 bits over ``shard`` ranks."""
        if weight_dtype is None or not self.linear:
            return [False] * len(self.params)
        return [
            q and rows_split_evenly(d0, shard) for q, (d0, _, _) in zip(self.linear, self.params, strict=True)
        ]

    def _stored_rows(self, shard: int) -> list[int]:
        """Per parameter: its stored row bytes when kept in a checkpoint's quantized bytes over ``shard`` ranks, else 0."""
        if not self.stored:
            return [0] * len(self.params)
        return [s if s and rows_split_evenly(d0, shard) else 0 for s, (d0, _, _) in zip(self.stored, self.params, strict=True)]

    def shard_bytes(self, shard: int, elem: int | None = None, weight_dtype: str | None = None) -> int:
        """Bytes FSDP2 allocates per rank: dim 0 padded to a multiple of ``shard``, one chunk each (8-bit rows and
        their scales for the weights ``weight_dtype`` quantizes; the stored rows of a GGUF / fp8-scaled weight)."""
        return sum(
            d0 // shard * s
            if s
            else quantized_bytes(d0 // shard, rest, weight_dtype)
            if q
            else math.ceil(d0 / shard) * rest * (elem or b)
            for s, q, (d0, rest, b) in zip(
                self._stored_rows(shard), self._eight_bit(shard, weight_dtype), self.params, strict=True
            )
        )

    def gathered_bytes(self, shard: int, elem: int | None = None, weight_dtype: str | None = None) -> int:
        """Size of the padded all-gather output (in ``elem`` bytes per value, or the stored dtype; 8-bit rows and
        their scales for the weights ``weight_dtype`` quantizes; the stored rows of a GGUF / fp8-scaled weight)."""
        return sum(
            d0 * s
            if s
            else quantized_bytes(d0, rest, weight_dtype)
            if q
            else math.ceil(d0 / shard) * shard * rest * (elem or b)
            for s, q, (d0, rest, b) in zip(
                self._stored_rows(shard), self._eight_bit(shard, weight_dtype), self.params, strict=True
            )
        )

    def copy_out_bytes(self, shard: int, elem: int | None = None, weight_dtype: str | None = None) -> int:
        """Peak bytes of the unit's gathered weights while FSDP2 copies its all-gather out: its unsharded weights;
        8-bit weights are copied out as 8-bit rows and scales and dequantized one at a time into the compute
        dtype through an fp32 product (:func:`hsdp.quantize.dequantize_rows`), each 8-bit copy freed after."""
        eight = self._eight_bit(shard, weight_dtype)
        stored = self._stored_rows(shard)
        live = sum(
            d0 * s if s else quantized_bytes(d0, rest, weight_dtype) if q else d0 * rest * (elem or b)
            for s, q, (d0, rest, b) in zip(stored, eight, self.params, strict=True)
        )
        peak = live
        for s, q, (d0, rest, b) in zip(stored, eight, self.params, strict=True):
            if s:  # dequantized one weight at a time into the compute dtype, its stored copy freed after
                e = elem or b
                peak = max(peak, live + d0 * rest * e)
                live += d0 * rest * e - d0 * s
            elif q:
                e = elem or b
                product = d0 * rest * 4  # fp32; it is the result itself when the compute dtype is fp32
                peak = max(peak, live + product + (d0 * rest * e if e != 4 else 0))
                live += d0 * rest * e - quantized_bytes(d0, rest, weight_dtype)
        return peak

    def unsharded_bytes(self, elem: int | None = None) -> int:
        """The unit's weights gathered, in ``elem`` bytes per value or the stored dtype (8-bit weights are
        dequantized into the compute dtype)."""
        return sum(d0 * rest * (elem or b) for d0, rest, b in self.params)


@dataclass(frozen=True)
class ModelProfile:
    """A model (or pipeline component) as the planner sees it: FSDP units plus what stays whole."""

    name: str
    class_name: str
    kind: str
    """``diffusion`` (a DiT: CFG and Ulysses apply), ``causal_lm`` or ``encoder``."""
    blocks: tuple[UnitProfile, ...]
    """Units the shard plan selects, in forward (module) order."""
    root: UnitProfile
    """Parameters left to the root unit."""
    replicated_bytes: int
    """Parameters FSDP2 does not shard (ignored modules, 0-d or integer) plus buffers: whole on every rank."""
    hidden: int
    ffn: int
    layers: int
    heads: int
    vocab: int
    num_params: int
    """Every parameter, sharded or not (tied weights once)."""
    replicated_trained: int | None = None
    """Bytes of ``replicated_bytes`` that are trained parameters; None: all of them (as before LoRA was planned)."""

    @property
    def replicated_trained_bytes(self) -> int:
        return self.replicated_bytes if self.replicated_trained is None else self.replicated_trained

    @property
    def units(self) -> tuple[UnitProfile, ...]:
        return (*self.blocks, self.root)

    @property
    def param_bytes(self) -> int:
        """Every parameter and buffer, in their stored dtypes."""
        return sum(u.nbytes for u in self.units) + self.replicated_bytes

    def with_frozen_whole(self, elem: int | None) -> ModelProfile:
        """The profile as training with ``--frozen-whole`` (or NO_SHARD) lays it out: the frozen parameters leave
        the FSDP units and stay whole on every rank, in ``elem`` bytes per value (the compute dtype they are cast
        to) or their stored dtype; the units keep what trains."""
        frozen = sum(u.frozen().unsharded_bytes(elem) for u in self.units)
        return dataclasses.replace(
            self,
            blocks=tuple(u.trained() for u in self.blocks),
            root=self.root.trained(),
            replicated_bytes=self.replicated_bytes + frozen,
            replicated_trained=self.replicated_trained_bytes,
        )


def main_component(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """The component that runs every step: a pipeline's diffusion transformer, else the largest."""
    return max(profiles, key=lambda p: (p.kind == "diffusion", p.num_params))


def _config_int(config: dict, *keys: str, default: int = 0) -> int:
    for key in keys:
        if isinstance(config.get(key), int):
            return config[key]
    return default


def model_kind(cls: type[nn.Module]) -> str:
    """``diffusion`` for a diffusers denoiser (a model that is not an autoencoder, as the engine decides) whose
    attention diffusers can split (a ``_cp_plan``: a DiT, where CFG and Ulysses apply); ``causal_lm`` for a class
    transformers registers as a causal LM; ``encoder`` for anything else (text encoders, VAEs, a UNet).
    :func:`profile_model` passes the class its folder's ``config.json`` names (``_class_name`` / ``architectures``).
    """
    # A class of either library means that library is imported: neither is imported here for a model of neither.
    if "diffusers" in sys.modules:
        from hsdp.models.description import is_denoiser_class

        if is_denoiser_class(cls) and getattr(cls, "_cp_plan", None):
            return "diffusion"
    if "transformers" in sys.modules:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        if cls.__name__ in {n for v in names for n in ([v] if isinstance(v, str) else v)}:
            return "causal_lm"
    return "encoder"


def profile_module(model: nn.Module, name: str = "model", config: dict | None = None) -> ModelProfile:
    """Profile a module (on meta or real) by the plan :func:`hsdp.sharding.apply_hsdp_to_model` would use."""
    plan = resolve_plan(model)
    targets = [n for n, m in model.named_modules() if n and plan.should_shard(n, m)]
    # The very rule apply_hsdp_to_model uses for parameters left whole (ignored, 0-d, integer, odd dtype).
    whole = (
        set(_unshardable_params(model, plan, training=False))
        if targets
        else {n for n, _ in model.named_parameters()}
    )
    owned: dict[str, list[tuple[int, int, int]]] = {n: [] for n in [*targets, ""]}
    linear: dict[str, list[bool]] = {n: [] for n in owned}
    stored: dict[str, list[int]] = {n: [] for n in owned}
    # Weights a GGUF / fp8-scaled checkpoint keeps in its stored bytes (build_meta_model attaches the layout).
    stored_rows = stored_linears(model, getattr(model, "hsdp_stored_layout", None) or {})
    trainable: dict[str, list[bool]] = {n: [] for n in owned}
    frozen = any(not p.requires_grad for p in model.parameters())
    replicated_trained = 0
    # The weights --weight-dtype would store in 8 bits (those left whole are skipped below, as quantizing skips them).
    eight_bit = {f"{n}.weight" if n else "weight" for n, _ in quantizable_linears(model)}
    replicated = sum(b.numel() * b.element_size() for b in model.buffers())
    for pname, param in model.named_parameters():
        if pname in whole:
            replicated += param.numel() * param.element_size()
            replicated_trained += param.numel() * param.element_size() if param.requires_grad else 0
            continue
        owner = _owner(pname, targets)
        owned[owner].append((param.shape[0], param.numel() // max(1, param.shape[0]), param.element_size()))
        linear[owner].append(pname in eight_bit)
        stored[owner].append(stored_rows.get(pname, 0))
        trainable[owner].append(param.requires_grad)
    if config is None:  # a transformers PretrainedConfig, or a diffusers FrozenDict
        found = getattr(model, "config", None)
        config = found.to_dict() if hasattr(found, "to_dict") else dict(found or {})
    heads = _config_int(config, "num_attention_heads", "num_heads", "n_head")
    hidden = _config_int(config, "hidden_size", "d_model", "n_embd")
    if not hidden and heads:
        hidden = heads * _config_int(config, "attention_head_dim", "head_dim", default=64)
    return ModelProfile(
        name=name,
        class_name=type(model).__name__,
        kind=model_kind(type(model)),
        blocks=tuple(_unit(t, owned, linear, trainable, frozen, stored) for t in targets if owned[t]),
        root=_unit("", owned, linear, trainable, frozen, stored),
        replicated_bytes=replicated,
        hidden=hidden,
        ffn=_config_int(config, "intermediate_size", "ffn_dim", "d_ff", "n_inner", default=4 * hidden),
        layers=_config_int(config, "num_hidden_layers", "num_layers", "n_layer", default=len(targets)),
        heads=heads,
        vocab=_config_int(config, "vocab_size"),
        num_params=sum(p.numel() for p in model.parameters()),
        replicated_trained=replicated_trained if frozen else None,
    )


def _owner(pname: str, targets: Sequence[str]) -> str:
    """The unit that owns parameter ``pname``: fully_shard runs leaf-first, so the deepest selected module that
    contains it ("" for the root)."""
    return max((t for t in targets if pname.startswith(t + ".")), key=len, default="")


def parameter_units(model: nn.Module) -> dict[str, str]:
    """Each parameter's name -> the unit that owns it under the model's shard plan (``""``: the root)."""
    plan = resolve_plan(model)
    targets = [n for n, m in model.named_modules() if n and plan.should_shard(n, m)]
    return {n: _owner(n, targets) for n, _ in model.named_parameters()}


def _unit(name: str, owned: dict, linear: dict, trainable: dict, frozen: bool, stored: dict) -> UnitProfile:
    """One unit's profile; which parameters are trained is recorded only when some parameter is frozen."""
    kept = tuple(stored[name]) if any(stored[name]) else ()
    return UnitProfile(name, tuple(owned[name]), tuple(linear[name]), tuple(trainable[name]) if frozen else (), kept)


def _stored_dtype(folder: Path, config: dict) -> torch.dtype:
    from hsdp.loading import CheckpointError, read_checkpoint_index, stored_view

    try:  # a GGUF / fp8-scaled checkpoint's plain tensors give its compute dtype
        dtype = stored_view(read_checkpoint_index(folder))[0].floating_dtype
    except CheckpointError:  # a config-only folder still plans, at the config's dtype
        dtype = None
    named = str(config.get("torch_dtype") or config.get("dtype") or "")  # transformers 5 writes "dtype"
    return dtype or DTYPES.get(named.removeprefix("torch."), torch.float32)


def build_meta_model(folder: Path, dtype: torch.dtype | None = None) -> tuple[nn.Module, dict]:
    """The model a folder's ``config.json`` describes, parameters on the meta device at the stored dtype (built as
    :func:`hsdp.loading.load_pretrained` builds it), and that config."""
    from hsdp.loading import (
        CheckpointError,
        build_empty_model,
        model_class_for,
        read_checkpoint_index,
        stored_view,
    )

    try:
        cls = model_class_for(folder)
        config = json.loads((folder / "config.json").read_text())
    except (CheckpointError, OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read model folder {folder}: {exc}") from exc
    try:
        # Loading's own build, so tied weights stay tied and fp32-kept modules stay fp32 exactly as loaded.
        model = build_empty_model(cls, folder, dtype or _stored_dtype(folder, config))
    except Exception as exc:  # a config the library rejects: say which file, keep the library's reason
        raise PlanError(f"cannot build {cls.__name__} from {folder / 'config.json'}: {exc}") from exc
    if not isinstance(model.config, dict):  # transformers' config, with every default filled in
        config = model.config.to_dict()
    # A converted GGUF / fp8-scaled single file: which weights keep their stored bytes (hsdp.stored_quant); a
    # config-only folder has none.
    with contextlib.suppress(CheckpointError):
        model.hsdp_stored_layout = stored_view(read_checkpoint_index(folder))[1]
    return model, config


def component_folders(name_or_path: str) -> list[tuple[str, Path]]:
    """``[(name, folder)]``: the folder itself, or each model component of a diffusers pipeline folder."""
    from hsdp.models.builtin import resolve_model

    try:
        folder = resolve_model(name_or_path)
    except FileNotFoundError as exc:
        raise PlanError(str(exc)) from exc
    from hsdp.models.description import describe, is_pipeline

    if not is_pipeline(folder):
        return [(folder.name, folder)]
    try:
        components = describe(folder).components
    except ValueError as exc:
        raise PlanError(f"cannot read {folder}: {exc}") from exc
    # Schedulers and tokenizers have no config.json; components set to null (Wan's transformer_2) are absent.
    found = [(name, c.folder) for name, c in components.items() if c.in_library and c.has_config]
    if not found:
        raise PlanError(f"{folder} is a pipeline folder, but none of its components has a model config.json")
    return found


def profile_whole(model: nn.Module, name: str = "model") -> ModelProfile:
    """A component every rank holds whole: no units (not profiled by a shard plan, which would warn about a model
    that is never sharded)."""
    tensors = [*model.parameters(), *model.buffers()]
    return ModelProfile(
        name=name,
        class_name=type(model).__name__,
        kind="encoder",
        blocks=(),
        root=UnitProfile("", ()),
        replicated_bytes=sum(t.numel() * t.element_size() for t in tensors),
        hidden=0,
        ffn=0,
        layers=0,
        heads=0,
        vocab=0,
        num_params=sum(p.numel() for p in model.parameters()),
    )


def profile_model(
    name_or_path: str, dtype: torch.dtype | None = None, sharded: Collection[str] | None = None
) -> list[ModelProfile]:
    """Profiles of a model folder, a diffusers pipeline folder (one per model component) or a built-in name.

    ``sharded``: the pipeline components the engine shards (:attr:`hsdp.engine.model_info.ModelInfo.shardable`);
    the others count whole on every rank. None profiles every component by its shard plan. A folder that is one
    model (a causal LM, one component) is always profiled sharded."""
    folders = component_folders(name_or_path)
    profiles = []
    for name, folder in folders:
        model, config = build_meta_model(folder, dtype)
        shard = sharded is None or len(folders) == 1 or name in sharded
        profiles.append(profile_module(model, name, config) if shard else profile_whole(model, name))
    return profiles
