"""``hsdp serve`` parts that need no model and no server: the job queue and its records, limits, text helpers,
metrics. The end-to-end behaviour over HTTP is in test_serve.py."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time

import pytest

from hsdp.launch import WorkerDiedError, WorkerRaised, WorkerTimeout
from hsdp.serve.jobs import Job, JobStore, QueueFull, Unavailable
from hsdp.serve.metrics import render_metrics
from hsdp.serve.routes.common import _raise_failure
from hsdp.serve.runner import RunnerStats
from hsdp.serve.schemas import (
    ApiError,
    ChatMessage,
    CompletionRequest,
    VideoRequest,
    check_limits,
    parse_size,
)
from hsdp.serve.settings import ServeLimits, ServeSettings
from hsdp.serve.text import TextStream, apply_stop, chat_prompt

VIDEO = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 1}


def _job(kind: str = "video", seed: int = 0, **params) -> Job:
    return Job(kind, f"prompt {seed}", {**VIDEO, **params}, seed, meta={"fps": 8})


def test_queue_bound_refuses_whole_request_with_retry_estimate(tmp_path):
    store = JobStore(tmp_path, capacity=3)
    store.submit([_job(seed=i) for i in range(2)])
    with pytest.raises(QueueFull) as info:
        store.submit([_job(seed=5), _job(seed=6)])  # all-or-nothing: 2 + 2 > 3
    assert info.value.retry_after_s >= 1
    assert store.depth() == 2
    store.submit([_job(seed=7)])
    assert store.depth() == 3


def test_batches_take_compatible_jobs_in_order(tmp_path):
    store = JobStore(tmp_path, capacity=10)
    a, b, c, d = _job(seed=1), _job(seed=2, num_inference_steps=2), _job("video_sync", seed=3), _job(seed=4)
    store.submit([a, b, c, d])
    batch = store.next_batch(2, timeout_s=0)
    assert batch == [a, c]  # video_sync has the same engine parameters as video; b differs in steps
    assert all(j.status == "in_progress" for j in batch)
    assert store.next_batch(2, timeout_s=0) == [b]
    assert store.next_batch(2, timeout_s=0) == [d]
    assert store.next_batch(2, timeout_s=0.01) == []


def test_cancel_queued_and_running(tmp_path):
    store = JobStore(tmp_path, capacity=10)
    running, queued = _job(seed=1), _job(seed=2, num_inference_steps=3)
    store.submit([running, queued])
    assert store.next_batch(1, timeout_s=0) == [running]
    store.cancel(queued, "by test")
    assert queued.status == "cancelled" and queued.finished and store.depth() == 0
    store.cancel(running, "by test")
    assert running.status == "cancelled" and not running.finished  # the engine still holds it
    store.finish(running, "completed", output="x.mp4")
    assert running.status == "cancelled" and running.finished  # cancellation wins over the late result


def test_records_survive_a_restart(tmp_path):
    store = JobStore(tmp_path, capacity=10)
    done, running, waiting, lost = (_job(seed=i) for i in range(4))
    store.submit([done, running, waiting, lost])
    store.next_batch(1, timeout_s=0)
    (store.videos_dir / f"{done.id}.mp4").write_bytes(b"mp4")
    store.finish(done, "completed", output=f"{done.id}.mp4")
    store.next_batch(1, timeout_s=0)  # running: in progress when the server "stops"
    store.next_batch(1, timeout_s=0)  # waiting: taken, then put back below as if never started
    waiting.status = "queued"
    store._save(waiting)
    lost_record = lost.record() | {
        "status": "completed",
        "output": "missing.mp4",
        "completed_at": time.time(),
    }
    (store.jobs_dir / f"{lost.id}.json").write_text(json.dumps(lost_record))

    spent = _job(seed=5)  # ran its last attempt when the server stopped
    (store.jobs_dir / f"{spent.id}.json").write_text(
        json.dumps(spent.record() | {"status": "in_progress", "attempts": 3})
    )

    again = JobStore(tmp_path, capacity=10, max_attempts=3)
    assert again.load() == (5, 2)
    assert again.get(done.id).status == "completed" and again.get(done.id).output == f"{done.id}.mp4"
    # The job that was running runs again (its seed is in the record), before the one that waited behind it.
    assert again.get(running.id).status == "queued" and again.get(running.id).attempts == 1
    assert again.get(spent.id).status == "failed" and again.get(spent.id).error["code"] == "server_restarted"
    assert "(attempt 3 of 3)" in again.get(spent.id).error["message"]
    assert again.get(lost.id).error["code"] == "output_missing"
    assert [j.id for j in again.next_batch(4, timeout_s=0)] == [running.id, waiting.id]
    assert again.get(running.id).attempts == 2


def test_a_torchrun_restart_ends_the_in_memory_jobs_and_keeps_the_persistent_ones(tmp_path):
    """Rank 0 is about to be replaced: each synchronous job, running or queued, ends now with the reason (its
    handler answers 503), the batch's later end leaves it so, new ones are refused, video jobs stay queued."""
    store = JobStore(tmp_path, capacity=10)
    running, video, queued = _job("video_sync", seed=1), _job(seed=2), _job("image", seed=3, num_inference_steps=2)
    store.submit([running, video, queued])
    assert store.next_batch(2, timeout_s=0) == [running, video]
    error = {"code": "restarting", "message": "a torchrun rank was lost", "retry_after_s": 7}
    assert store.fail_transient(error) == [queued, running]
    assert all(j.finished and j.status == "failed" and j.error == error for j in (running, queued))
    with pytest.raises(ApiError) as answer:  # what the waiting handler answers
        _raise_failure([running])
    assert (answer.value.status, answer.value.code, answer.value.headers) == (503, "restarting", {"Retry-After": "7"})
    store.retry([running, video], {"code": "worker_died", "message": "rank 1 died"})  # the interrupted batch
    assert running.status == "failed" and video.status == "queued" and store.depth() == 1
    with pytest.raises(Unavailable) as info:
        store.submit([_job("image", seed=4)])
    assert info.value.error == error
    store.submit([_job(seed=5)])  # kept on disk for the next rank 0
    assert store.depth() == 2


