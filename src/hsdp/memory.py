"""Training memory per rank: what each sharding strategy keeps, estimated from sizes, and measured.

The estimate follows the ZeRO paper's accounting. Mixed-precision Adam keeps, per parameter, the 16-bit
compute copy (``param_bytes=2``), its 16-bit gradient (``grad_bytes=2``) and fp32 master weights, momentum
and variance (``optimizer_bytes=12``). In plain fp32 training pass ``param_bytes=4, grad_bytes=4,
optimizer_bytes=8`` (the parameters *are* the master copy). Per strategy, with ``N`` ranks sharding:

=============== ============================== ============ ==================
strategy        parameters                     gradients    optimizer state
=============== ============================== ============ ==================
NO_SHARD        P x param_bytes                P x grad / 1  P x opt / 1
FULL_SHARD      P x param_bytes / N            P x grad / N  P x opt / N
SHARD_GRAD_OP   P x param_bytes (gathered      P x grad / N  P x opt / N
                from forward to backward)
HYBRID_SHARD    as FULL_SHARD with N = ranks in one shard group
=============== ============================== ============ ==================

FULL_SHARD also gathers one block at a time during forward and backward (a transient of one block's size,
left out here). :func:`hsdp.measure.peak_memory` reads what a rank actually used, on CPU or an accelerator.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hsdp.config import ShardingStrategy

__all__ = [
    "MemoryEstimate",
    "training_memory",
    "model_training_memory",
    "count_parameters",
]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds during a training step."""

    params: int
    grads: int
    optimizer: int
    activations: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def training_memory(
    num_params: int,
    world_size: int,
    strategy: ShardingStrategy | str,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
    *,
    replicate_size: int = 1,
) -> MemoryEstimate:
    """Per-rank bytes of parameters, gradients and optimizer state for ``strategy`` over ``world_size`` ranks.

    ``replicate_size`` is the number of replica groups (HYBRID_SHARD shards over ``world_size / replicate_size``).
    """
    strategy = ShardingStrategy.parse(strategy)
    if world_size < 1 or num_params < 0:
        raise ValueError(f"need world_size >= 1 and num_params >= 0, got {world_size} and {num_params}")
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if replicate_size < 2 or world_size % replicate_size:
            raise ValueError(
                f"HYBRID_SHARD needs replicate_size > 1 dividing world_size={world_size}, got {replicate_size}"
            )
        shards = world_size // replicate_size
    elif strategy is ShardingStrategy.NO_SHARD:
        shards = 1
    else:
        shards = world_size
    sharded = _ceil_div(num_params, shards)
    params = (
        num_params if strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_GRAD_OP) else sharded
    )
    return MemoryEstimate(
        params=params * param_bytes, grads=sharded * grad_bytes, optimizer=sharded * optimizer_bytes
    )


def count_parameters(config) -> int:
    """Parameters of a Llama-shaped decoder from a Hugging Face config (embeddings, blocks, norms, head)."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    mlp = 3 * h * config.intermediate_size
    per_layer = attn + mlp + 2 * h
    head = 0 if getattr(config, "tie_word_embeddings", False) else vocab * h
    return vocab * h + layers * per_layer + h + head


def model_training_memory(
    config,
    world_size: int,
    strategy: ShardingStrategy | str,
    *,
    micro_batch: int,
    seq_len: int,
    activation_checkpointing: bool = False,
    activation_bytes: int = 2,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
    replicate_size: int = 1,
) -> MemoryEstimate:
    """:func:`training_memory` for a Hugging Face decoder config, plus activations for this rank's micro-batch.

    Activations per block follow Korthikanti et al. (2022), ``s*b*h*(34 + 5*a*s/h)`` bytes at 16 bits, scaled by
    ``activation_bytes / 2``; with activation checkpointing only each block's input is kept, plus one block's
    activations during its recompute. The logits (and their gradient) add ``2 * b * s * vocab`` fp32 values.
    """
    estimate = training_memory(
        count_parameters(config),
        world_size,
        strategy,
        param_bytes,
        grad_bytes,
        optimizer_bytes,
        replicate_size=replicate_size,
    )
    s, b, h, a = seq_len, micro_batch, config.hidden_size, config.num_attention_heads
    per_block = int(s * b * h * (34 + 5 * a * s / h) * activation_bytes / 2)
    layers = config.num_hidden_layers
    blocks = (
        per_block + layers * s * b * h * activation_bytes if activation_checkpointing else layers * per_block
    )
    logits = 2 * b * s * config.vocab_size * 4
    return MemoryEstimate(estimate.params, estimate.grads, estimate.optimizer, activations=blocks + logits)
