"""``hsdp demo`` as the README shows it: 2 spawned ranks, each holding half the weights, equal to one process."""

import re

import pytest

from hsdp.cli import main as cli_main

pytestmark = pytest.mark.slow  # spawns 2 ranks


def test_demo_shards_in_half_and_matches_one_process(tmp_path_factory, monkeypatch, capsys):
    monkeypatch.setenv("HSDP_CACHE", str(tmp_path_factory.getbasetemp() / "hsdp-cache"))
    assert cli_main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "layout: world_size=2, hsdp=1x2 (FULL_SHARD)" in out
    rows = re.findall(r"^\s+(\d) \|\s+[\d.]+ \|\s+[\d.]+ \|\s+([\d.]+) \| (\S+)$", out, re.MULTILINE)
    assert [(rank, fraction, diff) for rank, fraction, diff in rows] == [
        ("0", "0.500", "0"),
        ("1", "0.500", "0"),
    ]
    assert "largest difference from the one-process output: 0\n" in out