def test_ephemeral_jobs_leave_no_record(tmp_path):
    store = JobStore(tmp_path, capacity=10)
    job = _job("image")
    store.submit([job])
    assert store.get(job.id) is None and not list(store.jobs_dir.iterdir())


def test_limits_name_the_flag():
    limits = ServeLimits(max_prompt_chars=10, max_side=64, max_frames=9, max_steps=2)
    request = VideoRequest(prompt="x" * 11, num_frames=13, num_inference_steps=3)
    with pytest.raises(ApiError) as info:
        check_limits(request, limits, width=128, height=32)
    message = info.value.message
    for flag in ("--max-prompt-chars", "--max-side", "--max-frames", "--max-steps"):
        assert flag in message
    assert info.value.status == 400
    with pytest.raises(ApiError, match="--max-new-tokens"):
        check_limits(CompletionRequest(prompt="hi", max_tokens=5000), limits)
    with pytest.raises(ApiError, match="non-empty"):
        check_limits(CompletionRequest(prompt=["a", ""]), limits)


def test_size_and_width_height():
    assert parse_size("48x32", None, None) == (48, 32)
    assert parse_size(None, 16, None) == (16, None)
    assert parse_size("48x32", 48, 32) == (48, 32)
    with pytest.raises(ApiError, match="disagrees"):
        parse_size("48x32", 64, None)


def test_settings_problems_name_flags():
    problems = ServeSettings(model="m", max_queue=0, job_timeout_s=0, api_key=" ").problems()
    assert any("--max-queue" in p for p in problems) and any("--job-timeout" in p for p in problems)
    assert any("--api-key" in p for p in problems)


def test_stop_strings_and_streamed_pieces():
    from hsdp.models.tiny import build_byte_tokenizer

    assert apply_stop("hello world", [" wor", "xyz"]) == ("hello", True)
    assert apply_stop("hello", None) == ("hello", False)
    tokenizer = build_byte_tokenizer()
    text = "héllo ✓"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def stream(stop):
        live = TextStream(tokenizer, stop)
        pieces = [live.update(ids[:n], final=False) for n in range(1, len(ids) + 1)]
        return pieces + [live.update(ids, final=True)], live.stopped

    pieces, stopped = stream(None)  # one token at a time, as the ranks produce them
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) and not stopped
    assert all("\ufffd" not in p for p in pieces) and sum(bool(p) for p in pieces) > 3
    pieces, stopped = stream(["llo"])  # held back while it may be a stop string, then cut before it
    assert "".join(pieces) == "hé" and stopped
    messages = [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content=[{"type": "text", "text": "hi"}]),
    ]
    assert chat_prompt(tokenizer, messages) == "system: be brief\nuser: hi\nassistant:"


def test_metrics_are_valid_prometheus_text(tmp_path):
    store = JobStore(tmp_path, capacity=4)
    store.submit([_job()])
    stats = RunnerStats(
        state="ready", peak_memory_bytes=[10, 20], memory_kind="cpu peak RSS", worker_pids=[11, 12]
    )
    text = render_metrics('m"x', store, stats)
    sample = re.compile(r'^[a-z_]+(\{([a-z_]+="([^"\\]|\\.)*",?)*\})? -?[0-9.e+-]+$')
    for line in text.splitlines():
        assert line.startswith("# ") or sample.match(line), line
    assert 'hsdp_queue_depth{model="m\\"x"} 1' in text
    assert 'hsdp_rank_peak_memory_bytes{model="m\\"x",rank="1",kind="cpu peak RSS"} 20' in text
    assert 'hsdp_worker_info{model="m\\"x",rank="1",pid="12"} 1' in text
    assert "hsdp_quantized_weight_fraction" not in text  # no --weight-dtype: no 8-bit series
    share = {"linear_weights": 10, "quantized_weights": 7, "quantized_fraction": 0.8125}
    text = render_metrics("m", store, stats, quantized=share)
    assert all(line.startswith("# ") or sample.match(line) for line in text.splitlines())
    assert 'hsdp_quantized_weight_fraction{model="m"} 0.8125' in text
    assert 'hsdp_linear_weights{model="m",stored="8bit"} 7' in text
    assert 'hsdp_linear_weights{model="m",stored="dtype"} 3' in text


