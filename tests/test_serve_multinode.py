"""``hsdp serve`` over two torchrun "nodes" on this machine (:class:`hsdp.serve.local.LocalNodes`: ``torchrun
--nnodes 2 --nproc-per-node P`` twice, c10d rendezvous on a free localhost port): global rank 0 serves HTTP and
leads, the other ranks follow (:mod:`hsdp.engine.leader`).

Outputs are compared with one process on the same input and seed (which the single-host server equals, see
tests/test_serve.py): streamed and plain completions, and ``/v1/videos/sync``'s mp4 bytes (the frames written by the
server's own writer), over 2 x 1 ranks (HSDP shard 2) and 2 x 2 (HSDP replicate 2 x shard 2). Killing the ranks of
the node without rank 0 (2 x 2): ``/health`` leaves "ready" within 2 s, torchrun (``--max-restarts``) restarts the group,
and every accepted video job completes with the same bytes as before; a synchronous request running at the kill is
answered 503 with ``Retry-After`` (rank 0's process is restarted too) and, sent again, equals one process. A
request the pipeline refuses on every rank fails alone (500, or a failed job), and the same ranks serve the next
request.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from hsdp.engine import SamplingParams
from hsdp.engine.model_info import inspect_model
from hsdp.engine.outputs import encode_image, save_frames
from hsdp.serve.local import LocalNodes
from tests.compose_hosts import wait_in_progress
from tests.engine_refs import builtin, reference_tokens, reference_video

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="two torchrun agents")]

SMALL = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 2, "fps": 16}
SHARD_2 = ("--use-hsdp", "--hsdp-shard-size", "2")


@pytest.fixture
def local_nodes(tmp_path):
    """``local_nodes(model, max_restarts=0, nproc_per_node=1)``: a started :class:`LocalNodes` of two nodes (HSDP
    over every rank, shard size 2 unless ``args`` says otherwise), stopped at the end of the test."""
    started: list[LocalNodes] = []

    def start(
        model: Path,
        max_restarts: int = 0,
        nproc_per_node: int = 1,
        args: tuple = SHARD_2,
        env: dict[str, str] | None = None,
    ) -> LocalNodes:
        (tmp_path / "out").mkdir(exist_ok=True)
        nodes = LocalNodes(
            str(model),
            [*args, "--output-dir", str(tmp_path / "out")],
            log_dir=tmp_path,
            nproc_per_node=nproc_per_node,
            max_restarts=max_restarts,
            env=env,
        )
        started.append(nodes)
        return nodes.start()

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


def test_causal_lm_over_two_nodes_equals_one_process(local_nodes, tmp_path):
    from transformers import AutoTokenizer

    llama = builtin("tiny-llama", tmp_path / "cache")
    nodes = local_nodes(llama)
    body = {"prompt": "Two nodes", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=nodes.url, timeout=120) as client:
        plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        streamed = _streamed(client, body)
    tokens = reference_tokens(llama, "Two nodes", 0, SamplingParams(max_new_tokens=8, temperature=0.0))
    want = AutoTokenizer.from_pretrained(llama).decode(tokens, skip_special_tokens=True)
    assert plain == streamed == want


def _poll_through_restarts(nodes: LocalNodes, video_id: str, timeout_s: float = 240) -> dict:
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


def _submit_through_restarts(nodes: LocalNodes, client: httpx.Client, body: dict) -> str:
    """The id of a job ``POST /v1/videos`` stored. A job that kills its ranks may start, and torchrun restart the
    group with rank 0's HTTP server, before the answer's body is written (seen on a loaded host: "peer closed
    connection"); the job is on disk by then, so the restarted server lists it."""
    listed = lambda: {job["id"] for job in httpx.get(f"{nodes.url}/v1/videos", timeout=30).json()["data"]}  # noqa: E731
    before = listed()
    try:
        return client.post("/v1/videos", json=body).json()["id"]
    except (httpx.RemoteProtocolError, httpx.ReadError):
        nodes.wait_healthy(120)
        (new,) = listed() - before
        return new


def _reference_mp4(wan: Path, tmp_path: Path) -> bytes:
    """The video of "a red fox", seed 3, ``SMALL`` from one process's frames, encoded by the server's writer."""
    params = SamplingParams(seed=3, **{k: v for k, v in SMALL.items() if k != "fps"})
    frames = reference_video(wan, "a red fox", 3, params, inspect_model(wan).defaults)
    return save_frames(frames, tmp_path / "reference.mp4", fps=SMALL["fps"]).read_bytes()


def test_video_over_two_nodes_of_two_ranks_equals_one_process_and_survives_a_dead_node(local_nodes, tmp_path):
    """2 x 2: HSDP replicate 2 x shard 2 over 4 ranks, the shard axis within a node, the replicate axis across;
    its mp4 equals one process's. Then the node without rank 0 dies (both its ranks): queued video jobs outlive
    the restart and complete. A synchronous request running at the kill cannot wait for its re-run: torchrun
    restarts rank 0's process (the HTTP server) with the others, and the client's connection with it. It is
    answered at once, 503 with ``Retry-After`` (before: the connection dropped), and sent again after the restart
    it gives the one-process image. So is one running when torchrun stops the job. (One group of nodes for both:
    the 2 x 1 layout restarts in test_a_failing_request_fails_alone_over_two_nodes.)"""
    wan = builtin("tiny-wan", tmp_path / "cache")
    hsdp_2x2 = ("--use-hsdp", "--hsdp-replicate-size", "2", "--hsdp-shard-size", "2")
    nodes = local_nodes(wan, max_restarts=1, nproc_per_node=2, args=hsdp_2x2)
    assert sorted(nodes.ranks()) == [0, 1, 2, 3] and {n for n, _ in nodes.ranks().values()} == {0, 1}
    image = {"prompt": "a cat", "seed": 5, "size": "32x32", "num_inference_steps": 20}
    with httpx.Client(base_url=nodes.url, timeout=120) as client, ThreadPoolExecutor(1) as pool:
        synced = client.post("/v1/videos/sync", json={"prompt": "a red fox", "seed": 3, **SMALL})
        in_flight = pool.submit(client.post, "/v1/images/generations", json=image)
        wait_in_progress(client)
        jobs = [
            client.post("/v1/videos", json={"prompt": "a red fox", "seed": 3 + i, **SMALL}).json()
            for i in range(6)
        ]
        assert nodes.kill_node(1 - nodes.head_node())  # the node without rank 0, while the jobs wait or run
        killed, killed_at = time.monotonic(), time.time()
        while nodes.health() == 200:
            time.sleep(0.05)
        noticed_s = time.monotonic() - killed
        answered = in_flight.result()
    assert synced.status_code == 200 and synced.content == _reference_mp4(wan, tmp_path)
    assert answered.status_code == 503 and answered.json()["error"]["code"] == "restarting", answered.text
    assert int(answered.headers["Retry-After"]) >= 5
    finished = [_poll_through_restarts(nodes, job["id"]) for job in jobs]
    with httpx.Client(base_url=nodes.url, timeout=120) as client, ThreadPoolExecutor(1) as pool:
        again = client.post("/v1/images/generations", json=image)
        first = client.get(f"/v1/videos/{jobs[0]['id']}/content").content
        in_flight = pool.submit(client.post, "/v1/images/generations", json=image)
        wait_in_progress(client)
        nodes.stop()  # torchrun stops every rank (SIGTERM): the same answer, not a connection held, then dropped
        stopped = in_flight.result()
    assert stopped.status_code == 503 and stopped.json()["error"]["code"] == "restarting", stopped.text
    params = SamplingParams(seed=5, height=32, width=32, num_frames=1, num_inference_steps=20)
    frames = reference_video(wan, "a cat", 5, params, inspect_model(wan).defaults)
    assert again.status_code == 200, again.text
    assert base64.b64decode(again.json()["data"][0]["b64_json"]) == encode_image(frames[0], ".png")
    assert noticed_s < 2.0, f"/health still said ready {noticed_s:.2f}s after the node died"
    assert [j["status"] for j in finished] == ["completed"] * 6, finished
    assert any(j["completed_at"] > killed_at for j in finished), "every job ended before the kill"
    assert first == synced.content  # seed 3 again, after the restart: the same bytes


def test_a_failing_request_fails_alone_over_two_nodes(local_nodes, tmp_path):
    """Fault injection (tests/fault_injection): the pipeline raising on every rank (a prompt with
    "raise-valueerror") fails that request only: 500 for the synchronous route, a failed job after one attempt for
    the queued one, and the same ranks serve the next request (issue 27 item 1; before, no answer for 30 s, then
    both agents exited, or with --max-restarts the job was queued again after the restart and crashed it again).
    A job that kills its ranks ("poison") costs one torchrun restart per attempt: with --max-attempts 1 it is
    failed after the restart, not run again, and the server serves on."""
    wan = builtin("tiny-wan", tmp_path / "cache")
    faults = str(Path(__file__).parent / "fault_injection")
    env = {
        "HSDP_TEST_FAULTS": "1",
        "HSDP_TEST_POISON": "1",
        "PYTHONPATH": os.pathsep.join([faults, os.environ.get("PYTHONPATH", "")]),
    }
    nodes = local_nodes(wan, max_restarts=1, args=(*SHARD_2, "--max-attempts", "1"), env=env)
    ranks = nodes.ranks()
    refuse = {"prompt": "raise-valueerror", "seed": 1, **SMALL}
    fox = {"prompt": "a red fox", "seed": 3, **SMALL}
    with httpx.Client(base_url=nodes.url, timeout=120) as client:
        refused = client.post("/v1/videos/sync", json=refuse)
        queued = client.post("/v1/videos", json=refuse).json()
        job = _poll_through_restarts(nodes, queued["id"], timeout_s=120)
        synced = client.post("/v1/videos/sync", json=fox)
        ranks_after = nodes.ranks()
        poison = _submit_through_restarts(nodes, client, {**refuse, "prompt": "poison"})
    poisoned = _poll_through_restarts(nodes, poison)
    nodes.wait_healthy(120)
    with httpx.Client(base_url=nodes.url, timeout=120) as client:
        again = client.post("/v1/videos/sync", json=fox)
    assert refused.status_code == 500 and "injected: the pipeline refuses" in refused.json()["error"]["message"]
    assert (job["status"], job["error"]["code"], job["attempts"]) == ("failed", "generation_error", 1), job
    assert synced.status_code == 200 and synced.content == _reference_mp4(wan, tmp_path)
    assert ranks_after == ranks  # no rank was restarted for the refusals
    assert (poisoned["status"], poisoned["attempts"]) == ("failed", 1), poisoned
    assert "(attempt 1 of 1)" in poisoned["error"]["message"]
    assert nodes.ranks() != ranks and again.status_code == 200 and again.content == synced.content
