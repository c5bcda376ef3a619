"""Shared fixtures. Multi-rank tests run module-level functions on a reused :class:`hsdp.launch.WorkerGroup`.

``dist_run(world_size, fn, *args)`` runs ``fn`` on every rank of a group of that size and returns the per-rank
results. One group per world size is kept for the whole session (process start-up and imports cost seconds);
a group that broke (a rank raised, died or timed out) is replaced before the next test.
"""

from __future__ import annotations

import os

import pytest

from hsdp.launch import WorkerGroup

os.environ.setdefault("HSDP_COLLECTIVE_TIMEOUT", "120")
CALL_TIMEOUT_S = 300


class DistRunner:
    def __init__(self) -> None:
        self._groups: dict[int, WorkerGroup] = {}

    def group(self, world_size: int) -> WorkerGroup:
        group = self._groups.get(world_size)
        if group is None or group.broken:
            # Two cores: keep at most one idle group alive so ranks do not compete for CPU.
            self.close()
            group = self._groups[world_size] = WorkerGroup(world_size, collective_timeout_s=120)
        return group

    def __call__(self, world_size: int, fn, *args, timeout_s: float = CALL_TIMEOUT_S, **kwargs):
        return self.group(world_size).run(fn, *args, timeout_s=timeout_s, **kwargs)

    def close(self) -> None:
        for group in self._groups.values():
            group.close()
        self._groups.clear()


@pytest.fixture(scope="session")
def dist_run():
    runner = DistRunner()
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Built-in tiny models saved as real safetensors checkpoints (fp32 and bf16), shared by the session."""
    from tests.checkpoints import write_tiny_checkpoints

    return write_tiny_checkpoints(tmp_path_factory.mktemp("ckpt"))
