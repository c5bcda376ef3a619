"""Tensor parallel from transformers' own plans (``config.base_model_tp_plan``) on a (dp 2, tp 2) mesh with FSDP2
over dp, for families other than Llama, against one process; a model without a plan is refused before any rank
starts (issue 13).

Tolerances as in test_train_parity (fp32: only the order of sums differs): losses 1e-5, weights 5e-5.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hsdp.config import ParallelConfig
from hsdp.models.tiny import build_byte_tokenizer
from hsdp.train import TrainConfig, TrainConfigError, preflight
from tests.forked_cli import run_hsdp
from tests.train_fns import train_configs

pytestmark = pytest.mark.slow

COMMON = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip


def _save(model, folder: Path) -> str:
    model.save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return str(folder)


def _family(name: str, folder: Path) -> str:
    """A tiny model of a family: Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms, replicated over tp), Gemma2."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config_cls, model_cls = {
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
    }[name]
    model = model_cls(config_cls(**COMMON, head_dim=16))
    if name == "qwen3":  # the norms start at 1: perturb them so their (tp all-reduced) gradients matter
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.data.uniform_(0.5, 1.5)
    return _save(model, folder / name)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp") / "data.txt"
    path.write_text("tensor parallel splits heads and the mlp; fsdp shards the rest over data. " * 40)
    return path


FAMILIES = ("qwen2", "qwen3", "gemma2")


@pytest.fixture(scope="module")
def runs(dist_run, data, tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    base = [
        TrainConfig(
            model=_family(name, root),
            data=str(data),
            steps=3,
            batch_size=4,
            seq_len=32,
            lr=1e-3,
            max_grad_norm=0.5,
            progress=False,
        )  # fmt: skip
        for name in FAMILIES
    ]
    layout = ParallelConfig(
        use_hsdp=True, hsdp_shard_size=2, sharding_strategy="FULL_SHARD", tensor_parallel_size=2
    )
    sharded = dist_run(4, train_configs, [c.replace(parallel=layout) for c in base])[0]
    return {
        "single": dict(zip(FAMILIES, train_configs(base), strict=True)),
        "tp": dict(zip(FAMILIES, sharded, strict=True)),
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_fsdp2_matches_one_process(runs, family):
    single, tp = runs["single"][family], runs["tp"][family]
    assert tp["losses"] == pytest.approx(single["losses"], abs=1e-5)
    assert tp["norms"] == pytest.approx(single["norms"], rel=1e-5)
    worst = max((tp["state"][k] - single["state"][k]).abs().max().item() for k in single["state"])
    assert worst <= 5e-5, f"{family}: max weight difference {worst:.3g}"
    # q_proj column-parallel over tp, sharded by FSDP over dp: transformers' plan was applied
    assert tp["q_proj"] == (("shard", "tp"), (("_StridedShard", 0), ("Shard", 0)))


def test_qwen3_per_head_norm_is_replicated_over_tp_and_trained(runs):
    """transformers' "replicated_with_grad_allreduce": the q_norm gradient is summed over the tp ranks' heads."""
    single, tp = runs["single"]["qwen3"], runs["tp"]["qwen3"]
    key = "model.layers.0.self_attn.q_norm.weight"
    assert tp["layer0"][key] == (("shard", "tp"), (("Shard", 0), ("Replicate", None)))
    assert (tp["state"][key] - single["state"][key]).abs().max().item() <= 5e-5


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> str:
    import transformers as tf

    config = tf.GPT2Config(vocab_size=384, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    return _save(tf.GPT2LMHeadModel(config), tmp_path_factory.mktemp("gpt2") / "gpt2")


def test_tensor_parallel_without_a_plan_is_refused_before_workers_start(gpt2, data):
    env = {**os.environ, "HSDP_COLLECTIVE_TIMEOUT": "30"}
    out = run_hsdp(
        ["train", "--model", gpt2, "--data", str(data), "--use-hsdp", "--hsdp-shard-size", "2",
         "--tensor-parallel-size", "2", "--steps", "1", "--seq-len", "16"],
        timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        "--tensor-parallel-size=2" in out.stderr
        and "GPT2LMHeadModel has no tensor-parallel plan" in out.stderr
    )
    assert "Traceback" not in out.stderr and "checkpoint" not in out.stderr


def test_tensor_parallel_size_must_divide_heads(data, tmp_path):
    import transformers as tf

    model = _save(tf.Qwen2ForCausalLM(tf.Qwen2Config(**{**COMMON, "num_key_value_heads": 1})), tmp_path / "q")
    layout = ParallelConfig(
        use_hsdp=True, hsdp_shard_size=2, sharding_strategy="FULL_SHARD", tensor_parallel_size=2
    )
    with pytest.raises(TrainConfigError, match="must divide num_key_value_heads=1"):
        preflight(TrainConfig(model=model, data=str(data), parallel=layout))
