"""Llama-family plan: decoder layers as FSDP units, and a Megatron-style tensor-parallel plan.

Tensor parallel (the layout of the Transformers "3-D parallelism" guide): in each decoder layer ``q/k/v`` and
``gate/up`` are column-parallel (each TP rank computes its own heads / its slice of the MLP), ``o`` and
``down`` are row-parallel (partial sums all-reduced over ``tp``). One all-reduce per attention and per MLP in
forward and in backward. Embeddings, norms and the LM head stay whole on the TP ranks and are sharded by FSDP
over the data-parallel axis only. The tied embedding / LM head stays in the root unit (one sharding group).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hsdp.plans import ShardPlan, classes_condition, register_plan

_LAYER_PLAN = {
    "self_attn.q_proj": "col",
    "self_attn.k_proj": "col",
    "self_attn.v_proj": "col",
    "self_attn.o_proj": "row",
    "mlp.gate_proj": "col",
    "mlp.up_proj": "col",
    "mlp.down_proj": "row",
}


def _check_divisible(config, tp: int) -> None:
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    if bad:
        raise ValueError(
            f"--tensor-parallel-size={tp} must divide {', '.join(bad)} of this model; choose a divisor"
        )


def llama_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard every decoder layer's projections over ``tp_mesh`` (in place, before FSDP)."""
    _check_divisible(model.config, tp_mesh.size())
    layers = model.model.layers
    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    for layer in layers:
        parallelize_module(layer, tp_mesh, {name: styles[kind]() for name, kind in _LAYER_PLAN.items()})


@register_plan("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
def llama_plan(model: nn.Module) -> ShardPlan:
    return ShardPlan(
        conditions=(classes_condition(model._no_split_modules),),
        tensor_parallel=llama_tensor_parallel,
        source=f"llama plan ({', '.join(model._no_split_modules)} units + TP)",
    )
