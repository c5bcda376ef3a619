"""LoRA with peft on a sharded base equals one process with peft; checkpoints, exports and bad input.

The reference is a ``get_peft_model`` model trained by a plain loop in this process, started from the same adapter
weights (:func:`hsdp.lora.init_adapters` with the same seed) and fed the same rows. fp32 sharded runs differ
only in the order of gradient sums: losses within 1e-5 over 10 steps, adapters within 5e-5 (Adam magnifies
rounding in tiny gradients, as in test_train_parity).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from hsdp.config import ParallelConfig
from hsdp.lora import init_adapters, peft_key
from hsdp.models.tiny import build_byte_tokenizer, build_tiny_llama
from hsdp.train import TrainConfig, TrainConfigError, preflight
from hsdp.train.trainer import load_dataset
from tests.train_fns import train_lora

pytestmark = pytest.mark.slow

STEPS = 10
LORA = {"lora_r": 4, "lora_alpha": 8.0}


def _fsdp(world: int) -> ParallelConfig:
    return ParallelConfig(use_hsdp=True, hsdp_shard_size=world, sharding_strategy="FULL_SHARD")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> TrainConfig:
    root = tmp_path_factory.mktemp("lora")
    model = root / "model"
    build_tiny_llama().save_pretrained(model)
    build_byte_tokenizer().save_pretrained(model)
    data = root / "data.txt"
    data.write_text("adapters learn a low-rank update while the sharded base stays frozen. " * 60)
    return TrainConfig(
        model=str(model),
        data=str(data),
        steps=STEPS,
        batch_size=4,
        seq_len=32,
        lr=1e-2,
        progress=False,
        **LORA,
    )


def _peft_model(cfg: TrainConfig, adapter: dict[str, torch.Tensor] | None = None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model)
    config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules="all-linear")
    peft_model = get_peft_model(model, config)
    if adapter is None:
        init_adapters(peft_model, cfg.seed)
    else:
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.data.copy_(adapter[peft_key(name.removeprefix("base_model.model."))])
    return peft_model


@pytest.fixture(scope="module")
def reference(base):
    """One process, peft's own model, a plain AdamW loop over the rows the trainer takes."""
    model = _peft_model(base).train()
    data = load_dataset(base, Path(base.model))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=base.lr, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        batch = data.micro_batch(step, 0, batch_size=base.batch_size, grad_accum=1, dp_rank=0, dp_size=1)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    adapter = {
        peft_key(n.removeprefix("base_model.model.")): p.detach().clone()
        for n, p in model.named_parameters()
        if "lora_" in n
    }
    return {"losses": losses, "adapter": adapter, "model": model.eval()}


