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
