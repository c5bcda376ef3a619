"""The same library code joined from torchrun's environment instead of our spawned workers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_torchrun_two_ranks_load_sharded_and_match(tiny_checkpoints):
    script = Path(__file__).with_name("torchrun_load.py")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "0"]
        + [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:0",
            str(script),
            str(tiny_checkpoints["llama-fp32"]),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(script.parents[1])},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = sorted(
        (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in rows] == [0, 1]
    assert all(r["diff"] == 0.0 for r in rows)
    assert all(abs(r["fraction"] - 0.5) < 0.01 for r in rows)