class _FakeEngine:
    """Engine stand-in: the runner's contract (request_slots, pids, closed, generate, cancel, kill_workers,
    last_heard, close) without workers. ``body(engine, prompts, params, on_token)``, when given, runs in the
    call before the outputs are made (slow phases, tokens, failures)."""

    def __init__(
        self, error: Exception | None = None, poison: str | None = None, kind="causal_lm", body=None
    ):
        self.error, self.closed, self.request_slots, self.pids, self.calls = error, False, 2, [101, 102], []
        self.poison = poison
        """Only a batch holding this prompt fails (a job that breaks the workers every time)."""
        self.kind, self.body = kind, body
        self.call_id, self.cancels, self.batches, self.adapters = 0, [], [], []
        self.last_heard: float | None = None
        self.killed = threading.Event()
        self.cancel_gate: threading.Event | None = None

    def ping(self, timeout_s):
        pass

    def generate(
        self, prompts, params, on_progress=None, on_token=None, on_start=None, batch_size=1, **adapter
    ):
        from hsdp.engine import GenerationOutput, Timings

        self.call_id += 1
        self.adapters.append(adapter)
        if on_start is not None:
            on_start(self.call_id)
        self.calls.append((list(prompts), list(params.seed)))
        self.batches.append((batch_size, params.negative_prompt))
        for step in range(1, 5):  # as the engine does after each denoising step of each request
            for request_id in range(len(prompts)):
                on_progress(request_id, step, 4)
        if self.body is not None:
            self.body(self, prompts, params, on_token)
        if self.error is not None and (self.poison is None or self.poison in prompts):
            self.closed = self.closed or not isinstance(self.error, WorkerRaised)  # as Engine.generate does
            raise self.error
        cancelled = {r for r, c in self.cancels if c == self.call_id}
        return [
            GenerationOutput(
                i,
                p,
                s,
                Timings(total_s=0.1, step_s=[0.05]),
                [1, 2],
                "test",
                text=p.upper(),
                token_ids=[i],
                cancelled=i in cancelled,
            )
            for i, (p, s) in enumerate(zip(prompts, params.seed, strict=True))
        ]

    def cancel(self, request_id, call_id=None):
        if self.cancel_gate is not None:  # hold the cancel back until the next call started (a forced race)
            self.cancel_gate.wait(10)
        self.cancels.append((request_id, self.call_id if call_id is None else call_id))

    def kill_workers(self):
        self.killed.set()

    def close(self):
        self.closed = True


class _RecordingStore(JobStore):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.progress_seen: dict[str, list[int]] = {}

    def set_progress(self, job: Job, percent: int, step: int = 0, steps: int | None = None) -> None:
        super().set_progress(job, percent, step, steps)
        self.progress_seen.setdefault(job.id, []).append(job.progress)


@pytest.mark.parametrize(
    "error, attempts, failures",
    [
        (WorkerDiedError("generate: worker rank 1 died (rank 1: exit code -9)", rank=1), 2, 1),
        # A batch past --job-timeout: which job overran is unknown, so each runs alone; that run is not counted.
        (WorkerTimeout("generate did not finish within 600s on ranks [0, 1]"), 1, 0),
    ],
)
def test_runner_runs_an_interrupted_batch_again_alone_after_a_restart(tmp_path, error, attempts, failures):
    from hsdp.serve.runner import EngineRunner

    engines = []

    def make_engine():
        engines.append(_FakeEngine(error if not engines else None))
        return engines[-1]

    store = _RecordingStore(tmp_path, capacity=10)
    a, b = (Job("text", f"p{i}", {"max_new_tokens": 4}, seed=10 + i) for i in range(2))
    runner = EngineRunner(make_engine, store, poll_s=0.05)
    runner.start()
    try:
        store.submit([a, b])
        _wait_finished([a, b])
    finally:
        runner.stop()
    assert a.status == b.status == "completed" and (a.result.text, b.result.text) == ("P0", "P1")
    assert a.attempts == b.attempts == attempts and store.requeued == 2
    # The failed batch ran side by side; after the restart each job runs alone (padded), with its own seed.
    assert engines[0].calls == [(["p0", "p1"], [10, 11])]
    assert engines[1].calls == [(["p0", "p0"], [10, 10]), (["p1", "p1"], [11, 11])]
    # The engine's per-step callback drives progress; 100 waits for the end (decode and encoding follow).
    assert store.progress_seen[b.id][-4:] == [25, 50, 75, 99] and b.progress == 100
    assert b.steps == 4  # step k of n as the pipeline counts them (what /v1/jobs reports)
    assert (runner.stats.restarts, runner.stats.worker_failures, runner.stats.padded_requests) == (
        1,
        failures,
        2,
    )
    assert engines[1].closed and runner.stats.state == "stopped"


def test_a_job_that_breaks_the_workers_every_time_fails_alone(tmp_path):
    from hsdp.serve.runner import EngineRunner

    engines = []

    def make_engine():
        engines.append(_FakeEngine(WorkerDiedError("generate: worker rank 0 died", rank=0), poison="bad"))
        return engines[-1]

    store = JobStore(tmp_path, capacity=10, max_attempts=3)
    bad, good, later = (
        Job("text", p, {"max_new_tokens": 4}, seed=i) for i, p in enumerate(["bad", "ok", "z"])
    )
    runner = EngineRunner(make_engine, store, poll_s=0.05)
    runner.start()
    try:
        store.submit([bad, good])
        store.submit([later])
        _wait_finished([bad, good, later])
    finally:
        runner.stop()
    assert bad.status == "failed" and bad.attempts == 3
    assert bad.error["code"] == "worker_died" and "(attempt 3 of 3)" in bad.error["message"]
    assert good.status == later.status == "completed" and good.attempts == 2 and later.attempts == 1


