"""The worker group: results, errors with the failing rank's traceback, dead ranks, time limits."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hsdp.launch import WorkerDiedError, WorkerError, WorkerGroup, WorkerTimeout, preload_modules
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


def test_the_forkserver_preloads_the_model_modules_the_ranks_build_with(monkeypatch):
    """An LM engine's caller imports no model classes before its ranks start; their forkserver imports them once
    (about 1.9 s of CPU) instead of each rank on its own."""
    monkeypatch.delitem(sys.modules, "transformers.modeling_utils", raising=False)
    preload = preload_modules(["transformers"])
    assert preload[:3] == ["hsdp.forkserver_signals", "hsdp.launch", "transformers.modeling_utils"]
    assert "transformers.modeling_utils" not in preload_modules()  # not for a group that builds no LM


def test_call_time_limit():
    with WorkerGroup(1) as group, pytest.raises(WorkerTimeout):
        group.run(core_fns.sleep_for, 30, timeout_s=2)
    assert group.broken
    with pytest.raises(WorkerError, match="closed or broken"):
        group.run(core_fns.rank_and_world)


# Rank-side functions of the tests below (module level: the ranks import them by name).
def raise_value_error() -> None:
    import torch.distributed as dist

    raise ValueError(f"height=33 must be a multiple of 16 (rank {dist.get_rank()})\nsecond line")


def beat_for(seconds: float) -> int:
    from hsdp.launch import heartbeat

    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        heartbeat()
        time.sleep(0.01)
    return 0


def new_semaphores() -> list[str]:
    """POSIX semaphores this rank creates when a progress bar runs (what a killed rank would leak)."""
    import os

    from tqdm import tqdm

    before = set(os.listdir("/dev/shm"))
    for _ in tqdm(range(2)):
        pass
    return sorted(n for n in set(os.listdir("/dev/shm")) - before if n.startswith("sem."))


def test_an_ordinary_exception_on_every_rank_keeps_the_group(dist_run):
    """Issue 21 item 7: a ValueError raised by the function broke the group like a dead rank (a full reload)."""
    from hsdp.launch import WorkerRaised

    group = dist_run.group(2)
    pids = group.pids
    with pytest.raises(WorkerRaised) as info:
        group.run(raise_value_error, timeout_s=60)
    assert info.value.error == "ValueError: height=33 must be a multiple of 16 (rank 0)\nsecond line"
    assert info.value.rank == 0 and "Traceback" in str(info.value)
    assert not group.broken and dist_run(2, core_fns.rank_and_world) == [(0, 2), (1, 2)]
    assert dist_run.group(2).pids == pids  # the same processes: nothing was restarted


def test_heartbeats_show_life_during_a_call_and_workers_make_no_semaphores(dist_run):
    """Issue 21 items 5 and 11: a rank's heartbeat reaches the caller while the call runs (a long VAE decode is not
    a hang); a rank's progress bar made a POSIX semaphore that a killed rank leaked."""
    group = dist_run.group(2)
    seen = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.1):
            seen.append(time.monotonic() - group.last_heard)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        group.run(beat_for, 1.5, timeout_s=60)
    finally:
        stop.set()
        watcher.join()
    assert max(seen[2:-1]) < 1.0, seen  # never silent for long, although the call sends no event
    assert group.run(new_semaphores, timeout_s=60) == [[], []]


