"""Tensor parallelism from transformers' own plans: ``config.base_model_tp_plan``, what ``tp_plan="auto"`` uses.

Every family that ships a plan gets TP with no family code here: the plan maps module patterns of the base model
(``layers.*.self_attn.q_proj``) to style names, which are translated to torch's DTensor styles so that FSDP2 can
shard the same parameters over the data-parallel axis (2-D ``(dp, tp)`` parameters) and the sharded loader can read
each rank's region of every weight.

| transformers style | torch style |
|---|---|
| ``colwise`` | ``ColwiseParallel()``: each rank computes its heads / its slice of the MLP |
| ``rowwise`` | ``RowwiseParallel()``: partial sums all-reduced over ``tp`` |
| ``colwise_gather_output`` | ``ColwiseParallel(output_layouts=Replicate())`` |
| ``rowwise_split_input`` | ``RowwiseParallel(input_layouts=Replicate())`` |
| ``replicated_with_grad_allreduce`` | ``SequenceParallel(sequence_dim=2)``: per-head norms (Qwen3 / Gemma3 ``q_norm``) |

The last one: the norm's weight is a ``Replicate`` DTensor and its input is marked as sharded over the head axis
(dim 2 of ``(batch, seq, heads, head_dim)``), so backward all-reduces the weight's gradient over ``tp``, as
transformers' style does. Mixture-of-experts styles (``packed_colwise``, ``moe_tp_experts``) are not translated:
such plans are refused, naming the styles. Embeddings, final norm and LM head stay whole on the TP ranks (the
model-level ``_tp_plan`` entries for ``lm_head`` are not used), sharded by FSDP over the data-parallel axis only.

This replaces the hand-written Llama plan (transformers' Llama plan is the same Megatron layout).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["SUPPORTED_STYLES", "tp_plan_of", "tp_plan_problem", "hf_tensor_parallel"]

_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
}
SUPPORTED_STYLES = tuple(_STYLES)


def tp_plan_of(config: Any) -> dict[str, str] | None:
    """transformers' base-model TP plan of a model config (None when the family ships none)."""
    return getattr(config, "base_model_tp_plan", None) or None


def tp_plan_problem(config: Any, tp: int) -> str | None:
    """Why ``--tensor-parallel-size tp`` cannot work for this config (None when it can)."""
    plan = tp_plan_of(config)
    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    if plan is None:
        return (
            f"--tensor-parallel-size={tp}: {arch} has no tensor-parallel plan (transformers ships no "
            "base_model_tp_plan for it); use --tensor-parallel-size 1 and shard with --hsdp-shard-size, or register "
            "a plan in hsdp.shard_rules"
        )
    unknown = sorted({s for s in plan.values() if s not in _STYLES})
    if unknown:
        return (
            f"--tensor-parallel-size={tp}: {arch}'s transformers TP plan uses styles hsdp does not translate "
            f"({', '.join(unknown)}; mixture-of-experts); use --tensor-parallel-size 1"
        )
    sizes = {
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "intermediate_size": getattr(config, "intermediate_size", None),
    }
    bad = [f"{k}={v}" for k, v in sizes.items() if isinstance(v, int) and v % tp]
    if bad:
        return f"--tensor-parallel-size={tp} must divide {', '.join(bad)} of {arch}; choose a divisor"
    return None


def _pattern(base_prefix: str, key: str) -> re.Pattern[str]:
    body = re.escape(key).replace(r"\*", r"\d+")
    return re.compile(rf"^{re.escape(base_prefix)}\.{body}$" if base_prefix else rf"^{body}$")


def hf_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Apply the model's transformers TP plan over ``tp_mesh`` (in place, before FSDP)."""
    problem = tp_plan_problem(model.config, tp_mesh.size())
    if problem:
        raise ValueError(problem)
    base = getattr(model, "base_model_prefix", "") if model is not getattr(model, "base_model", model) else ""
    patterns = [(_pattern(base, key), style) for key, style in tp_plan_of(model.config).items()]
    plan: dict[str, ParallelStyle] = {}
    for name, _ in model.named_modules():
        for pattern, style in patterns:
            if pattern.match(name):
                plan[name] = _STYLES[style]()
                break
    if not plan:
        raise ValueError(
            f"--tensor-parallel-size={tp_mesh.size()}: the transformers TP plan of {type(model).__name__} matched "
            "no module; use --tensor-parallel-size 1"
        )
    parallelize_module(model, tp_mesh, plan)