def _wait_finished(jobs: list[Job], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(j.finished for j in jobs):
        assert time.monotonic() < deadline, [(j.prompt, j.status) for j in jobs]
        time.sleep(0.01)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["no-such-model"], "neither an existing path nor a built-in model"),
        (["tiny-llama", "--max-queue", "0"], "--max-queue 0 must be >= 1"),
        (["tiny-llama", "--max-frames", "0"], "--max-frames 0 must be >= 1"),
        (["tiny-llama", "--use-hsdp", "--ulysses-degree", "2"], "causal LMs run with HSDP"),
        (["tiny-llama", "--max-batch-size", "2"], "--max-batch-size 2: causal LMs run one request at a time"),
        (["tiny-llama", "--host", "no.such.host.invalid"], "--host no.such.host.invalid: not an address"),
    ],
)
def test_cli_refuses_bad_input_before_serving(tmp_path, capsys, monkeypatch, argv, needle):
    """Each refusal comes before the model loads (issue 27 item 17: --max-batch-size on a causal LM was refused
    only after loading it)."""
    from hsdp.cli import main

    monkeypatch.setattr("hsdp.engine.engine.WorkerGroup", _no_ranks)
    assert main(["serve", *argv, "--output-dir", str(tmp_path), "--port", "0"]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("name", ["default", "tiny-flux", "base"])
def test_an_adapter_named_like_the_base_is_refused_at_start(tmp_path, capsys, monkeypatch, name):
    """Issue 33 item 4: ``--lora default=DIR`` (or the served model's name) was accepted at start-up, and then a
    request for the base (``model: "default"``) got the adapter; the run-time load already refused such names."""
    from hsdp.cli import main

    monkeypatch.setattr("hsdp.engine.engine.WorkerGroup", _no_ranks)
    argv = ["serve", "tiny-flux", "--served-model-name", "base", "--lora", f"{name}={tmp_path}"]
    assert main([*argv, "--output-dir", str(tmp_path / "out"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"--lora: the adapter name {name!r} is what requests say for the base model" in err, err
    assert f"--lora {name}-lora=DIR" in err


def _no_ranks(*args, **kwargs):
    raise AssertionError("ranks started to load the model before the refusal")


def test_cli_refuses_a_busy_port_and_a_file_as_output_dir_before_loading(tmp_path, capsys, monkeypatch):
    """A port in use is exit 2 before the model loads (issue 27 item 11: it loaded, said "serving", then exited
    3), and so is an --output-dir that is a file (item 13: a NotADirectoryError traceback)."""
    import socket

    from hsdp.cli import main

    monkeypatch.setattr("hsdp.engine.engine.WorkerGroup", _no_ranks)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "tiny-llama", "--output-dir", str(tmp_path), "--port", str(port)]) == 2
    assert f"--port {port} on 127.0.0.1: cannot listen there" in capsys.readouterr().err
    (tmp_path / "file").write_text("not a folder")
    for output_dir in (tmp_path / "file", tmp_path / "file" / "sub"):
        assert main(["serve", "tiny-llama", "--output-dir", str(output_dir), "--port", "0"]) == 2
        assert f"--output-dir {output_dir}: {tmp_path / 'file'} is a file" in capsys.readouterr().err


def test_wait_healthy_retries_until_its_deadline(tmp_path):
    """A server that does not answer (restarting, or gone) is asked again until the deadline, then TimeoutError."""
    from hsdp.serve.local import LocalServer, free_port

    server = LocalServer("tiny-wan", log=tmp_path / "server.log")
    server.port = free_port()  # nothing listens there: every request fails to connect
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="not healthy within 1"):
        server.wait_healthy(timeout_s=1)
    assert 1 <= time.monotonic() - started < 10


def test_progress_is_recorded_and_only_rises(tmp_path):
    store = JobStore(tmp_path, capacity=4)
    job = _job()
    store.submit([job])
    store.next_batch(1, timeout_s=0)
    store.set_progress(job, 40)
    store.set_progress(job, 30)  # a late callback never moves it back
    assert job.progress == 40
    assert json.loads((store.jobs_dir / f"{job.id}.json").read_text())["progress"] == 40
    store.finish(job, "completed", output="x.mp4")
    assert job.progress == 100


def test_input_images_are_stored_beside_the_record(tmp_path):
    store = JobStore(tmp_path, capacity=4)
    job = Job("video", "p", VIDEO, 1, meta={"fps": 8}, inputs={"image": b"\x89PNG..."})
    store.submit([job])
    assert (store.jobs_dir / f"{job.id}.image").read_bytes() == b"\x89PNG..."
    again = JobStore(tmp_path, capacity=4)
    assert again.load() == (1, 1)
    assert again.get(job.id).inputs == {"image": b"\x89PNG..."}
    again.delete(again.get(job.id))
    assert not list(again.jobs_dir.iterdir())


def test_seconds_become_frames_of_the_model_rule():
    assert VideoRequest(prompt="x", seconds=2).frames(4, 8) == 17  # 16 frames, rounded to 4k+1
    assert VideoRequest(prompt="x", seconds=2).frames(1, 8) == 16
    assert VideoRequest(prompt="x", seconds=2, num_frames=9).frames(4, 8) == 9


def _png(size: int = 8) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_chat_generation_merges_extra_body_and_reads_image_parts():
    import base64

    from hsdp.serve.media import chat_generation
    from hsdp.serve.schemas import ChatCompletionRequest

    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    body = ChatCompletionRequest.model_validate(
        {
            "model": "default",
            "seed": 3,
            "messages": [
                {"role": "system", "content": "ignored"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a fox"},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                },
                {"role": "user", "content": "in snow"},
            ],
            "num_inference_steps": 2,  # flattened by the openai client
            "cfg_scale": 4.0,
            "extra_body": {"num_inference_steps": 3, "num_outputs_per_prompt": 2, "size": "32x32"},
        }
    )
    params, image = chat_generation(body)
    assert params.prompt == "a fox in snow"
    assert (params.num_inference_steps, params.num_outputs_per_prompt, params.size) == (3, 2, "32x32")
    assert (params.true_cfg_scale, params.seed) == (4.0, 3)
    assert image.field == "messages[1].content[1].image_url" and image.data == _png()


@pytest.mark.parametrize(
    "url, needle",
    [
        ("https://example.com/a.png", "fetches no http"),
        ("data:image/png,abc", "must be base64"),
        ("data:image/png;base64,@@@", "not valid base64"),
    ],
)
def test_data_urls_name_the_field(url, needle):
    from hsdp.serve.media import decode_data_url

    with pytest.raises(ApiError, match=needle) as info:
        decode_data_url(url, "input_reference")
    assert info.value.param == "input_reference" and info.value.status == 400


# -- issue 21: supervision of the engine thread ------------------------------------------------------------------
def _runner(tmp_path, store=None, *, engines=None, **engine_kwargs):
    """A runner over fresh fake engines (one per start or restart), started; ``engines`` collects them."""
    from hsdp.serve.runner import EngineRunner

    engines = [] if engines is None else engines

    def make_engine():
        engines.append(_FakeEngine(**engine_kwargs))
        return engines[-1]

    runner = EngineRunner(make_engine, store or JobStore(tmp_path, capacity=16), poll_s=0.05)
    return runner, engines


def _text_job(prompt: str, seed: int = 0, **fields) -> Job:
    return Job("text", prompt, {"max_new_tokens": 4}, seed=seed, **fields)


def _run_in_batches_of_two(tmp_path, jobs: list[Job]):
    """Run ``jobs`` through a diffusion runner with ``--max-batch-size 2`` on a fake engine; all must complete.
    Returns the engine, which recorded its calls."""
    store = JobStore(tmp_path, capacity=len(jobs))
    store.submit(jobs)
    runner, engines = _runner(tmp_path, store, kind="diffusion")
    runner.max_batch_size = 2
    runner.start()
    try:
        _wait_finished(jobs)
    finally:
        runner.stop()
    assert all(j.status == "completed" for j in jobs)
    return engines[0]


def test_max_batch_size_batches_given_and_absent_inputs_apart(tmp_path):
    """Issue 21 items 1 and 10: a job without a negative prompt (or without an image) among jobs with one used to
    make the whole batch run one request at a time (or, request-parallel, ranks run different forwards)."""
    kinds = [{}, {"negative_prompt": "blurry"}, {"inputs": {"image": b"png"}}]
    engine = _run_in_batches_of_two(tmp_path, [_text_job(f"p{i}", i, **kinds[i % 3]) for i in range(12)])
    calls = engine.calls
    assert len(calls) == 3 and all(len(prompts) == 4 for prompts, _ in calls)  # 2 slots x batch 2, no padding
    for (prompts, _), (batch_size, negative) in zip(calls, engine.batches, strict=True):
        kind = {int(p[1:]) % 3 for p in prompts}
        assert len(kind) == 1 and batch_size == 2, prompts
        assert negative == (["blurry"] * 4 if kind == {1} else None)


def test_max_batch_size_batches_each_set_of_adapters_apart(tmp_path):
    """Issue 26 item 4: a request composing adapters (``lora`` a list) never shares an engine call with one naming
    another adapter, the same ones in another order or other scales, or none; each call gets its jobs' set."""
    choices = [
        {},
        {"adapter": "x", "adapter_scale": 1.0},
        {"adapter": ["x", "y"], "adapter_scale": [1.0, 0.5]},
        {"adapter": ["y", "x"], "adapter_scale": [0.5, 1.0]},
        {"adapter": ["x", "y"], "adapter_scale": [1.0, 1.0]},
    ]
    engine = _run_in_batches_of_two(tmp_path, [_text_job(f"p{i}", i, meta=dict(choices[i % 5])) for i in range(20)])
    assert len(engine.calls) == 5
    for (prompts, _), adapter in zip(engine.calls, engine.adapters, strict=True):
        [choice] = {json.dumps(choices[int(p[1:]) % 5]) for p in prompts}
        assert adapter == json.loads(choice), prompts


def test_lora_field_takes_one_adapter_or_a_list():
    """Issue 26 item 4: ``lora`` is one adapter or a list composed (a JSON string in multipart forms); errors name
    the list item's field, as the one adapter's."""
    from pydantic import ValidationError

    from hsdp.serve.http import describe_validation_errors
    from hsdp.serve.schemas import MAX_COMPOSED_LORAS, ImageRequest, VideoRequest

    def problem(lora) -> tuple[str, str | None]:
        with pytest.raises(ValidationError) as info:
            VideoRequest.model_validate({"prompt": "x", "lora": lora})
        return describe_validation_errors(list(info.value.errors()))

    composed = VideoRequest.model_validate({"prompt": "x", "lora": '[{"name": "a"}, {"name": "b", "scale": 0.5}]'})
    assert [(x.name, x.scale) for x in composed.lora] == [("a", 1.0), ("b", 0.5)]
    assert ImageRequest.model_validate({"prompt": "x", "lora": {"name": "a"}}).lora.name == "a"
    assert problem({"nam": "a"}) == ("lora.nam: unknown field; did you mean name?", "lora.nam")
    assert problem([{"name": "a"}, {"name": "b", "sclae": 2}])[1] == "lora.1.sclae"
    assert problem([{"name": "a"}, {"name": "a"}]) == (
        "lora: Value error, names the adapter 'a' twice; give each once",
        "lora",
    )
    assert "at least 1 item" in problem([])[0]
    assert "at most 16 items" in problem([{"name": f"a{i}"} for i in range(MAX_COMPOSED_LORAS + 1)])[0]


def test_a_full_disk_fails_the_job_and_the_engine_thread_goes_on(tmp_path, monkeypatch):
    """Issue 21 item 2: an OSError writing a record (disk full) ended the engine thread; the job stayed
    ``in_progress`` for ever and every later job queued for ever."""
    import errno

    import numpy as np

    from hsdp.engine import GenerationOutput, Timings
    from hsdp.serve import runner as runner_module

    full = threading.Event()

    class DiskFull(JobStore):
        def _save(self, job):
            if full.is_set() and job.persistent:
                raise OSError(errno.ENOSPC, "No space left on device")
            super()._save(job)

    def save_frames(frames, path, fps, audio=None):
        if full.is_set():
            path.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        path.write_bytes(b"mp4")

    def fill_the_disk_for_the_first_job(engine, prompts, params, on_token):
        if prompts[0] == "first":
            full.set()

    class VideoEngine(_FakeEngine):
        def generate(self, prompts, params, **kwargs):
            outputs = super().generate(prompts, params, **kwargs)
            frames = np.zeros((1, 16, 16, 3), dtype=np.float32)
            return [
                GenerationOutput(
                    o.request_id, o.prompt, o.seed, Timings(total_s=0.1), [1], "t", frames=frames
                )
                for o in outputs
            ]

    monkeypatch.setattr(runner_module, "save_frames", save_frames)
    store = DiskFull(tmp_path, capacity=8)
    from hsdp.serve.runner import EngineRunner

    runner = EngineRunner(lambda: VideoEngine(body=fill_the_disk_for_the_first_job), store, poll_s=0.05)
    first, second = _job(seed=1), _job(seed=2, num_inference_steps=2)
    first.prompt, second.prompt = "first", "second"
    runner.start()
    try:
        store.submit([first])
        _wait_finished([first])
        with pytest.raises(OSError):  # a new job cannot be stored: refused (507), nothing queued or left
            store.submit([second])
        assert store.depth() == 0 and not list(store.jobs_dir.glob(f"{second.id}*"))
        full.clear()  # space freed
        store.submit([second])
        _wait_finished([second])
        assert runner.state == "ready" and runner._thread.is_alive()
    finally:
        runner.stop()
    assert first.status == "failed" and first.error["code"] == "output_error", first.error
    assert "No space left on device" in first.error["message"]
    assert store.write_errors >= 1  # the failed record write was counted (and logged), not fatal
    assert not list(store.videos_dir.glob(".*.mp4"))  # no partial staging file left behind
    assert second.status == "completed" and (store.videos_dir / second.output).read_bytes() == b"mp4"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_engine_thread_error_fails_its_batch_and_a_dead_thread_shows_in_health(tmp_path, monkeypatch):
    """Issue 21 item 2: any error of the engine thread fails the running batch with the reason and the thread goes
    on; a thread that ends anyway makes ``/health`` answer 503 ``dead`` (it read only the last state)."""
    import asyncio
    from types import SimpleNamespace

    from hsdp.serve.routes.system import health

    runner, _ = _runner(tmp_path)
    broken = [RuntimeError("bookkeeping bug")]

    def record(batch, outputs, padding):
        if broken:
            raise broken.pop()

    monkeypatch.setattr(runner, "_record", record)
    a, b = _text_job("a", 1), _text_job("b", 2, solo=True)
    runner.start()
    try:
        runner.store.submit([a])
        _wait_finished([a])
        runner.store.submit([b])
        _wait_finished([b])
        assert runner.state == "ready"

        class Stop(BaseException):
            """Not an Exception: nothing catches it, so the thread ends."""

        def next_batch(max_jobs, timeout_s):
            raise Stop()

        monkeypatch.setattr(runner.store, "next_batch", next_batch)
        runner._thread.join(5)
        response = asyncio.run(health(SimpleNamespace(runner=runner, name="m")))
    finally:
        runner.stop()
    assert a.status == "failed" and a.error["code"] == "internal_error"
    assert "RuntimeError: bookkeeping bug" in a.error["message"]
    assert b.status == "completed" and runner.stats.thread_errors == 1
    assert response.status_code == 503 and json.loads(response.body)["engine"] == "dead"


@pytest.mark.parametrize("streamed", [True, False])
def test_a_rerun_that_contradicts_the_streamed_tokens_ends_the_stream_with_an_error(tmp_path, streamed):
    """Issue 21 item 4: the re-run's first tokens were skipped unchecked, so a client could hold text (streamed
    [7, 8]) that the final record contradicts ([7, 5, 6, 4])."""
    import asyncio

    store = JobStore(tmp_path, capacity=8)
    job = _text_job("p")
    runs = []

    def run(engine, prompts, params, on_token):
        first = not runs
        runs.append(engine)
        for token in [7, 8] if first else [7, 5, 6, 4]:  # the re-run diverges at position 1
            on_token(0, token)
        if first:
            if streamed:  # a client reads what came so far
                assert asyncio.run(store.tokens_after(job, 0)) == ([7, 8], False)
            engine.closed = True
            raise WorkerDiedError("generate: worker rank 1 died (rank 1: exit code -9)", rank=1)

    runner, engines = _runner(tmp_path, store, body=run)
    runner.start()
    try:
        store.submit([job])
        _wait_finished([job])
    finally:
        runner.stop()
    if streamed:
        assert job.status == "failed" and job.error["code"] == "stream_diverged", job.error
        assert "position 1" in job.error["message"] and job.tokens == [7, 8]  # nothing past the conflict sent
        assert (0, 1) in engines[1].cancels  # the diverged run was stopped
    else:  # nothing had left the server: the re-run's tokens replace the first run's
        assert job.status == "completed" and job.tokens == [7, 5, 6, 4]


def test_a_slow_decode_with_signs_of_life_is_not_a_hang_and_a_hang_counts_once(tmp_path):
    """Issue 21 item 5: only denoising steps and tokens showed life, so a VAE decode or prompt encoding longer than
    --step-timeout was killed as a hang on every attempt; and each kill counted twice."""

    def slow_decode(engine, prompts, params, on_token):
        ends = time.monotonic() + 1.5
        while time.monotonic() < ends:  # 3x the step timeout, with the ranks' heartbeats arriving
            engine.last_heard = time.monotonic()
            assert not engine.killed.wait(0.05), "a computing engine was killed as hung"

    def hang_once(engine, prompts, params, on_token):
        if len(engines) == 1:  # silent until the watchdog kills the workers
            assert engine.killed.wait(10)
            engine.closed = True
            raise WorkerDiedError("generate: worker rank 0 died (rank 0: exit code -9)", rank=0)

    for body, attempts, failures in ((slow_decode, 1, 0), (hang_once, 2, 1)):
        runner, engines = _runner(tmp_path, body=body)
        runner.step_timeout_s = 0.5
        job = _text_job("p")
        runner.start()
        try:
            runner.store.submit([job])
            _wait_finished([job])
        finally:
            runner.stop()
        assert job.status == "completed" and job.attempts == attempts, (body.__name__, job.error)
        assert runner.stats.worker_failures == failures, body.__name__


def test_cancel_reaches_the_call_its_job_runs_in(tmp_path):
    """Issue 21 item 6: a cancel between next_batch() and the engine call never reached the engine (all steps
    ran), and a late cancel used the engine's current call id, stopping the next call's request."""

    class CancelInTheWindow(JobStore):
        def next_batch(self, max_jobs, timeout_s):
            batch = super().next_batch(max_jobs, timeout_s)
            if batch and batch[0].prompt == "early":
                self.cancel(batch[0], "cancelled before its call started")
            return batch

    store = CancelInTheWindow(tmp_path, capacity=8)
    early, late, nxt = _text_job("early", 1), _text_job("late", 2), _text_job("next", 3)
    gate = threading.Event()

    def run(engine, prompts, params, on_token):
        engine.cancel_gate = gate
        if prompts[0] == "late":  # a client cancels while this call runs; its cancel is delayed (forced race)
            threading.Thread(target=store.cancel, args=(late, "late cancel")).start()
            time.sleep(0.2)
        if prompts[0] == "next":
            gate.set()  # the held-back cancel lands while the next call runs
            time.sleep(0.2)

    runner, engines = _runner(tmp_path, store, body=run)
    runner.start()
    try:
        store.submit([early])
        _wait_finished([early])
        store.submit([late])
        _wait_finished([late])
        store.submit([nxt])
        _wait_finished([nxt])
    finally:
        runner.stop()
    engine = engines[0]
    # Calls 1, 2 and 3 (each job alone, padded to the 2 slots): cancels name calls 1 and 2 only.
    assert sorted(engine.cancels) == [(0, 1), (0, 2), (1, 1), (1, 2)], engine.cancels
    assert early.status == "cancelled" and late.status == "cancelled"
    assert nxt.status == "completed" and nxt.result is not None and not nxt.result.cancelled


def test_a_pipeline_error_fails_its_job_at_once_and_spares_the_engine_and_its_neighbour(tmp_path):
    """Issue 21 item 7: a ValueError in the pipeline restarted the engine up to --max-attempts times, re-ran its
    neighbours and reported only "generate failed on rank 0: (attempt 3 of 3)"."""
    error = WorkerRaised(
        "generate failed on rank 1:\nTraceback (most recent call last):\nValueError: bad latents",
        1,
        "ValueError: bad latents shape (1, 4, 9)\n  expected (1, 4, 8)",
    )
    runner, engines = _runner(tmp_path, error=error, poison="bad")
    bad, good = _text_job("bad", 1), _text_job("good", 2)
    runner.start()
    try:
        runner.store.submit([bad, good])  # one batch: side by side on the two slots
        _wait_finished([bad, good])
    finally:
        runner.stop()
    assert bad.status == "failed" and bad.attempts == 1
    assert bad.error == {"code": "generation_error", "message": f"{error.error} (rank 1)"}
    assert good.status == "completed" and good.attempts == 1  # the split run was not counted against it
    assert len(engines) == 1 and runner.stats.restarts == 0 and runner.stats.worker_failures == 0


def test_a_job_past_job_timeout_fails_without_a_rerun(tmp_path):
    """Issue 21 item 7: --job-timeout jobs were run again although the settings say they fail."""
    runner, engines = _runner(
        tmp_path, error=WorkerTimeout("generate did not finish within 600s on ranks [0, 1]")
    )
    runner.job_timeout_s = 600
    job = _text_job("slow")
    runner.start()
    try:
        runner.store.submit([job])
        _wait_finished([job])
    finally:
        runner.stop()
    assert job.status == "failed" and job.attempts == 1 and job.error["code"] == "timeout"
    assert "--job-timeout 600" in job.error["message"] and runner.stats.worker_failures == 0


# -- issue 21 item 11: shared state on disk and in memory ----------------------------------------------------------
def test_a_second_server_on_the_same_output_dir_is_refused(tmp_path):
    import os

    from hsdp.serve.jobs import OutputDirInUse

    first, second = JobStore(tmp_path, capacity=4), JobStore(tmp_path, capacity=4)
    first.lock()
    with pytest.raises(
        OutputDirInUse,
        match=rf"--output-dir {tmp_path} is in use by another hsdp serve \(pid {os.getpid()}\)",
    ):
        second.lock()
    first.unlock()
    second.lock()  # free again once the first server stopped
    second.unlock()


def test_a_server_whose_engine_fails_to_close_still_frees_its_output_dir(tmp_path):
    """An in-process restart (the combination tier's ``restarted`` servers) met OutputDirInUse from its own process
    when the stopping server's engine raised while closing: the lock was released only after a clean close."""
    import threading

    from hsdp.serve.service import Server

    class RunnerWhoseEngineFailsToClose:
        def stop(self) -> None:
            raise RuntimeError("rank 1 exited with SIGKILL while unloading")

    server = object.__new__(Server)  # the parts stop() uses: a started server's
    server._stopped, server.runner = threading.Event(), RunnerWhoseEngineFailsToClose()
    server.store = JobStore(tmp_path, capacity=4)
    server.store.lock()
    with pytest.raises(RuntimeError, match="while unloading"):
        server.stop()
    again = JobStore(tmp_path, capacity=4)
    again.lock()  # the next server on the same --output-dir starts
    again.unlock()


def test_load_sweeps_leftovers_and_reads_back_only_inputs_of_jobs_that_will_run(tmp_path):
    store = JobStore(tmp_path, capacity=4)
    done = Job("video", "p", VIDEO, 1, meta={"fps": 8}, inputs={"image": b"done-png"})
    waiting = Job("video", "q", VIDEO, 2, meta={"fps": 8}, inputs={"image": b"waiting-png"})
    store.submit([done, waiting])
    store.next_batch(1, timeout_s=0)
    (store.videos_dir / f"{done.id}.mp4").write_bytes(b"mp4")
    store.finish(done, "completed", output=f"{done.id}.mp4")
    assert done.inputs == {"image": None}  # a finished job holds no upload in memory
    leftovers = [store.videos_dir / f".{waiting.id}.mp4", store.jobs_dir / f"{waiting.id}.4242.tmp"]
    for path in leftovers:  # a crash mid-write
        path.write_bytes(b"partial")
    again = JobStore(tmp_path, capacity=4)
    assert again.load() == (2, 1)
    assert not any(path.exists() for path in leftovers)
    assert again.get(done.id).inputs == {"image": None} and again.get(waiting.id).inputs == {
        "image": b"waiting-png"
    }
    again.delete(again.get(done.id))
    assert not (store.jobs_dir / f"{done.id}.image").exists()  # the name was enough to delete the upload


def test_stop_joins_the_watchdog(tmp_path, monkeypatch):
    runner, _ = _runner(tmp_path)

    def busy_watchdog():  # a watchdog caught mid-kill when the server stops
        runner._stopping.wait()
        time.sleep(0.3)

    monkeypatch.setattr(runner, "_watch_steps", busy_watchdog)
    runner.start()
    runner.stop()
    assert not runner._thread.is_alive() and not runner._watchdog.is_alive()


def test_an_inpainting_pipeline_offers_a_mask_field():
    """``/v1/models``' ``parameters`` of a pipeline whose ``__call__`` takes ``mask_image`` (FLUX Fill's) list the
    ``mask`` file field after the input image, both required as ``__call__`` requires them: the playground draws a
    file input for each and sends them as ``/v1/jobs``' ``input_reference`` and ``mask`` parts."""
    from pathlib import Path

    from hsdp.engine.model_info import ModelInfo
    from hsdp.serve.fields import model_parameters
    from hsdp.serve.settings import ServeLimits

    takes = frozenset({"prompt", "image", "mask_image", "num_inference_steps", "height", "width"})
    info = ModelInfo(
        path=Path("fill"), kind="diffusion", class_name="FluxFillPipeline", output="image", call_params=takes,
        required_params=frozenset({"image", "mask_image"}),
    )  # fmt: skip
    files = [(f.name, f.required) for f in model_parameters(info, ServeLimits(), "/v1/jobs").fields if f.type == "image"]
    assert files == [("input_reference", True), ("mask", True)]
    no_mask = dataclasses.replace(info, call_params=takes - {"mask_image"}, required_params=frozenset({"image"}))
    assert [f.name for f in model_parameters(no_mask, ServeLimits(), "/v1/jobs").fields if f.type == "image"] == [
        "input_reference"
    ]


def test_the_servers_connections_send_without_waiting_for_acks():
    """The socket ``hsdp serve`` binds (before loading) and hands uvicorn: asyncio turns Nagle's algorithm off on its
    connections only when the socket names TCP as its protocol. With it on, each answer after the first on a
    kept-alive connection waited for the client's delayed ACK (~40 ms) between its headers and its body (the
    schema fuzz's ~800 requests: ~35 s of a 50 s run)."""
    import asyncio
    import socket

    from hsdp.serve.cli import _bind

    async def nodelay_of_an_accepted_connection() -> int:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport):
                accepted.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Protocol, sock=_bind("127.0.0.1", 0))  # as uvicorn
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0
