"""A caller of :class:`hsdp.launch.WorkerGroup` in its own process, for tests/test_launch.py (light imports: the
ranks and the forkserver load only torch).

``python -c "from tests.launch_caller import main; main(WORKDIR)"``: first makes the forkserver fail (it preloads
this module, which raises at import while ``HSDP_TEST_FAIL_IMPORT=1``), starts a one-rank group (spawned instead)
and prints its rank's parent pid; then starts a one-rank group again (which starts a working forkserver), changes what a rank should take from its caller -- the directory (to ``WORKDIR``), the
environment (sets ``HSDP_TEST_SET``, removes ``HSDP_TEST_GONE``) and stderr (to ``WORKDIR/stderr.txt``) -- starts a
two-rank group, prints one JSON line per rank with what the rank sees, then a line with the ranks' pids, and
blocks in a 60 s call until killed.
"""

from __future__ import annotations

import json
import os
import sys
import time

if os.environ.get("HSDP_TEST_FAIL_IMPORT") == "1":
    raise RuntimeError("tests.launch_caller refuses to be imported (a forkserver preload that fails)")


def rank_view() -> dict:
    import torch.distributed as dist

    print(f"rank {dist.get_rank()} on the caller's stderr", file=sys.stderr, flush=True)
    return {
        "cwd": os.getcwd(),
        "set": os.environ.get("HSDP_TEST_SET"),
        "gone": os.environ.get("HSDP_TEST_GONE"),
        "ppid": os.getppid(),
    }


def sleep_for(seconds: float) -> None:
    time.sleep(seconds)


def main(workdir: str) -> None:
    from hsdp import launch
    from hsdp.launch import WorkerGroup

    launch.group.PRELOAD_PACKAGES += ("tests",)  # the forkserver preloads this module too
    os.environ["HSDP_TEST_FAIL_IMPORT"] = "1"
    with WorkerGroup(1) as spawned:
        print(json.dumps({"fallback_ppid": spawned.run(os.getppid)[0]}), flush=True)
    del os.environ["HSDP_TEST_FAIL_IMPORT"]
    launch.group._FORKSERVER_FAILED.clear()  # try the forkserver again (it restarts, this time preloading cleanly)
    os.environ["HSDP_TEST_GONE"] = "set when the first group started"
    with WorkerGroup(1) as first:
        first.run(os.getpid)
    os.chdir(workdir)
    os.environ["HSDP_TEST_SET"] = "set after the first group started"
    del os.environ["HSDP_TEST_GONE"]
    stderr = os.open(os.path.join(workdir, "stderr.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(stderr, 2)
    group = WorkerGroup(2)
    for view in group.run(rank_view, timeout_s=60):
        print(json.dumps(view), flush=True)
    print(json.dumps({"caller": os.getpid(), "ranks": group.pids}), flush=True)
    group.run(sleep_for, 60)


def _open_files(fds: list[int] | None = None) -> list[str]:
    """What this process's descriptors (or ``fds``) point at (``socket:[inode]``, ``pipe:[inode]``, paths)."""
    names = fds if fds is not None else [int(fd) for fd in os.listdir("/proc/self/fd")]
    found = []
    for fd in names:
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return found


def forked_view() -> dict:
    """What a rank forked from the caller has: its parent, SIGINT ignored from birth, descriptors open."""
    import signal as signals

    return {
        "ppid": os.getppid(),
        "sigint_ignored": signals.getsignal(signals.SIGINT) == signals.SIG_IGN,
        "open": _open_files(),
        "diffusers_pipeline_imported": "diffusers.pipelines.pipeline_utils" in sys.modules,
    }


def fork_main() -> None:
    """Issue 34: a caller that runs another Python thread starts its ranks from the forkserver (preloading only
    torch here: nothing heavier is imported yet); once that thread is gone, it forks them (they inherit its
    imports: nothing is imported twice). Prints a JSON line per group."""
    import threading

    from hsdp.launch import WorkerGroup, fork_problem

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="a-server-thread", daemon=True)
    thread.start()
    print(json.dumps({"problem": fork_problem()}), flush=True)
    with WorkerGroup(1) as group:
        print(json.dumps({"ppid": group.run(os.getppid)[0]}), flush=True)
    stop.set()
    thread.join()
    print(json.dumps({"caller": os.getpid(), "problem": fork_problem()}), flush=True)
    with WorkerGroup(2, packages=["diffusers"]) as group:
        views = group.run(forked_view, timeout_s=60)
        caller_ends = _open_files([c.fileno() for c in group._conns])
    print(json.dumps({"views": views, "caller_pipe_ends": caller_ends}), flush=True)


def tqdm_main() -> None:
    """A caller that showed a progress bar (a disabled one, as the planner's recorded pipeline call in ``hsdp
    train``), which leaves tqdm's monitor thread running, still forks its ranks. Prints one JSON line."""
    import threading

    from tqdm import tqdm

    from hsdp.launch import WorkerGroup

    with tqdm(total=2, disable=True) as bar:
        bar.update(2)
    monitor_before = any(t.name == "tqdm_monitor" for t in threading.enumerate())
    with WorkerGroup(1) as group:
        ppid = group.run(os.getppid)[0]
    with tqdm(total=1, disable=True):  # a bar after the ranks started: tqdm starts its monitor again
        monitor_after = any(t.name == "tqdm_monitor" for t in threading.enumerate())
    print(json.dumps({"caller": os.getpid(), "rank_ppid": ppid, "monitor_before": monitor_before,
                      "monitor_after": monitor_after}), flush=True)  # fmt: skip
