"""deploy/slurm/*.sbatch under a real SLURM (Debian's slurm-wlm): slurmctld and two slurmd on this machine (nodes
node1 and node2 on localhost), started and stopped here. train.sbatch on tiny-llama and on a tiny-wan LoRA at once,
each over both nodes (one torchrun agent and one rank per node: world 2 through the multi-node rendezvous): mid-run
each batch shell gets the signal that ``--signal=B:USR1@180`` sends ahead of the time limit; the script sends
SIGTERM to every process of the job's steps, hsdp train saves at its next step boundary and stops, the script
requeues the job, which runs again, names the checkpoint it resumed from, and its loss curve equals an uninterrupted
run's. Meanwhile generate.sbatch runs hsdp generate at HSDP 2 (one node, two ranks) from SLURM's environment
alone, its output equal to one process's. serve.sbatch over both nodes answers and drains on scancel (issue 37)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from functools import partial
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
    return _free_ports(1)[0]


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (held open together while chosen)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


NODES = ("node1", "node2")


def _conf(root: Path) -> Path:
    """Two nodes on this host (slurmd -N node1 and -N node2, each on its own port: Debian's slurm-wlm is built with
    multiple-slurmd support; %n in the slurmd paths is the node's name) and one partition; no munge (auth/none: the
    daemons and clients are all local)."""
    host = socket.gethostname()
    for folder in ("state", "log", *(f"spool/{name}" for name in NODES)):
        (root / folder).mkdir(parents=True, exist_ok=True)
    ctld, *ports = _free_ports(1 + len(NODES))
    nodes = "".join(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={os.cpu_count()} "
                    "RealMemory=1000 State=UNKNOWN\n" for name, port in zip(NODES, ports, strict=True))  # fmt: skip
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=hsdptest
SlurmctldHost={host}
SlurmctldPort={ctld}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=60
JobRequeue=1
SchedulerParameters=sched_interval=1
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
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
    """slurmctld and a slurmd per node in the foreground (-D), ended at the module's end with every job they ran."""
    root = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURM_CONF": str(_conf(root))}
    daemons = [
        subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT),
        *(subprocess.Popen(["slurmd", "-D", "-N", name], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
          for name in NODES),
    ]
    try:
        states = partial(_slurm, env, "sinfo", "-h", "-N", "-o", "%t")
        _until("the nodes idle", lambda: states().split() == ["idle"] * len(NODES), 60)
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


