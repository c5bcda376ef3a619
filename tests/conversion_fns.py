"""Rank-side functions for the checkpoint-conversion tests: tiny mixture-of-experts causal LMs whose checkpoints
store one tensor per expert, as the hub checkpoints do, and a sharded load that records what each rank read."""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from hsdp import loading
from tests.core_fns import hsdp_config

VOCAB = 128
_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
# One stored expert tensor (by its name after the expert index) -> the fused parameter it is a row of.
_FUSED_BY_STORED = {
    "gate_proj.weight": "gate_up_proj",
    "up_proj.weight": "gate_up_proj",
    "down_proj.weight": "down_proj",
    "w1.weight": "gate_up_proj",
    "w3.weight": "gate_up_proj",
    "w2.weight": "down_proj",
}
_EXPERT_KEY = re.compile(r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\.(?P<name>.+)$")


def build_moe(name: str) -> PreTrainedModel:
    """Qwen3-MoE with 4 experts or Mixtral with 3 (rows that do not split evenly over 2 ranks), random weights."""
    torch.manual_seed(0)
    if name == "qwen3_moe":
        config = Qwen3MoeConfig(
            **_SMALL, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1
        )
        return Qwen3MoeForCausalLM(config)
    return MixtralForCausalLM(MixtralConfig(**_SMALL, num_local_experts=3, num_experts_per_tok=2))


def moe_inputs() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def fused_row(stored_key: str) -> tuple[str, int] | None:
    """(the fused model parameter, the row) a per-expert stored key fills, or None for any other key."""
    match = _EXPERT_KEY.match(stored_key)
    if match is None:
        return None
    return f"{match['layer']}.mlp.experts.{_FUSED_BY_STORED[match['name']]}", int(match["expert"])


def load_moes_and_compare(paths: dict[str, str], shard: int, replicate: int) -> dict[str, dict]:
    """:func:`load_moe_and_compare` for each folder of ``paths`` (one call, so one worker group, for all)."""
    return {name: load_moe_and_compare(path, shard, replicate) for name, path in paths.items()}


def load_moe_and_compare(path: str, shard: int, replicate: int) -> dict:
    """Load ``path`` sharded while recording every stored tensor read; compare logits with ``from_pretrained``."""
    reads: list[str] = []
    original = loading._read_slice

    def record(handle, key: str, region: tuple[slice, ...]) -> torch.Tensor:
        reads.append(key)
        return original(handle, key, region)

    with mock.patch.object(loading, "_read_slice", record):
        model = loading.load_pretrained(path, hsdp_config(shard, replicate))
    reference = AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32)
    ids = moe_inputs()
    with torch.no_grad():
        logits, want = model(ids).logits, reference(ids).logits
    rows_read: dict[str, list[int]] = {}
    for key in reads:
        if (fused := fused_row(key)) is not None:
            rows_read.setdefault(fused[0], []).append(fused[1])
    return {
        "equal": torch.equal(logits, want),
        "max_diff": (logits - want).abs().max().item(),
        "dtype": str(logits.dtype),
        "reads": reads,
        "rows_read": rows_read,
        "rows_held": _rows_held(model),
    }


def _rows_held(model: torch.nn.Module) -> dict[str, list[int]]:
    """The dim-0 rows of each fused expert parameter this rank holds, as FSDP2 sharded them."""
    held = {}
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert isinstance(param, DTensor), f"{name} was not sharded"
            shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements
            )
            held[name] = list(range(offset[0], offset[0] + shape[0]))
    return held
