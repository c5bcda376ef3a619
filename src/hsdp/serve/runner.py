"""The one thread that drives the engine: take a batch, generate, store the outputs, survive dead workers.

The engine runs one call at a time on all its ranks, so a single thread owns it and HTTP handlers never touch
it. A batch is up to ``request_slots`` compatible jobs (request-parallel HSDP generates them side by side, one
per rank); a shorter batch is padded with copies of its first request, whose outputs are discarded, because
the ranks run in lockstep. Each request has its own seed, so its output does not depend on its batch. The
engine's per-step callback sets each job's ``progress`` as its ranks run.

When the engine call fails because a worker died, hung past the job timeout or raised, the group is gone: the
batch's jobs are marked failed with the reason, the engine is started again (with backoff if that fails too),
and the queue carries on. Jobs queued meanwhile simply wait.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hsdp.engine import Engine, GenerationOutput, SamplingParams
from hsdp.engine.outputs import encode_image, save_frames
from hsdp.launch import WorkerDiedError, WorkerError, WorkerTimeout
from hsdp.serve.jobs import Job, JobStore

logger = logging.getLogger("hsdp")

__all__ = ["EngineRunner", "RunnerStats"]


@dataclass
class RunnerStats:
    """What ``/metrics`` reports about the engine (written by the engine thread only)."""

    state: str = "starting"
    """starting, ready, restarting or stopped."""
    restarts: int = 0
    batches: int = 0
    batched_requests: int = 0
    padded_requests: int = 0
    step_seconds_sum: float = 0.0
    step_count: int = 0
    job_seconds_sum: float = 0.0
    job_count: int = 0
    peak_memory_bytes: list[int] = field(default_factory=list)
    memory_kind: str = ""
    worker_pids: list[int] = field(default_factory=list)


def _failure(exc: BaseException, *, stopping: bool, restarting: bool) -> dict:
    """The ``error`` of the jobs of a failed engine call: a code clients can branch on, and the reason."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if stopping:
        return {"code": "server_stopped", "message": f"the server stopped while this job ran ({first_line})"}
    if isinstance(exc, ValueError) and not restarting:
        return {"code": "invalid_request", "message": str(exc)}
    codes = ((WorkerTimeout, "timeout"), (WorkerDiedError, "worker_died"), (WorkerError, "worker_error"))
    code = next((c for cls, c in codes if isinstance(exc, cls)), "internal_error")
    then = "; the workers are being restarted, resubmit the job" if restarting else ""
    return {"code": code, "message": f"{first_line}{then}"}


def _per_job(values: list) -> list | None:
    """One value per request for the engine, or None when no job set one."""
    return values if any(v is not None for v in values) else None