def _env(slurm, per_node: int = 2) -> dict:
    """What a job needs here: this Python, ``per_node`` ranks per node (no GPUs for SLURM to count) and src/."""
    return {**slurm["env"], "HSDP_PYTHON": sys.executable, "HSDP_NPROC_PER_NODE": str(per_node), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip


def _submit(env: dict, folder: Path, script: str, *args: str, nodes: int = 1) -> str:
    # --oversubscribe: the jobs share this machine's cores (each node has as many CPUs as the host, often 2)
    submitted = _slurm(env, "sbatch", "--parsable", "--oversubscribe", "--nodes", str(nodes), "--chdir", str(folder),
                       "--output", str(folder / "job.log"), str(ROOT / "deploy" / "slurm" / script), *args)  # fmt: skip
    return submitted.strip().split(";")[0]


def _steps(summary: Path) -> list[dict]:
    """The steps a run has written so far (every step rewrites the file: a read may meet it half written)."""
    for _ in range(50):
        with contextlib.suppress(OSError, ValueError):
            return json.loads(summary.read_text())
        time.sleep(0.1)
    return []


def _training_runs(tmp_path: Path) -> dict[str, list[str]]:
    """tiny-llama on text and a LoRA on tiny-wan (a diffusers pipeline) on captioned images, both at HSDP 2."""
    import numpy as np
    from PIL import Image

    text = tmp_path / "docs.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"document {i}: shards, meshes and gradients. " * 3}) for i in range(40)))
    media = tmp_path / "media"
    media.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(media / f"img{i}.png")
        (media / f"img{i}.txt").write_text(f"a cat playing piano, style {i}")
    layout = ["--batch-size", "2", "--use-hsdp", "--hsdp-shard-size", "2", "--save-every", "1000"]
    return {
        "llama": ["--model", "tiny-llama", "--data", str(text), "--seq-len", "32", *layout],
        "wan": ["--model", "tiny-wan", "--data", str(media), "--resolution", "32", "--lora-r", "4", "--lr", "1e-3",
                *layout],  # fmt: skip
    }


def test_requeued_training_jobs_resume_their_checkpoints_and_curves_and_generate_runs_as_one_process(slurm, tmp_path):
    """train.sbatch on tiny-llama and on a tiny-wan LoRA (issue 37 item 1), side by side, each a 2-node job of one
    rank per node: after two steps each batch shell gets what --signal=B:USR1@180 sends, each run stops at a step boundary with one checkpoint and nothing
    temporary, the script requeues, and the requeued run says which checkpoint it resumed from and continues with
    the losses of an uninterrupted run (which runs meanwhile, outside SLURM). Meanwhile generate.sbatch runs
    hsdp generate at HSDP 2 from SLURM's environment alone; its output equals one process's."""
    env = _env(slurm)
    hsdp = [sys.executable, "-m", "hsdp.cli"]
    prompt = ["--model", "tiny-llama", "--prompt", "a sharded", "--max-new-tokens", "8", "--seed", "0"]
    generate = tmp_path / "generate"
    generate.mkdir()
    generated = _submit(env, generate, "generate.sbatch", *prompt, "--use-hsdp", "--hsdp-shard-size", "2",
                        "--output", str(generate / "sharded.txt"))  # fmt: skip
    one = subprocess.Popen([*hsdp, "generate", *prompt, "--output", str(generate / "one.txt")], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    runs, jobs = _training_runs(tmp_path), {}
    for name, args in runs.items():
        folder = tmp_path / name
        folder.mkdir()
        # Two nodes of one rank each: one torchrun agent per node, joined at node1's rendezvous (world 2)
        jobs[name] = _submit(_env(slurm, per_node=1), folder, "train.sbatch", *args, "--steps", "100000",
                             "--output-dir", str(folder / "run"), "--summary-json", str(folder / "summary.json"),
                             nodes=2)  # fmt: skip
    first, stopped_at, references, second = {}, {}, {}, {}
    try:
        for name, job in jobs.items():
            _until(f"{name}: 2 steps", partial(_made, tmp_path / name / "summary.json", 2), 600)
            # What --signal=B:USR1@180 sends ahead of the time limit: the script stops the steps and requeues the job
            _slurm(env, "scancel", "--batch", "--signal=USR1", job)
        for name, job in jobs.items():
            stopped_at[name], first[name] = _stopped_and_requeued(env, tmp_path / name, job)
        # The uninterrupted runs, while the jobs restart: to the resumed runs' last steps (below); the learning rate
        # is constant, so the steps to come do not change the curve.
        references = {
            name: subprocess.Popen([*hsdp, "train", *args, "--steps", "100000", "--output-dir", str(tmp_path / name / "whole"),
                                    "--summary-json", str(tmp_path / name / "whole.json")], env=env,
                                   start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for name, args in runs.items()
        }  # fmt: skip
        for name, job in jobs.items():
            folder, step = tmp_path / name, stopped_at[name]
            resumed = f"Resumed from {folder / 'run' / f'step-{step:08d}'} at step {step}"  # the job's log names it
            _until(f"{name}: the resumed run", partial(_resumed, folder, resumed, step), 600)
            _slurm(env, "scancel", job)  # each as soon as it has shown it, and its reference once it is as far
            _until(f"{name}: the job's end", partial(_gone, env, job))
            second[name] = _steps(folder / "summary.json")
            end = second[name][-1]["step"]
            _until(f"{name}: the uninterrupted run's step {end}", partial(_made, folder / "whole.json", end,
                                                                          references[name]), 600)  # fmt: skip
            os.killpg(references[name].pid, signal.SIGKILL)
        _until("the generate job's end", partial(_gone, env, generated), 600)
    finally:
        for reference in references.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(reference.pid, signal.SIGKILL)
        subprocess.run(["scancel", *jobs.values(), generated], env=env, check=False)
    _, err = one.communicate(timeout=600)
    assert one.returncode == 0, err[-3000:]
    log = (generate / "job.log").read_text()
    assert log.count("\nwrote ") == 1, log[-3000:]  # rank 0 writes; the other ranks have the same outputs
    assert (generate / "sharded.txt").read_text() == (generate / "one.txt").read_text(), log[-3000:]
    for name, reference in references.items():
        folder = tmp_path / name
        _, err = reference.communicate()
        log = (folder / "job.log").read_text()
        assert second[name][0]["step"] == stopped_at[name] + 1 and "(restart 1) on 2 node(s) x 1 rank(s)" in log
        end = second[name][-1]["step"]
        whole = [s["loss"] for s in _steps(folder / "whole.json")][:end]
        assert len(whole) == end, err[-3000:]
        assert [s["loss"] for s in first[name] + second[name]] == whole, name


def _made(summary: Path, steps: int, proc: subprocess.Popen | None = None) -> bool:
    """The run has written ``steps`` steps (or ``proc`` has ended: the caller's assertion says why)."""
    return len(_steps(summary)) >= steps or (proc is not None and proc.poll() is not None)


def _gone(env: dict, job: str) -> bool:
    return job not in _slurm(env, "squeue", "-h", "-o", "%i")


def _resumed(folder: Path, line: str, step: int) -> bool:
    """The log names the checkpoint and the resumed run has made 2 steps (not the first run's summary)."""
    steps = _steps(folder / "summary.json")
    return line in (folder / "job.log").read_text() and len(steps) >= 2 and steps[0]["step"] == step + 1


def _stopped_and_requeued(env: dict, folder: Path, job: str) -> tuple[int, list[dict]]:
    """The step the job stopped after and the steps it made; its requeue let run at once."""
    log = folder / "job.log"
    found = _until("the stop", lambda: re.search(r"stopped by SIGTERM after step (\d+)\n", log.read_text()))
    step = int(found[1])
    _until("the requeue", lambda: f"requeueing job {job}" in log.read_text())
    steps = _steps(folder / "summary.json")
    assert [s["step"] for s in steps] == list(range(1, step + 1))
    # The run page and one checkpoint: nothing temporary
    assert sorted(p.name for p in (folder / "run").iterdir()) == ["report.html", f"step-{step:08d}"]
    # A requeued job waits (BeginTime) before it may run again; lift that wait here.
    _until("the job pending", lambda: "PENDING" in _slurm(env, "scontrol", "show", "job", job))
    _slurm(env, "scontrol", "update", f"jobid={job}", "StartTime=now")
    return step, steps


def _answers(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def test_server_job_answers_and_scancel_stops_it_gracefully(slurm, tmp_path):
    """deploy/slurm/serve.sbatch on tiny-llama at HSDP 2 over two nodes of one rank each: rank 0's log names where
    it serves, a completion is answered, and scancel (SIGTERM to every process of the job) ends it through the
    server's own shutdown, not a kill."""
    import urllib.request

    env = _env(slurm, per_node=1)
    port, log = _free_port(), tmp_path / "serve.log"
    submitted = _slurm(env, "sbatch", "--parsable", "--nodes", "2", "--chdir", str(tmp_path), "--output", str(log),
                       str(ROOT / "deploy" / "slurm" / "serve.sbatch"), "tiny-llama", "--use-hsdp", "--hsdp-shard-size",
                       "2", "--host", "127.0.0.1", "--port", str(port), "--output-dir", str(tmp_path / "out"))  # fmt: skip
    job = submitted.strip().split(";")[0]
    try:
        # The log names the address as uvicorn starts; /health answers once it listens and the engine is ready.
        _until("the server", lambda: _answers(f"http://127.0.0.1:{port}/health"), 180)
        assert "on 2 node(s) x 1 rank(s)" in log.read_text() and f"on http://127.0.0.1:{port}" in log.read_text()
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
