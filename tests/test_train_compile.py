"""``hsdp train --compile``: the engine's regional compilation on the model being trained gives eager training's
losses and weights, and is refused before anything starts where inductor cannot run.

Compiling the blocks' forward and backward takes about a minute on this 2-core CPU the first time (inductor's
on-disk cache shortens later runs), so the parity test is ``slow``; on an H200 it made Wan-shaped LoRA steps 1.06x
faster (benchmarks/results/train_diffusion-h200-compile.json).
"""

from __future__ import annotations

import numpy as np
import pytest

from hsdp.config import ParallelConfig
from hsdp.train import TrainConfig
from tests.diffusion_train_fns import train_diffusion

TOLERANCE = 1e-5
"""Inductor fuses and reorders float ops: the same math to rounding (measured below 1e-6 on tiny-wan)."""


@pytest.mark.slow
def test_compiled_lora_training_equals_eager(dist_run, media):
    layout = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    eager = TrainConfig(
        model="tiny-wan", data=str(media), resolution=32, steps=3, batch_size=2, lr=1e-3, seed=3, progress=False,
        lora_r=4, parallel=layout,
    )  # fmt: skip
    plain, compiled = dist_run(2, train_diffusion, [eager, eager.replace(compile=True)])[0]
    np.testing.assert_allclose(compiled["losses"], plain["losses"], atol=TOLERANCE, rtol=0)
    assert compiled["state"].keys() == plain["state"].keys()
    worst = max((compiled["state"][k] - plain["state"][k]).abs().max().item() for k in plain["state"])
    assert worst < TOLERANCE, worst
    assert plain["losses"][0] != plain["losses"][-1]  # it trained


def test_compile_refused_without_a_cpu_compiler(media, monkeypatch):
    from torch._inductor import config

    import hsdp.distributed

    monkeypatch.setattr(hsdp.distributed, "device_type", lambda: "cpu")  # the CPU's check, on any machine
    cfg = TrainConfig(model="tiny-wan", data=str(media), compile=True)
    with config.patch({"cpp.cxx": ("no-such-compiler",)}):
        problems = cfg.problems()
    assert any("--compile" in p and "no-such-compiler" in p for p in problems), problems
    assert not any("--compile" in p for p in cfg.problems())  # with g++ it runs
