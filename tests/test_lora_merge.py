"""``--export-merged`` (:func:`hsdp.lora.merged_state`): the merged weights give the logits of the unmerged adapter.

Sharded over two ranks, with random ``lora_A`` and ``lora_B`` (peft's init leaves ``B`` zero, which would merge
nothing). GPT-2 stores its projections as transformers' ``Conv1D`` (weight ``(in, out)``, peft's
``fan_in_fan_out``): its square ``attn.c_proj`` merged silently wrong and its non-square ``c_attn`` / ``c_fc``
crashed before the update was transposed. tiny-llama's ``nn.Linear`` layers are the usual case.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hsdp import ParallelConfig
from hsdp.models.builtin import resolve_model

TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"], "tiny-llama": ["q_proj", "k_proj", "o_proj", "down_proj"]}


def _ids() -> torch.Tensor:
    return torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(3))


def merged_on_ranks(model_dir: str, targets: list[str]) -> tuple | None:
    """On each rank: the model sharded with random adapters; returns, on rank 0, its logits with the adapters
    unmerged and the merged state gathered whole."""
    from hsdp import lora
    from hsdp.distributed import rank
    from hsdp.loading import load_pretrained, local_slices
    from hsdp.lora_state import full_tensor

    config = lora.lora_config(r=4, alpha=8, dropout=0.0, targets=targets)
    model = load_pretrained(
        model_dir, ParallelConfig(use_hsdp=True, hsdp_shard_size=2), prepare=lora.injector(config)
    ).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:  # every rank draws the same full tensor and keeps its slice
                full = torch.randn(param.shape, generator=generator) * 0.2
                local, region = local_slices(param)
                local.copy_(full[region].reshape(local.shape))
        logits = model(_ids()).logits
        merged = {k: full_tensor(v).detach().clone() for k, v in lora.merged_state(model).items()}
    return (logits, merged) if rank() == 0 else None


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    import transformers as tf

    config = tf.GPT2Config(vocab_size=384, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("gpt2") / "gpt2"
    tf.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("model", ["gpt2", "tiny-llama"])
def test_merged_export_equals_the_unmerged_adapter(model, gpt2, dist_run):
    from transformers import AutoModelForCausalLM

    path = gpt2 if model == "gpt2" else resolve_model("tiny-llama")
    unmerged, merged = dist_run(2, merged_on_ranks, str(path), TARGETS[model])[0]
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # GPT-2's head is tied to the embedding
    with torch.no_grad():
        logits = plain(_ids()).logits
    base = AutoModelForCausalLM.from_pretrained(path).eval()(_ids()).logits
    assert (unmerged - base).abs().max() > 1e-2  # the adapters change the logits
    assert (logits - unmerged).abs().max() <= 1e-5