class EngineRunner:
    """Owns the :class:`hsdp.Engine` and its thread. ``start`` loads the model in the caller (errors surface)."""

    def __init__(self, make_engine: Callable[[], Engine], store: JobStore, *, poll_s: float = 0.5):
        self._make_engine = make_engine
        self.store = store
        self.poll_s = poll_s
        self.stats = RunnerStats()
        self.engine: Engine | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._set_engine(self._make_engine())
        self._thread = threading.Thread(target=self._loop, name="hsdp-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the running batch (up to ``timeout_s``), then stop the workers; queued jobs stay queued."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.engine is not None:
            self.engine.close()
        self.stats.state = "stopped"

    def _set_engine(self, engine: Engine) -> None:
        self.engine = engine
        self.store.slots = engine.request_slots
        self.stats.worker_pids = engine.pids
        self.stats.state = "ready"

    def _loop(self) -> None:
        while not self._stopping.is_set():
            if self.engine is None or self.engine.closed:
                self._restart()
                continue
            batch = self.store.next_batch(self.engine.request_slots, self.poll_s)
            if batch:
                self._run(batch)

    def _restart(self) -> None:
        self.stats.state = "restarting"
        self.stats.restarts += 1
        delay = 1.0
        while not self._stopping.is_set():
            try:
                self._set_engine(self._make_engine())
                logger.info("engine restarted (restart %d)", self.stats.restarts)
                return
            except Exception:
                logger.exception("engine restart failed; retrying in %.0fs", delay)
                self._stopping.wait(delay)
                delay = min(30.0, delay * 2)

    def _run(self, batch: list[Job]) -> None:
        engine = self.engine
        assert engine is not None
        slots = engine.request_slots
        padded = batch + [batch[0]] * (-len(batch) % slots)
        params = SamplingParams(
            **batch[0].params,
            seed=[j.seed for j in padded],
            negative_prompt=_per_job([j.negative_prompt for j in padded]),
            image=_per_job([j.inputs.get("image") for j in padded]),
            mask_image=_per_job([j.inputs.get("mask_image") for j in padded]),
        )

        def on_progress(request_id: int, step: int, total: int) -> None:
            if request_id < len(batch):  # the rest are padding
                # 100 means done: the VAE decode and the encoding still follow the last step.
                self.store.set_progress(batch[request_id], min(99, 100 * step // max(1, total)))

        started = time.perf_counter()
        try:
            outputs = engine.generate([j.prompt for j in padded], params, on_progress=on_progress)
        except Exception as exc:
            error = _failure(exc, stopping=self._stopping.is_set(), restarting=engine.closed)
            logger.warning("batch of %d job(s) failed: %s", len(batch), error["message"])
            for job in batch:
                self.store.finish(job, "failed", error=error)
            return
        elapsed = time.perf_counter() - started
        self.store.batch_seconds = (
            elapsed if not self.store.batch_seconds else 0.8 * self.store.batch_seconds + 0.2 * elapsed
        )
        self._record(batch, outputs, len(padded) - len(batch))
        for job, output in zip(batch, outputs, strict=False):
            try:
                self._deliver(job, output)
            except Exception as exc:  # writing the output failed: this job fails, the server goes on
                logger.exception("storing the output of %s failed", job.id)
                self.store.finish(job, "failed", error={"code": "output_error", "message": str(exc)})

    def _record(self, batch: list[Job], outputs: list[GenerationOutput], padding: int) -> None:
        stats = self.stats
        stats.batches += 1
        stats.batched_requests += len(batch)
        stats.padded_requests += padding
        for output in outputs[: len(batch)]:
            stats.step_seconds_sum += sum(output.timings.step_s)
            stats.step_count += len(output.timings.step_s)
            stats.job_seconds_sum += output.timings.total_s
            stats.job_count += 1
        if outputs:
            stats.peak_memory_bytes = list(outputs[0].peak_memory_bytes)
            stats.memory_kind = outputs[0].memory_kind

    def _deliver(self, job: Job, output: GenerationOutput) -> None:
        if job.cancel_requested:
            self.store.finish(job, "cancelled")
            return
        if job.kind == "video":
            name = f"{job.id}.mp4"
            staging = self.store.videos_dir / f".{name}"
            save_frames(output.frames, staging, fps=job.meta["fps"])
            os.replace(staging, self.store.videos_dir / name)
            self.store.finish(job, "completed", output=name)
            return
        if job.kind == "video_sync":
            staging = self.store.videos_dir / f".{job.id}.mp4"
            try:
                save_frames(output.frames, staging, fps=job.meta["fps"])
                job.result = staging.read_bytes()
            finally:
                staging.unlink(missing_ok=True)
        elif job.kind == "image":
            # An image pipeline's first image, or a video pipeline's only frame (image endpoints ask for one).
            image = output.images[0] if output.images is not None else output.frames[0]
            job.result = encode_image(image, "." + job.meta.get("format", "png"))
            job.meta["size"] = (
                f"{image.shape[1]}x{image.shape[0]}"  # pipelines may resize (Kontext's max_area)
            )
        else:
            job.result = output
        self.store.finish(job, "completed")
