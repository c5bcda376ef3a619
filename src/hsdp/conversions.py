"""transformers' own load-time checkpoint conversions, planned from safetensors headers alone.

transformers 5 renames some checkpoint keys while loading (legacy names such as Mixtral's ``block_sparse_moe``)
and fuses others (a mixture-of-experts checkpoint stores ``mlp.experts.0.gate_proj.weight`` and so on per expert;
the model holds one ``mlp.experts.gate_up_proj`` of shape ``[experts, 2 * intermediate, hidden]``). This module
asks transformers for the model's conversions (``get_model_conversion_mapping``) and maps every stored key the
way ``convert_and_load_state_dict_in_model`` does (``rename_source_key`` in ``dot_natural_key`` order), without
reading any tensor data: each fused parameter is converted once on the meta device to learn its name and shape,
so a checkpoint that does not fit is reported before anything is allocated. Conversions run with transformers' own
``WeightConverter.convert``; this module only decides which stored tensors a rank needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from copy import deepcopy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers.core_model_loading import WeightConverter

    from hsdp.safetensors_index import TensorEntry

__all__ = ["FusedParam", "KeyPlan", "plan_keys"]


@dataclass
class FusedParam:
    """Model parameters that one transformers ``WeightConverter`` builds from one or more stored tensors."""

    first_target: str  # the model key transformers groups this conversion under
    converter: WeightConverter  # a template that never holds tensors; each conversion runs on a fresh copy
    sources: dict[str, list[str]] = field(
        default_factory=dict
    )  # source pattern -> stored keys, in load order
    shapes: dict[str, torch.Size] = field(default_factory=dict)  # model key -> converted shape (from meta)
    error: str | None = None  # why the conversion failed on meta, if it did

    @property
    def stored_keys(self) -> list[str]:
        return [key for keys in self.sources.values() for key in keys]

    def convert(self, model: nn.Module, tensors: Mapping[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Run transformers' conversion on ``tensors`` (source pattern -> tensors in load order)."""
        converter = deepcopy(self.converter)
        for pattern, values in tensors.items():
            for value in values:
                converter.add_tensor(self.first_target, "", pattern, value)
        out = converter.convert(self.first_target, model=model, config=model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}

    def stacks_rows(self) -> bool:
        """True when row ``i`` of the one fused parameter comes from the ``i``-th stored tensor of every source,
        so a rank holding rows ``[a, b)`` needs only those stored tensors: the first op stacks the per-expert
        tensors along a new dim 0 and every later op leaves dim 0 alone."""
        from transformers.core_model_loading import Chunk, Concatenate, Interleave, MergeModulelist, Transpose

        first, *rest = self.converter.operations
        if len(self.shapes) != 1 or not isinstance(first, MergeModulelist) or first.dim != 0:
            return False
        for op in rest:
            if isinstance(op, Transpose):
                dims = (op.dim0, op.dim1)
            elif isinstance(op, (Concatenate, Chunk, Interleave)):
                dims = (op.dim,)
            else:  # an op we do not know may move rows; the caller then reads every source tensor
                return False
            if any(d < 1 for d in dims):  # negative dims are left to the safe path rather than resolved
                return False
        return True


@dataclass
class KeyPlan:
    """Where every model key comes from in a checkpoint, after transformers' load-time conversions."""

    direct: dict[str, str]  # model key -> the stored key read into it as is (the same name unless renamed)
    fused: list[FusedParam]
    unexpected: dict[str, str]  # stored key -> the name it was renamed to, for keys no model key comes from

    @property
    def converted(self) -> bool:
        return bool(self.fused) or any(model_key != stored for model_key, stored in self.direct.items())


def plan_keys(model: nn.Module, stored: Mapping[str, TensorEntry]) -> KeyPlan:
    """Map ``stored`` checkpoint keys to ``model``'s keys as ``from_pretrained`` would; reads no tensor data."""
    model_keys = model.state_dict()
    if not _converts_on_load(model):  # diffusers, plain modules and transformers 4 read keys as stored
        direct = {k: k for k in stored if k in model_keys}
        return KeyPlan(direct, [], {k: k for k in stored if k not in model_keys})
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = model.base_model_prefix
    direct: dict[str, str] = {}
    fused: dict[str, FusedParam] = {}
    unexpected: dict[str, str] = {}
    # Sorted like transformers: the order fixes which expert lands in which row, and guarded renamings depend on it.
    for key in sorted(stored, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, model_keys)
        if (
            renamed not in model_keys and key in model_keys
        ):  # a key that already names a parameter stays as is
            renamed, pattern = rename_source_key(key, [], [], prefix, model_keys)
        if renamed not in model_keys:
            unexpected[key] = renamed
        elif pattern is not None:
            template = fused.setdefault(renamed, FusedParam(renamed, deepcopy(by_pattern[pattern])))
            template.sources.setdefault(pattern, []).append(key)
        elif renamed in direct:  # transformers loads the first of two keys renamed alike; the other is unused
            unexpected[key] = renamed
        else:
            direct[renamed] = key
    for param in fused.values():
        _convert_on_meta(model, param, stored)
    return KeyPlan(direct, list(fused.values()), unexpected)


def _converts_on_load(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model of a transformers that converts checkpoints on load (5 and
    later; transformers is optional for hsdp and 4.x has no ``conversion_mapping``)."""
    try:
        import transformers.conversion_mapping  # noqa: F401
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _convert_on_meta(model: nn.Module, param: FusedParam, stored: Mapping[str, TensorEntry]) -> None:
    """Fill ``param.shapes`` (or ``param.error``) by converting meta tensors of the stored shapes: the header
    check for fused keys, free of any allocation."""
    tensors = {
        pattern: [torch.empty(stored[k].shape, dtype=stored[k].dtype, device="meta") for k in keys]
        for pattern, keys in param.sources.items()
    }
    try:
        param.shapes = {name: value.shape for name, value in param.convert(model, tensors).items()}
    except Exception as exc:  # noqa: BLE001 (any op failure means these stored tensors cannot form the parameter)
        param.error = f"{type(exc).__name__}: {exc}"
