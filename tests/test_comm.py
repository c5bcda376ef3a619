"""Communication accounting on 2 real ranks: counted bytes against the minimum, and budgeted residency."""

from __future__ import annotations

import pytest
import torch

from hsdp.measure.comm import CommReport, minimum_bytes

pytestmark = pytest.mark.slow


def _wan_inputs() -> tuple:
    generator = torch.Generator().manual_seed(1)
    return (
        torch.randn(1, 4, 1, 8, 8, generator=generator),
        torch.tensor([10]),
        torch.randn(1, 8, 32, generator=generator),
    )


def _sharded_wan(resident_blocks: int = 0, prefetch: int = 0, training: bool = False):
    from hsdp.config import ParallelConfig
    from hsdp.models.tiny import build_tiny_wan_transformer
    from hsdp.sharding import apply_hsdp_to_model

    model = build_tiny_wan_transformer()
    reference = build_tiny_wan_transformer()
    resident = tuple(f"blocks.{i}" for i in range(resident_blocks))
    apply_hsdp_to_model(
        model,
        ParallelConfig(use_hsdp=True, hsdp_shard_size=2),
        training=training,
        resident_modules=resident,
        forward_prefetch=prefetch,
    )
    return model, reference


def forward_comm(resident_blocks: int, prefetch: int) -> dict:
    """Two forwards (cold, warm) under the counter; the warm output against the unsharded model."""
    from hsdp.measure.comm import measure_comm

    model, reference = _sharded_wan(resident_blocks, prefetch)
    inputs = _wan_inputs()
    with torch.no_grad():
        _, cold = measure_comm(model, lambda: model(*inputs).sample)
        out, warm = measure_comm(model, lambda: model(*inputs).sample)
        expected = reference(*inputs).sample
    return dict(cold=cold.to_dict(), warm=warm.to_dict(), max_diff=(out - expected).abs().max().item())


def train_comm() -> dict:
    from hsdp.measure.comm import measure_comm

    model, _ = _sharded_wan(training=True)
    inputs = _wan_inputs()

    def step():
        model(*inputs).sample.square().mean().backward()

    step()  # the first step allocates; the second is the steady state
    _, report = measure_comm(model, step, training=True)
    return report.to_dict()


@pytest.mark.parametrize("prefetch", [0, 1])
def test_forward_moves_the_minimum_and_matches_unsharded(dist_run, prefetch):
    for rank_result in dist_run(2, forward_comm, 0, prefetch):
        warm = rank_result["warm"]
        assert rank_result["max_diff"] == 0.0
        assert warm["calls"]["all_gather"] == 4  # three blocks and the root, each gathered once
        assert 1.0 <= warm["ratio"] <= 1.05, warm


def test_resident_blocks_are_gathered_once(dist_run):
    results = dist_run(2, forward_comm, 3, 1)
    for rank_result in results:
        assert rank_result["max_diff"] == 0.0
        assert rank_result["cold"]["calls"]["all_gather"] == 4
        # Warm: only the root is gathered again; the three resident blocks kept their weights.
        assert rank_result["warm"]["calls"]["all_gather"] == 1
        assert 1.0 <= rank_result["warm"]["ratio"] <= 1.05


def test_training_step_traffic(dist_run):
    for report in dist_run(2, train_comm):
        assert report["calls"]["reduce_scatter"] == 4
        assert report["calls"]["all_gather"] == 8  # forward and backward, every unit resharded after forward
        assert 1.0 <= report["ratio"] <= 1.05, report


def test_report_ratio_and_summary():
    report = CommReport(calls={"all_gather": 2}, bytes={"all_gather": 210}, minimum={"all_gather": 200})
    assert report.ratio == pytest.approx(1.05)
    assert "2 all_gather" in report.summary() and "1.050x" in report.summary()
    assert CommReport().ratio == 1.0
    assert minimum_bytes(torch.nn.Linear(2, 2)) == {}
