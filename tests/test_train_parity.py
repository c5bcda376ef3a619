"""Sharded training equals single-process training on the same data and seed (world 2 and 4).

Tolerances: fp32 runs differ from one process only in the order of gradient sums, so losses agree to 1e-5
and weights, after 3 AdamW steps at lr 1e-3, to 5e-5 (Adam divides by sqrt(v), which magnifies rounding in
tiny gradients). A resumed run at the same world size is compared bit for bit. bf16 compute is within 2e-3 of the
fp32 loss and 2e-2 of the fp32 weights (measured: 3e-4 and 4e-3); fp16 with loss scaling likewise.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hsdp.checkpoint import complete_checkpoints
from hsdp.config import ParallelConfig
from hsdp.memory import training_memory
from hsdp.train import TrainConfig
from tests.train_fns import train_configs

pytestmark = pytest.mark.slow

FP32 = {"loss": 1e-5, "weights": 5e-5}


def shard(strategy: str, shard_size: int = 2, replicate: int = 1, **kw) -> ParallelConfig:
    return ParallelConfig(
        use_hsdp=True,
        hsdp_shard_size=shard_size,
        hsdp_replicate_size=replicate,
        sharding_strategy=strategy,
        **kw,
    )


@pytest.fixture(scope="module")
def sample_text(tmp_path_factory) -> Path:
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "ranks",
        "shard",
        "gradients",
        "across",
        "the",
        "mesh",
    ]
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(len(words), (3000,), generator=generator).tolist()
    path = tmp_path_factory.mktemp("data") / "sample.txt"
    path.write_text(" ".join(words[i] for i in picks))
    return path


@pytest.fixture(scope="module")
def base(sample_text, tiny_checkpoints, tmp_path_factory) -> TrainConfig:
    from hsdp.models.tiny import build_byte_tokenizer

    model = tmp_path_factory.mktemp("model") / "tiny-llama"
    shutil.copytree(tiny_checkpoints["llama-fp32"], model)
    build_byte_tokenizer().save_pretrained(model)
    return TrainConfig(
        model=str(model), data=str(sample_text), steps=3, batch_size=4, seq_len=32, lr=1e-3, progress=False
    )


@pytest.fixture(scope="module")
def reference(base):
    """Single-process runs (no process group, no FSDP): plain, clipped, and LoRA-style frozen + clipped."""
    plain, clipped, frozen = train_configs(
        [base, base.replace(max_grad_norm=0.05), base.replace(max_grad_norm=0.05, freeze=("self_attn",))]
    )
    return {"plain": plain, "clipped": clipped, "frozen": frozen}


def assert_matches(
    run: dict, ref: dict, loss_tol: float = FP32["loss"], weight_tol: float = FP32["weights"]
) -> None:
    """Losses (of the steps ``run`` made, the last ones of ``ref``), grad norms and final weights agree."""
    steps = len(run["losses"])
    assert run["losses"] == pytest.approx(ref["losses"][-steps:], abs=loss_tol)
    if ref["norms"][0] is not None:
        assert run["norms"] == pytest.approx(ref["norms"][-steps:], rel=1e-5)
    assert run["state"].keys() == ref["state"].keys()
    worst = max((run["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"])
    assert worst <= weight_tol, f"max weight difference {worst:.3g} > {weight_tol}"


@pytest.fixture(scope="module")
def world2(dist_run, base, tmp_path_factory):
    root = tmp_path_factory.mktemp("w2")
    configs = {
        "full": base.replace(
            parallel=shard("FULL_SHARD"),
            output_dir=str(root / "full"),
            save_every=1,
            keep_last=2,
            async_save=True,
            export=str(root / "export"),
        ),
        "grad_op_clip": base.replace(parallel=shard("SHARD_GRAD_OP"), max_grad_norm=0.05),
        "no_shard_accum": base.replace(
            parallel=shard("NO_SHARD", shard_size=1, replicate=2),
            batch_size=2,
            grad_accum=2,
            export=str(root / "export-bf16"),
            export_dtype="bf16",
        ),
        "bf16": base.replace(parallel=shard("FULL_SHARD"), mixed_precision="bf16"),
        "fp16": base.replace(parallel=shard("FULL_SHARD"), mixed_precision="fp16"),
        "frozen_mixed": base.replace(
            parallel=shard("FULL_SHARD", cpu_offload=True),
            max_grad_norm=0.05,
            freeze=("self_attn",),
            replicated_modules=("model.norm",),
            activation_checkpointing=True,
        ),
        "cosine": base.replace(
            parallel=shard("FULL_SHARD"),
            output_dir=str(root / "cosine"),
            save_every=1,
            keep_last=3,
            lr_scheduler="cosine",
            warmup_steps=1,
        ),
    }
    runs = dist_run(2, train_configs, list(configs.values()), True)
    resumed = dist_run(
        2,
        train_configs,
        [
            configs["full"].replace(resume=str(root / "full" / "step-00000002"), export=None),
            configs["cosine"].replace(resume=str(root / "cosine" / "step-00000001")),
        ],
    )
    return {
        "configs": configs,
        "runs": dict(zip(configs, runs[0], strict=True)),
        "all_ranks": runs,
        "root": root,
        "resumed": resumed[0][0],
        "resumed_cosine": resumed[0][1],
    }


def test_full_shard_matches_single_process(world2, reference):
    assert_matches(world2["runs"]["full"], reference["plain"])


def test_one_rank_fsdp_run_training_matches_single_process(base, reference):
    """``run_training`` of an FSDP layout over one rank (``--use-hsdp --hsdp-shard-size 1``, e.g. for
    ``--offload-layers`` on one device) starts a one-rank group; it raised "build_meshes needs torch.distributed"."""
    from hsdp.train import run_training

    result = run_training(base.replace(parallel=shard("FULL_SHARD", shard_size=1)))
    assert [s.loss for s in result.steps] == pytest.approx(reference["plain"]["losses"], abs=FP32["loss"])


def test_shard_grad_op_clipping_matches_single_process(world2, reference):
    assert_matches(world2["runs"]["grad_op_clip"], reference["clipped"])
    assert reference["clipped"]["norms"][0] > 0.05  # clipping was active


def test_no_shard_grad_accumulation_equals_large_batch(world2, reference):
    assert_matches(world2["runs"]["no_shard_accum"], reference["plain"])


def test_bf16_mixed_precision_close_to_fp32(world2, reference):
    run = world2["runs"]["bf16"]
    assert_matches(run, reference["plain"], loss_tol=2e-3, weight_tol=2e-2)
    assert all(v.dtype == torch.float32 for v in run["state"].values())  # fp32 master weights


def test_fp16_mixed_precision_with_loss_scaling_close_to_fp32(world2, reference):
    run = world2["runs"]["fp16"]
    assert_matches(run, reference["plain"], loss_tol=2e-3, weight_tol=2e-2)
    assert all(v.dtype == torch.float32 for v in run["state"].values())


def test_frozen_replicated_offload_checkpointing_matches(world2, reference):
    """LoRA-style frozen attention, a replicated (ignored) norm mixing plain and DTensor grads in the clip, CPU
    offload and activation checkpointing, against one process with the same frozen set and clipping."""
    from hsdp.models.tiny import build_tiny_llama

    run = world2["runs"]["frozen_mixed"]
    assert_matches(run, reference["frozen"])
    assert run["checkpointing"] and not reference["frozen"]["checkpointing"]
    start = dict(build_tiny_llama().named_parameters())
    frozen = [name for name in start if "self_attn" in name]
    assert frozen and all(torch.equal(run["state"][name], start[name].detach()) for name in frozen)


def test_resume_equals_uninterrupted_and_keeps_last_k(world2):
    full, resumed = world2["runs"]["full"], world2["resumed"]
    assert resumed["losses"] == full["losses"][2:]  # bit for bit
    for name, tensor in full["state"].items():
        assert torch.equal(resumed["state"][name], tensor), name
    kept = [p.name for p in complete_checkpoints(world2["root"] / "full")]
    assert kept == ["step-00000002", "step-00000003"]
    # Training again on a layout already built leaves no process group behind: the trainer destroys its
    # checkpointer's group, and the meshes' groups are reused (the test session reuses one process group).
    assert full["leaked_groups"] == 0 and resumed["leaked_groups"] == 0


def test_resume_with_warmup_and_cosine_schedule_is_exact(world2):
    """The scheduler's state is in the checkpoint: resumed after step 1 (mid-warmup boundary), steps 2-3 run at
    the same learning rates and give the same losses and weights, bit for bit."""
    from transformers import get_scheduler

    full, resumed = world2["runs"]["cosine"], world2["resumed_cosine"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=3)
    expected = []
    for _ in range(3):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert full["lrs"] == pytest.approx(expected) and expected[0] == 0.0 and expected[1] == 1e-3
    assert resumed["lrs"] == full["lrs"][1:]
    assert resumed["losses"] == full["losses"][1:]
    for name, tensor in full["state"].items():
        assert torch.equal(resumed["state"][name], tensor), name


def test_export_loads_in_transformers_with_equal_logits(world2):
    from transformers import AutoModelForCausalLM

    from hsdp.models.tiny import build_tiny_llama

    trained = build_tiny_llama()
    loaded = trained.load_state_dict(world2["runs"]["full"]["state"], strict=False)
    assert (loaded.missing_keys, loaded.unexpected_keys) == (["lm_head.weight"], [])  # only the tied alias
    ids = torch.randint(4, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    exported = AutoModelForCausalLM.from_pretrained(world2["root"] / "export").eval()
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()  # re-tied
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trained(ids).logits)
    low = AutoModelForCausalLM.from_pretrained(world2["root"] / "export-bf16", dtype="auto")
    assert low.dtype == torch.bfloat16
    assert (world2["root"] / "export" / "tokenizer.json").exists()


def test_memory_estimate_matches_measured_bytes(world2):
    """fp32 AdamW: 4 bytes of params, 4 of grads, 8 of optimizer state (momentum, variance) per parameter."""
    num_params = sum(t.numel() for t in world2["runs"]["full"]["state"].values())
    for name, strategy in [("full", "FULL_SHARD"), ("no_shard_accum", "NO_SHARD")]:
        estimate = training_memory(num_params, 2, strategy, 4, 4, 8)
        for rank_runs in world2["all_ranks"]:
            measured = rank_runs[list(world2["configs"]).index(name)]["bytes"]
            assert measured["params"] == pytest.approx(estimate.params, rel=0.01)
            assert measured["grads"] == pytest.approx(estimate.grads, rel=0.01)
            assert measured["optimizer"] == pytest.approx(estimate.optimizer, rel=0.01)
    full = world2["all_ranks"][0][list(world2["configs"]).index("full")]["bytes"]
    assert full["gathered"] == 0  # FULL_SHARD frees every gathered block after its forward


def test_memory_estimate_shard_grad_op_keeps_params_gathered(world2):
    """SHARD_GRAD_OP holds every parameter gathered from forward to backward; grads and Adam state sharded."""
    num_params = sum(t.numel() for t in world2["runs"]["full"]["state"].values())
    estimate = training_memory(num_params, 2, "SHARD_GRAD_OP", 4, 4, 8)
    for rank_runs in world2["all_ranks"]:
        measured = rank_runs[list(world2["configs"]).index("grad_op_clip")]["bytes"]
        assert measured["gathered"] == estimate.params
        assert (measured["grads"], measured["optimizer"]) == pytest.approx(
            (estimate.grads, estimate.optimizer), rel=0.01
        )


@pytest.fixture(scope="module")
def world4(dist_run, base, tmp_path_factory):
    root = tmp_path_factory.mktemp("w4")
    hybrid = base.replace(parallel=shard("HYBRID_SHARD", 2, 2), output_dir=str(root / "hybrid"), save_every=2)
    tp = base.replace(parallel=shard("FULL_SHARD", tensor_parallel_size=2), max_grad_norm=0.05)
    runs = dist_run(4, train_configs, [hybrid, tp], True)[0]
    resharded = dist_run(
        2,
        train_configs,
        [hybrid.replace(parallel=shard("FULL_SHARD"), resume=str(root / "hybrid" / "step-00000002"))],
    )[0][0]
    return {"hybrid": runs[0], "tp": runs[1], "resharded": resharded}


def test_hybrid_shard_matches_single_process(world4, reference):
    assert_matches(world4["hybrid"], reference["plain"])


def test_tensor_parallel_2x_fsdp_2_matches_single_process(world4, reference):
    assert_matches(world4["tp"], reference["clipped"])
    # q_proj is column-parallel over tp and sharded by FSDP over the data-parallel axis
    assert world4["tp"]["q_proj"] == (("shard", "tp"), (("_StridedShard", 0), ("Shard", 0)))


def test_reshard_on_load_4_to_2(world4, reference):
    """Saved by 4 ranks (HYBRID 2x2) at step 2, resumed by 2 ranks (FULL_SHARD): step 3 as the 4-rank run."""
    assert world4["resharded"]["losses"] == pytest.approx(world4["hybrid"]["losses"][2:], abs=FP32["loss"])
    assert_matches(world4["resharded"], reference["plain"])


def test_memory_estimate_matches_measured_bytes_hybrid(world4):
    num_params = sum(t.numel() for t in world4["hybrid"]["state"].values())
    estimate = training_memory(num_params, 4, "HYBRID_SHARD", 4, 4, 8, replicate_size=2)
    measured = world4["hybrid"]["bytes"]
    assert (measured["params"], measured["grads"], measured["optimizer"]) == pytest.approx(
        (estimate.params, estimate.grads, estimate.optimizer), rel=0.01
    )
