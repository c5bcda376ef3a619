"""Sharded loading of checkpoints that transformers converts while loading: mixture-of-experts checkpoints stored
per expert (fused into one tensor per layer in memory) and legacy key names (Mixtral's ``block_sparse_moe``)."""

import shutil

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests import conversion_fns, core_fns

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """``save_pretrained`` folders. transformers 5 saves the per-expert layout of the original hub checkpoints
    (it reverses its own load-time conversion); Qwen3-MoE is split over several files so experts of one fused
    parameter live in different files."""
    root = tmp_path_factory.mktemp("moe")
    paths = {}
    for name, shard_size in [("qwen3_moe", "40KB"), ("mixtral", "5GB")]:
        paths[name] = root / name
        conversion_fns.build_moe(name).save_pretrained(paths[name], max_shard_size=shard_size)
    return paths


def _stored_keys(folder):
    keys = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            keys.update(handle.keys())
    return keys


def test_checkpoints_store_experts_separately(moe_checkpoints):
    """The premise: the stored keys are not the model's keys, so loading must convert them."""
    qwen, mixtral = moe_checkpoints["qwen3_moe"], moe_checkpoints["mixtral"]
    assert len(list(qwen.glob("*.safetensors"))) > 1
    model_keys = set(conversion_fns.build_moe("qwen3_moe").state_dict())
    stored = _stored_keys(qwen)
    assert "model.layers.0.mlp.experts.gate_up_proj" in model_keys - stored
    assert {f"model.layers.0.mlp.experts.{i}.up_proj.weight" for i in range(4)} <= stored - model_keys
    stored = _stored_keys(mixtral)
    assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in stored
    assert "model.layers.1.block_sparse_moe.gate.weight" in stored  # renamed to mlp.gate on load


@pytest.fixture(scope="module")
def broken_moe(moe_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken-moe")
    good = moe_checkpoints["mixtral"] / "model.safetensors"
    cases = {}

    def variant(case, edit):
        folder = root / case
        shutil.copytree(good.parent, folder)
        tensors = load_file(good)
        edit(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        cases[case] = folder

    layer = "model.layers.1.block_sparse_moe"
    variant("expert-missing", lambda t: [t.pop(f"{layer}.experts.2.{w}.weight") for w in ("w1", "w2", "w3")])
    variant("fused-missing", lambda t: [t.pop(f"{layer}.experts.{i}.w2.weight") for i in range(3)])
    variant("half-missing", lambda t: t.pop(f"{layer}.experts.0.w3.weight"))
    variant(
        "unexpected-renamed", lambda t: t.update({f"{layer}.extra.weight": t[f"{layer}.gate.weight"].clone()})
    )
    return cases


@pytest.mark.parametrize(
    "case, fragments",
    [
        (
            "expert-missing",
            [
                "shape mismatch",
                "model.layers.1.mlp.experts.gate_up_proj (fused from 4 keys such as "
                "model.layers.1.block_sparse_moe.experts.0.w1.weight in model.safetensors)",
                "checkpoint [2, 64, 32], model [3, 64, 32]",
            ],
        ),
        ("fused-missing", ["missing keys", "model.layers.1.mlp.experts.down_proj"]),
        (
            "half-missing",
            [
                "transformers' load-time conversion failed: model.layers.1.mlp.experts.gate_up_proj (fused from 5 keys"
            ],
        ),
        (
            "unexpected-renamed",
            [
                "unexpected keys in model.safetensors",
                "model.layers.1.block_sparse_moe.extra.weight (renamed model.layers.1.mlp.extra.weight)",
            ],
        ),
    ],
)
def test_bad_converted_checkpoint_fails_clearly_on_every_rank(dist_run, broken_moe, case, fragments):
    messages = dist_run(2, core_fns.load_expecting_error, str(broken_moe[case]), 2)
    assert messages[0] == messages[1], "every rank must fail the same way"
    assert messages[0].startswith("CheckpointError"), messages[0]
    for fragment in fragments:
        assert fragment in messages[0], messages[0]


# After the error tests, so that the world-2 tests share one worker group and the world-4 one comes last.
@pytest.mark.parametrize("shard, replicate", [(2, 1), (2, 2)], ids=["fsdp2", "hsdp2x2"])
def test_converted_moe_logits_equal_from_pretrained(dist_run, moe_checkpoints, shard, replicate):
    paths = {name: str(folder) for name, folder in moe_checkpoints.items()}
    by_rank = dist_run(shard * replicate, conversion_fns.load_moes_and_compare, paths, shard, replicate)
    for name, folder in moe_checkpoints.items():
        _check_moe_load(name, _stored_keys(folder), [out[name] for out in by_rank])


def _check_moe_load(name: str, stored: set[str], results: list[dict]) -> None:
    """Exact logits on every rank, and each rank read only the stored experts of the rows FSDP2 gave it."""
    experts = 4 if name == "qwen3_moe" else 3
    covered: dict[str, set[int]] = {}
    for rank, out in enumerate(results):
        assert out["dtype"] == "torch.float32"
        assert out["equal"], f"{name} rank {rank}: logits differ by {out['max_diff']}"
        assert len(out["reads"]) == len(set(out["reads"])), f"{name} rank {rank} read a stored tensor twice"
        assert set(out["reads"]) <= stored
        # Every fused expert parameter: this rank read exactly the experts of the rows FSDP2 gave it.
        assert set(out["rows_read"]) == set(out["rows_held"]) and len(out["rows_held"]) == 4
        for param, rows in out["rows_held"].items():
            assert sorted(set(out["rows_read"][param])) == rows, f"{name} rank {rank}, {param}"
            covered.setdefault(param, set()).update(rows)
        # Non-expert tensors are all read (every rank holds a slice of each at this size).
        non_expert = {k for k in stored if conversion_fns.fused_row(k) is None}
        assert non_expert <= set(out["reads"])
    assert all(rows == set(range(experts)) for rows in covered.values())
    # Rows split as FSDP2 splits dim 0 over the 2 shards: 4 experts -> 2 + 2; 3 experts -> 2 + 1.
    splits = {tuple(rows) for out in results for rows in out["rows_held"].values()}
    assert splits == ({(0, 1), (2, 3)} if experts == 4 else {(0, 1), (2,)})
