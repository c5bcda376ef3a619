"""Sharded loading from safetensors: parity with the saved model, and clear errors on every rank."""

import json
import shutil

import pytest

from tests import core_fns

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("shard, replicate", [(1, 1), (2, 1), (2, 2)], ids=["one-process", "fsdp2", "hsdp2x2"])
def test_loaded_outputs_equal_saved_model(dist_run, tiny_checkpoints, shard, replicate):
    for out in dist_run(shard * replicate, core_fns.load_and_compare, tiny_checkpoints, shard, replicate):
        assert out["llama-fp32"] == 0.0 and out["llama-sharded"] == 0.0 and out["llama-offload"] == 0.0
        # --offload-layers 1: the same logits; blocks 1-3 of 4 offloaded by FSDP2 (their shards in host memory),
        # block 0 and the root (embeddings, final norm, head) not.
        assert out["llama-offload-layers"] == 0.0
        placement = out["offload-layers-placement"]
        assert placement["offloaded"] == ["model.layers.1", "model.layers.2", "model.layers.3"]
        assert {name: offloaded for name, (offloaded, _) in placement["units"].items()} == {
            "model.layers.3": True, "model.layers.2": True, "model.layers.1": True, "model.layers.0": False, "": False,
        }
        assert all(devices == ["cpu"] for offloaded, devices in placement["units"].values() if offloaded)
        assert 0.6 * placement["local_bytes"] < placement["host_bytes"] < 0.7 * placement["local_bytes"]
        assert out["llama-bf16-as-fp32"] == 0.0
        assert out["llama-bf16-dtype"] == "torch.bfloat16" and out["llama-bf16"] == 0.0
        assert out["wan-fp32"] == 0.0 and out["wan-bf16"] == 0.0


@pytest.fixture(scope="module")
def broken_checkpoints(tiny_checkpoints, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("broken")
    good = tiny_checkpoints["llama-fp32"]
    cases = {}

    def variant(name, mutate):
        folder = root / name
        shutil.copytree(good, folder)
        mutate(folder)
        cases[name] = folder

    def corrupt(folder):
        (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")

    def edit_tensors(edit):
        def mutate(folder):
            tensors = load_file(folder / "model.safetensors")
            edit(tensors)
            save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

        return mutate

    variant("corrupt", corrupt)
    variant("missing-key", edit_tensors(lambda t: t.pop("model.norm.weight")))
    variant("unexpected-key", edit_tensors(lambda t: t.update(extra_head=t["model.norm.weight"].clone())))
    variant(
        "wrong-shape",
        edit_tensors(lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:10].clone()})),
    )
    variant("no-weights", lambda folder: (folder / "model.safetensors").unlink())
    variant("bad-config", lambda folder: (folder / "config.json").write_text(json.dumps({"hidden_size": 4})))
    cases["missing-folder"] = root / "does-not-exist"
    return cases


@pytest.mark.parametrize(
    "case, fragments",
    [
        ("corrupt", ["model.safetensors", "corrupt"]),
        ("missing-key", ["missing keys", "model.norm.weight"]),
        ("unexpected-key", ["unexpected keys in model.safetensors", "extra_head"]),
        ("wrong-shape", ["shape mismatch", "model.norm.weight in model.safetensors", "[10]", "[64]"]),
        ("no-weights", ["no *.safetensors checkpoint in"]),
        ("bad-config", ["names no model class"]),
        ("missing-folder", ["does-not-exist does not exist"]),
    ],
)
def test_bad_checkpoint_fails_clearly_on_every_rank(dist_run, broken_checkpoints, case, fragments):
    messages = dist_run(2, core_fns.load_expecting_error, str(broken_checkpoints[case]), 2)
    assert messages[0] == messages[1], "every rank must fail the same way"
    assert messages[0].startswith("CheckpointError")
    for fragment in fragments:
        assert fragment in messages[0]
