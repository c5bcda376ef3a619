"""FSDP2 sharding by shard plan: exact parity with one process at world 2 (1-D) and 4 (2 x 2 HSDP)."""

import contextlib
from collections.abc import Iterator

import pytest
from torch import nn

from hsdp.config import ParallelConfig
from hsdp.mesh import ParallelMeshes, build_meshes
from hsdp.shard_rules import resolve_plan
from tests import core_fns

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("shard, replicate", [(2, 1), (2, 2)], ids=["fsdp2", "hsdp2x2"])
def test_sharded_outputs_equal_unsharded(dist_run, shard, replicate):
    results = dist_run(shard * replicate, core_fns.shard_and_compare, shard, replicate)
    for rank, out in enumerate(results):
        assert out["llama_diff"] == 0.0 and out["llama_diff_second_call"] == 0.0
        assert out["tokens_equal"]
        assert out["wan_diff"] == 0.0
        # The root is resharded after forward: every parameter is back to its sharded DTensor.
        assert out["unsharded_after_forward"] == []
        report = out["llama_report"]
        assert report.num_sharded == 4 and report.sharded_modules[0] == "model.layers.3"
        # Held bytes are total / shard_size, give or take one padded row per parameter.
        assert abs(report.local_param_bytes - report.total_param_bytes / shard) <= out["llama_row_bytes"]
        assert out["wan_report"].num_sharded == 3
        assert (
            f"HSDP Inference: replicate_size={replicate}, shard_size={shard}, world_size={shard * replicate}, rank={rank}"
            in out["logs"]
        )
        assert "Sharded 4 modules + root" in out["logs"] and "Sharded 3 modules + root" in out["logs"]
        assert "use torch.no_grad()" in out["inference_mode_error"]


def test_plan_sources():
    from hsdp.models.tiny import build_tiny_wan_transformer

    wan = build_tiny_wan_transformer()
    plan = resolve_plan(wan)
    assert "WanTransformerBlock" in plan.source
    assert plan.should_shard("blocks.0", wan.blocks[0]) and not plan.should_shard(
        "blocks.0.attn1", wan.blocks[0].attn1
    )

    class Custom(nn.Module):
        _hsdp_shard_conditions = [lambda name, module: isinstance(module, nn.Linear)]

    assert resolve_plan(Custom()).source == "_hsdp_shard_conditions"


def test_plan_matching_nothing_lists_candidates():
    from hsdp.sharding import apply_hsdp_to_model

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=1)
    with (
        _single_rank_meshes(config) as meshes,
        pytest.raises(ValueError, match="matched no module of Blocks.*Sequential"),
    ):
        apply_hsdp_to_model(Blocks(), config, meshes=meshes)


def test_plan_with_ignored_keeps_module_replicated():
    """``ShardPlan.with_ignored`` (what ``load_pretrained(plan=)`` and the trainer's --replicated-modules use)
    leaves the named module's parameters whole while the rest become DTensors."""
    from torch.distributed.tensor import DTensor

    from hsdp.sharding import apply_hsdp_to_model

    class Blocks(nn.Module):
        _no_split_modules = ["Linear"]

        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=1)
    model = Blocks()
    with _single_rank_meshes(config) as meshes:
        report = apply_hsdp_to_model(
            model, config, meshes=meshes, plan=resolve_plan(model).with_ignored(["second"])
        )
    assert report.replicated_params == ["second.bias", "second.weight"]
    assert not any(isinstance(p, DTensor) for p in model.second.parameters())
    assert all(isinstance(p, DTensor) for p in model.first.parameters())


@contextlib.contextmanager
def _single_rank_meshes(config: ParallelConfig) -> Iterator[ParallelMeshes]:
    """Real one-rank meshes over torch's fake process group (no peers, no threads), torn down afterwards."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        yield build_meshes(config)
    finally:
        dist.destroy_process_group()
