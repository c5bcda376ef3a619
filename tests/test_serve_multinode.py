"""``hsdp serve`` over two torchrun "nodes" on this machine (``torchrun --nnodes 2 --nproc-per-node 1`` twice, c10d
rendezvous on a free localhost port): global rank 0 serves HTTP and leads, the other node's rank follows
(:mod:`hsdp.engine.leader`).

Outputs are compared with one process on the same input and seed (which the single-host server equals, see
tests/test_serve.py): streamed and plain completions, and ``/v1/videos/sync``'s mp4 bytes (the frames written by the
server's own writer). Killing the second node's rank: ``/health`` leaves "ready" within 2 s, torchrun
(``--max-restarts``) restarts the group, and every accepted video job completes with the same bytes as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from hsdp.engine import SamplingParams
from hsdp.engine.model_info import inspect_model
from hsdp.engine.outputs import save_frames
from hsdp.serve.local import free_port
from tests.engine_refs import builtin, reference_tokens, reference_video

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="two torchrun agents")]

SMALL = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 2, "fps": 16}


class TwoNodes:
    """Two torchrun agents (one rank each) serving ``model``; stopped by killing their process groups."""

    def __init__(self, model: Path, out: Path, max_restarts: int = 0):
        rdzv, self.port = free_port(), free_port()
        self.agents = []
        for node in range(2):
            command = [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"),
                *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv}"),
                *("--max-restarts", str(max_restarts), "-m", "hsdp.cli", "serve", str(model)),
                *("--use-hsdp", "--hsdp-shard-size", "2", "--port", str(self.port), "--output-dir", str(out)),
            ]
            log = open(out.parent / f"node{node}.log", "wb")  # noqa: SIM115  (closed with the agent)
            # A fresh store per rendezvous round, as docs/serving.md says (torch's shared one keeps a dead
            # round's addresses, and a restarted group may read them).
            env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
            self.agents.append(
                subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
                )
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def health(self) -> int | None:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code
        except httpx.HTTPError:
            return None

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while self.health() != 200:
            assert time.monotonic() < deadline, "the two-node server did not become ready"
            assert all(a.poll() is None for a in self.agents), "a torchrun agent ended"
            time.sleep(0.2)

    def follower(self) -> psutil.Process:
        """The rank-1 worker process (the agent that does not serve HTTP)."""
        for agent in self.agents:
            for child in psutil.Process(agent.pid).children():
                if not any(c.laddr.port == self.port for c in child.net_connections("tcp")):
                    return child
        raise AssertionError("no follower rank found")

    def stop(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


@pytest.fixture
def two_nodes(tmp_path):
    started: list[TwoNodes] = []

    def start(model: Path, max_restarts: int = 0) -> TwoNodes:
        (tmp_path / "out").mkdir(exist_ok=True)
        nodes = TwoNodes(model, tmp_path / "out", max_restarts)
        started.append(nodes)
        nodes.wait_ready()
        return nodes

    yield start
    for nodes in started:
        nodes.stop()


def _streamed(client: httpx.Client, body: dict) -> str:
    text = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


def test_causal_lm_over_two_nodes_equals_one_process(two_nodes, tmp_path):
    from transformers import AutoTokenizer

    llama = builtin("tiny-llama", tmp_path / "cache")
    nodes = two_nodes(llama)
    body = {"prompt": "Two nodes", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=nodes.url, timeout=120) as client:
        plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        streamed = _streamed(client, body)
    tokens = reference_tokens(llama, "Two nodes", 0, SamplingParams(max_new_tokens=8, temperature=0.0))
    want = AutoTokenizer.from_pretrained(llama).decode(tokens, skip_special_tokens=True)
    assert plain == streamed == want


def _poll_through_restarts(nodes: TwoNodes, video_id: str, timeout_s: float = 240) -> dict:
    """The job's record once finished; connection errors while the group restarts are waited out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            job = httpx.get(f"{nodes.url}/v1/videos/{video_id}", timeout=2).json()
            if job["status"] in ("completed", "failed", "cancelled"):
                return job
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"video {video_id} did not finish in {timeout_s}s")


def test_video_over_two_nodes_survives_a_dead_node(two_nodes, tmp_path):
    wan = builtin("tiny-wan", tmp_path / "cache")
    nodes = two_nodes(wan, max_restarts=1)
    with httpx.Client(base_url=nodes.url, timeout=120) as client:
        synced = client.post("/v1/videos/sync", json={"prompt": "a red fox", "seed": 3, **SMALL})
        jobs = [
            client.post("/v1/videos", json={"prompt": "a red fox", "seed": 3 + i, **SMALL}).json()
            for i in range(6)
        ]
    params = SamplingParams(seed=3, **{k: v for k, v in SMALL.items() if k != "fps"})
    frames = reference_video(wan, "a red fox", 3, params, inspect_model(wan).defaults)
    save_frames(frames, tmp_path / "reference.mp4", fps=SMALL["fps"])
    assert synced.status_code == 200 and synced.content == (tmp_path / "reference.mp4").read_bytes()

    nodes.follower().kill()  # the second node's rank, while the jobs are queued or running
    killed, killed_at = time.monotonic(), time.time()
    while nodes.health() == 200:
        time.sleep(0.05)
    noticed_s = time.monotonic() - killed
    finished = [_poll_through_restarts(nodes, job["id"]) for job in jobs]
    assert noticed_s < 2.0, f"/health still said ready {noticed_s:.2f}s after the node died"
    assert [j["status"] for j in finished] == ["completed"] * 6, finished
    assert any(j["completed_at"] > killed_at for j in finished), "every job ended before the kill"
    with httpx.Client(base_url=nodes.url, timeout=120) as client:
        first = client.get(f"/v1/videos/{jobs[0]['id']}/content").content
    assert first == synced.content  # seed 3 again, after the restart: the same bytes
