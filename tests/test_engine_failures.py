"""A worker dying mid-generation surfaces in the caller in bounded time, and a new Engine starts afterwards.

The replacement engine keeps weights gathered between steps (``reshard_after_forward=False``) without explicit
prefetch, so the same test also checks that this overlap option leaves the output unchanged. ``hsdp generate``
is run end to end once, as the README shows it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import numpy as np
import pytest

from hsdp import ParallelConfig
from hsdp.cli import main as cli_main
from hsdp.engine import Engine, SamplingParams
from hsdp.launch import WorkerDiedError
from tests.engine_refs import builtin, reference_param_bytes, reference_video

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wan_path(tmp_path_factory):
    return builtin("tiny-wan", tmp_path_factory.getbasetemp() / "hsdp-cache")


def test_worker_death_mid_generation_then_new_engine(wan_path):
    engine = Engine(wan_path, ParallelConfig(use_hsdp=True, hsdp_shard_size=2))
    victim = engine.pids[1]
    killer = threading.Timer(1.0, os.kill, args=(victim, signal.SIGKILL))
    started = time.monotonic()
    killer.start()
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        engine.generate("A cat playing piano", SamplingParams(num_inference_steps=100_000))
    assert time.monotonic() - started < 30
    assert engine.closed
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate("again")

    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, reshard_after_forward=False)
    params = SamplingParams(seed=3, num_inference_steps=2)
    with Engine(wan_path, config, forward_prefetch=False) as fresh:
        [out] = fresh.generate("A cat playing piano", params)
        held = fresh.memory_report()
    # Kept gathered: after generating, each rank holds the full weights, not just its shards.
    for loaded, now in zip(fresh.load_report, held, strict=True):
        assert loaded["param_bytes"] < now["param_bytes"] == reference_param_bytes(wan_path)
    expected = reference_video(wan_path, "A cat playing piano", 3, params, fresh.info.defaults)
    np.testing.assert_array_equal(out.frames, expected)


def test_generate_command_writes_a_playable_video(tmp_path, monkeypatch, capsys):
    import imageio.v3 as iio

    monkeypatch.setenv("HSDP_CACHE", str(tmp_path / "cache"))
    output = tmp_path / "cat.mp4"
    argv = ["generate", "--model", "tiny-wan", "--use-hsdp", "--hsdp-shard-size", "2"]
    code = cli_main([*argv, "--prompt", "A cat playing piano", "--output", str(output), "--comm-stats"])
    assert code == 0
    frames = iio.imread(output, plugin="FFMPEG")
    assert frames.shape == (5, 32, 32, 3)
    summary = capsys.readouterr().err
    assert "layout: world_size=2, hsdp=1x2 (FULL_SHARD)" in summary and "s/step" in summary
    assert "peak memory (cpu peak RSS): rank0" in summary and "rank1" in summary
    # 4 steps x 2 guidance branches of the transformer, plus the text encoder for prompt and negative prompt;
    # every all-gather moves (N-1)/N of a unit's padded weights, so the ratio sits just above 1.
    comm = re.search(r"(\d+) all_gather over (\d+) sharded forwards; .* ([\d.]+)x the minimum", summary)
    assert comm is not None, summary
    assert int(comm[2]) == 10 and int(comm[1]) > 0
    assert 1.0 <= float(comm[3]) <= 1.05
