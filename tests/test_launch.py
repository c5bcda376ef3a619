"""The worker group: results, errors with the failing rank's traceback, dead ranks, time limits."""

import time

import pytest

from hsdp.launch import WorkerDiedError, WorkerError, WorkerGroup, WorkerTimeout
from tests import core_fns

pytestmark = pytest.mark.slow


def test_runs_on_every_rank_and_reuses_group(dist_run):
    assert dist_run(2, core_fns.rank_and_world) == [(0, 2), (1, 2)]
    first = dist_run.group(2).pids
    dist_run(2, core_fns.rank_and_world)
    assert dist_run.group(2).pids == first


def test_error_on_one_rank_reports_its_traceback_without_waiting(dist_run):
    started = time.monotonic()
    with pytest.raises(WorkerError) as info:
        dist_run(2, core_fns.fail_on_rank, 1)
    assert info.value.rank == 1
    assert "boom on rank 1" in str(info.value) and "Traceback" in str(info.value)
    assert time.monotonic() - started < 30  # not the collective timeout
    assert dist_run(2, core_fns.rank_and_world) == [(0, 2), (1, 2)]  # a fresh group replaced the broken one


def test_dead_rank_is_reported_and_a_new_group_starts(dist_run):
    with pytest.raises(WorkerDiedError) as info:
        dist_run(2, core_fns.die_on_rank, 0)
    assert info.value.rank == 0 and "exit code -9" in str(info.value)
    assert dist_run(2, core_fns.rank_and_world) == [(0, 2), (1, 2)]


def test_call_time_limit():
    with WorkerGroup(1) as group, pytest.raises(WorkerTimeout):
        group.run(core_fns.sleep_for, 30, timeout_s=2)
    assert group.broken
    with pytest.raises(WorkerError, match="closed or broken"):
        group.run(core_fns.rank_and_world)
