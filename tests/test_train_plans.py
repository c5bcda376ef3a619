"""The size-based plan for custom models with neither ``_hsdp_shard_conditions`` nor ``_no_split_modules``."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from hsdp.shard_rules import resolve_plan
from tests.train_fns import SizePlanModel, size_plan_step


def test_size_based_plan_only_when_nothing_else_matches(caplog):
    with caplog.at_level(logging.WARNING, logger="hsdp"):
        plan = resolve_plan(SizePlanModel())
    assert plan.source.startswith("size-based (min_num_params=1000")
    assert "FSDP units by size" in caplog.text
    model = SizePlanModel()
    plan = resolve_plan(model)
    assert [n for n, m in model.named_modules() if n and plan.should_shard(n, m)] == [
        "body.0",
        "body.1",
        "body.2",
    ]

    class WithBlocks(SizePlanModel):
        _no_split_modules = ["Sequential"]

    assert resolve_plan(WithBlocks()).source == "_no_split_modules=['Sequential']"


def test_size_based_units_take_what_smaller_units_left():
    """Bottom-up as torch's size_based_auto_wrap_policy: a parent counts only parameters no child unit took."""

    class Nested(nn.Module):
        _hsdp_min_num_params = 100

        def __init__(self) -> None:
            super().__init__()
            self.outer = nn.Sequential(nn.Linear(10, 10), nn.Linear(3, 3))  # 110 + 12 parameters

    model = Nested()
    plan = resolve_plan(model)
    assert [n for n, m in model.named_modules() if n and plan.should_shard(n, m)] == ["outer.0"]


@pytest.mark.slow
def test_size_based_plan_sharded_gradients_equal_whole_model(dist_run):
    for result in dist_run(2, size_plan_step):
        assert result["losses"][0] == result["losses"][1]
        assert result["worst_grad"] <= 1e-6
        assert result["units"] == ["body.2", "body.1", "body.0"]
