"""deploy/slurm/train.sbatch under a real SLURM (Debian's slurm-wlm): slurmctld and one slurmd on this machine,
started and stopped here. Mid-run the batch shell gets the signal that ``--signal=B:USR1@180`` sends ahead of the
time limit; the script sends SIGTERM to every process of the job's steps, hsdp train saves at its next step
boundary and stops, the script requeues the job, which runs again, resumes from that checkpoint, and its loss curve
equals an uninterrupted run's (issue 37 items 1 and 2)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "slurm" / "train.sbatch"
DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")

if missing := [name for name in DAEMONS if shutil.which(name) is None]:
    pytest.skip(f"no SLURM here ({', '.join(missing)} not found: apt-get install slurm-wlm)", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("slurmd runs jobs as their user only as root", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(root: Path) -> Path:
    """One node (this host) and one partition; no munge (auth/none: the daemons and clients are all local)."""
    host = socket.gethostname()
    for folder in ("state", "spool", "log"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=hsdptest
SlurmctldHost={host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=60
JobRequeue=1
NodeName={host} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
    )
    return conf


def _slurm(env: dict, *args: str) -> str:
    return subprocess.run(list(args), env=env, capture_output=True, text=True, check=True, timeout=30).stdout


def _until(what: str, check, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
            if found := check():
                return found
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """slurmctld and slurmd in the foreground (-D), ended at the module's end with every job they ran."""
    root = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURM_CONF": str(_conf(root))}
    daemons = [
        subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT),
        subprocess.Popen(["slurmd", "-D"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT),
    ]
    try:
        _until("the node idle", lambda: "idle" in _slurm(env, "sinfo", "-h", "-o", "%t"), 60)
        yield {"env": env, "root": root}
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            _slurm(env, "scancel", "--full", "--user", "root")
            _until("no job left", lambda: _slurm(env, "squeue", "-h") == "", 90)
        for daemon in daemons:
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()


def test_requeued_training_job_resumes_its_checkpoint_and_the_curve(slurm, tmp_path):
    env = {**slurm["env"], "HSDP_PYTHON": sys.executable, "HSDP_NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"document {i}: shards, meshes and gradients. " * 3}) for i in range(40)))
    args = ["--model", "tiny-llama", "--data", str(data), "--batch-size", "2", "--seq-len", "32", "--use-hsdp",
            "--hsdp-shard-size", "2", "--save-every", "1000", "--output-dir", str(tmp_path / "run")]  # fmt: skip
    summary, log = tmp_path / "summary.json", tmp_path / "job.log"
    submitted = _slurm(env, "sbatch", "--parsable", "--chdir", str(tmp_path), "--output", str(log), str(SCRIPT),
                       *args, "--steps", "100000", "--summary-json", str(summary))  # fmt: skip
    job = submitted.strip().split(";")[0]
    try:
        _until("2 steps", lambda: len(json.loads(summary.read_text())) >= 2)
        # What --signal=B:USR1@180 sends ahead of the time limit: the script stops the steps and requeues the job
        _slurm(env, "scancel", "--batch", "--signal=USR1", job)
        stopped = _until("the stop", lambda: re.search(r"stopped by SIGTERM after step (\d+)\n", log.read_text()))
        step = int(stopped[1])
        _until("the requeue", lambda: f"requeueing job {job}" in log.read_text())
        first = json.loads(summary.read_text())
        assert [s["step"] for s in first] == list(range(1, step + 1))
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [f"step-{step:08d}"]  # nothing temporary
        # A requeued job waits (BeginTime) before it may run again; lift that wait here.
        _until("the job pending", lambda: "PENDING" in _slurm(env, "scontrol", "show", "job", job))
        _slurm(env, "scontrol", "update", f"jobid={job}", "StartTime=now")
        resumed = f"Resumed from {tmp_path / 'run' / f'step-{step:08d}'} at step {step}"
        _until("the resumed run", lambda: resumed in log.read_text() and len(json.loads(summary.read_text())) >= 2)
    finally:
        subprocess.run(["scancel", job], env=env, check=False)
    _until("the job's end", lambda: job not in _slurm(env, "squeue", "-h", "-o", "%i"))
    second = json.loads(summary.read_text())
    assert second[0]["step"] == step + 1 and "restart 1" in log.read_text()
    end = second[-1]["step"]
    whole = subprocess.run([sys.executable, "-m", "hsdp.cli", "train", *args, "--steps", str(end), "--output-dir",
                            str(tmp_path / "whole"), "--summary-json", str(tmp_path / "whole.json")],
                           env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-3000:]
    reference = [s["loss"] for s in json.loads((tmp_path / "whole.json").read_text())]
    assert [s["loss"] for s in first + second] == reference


def _answers(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def test_server_job_answers_and_scancel_stops_it_gracefully(slurm, tmp_path):
    """deploy/slurm/serve.sbatch on tiny-llama at HSDP 2 (one node, two ranks): rank 0's log names where it serves,
    a completion is answered, and scancel (SIGTERM to every process of the job) ends it through the server's own
    shutdown, not a kill."""
    import urllib.request

    env = {**slurm["env"], "HSDP_PYTHON": sys.executable, "HSDP_NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    port, log = _free_port(), tmp_path / "serve.log"
    submitted = _slurm(env, "sbatch", "--parsable", "--chdir", str(tmp_path), "--output", str(log),
                       str(ROOT / "deploy" / "slurm" / "serve.sbatch"), "tiny-llama", "--use-hsdp", "--hsdp-shard-size",
                       "2", "--host", "127.0.0.1", "--port", str(port), "--output-dir", str(tmp_path / "out"))  # fmt: skip
    job = submitted.strip().split(";")[0]
    try:
        # The log names the address as uvicorn starts; /health answers once it listens and the engine is ready.
        _until("the server", lambda: _answers(f"http://127.0.0.1:{port}/health"), 180)
        assert f"on http://127.0.0.1:{port}" in log.read_text()
        body = json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 4, "seed": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as answer:
            completion = json.loads(answer.read())
        assert completion["usage"]["completion_tokens"] == 4 and completion["choices"][0]["finish_reason"] == "length"
    finally:
        subprocess.run(["scancel", job], env=env, check=False)
    _until("the job's end", lambda: job not in _slurm(env, "squeue", "-h", "-o", "%i"))
    assert "Application shutdown complete" in log.read_text()