def _exited(pid: int) -> bool:
    """The process is gone or a zombie (its parent, the forkserver, may be gone too and nobody reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_forkserver_ranks_take_the_callers_state_at_start_and_exit_with_the_caller(tmp_path):
    """A forkserver whose preload raises does not stop ranks from starting (they are spawned). Ranks forked from a forkserver started earlier: each has the caller's directory, environment and stderr as
    they are at the group's start (not as when the forkserver started), and exits within seconds when the caller
    is killed in the middle of a call (the rank's parent is the forkserver, so it must watch the caller's pid)."""
    env = {**os.environ, "HSDP_START_METHOD": "forkserver"}
    caller = subprocess.Popen(
        [sys.executable, "-c", f"from tests.launch_caller import main; main({str(tmp_path)!r})"],
        cwd=Path(__file__).parents[1],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [json.loads(caller.stdout.readline()) for _ in range(4)]
    finally:
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait()
    fallback, *views, pids = lines
    assert pids["caller"] == caller.pid
    assert fallback == {"fallback_ppid": caller.pid}  # a preload that raised: the rank was spawned instead
    for view in views:
        assert view == {
            "cwd": str(tmp_path),
            "set": "set after the first group started",
            "gone": None,
            "ppid": view["ppid"],
        }
        assert view["ppid"] != caller.pid  # forked by the forkserver, not spawned by the caller
    assert sorted(
        (tmp_path / "stderr.txt").read_text().count(f"rank {r} on the caller's stderr") for r in (0, 1)
    ) == [1, 1]
    deadline = time.monotonic() + 10
    while not all(_exited(pid) for pid in pids["ranks"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [_exited(pid) for pid in pids["ranks"]] == [True, True]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_killed_forkserver_neither_fails_the_group_nor_leaves_ranks_running(monkeypatch):
    """Killing the forkserver (the ranks' parent) makes multiprocessing read exit code 255 for every rank, which
    run on. The group asks their pids instead: the next call runs, and closing kills them (Process.kill would do
    nothing, believing them gone). The next group gets a new forkserver (multiprocessing reaps the dead one and
    starts another), not spawned ranks."""
    from multiprocessing import forkserver

    from hsdp.launch import group as launch_group

    monkeypatch.setenv("HSDP_START_METHOD", "forkserver")
    with WorkerGroup(2) as group:
        assert group.run(core_fns.rank_and_world) == [(0, 2), (1, 2)]
        server = forkserver._forkserver._forkserver_pid  # started by this process for the group
        os.kill(server, signal.SIGKILL)
        # Left for multiprocessing to reap, as a forkserver that died on its own is: reaping it here made the next
        # group's forkserver check fail (ChildProcessError), and every later group of this process spawned its ranks.
        while not _exited(server):
            time.sleep(0.01)
        assert group.run(core_fns.rank_and_world) == [(0, 2), (1, 2)]
        ranks = group.pids
        assert not any(_exited(pid) for pid in ranks)
    assert [_exited(pid) for pid in ranks] == [True, True]
    with WorkerGroup(2) as group:  # the next group gets a new forkserver
        assert group.run(core_fns.rank_and_world) == [(0, 2), (1, 2)]
        assert forkserver._forkserver._forkserver_pid not in (None, server)
    assert not launch_group._FORKSERVER_FAILED


@pytest.mark.skipif(sys.platform != "linux", reason="ranks fork from the caller on Linux only")
def test_a_single_threaded_caller_forks_its_ranks_and_a_threaded_one_does_not():
    """Issue 34: the ranks of a CPU-only, single-threaded caller are forked from it (its imports inherited, where
    the forkserver imported everything again: 7 s of a 21 s tiny-wan command); they ignore SIGINT from birth and
    hold none of the caller's pipe ends. A caller running another thread (a server's) starts them from the
    forkserver: a fork would copy a lock that thread may hold."""
    import torch

    if torch.version.cuda or torch.version.hip:
        pytest.skip("an accelerator build of torch never forks its ranks")
    env = {k: v for k, v in os.environ.items() if k != "HSDP_START_METHOD"}
    out = subprocess.run(
        [sys.executable, "-c", "from tests.launch_caller import fork_main; fork_main()"],
        cwd=Path(__file__).parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    threaded, spawned, first, forked = (json.loads(line) for line in out.stdout.splitlines())
    assert first["problem"] is None
    for view in forked["views"]:
        assert view["ppid"] == first["caller"]  # forked by the caller itself
        assert view["sigint_ignored"]
        assert view["diffusers_pipeline_imported"]  # imported once, in the caller, before the fork
        assert len(forked["caller_pipe_ends"]) == 2 and not set(view["open"]) & set(forked["caller_pipe_ends"])
    assert "a-server-thread" in threaded["problem"]
    assert spawned["ppid"] != first["caller"]


@pytest.mark.skipif(sys.platform != "linux", reason="ranks fork from the caller on Linux only")
def test_a_caller_that_showed_a_progress_bar_still_forks_its_ranks():
    """tqdm's monitor thread, started by the first progress bar (even a disabled one: the planner's recorded
    pipeline call in every ``hsdp train``) and running until the process exits, made the ranks start from the
    forkserver, importing torch and diffusers again (main 2a202a7: 'ranks start by forkserver (this process runs
    other Python threads (tqdm_monitor))'). It is stopped before the ranks fork; the next bar starts it again."""
    import torch

    if torch.version.cuda or torch.version.hip:
        pytest.skip("an accelerator build of torch never forks its ranks")
    env = {k: v for k, v in os.environ.items() if k != "HSDP_START_METHOD"}
    out = subprocess.run(
        [sys.executable, "-c", "from tests.launch_caller import tqdm_main; tqdm_main()"],
        cwd=Path(__file__).parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["monitor_before"] and seen["monitor_after"], seen
    assert seen["rank_ppid"] == seen["caller"], seen  # forked by the caller, not by the forkserver


def test_a_caller_with_an_open_group_starts_the_next_without_fork():
    """A fork copies an open group's rendezvous store without its server thread, and a rank that freed that copy
    aborted (the combination tier, several engines up in one process): while a group is open, the next starts its
    ranks another way; once it is closed, forking is safe again."""
    from hsdp.launch import WorkerGroup
    from hsdp.launch.group import _OPEN_GROUPS, fork_problem

    before = len(_OPEN_GROUPS)  # (this process may hold the suite's shared groups)
    with WorkerGroup(1) as group:
        assert group in _OPEN_GROUPS and "open worker group" in (fork_problem() or "")
    assert group not in _OPEN_GROUPS and len(_OPEN_GROUPS) == before


def _collect_garbage() -> int:
    import gc

    return gc.collect()


def test_a_forked_rank_never_collects_the_callers_uncollected_garbage(dist_run):
    """A caller's garbage cycle holding a store (its server thread lives in the caller only) was collected in a rank
    forked before the caller collected it: the rank aborted (SIGABRT, "Fatal Python error: Aborted" while
    garbage-collecting, seen in a compose-tier rank's unload). Ranks freeze what they were born with."""
    import gc

    import torch.distributed as dist

    from hsdp.launch.group import _stop_progress_monitors, fork_problem

    dist_run.close()  # the session's groups: an open one makes the next group start by the forkserver
    _stop_progress_monitors()  # as a group does before it decides (an earlier test's bar left tqdm's thread)
    if problem := fork_problem():
        pytest.skip(f"the ranks would not be forked from this process: {problem}")
    gc.disable()
    try:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        cycle: list = [store]
        cycle.append(cycle)
        del store, cycle
        with WorkerGroup(1) as group:
            assert group.run(_collect_garbage)[0] >= 0
    finally:
        gc.enable()
        gc.collect()
