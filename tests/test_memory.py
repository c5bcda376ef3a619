"""The training memory estimator's arithmetic (measured bytes are checked in test_train_parity.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hsdp.measure import peak_memory, reset_peak_memory
from hsdp.memory import count_parameters, model_training_memory, training_memory
from hsdp.models.tiny import build_tiny_llama, tiny_llama_config

P = 7_000_000_000


def test_mixed_precision_adam_per_strategy():
    """7B parameters on 8 ranks: 2 + 2 + 12 bytes per parameter (ZeRO accounting), split as each strategy shards."""
    assert training_memory(P, 8, "NO_SHARD").as_dict() == {
        "params": 2 * P, "grads": 2 * P, "optimizer": 12 * P, "activations": 0, "total": 16 * P,
    }  # fmt: skip
    full = training_memory(P, 8, "FULL_SHARD")
    assert (full.params, full.grads, full.optimizer) == (2 * P // 8, 2 * P // 8, 12 * P // 8)
    grad_op = training_memory(P, 8, "SHARD_GRAD_OP")
    assert (grad_op.params, grad_op.grads, grad_op.optimizer) == (2 * P, 2 * P // 8, 12 * P // 8)
    assert training_memory(P, 8, "HYBRID_SHARD", replicate_size=2) == training_memory(P, 4, "FULL_SHARD")
    assert training_memory(P, 8, "FULL_SHARD").total < grad_op.total < training_memory(P, 8, "NO_SHARD").total


def test_uneven_split_rounds_up_and_bad_input():
    assert training_memory(10, 4, "FULL_SHARD", 1, 1, 1).params == 3
    with pytest.raises(ValueError, match="replicate_size"):
        training_memory(P, 8, "HYBRID_SHARD")
    with pytest.raises(ValueError, match="unknown"):
        training_memory(P, 8, "ZERO_SHARD")


def test_model_aware_estimate_counts_parameters_and_activations():
    config = tiny_llama_config()
    assert count_parameters(config) == sum(p.numel() for p in build_tiny_llama().parameters())
    untied = tiny_llama_config(tie_word_embeddings=False)
    assert count_parameters(untied) == count_parameters(config) + config.vocab_size * config.hidden_size
    full = model_training_memory(config, 2, "FULL_SHARD", micro_batch=4, seq_len=128)
    checkpointed = model_training_memory(
        config, 2, "FULL_SHARD", micro_batch=4, seq_len=128, activation_checkpointing=True
    )
    assert 0 < checkpointed.activations < full.activations
    assert full.params == training_memory(count_parameters(config), 2, "FULL_SHARD").params
    assert (
        model_training_memory(config, 2, "FULL_SHARD", micro_batch=8, seq_len=128).activations
        > full.activations
    )


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_cpu_peak_is_the_resident_high_water_mark_in_bytes():
    """The CPU figure is the kernel's peak RSS in bytes: a KiB/byte mix-up or another counter fails here."""
    rss_before = _status_bytes("VmRSS")
    ballast = torch.ones(64 * 2**20 // 4)  # 64 MiB, written so every page is resident
    rss_after = _status_bytes("VmRSS")
    assert rss_after - rss_before >= 60 * 2**20
    # The kernel syncs its per-thread RSS counters lazily, so the figures agree to within a few pages, not exactly.
    slack = 4 * 2**20
    peak, kind = peak_memory(torch.device("cpu"))
    assert kind == "cpu peak RSS"
    assert peak >= rss_after - slack
    assert abs(peak - _status_bytes("VmHWM")) <= slack
    del ballast


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets Linux's RSS high-water mark")
def test_cpu_peak_resets_to_the_current_resident_set():
    """After a reset the peak follows what is resident now, not the process's past (generate and each training
    step report their own peak)."""
    ballast = torch.ones(128 * 2**20 // 4)
    high = peak_memory(torch.device("cpu")).bytes
    del ballast
    reset_peak_memory(torch.device("cpu"))
    after = peak_memory(torch.device("cpu")).bytes
    assert after <= high - 100 * 2**20, (high, after)
    assert abs(after - _status_bytes("VmRSS")) <= 8 * 2**20


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB$", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert match is not None, field
    return int(match.group(1)) * 1024