@pytest.fixture(scope="module")
def world2(dist_run, base, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-w2")
    full = base.replace(
        parallel=_fsdp(2),
        output_dir=str(root / "run"),
        save_every=4,
        keep_last=3,
        export=str(root / "adapter"),
        export_merged=str(root / "merged"),
    )
    # --offload-layers 1: the blocks after the first in host memory (FSDP2's CPU offload per block)
    offloaded = base.replace(parallel=dataclasses.replace(_fsdp(2), offload_layers=1))
    runs = dist_run(2, train_lora, [full, offloaded])
    resumed = dist_run(
        2,
        train_lora,
        [full.replace(resume=str(root / "run" / "step-00000004"), export=None, export_merged=None)],
    )
    return {"root": root, "ranks": [r[0] for r in runs], "offloaded": [r[1] for r in runs], "resumed": resumed[0][0]}


@pytest.fixture(scope="module")
def world4(dist_run, base):
    return [r[0] for r in dist_run(4, train_lora, [base.replace(parallel=_fsdp(4))])]


def _assert_matches(run: dict, ref: dict) -> None:
    assert run["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert run["adapter"].keys() == ref["adapter"].keys()
    worst = max((run["adapter"][k] - ref["adapter"][k]).abs().max().item() for k in ref["adapter"])
    assert worst <= 5e-5, f"max adapter difference {worst:.3g}"


def test_lora_world2_matches_one_process_peft(world2, reference):
    _assert_matches(world2["ranks"][0], reference)
    assert reference["losses"][-1] < reference["losses"][0] - 0.1  # it learned


def test_lora_with_offloaded_layers_equals_resident(world2):
    """--offload-layers 1 moves where the shards of blocks 1.. live, not the math: the same losses and adapters."""
    for run, offloaded in zip(world2["ranks"], world2["offloaded"], strict=True):
        assert offloaded["losses"] == run["losses"]
        assert offloaded["offloaded"] == ["model.layers.1", "model.layers.2", "model.layers.3"]
        assert run["offloaded"] == [] and 0 < offloaded["host_bytes"] < offloaded["base_bytes"]
    for key, tensor in world2["ranks"][0]["adapter"].items():
        assert torch.equal(world2["offloaded"][0]["adapter"][key], tensor), key


def test_lora_world4_matches_one_process_peft(world4, reference):
    _assert_matches(world4[0], reference)


def test_trainable_and_optimizer_bytes_are_adapters_only(world2, world4, reference):
    """Per rank: fp32 adapters / world of trainable bytes, twice that of Adam state; the base is not trained."""
    adapter_bytes = sum(t.numel() * 4 for t in reference["adapter"].values())
    base_bytes = sum(p.numel() * 4 for p in build_tiny_llama().parameters())
    for world, ranks in ((2, world2["ranks"]), (4, world4)):
        for run in ranks:
            assert run["trainable_bytes"] == pytest.approx(adapter_bytes / world, rel=0.05)
            assert run["optimizer_bytes"] == pytest.approx(2 * adapter_bytes / world, rel=0.05)
            assert run["base_bytes"] == pytest.approx(base_bytes / world, rel=0.05)


def test_checkpoint_holds_adapters_only_and_resumes_exactly(world2):
    full, resumed = world2["ranks"][0], world2["resumed"]
    assert resumed["losses"] == full["losses"][4:]  # bit for bit
    for key, tensor in full["adapter"].items():
        assert torch.equal(resumed["adapter"][key], tensor), key
    saved = FileSystemReader(world2["root"] / "run" / "step-00000004").read_metadata().state_dict_metadata
    models = [k for k in saved if k.startswith("model.")]
    assert models and all(".lora_" in k for k in models)


def test_exported_adapter_loads_in_peft_with_equal_logits(world2, base):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    expected = _peft_model(base, world2["ranks"][0]["adapter"]).eval()
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base.model), world2["root"] / "adapter"
    ).eval()
    ids = torch.randint(4, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected(ids).logits)
        merged = AutoModelForCausalLM.from_pretrained(world2["root"] / "merged").eval()
        # Merging reorders the arithmetic (x (W + s BA) against x W + s (x A) B): equal to rounding.
        torch.testing.assert_close(merged(ids).logits, expected(ids).logits, atol=1e-5, rtol=0)
    assert (world2["root"] / "merged" / "tokenizer.json").exists()


def test_target_modules_matching_nothing_is_refused(base):
    with pytest.raises(TrainConfigError) as info:
        preflight(base.replace(lora_target_modules=("qkv_proj",)))
    message = str(info.value)
    assert "--lora-target-modules" in message and "qkv_proj" in message and "q_proj" in message


def test_adapter_for_another_base_is_refused(base, tmp_path):
    from peft import LoraConfig, get_peft_model

    other = get_peft_model(build_tiny_llama(hidden_size=32), LoraConfig(r=4, target_modules="all-linear"))
    other.save_pretrained(tmp_path / "other-adapter")
    with pytest.raises(TrainConfigError) as info:
        preflight(base.replace(lora_r=0, lora_adapter=str(tmp_path / "other-adapter")))
    message = str(info.value)
    assert "--lora-adapter" in message and "does not fit" in message and "model [" in message


def test_lora_flag_conflicts_are_named(base):
    problems = base.replace(freeze=("mlp",), lora_dropout=1.5).problems()
    assert any("--freeze" in p for p in problems) and any("--lora-dropout" in p for p in problems)
    assert any("--export-merged" in p for p in base.replace(lora_r=0, export_merged="x").problems())


def test_adapter_folder_continues_training(base, tmp_path):
    """--lora-adapter starts from a saved adapter: one process, the first loss equals that adapter's loss."""
    from hsdp.train import Trainer

    first = Trainer(base.replace(steps=2, export=str(tmp_path / "a"))).fit()
    again = Trainer(base.replace(lora_r=0, lora_adapter=str(tmp_path / "a"), steps=1)).fit()
    assert again.losses[0] < first.losses[0]
    shutil.rmtree(tmp_path / "a")
