"""The one thread that drives the engine: take a batch, generate, store the outputs, survive dead workers.

The engine runs one call at a time on all its ranks, so a single thread owns it and HTTP handlers never touch
it. A batch is up to ``request_slots`` compatible jobs (request-parallel HSDP generates them side by side, one
per rank); a shorter batch is padded with copies of its first request, whose outputs are discarded, because
the ranks run in lockstep. Each request has its own seed, so its output does not depend on its batch. The
engine's per-step callback sets each job's ``progress`` as its ranks run.

Supervision: while idle, the thread pings the ranks every ``poll_s`` (a dead or hung worker is noticed within
``poll_s + ping_timeout_s``); while a batch runs, a dead worker is noticed by its process sentinel within a
fraction of a second and a hung one when the ranks show no life for ``step_timeout_s`` (no step, no token, and
no module computing: prompt encoding and VAE decode count; its workers are then killed, counted once as a
worker failure). Either way the engine is restarted at once, before any request asks, and ``/health`` says
``restarting`` meanwhile. The interrupted batch's jobs go back to the front of the queue, each to run alone,
with the same seed, so their results equal an undisturbed run; a job whose attempts are spent
(``--max-attempts``) fails with the reason and the count, and the jobs behind it run.

Only a lost or hung rank is a reason to run a job again. An ordinary exception of the pipeline
(:class:`hsdp.launch.WorkerRaised`: every rank came back, the group is intact) fails the job at once with the
exception's full message, and the engine stays loaded; a call past ``--job-timeout`` fails its job. When such a
call held several jobs, each runs again alone (the run does not count against its attempts), so only the job
that causes it fails. Anything else going wrong in this thread (a record it cannot write, a bug) fails the
running batch with the reason and the thread goes on; should the thread end anyway, ``/health`` says ``dead``.

A client's cancel goes to the engine call its job runs in (by call id, taken when the call starts), so a cancel
that arrives between taking the batch and starting the call still stops it, and a late one cannot stop the
next call's request at the same index.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hsdp.engine import Engine, GenerationOutput, SamplingParams
from hsdp.engine.outputs import encode_audio, encode_image, save_frames
from hsdp.launch import WorkerDiedError, WorkerError, WorkerRaised, WorkerTimeout
from hsdp.serve.jobs import Job, JobStore

logger = logging.getLogger("hsdp")

__all__ = ["EngineRunner", "RunnerStats"]


@dataclass
class RunnerStats:
    """What ``/metrics`` reports about the engine (written by the engine thread only)."""

    state: str = "starting"
    """starting, ready, restarting, stopped, or dead (the engine thread ended while the server runs)."""
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
    worker_failures: int = 0
    """Dead or hung workers noticed (idle or busy), each once."""
    thread_errors: int = 0
    """Errors the engine thread met outside the engine call (a record it could not write, ...): each failed
    the running batch, and the thread went on."""
    last_error: str = ""
    generated_tokens: int = 0
    ttft_seconds_sum: float = 0.0
    """Time to first token, from the request's arrival, summed over streamed or not text jobs."""
    ttft_count: int = 0


def _failure(exc: BaseException) -> dict:
    """The ``error`` of the jobs of a failed engine call: a code clients can branch on, and the reason (the
    summary line, and a rank's exception line after its traceback)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    message = lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')}: {lines[-1]}"
    codes = ((WorkerTimeout, "timeout"), (WorkerDiedError, "worker_died"), (WorkerError, "worker_error"))
    code = next((c for cls, c in codes if isinstance(exc, cls)), "internal_error")
    return {"code": code, "message": message}


def _per_job(values: list) -> list | None:
    """One value per request for the engine, or None when no job set one."""
    return values if any(v is not None for v in values) else None


class EngineRunner:
    """Owns the :class:`hsdp.Engine` and its thread. ``start`` loads the model in the caller (errors surface)."""

    def __init__(
        self,
        make_engine: Callable[[], Engine],
        store: JobStore,
        *,
        poll_s: float = 0.5,
        ping_timeout_s: float = 1.5,
        step_timeout_s: float = 120.0,
        max_batch_size: int = 1,
    ):
        self._make_engine = make_engine
        self.store = store
        self.poll_s = poll_s
        self.ping_timeout_s = ping_timeout_s
        self.step_timeout_s = step_timeout_s
        self.job_timeout_s: float | None = None
        """The engine's call limit (``--job-timeout``), named in the error of a job that overruns it."""
        self.max_batch_size = max_batch_size
        self.stats = RunnerStats()
        self.engine: Engine | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._lock = threading.Lock()
        self._batch: list[Job] = []
        """The jobs of the running engine call, by request index (padding included)."""
        self._call_id: int | None = None
        """The engine's id of that call, once it started (cancels name it)."""
        self._last_sign_of_life = 0.0
        self._hung_for: float | None = None
        """Set by the watchdog when it killed the workers of a silent call: how long it was silent."""
        store.on_cancel_running = self._cancel_running

    def start(self) -> None:
        from hsdp.launch import fork_forkserver_with_ranks, start_forkserver

        # Restarts start ranks from a process with threads (these, uvicorn's): not forked from it but from a
        # forkserver. Forked with the first ranks where those fork, it has their imports and imports nothing;
        # else one is started now, and imports the libraries while the server serves rather than when a restart
        # waits.
        with fork_forkserver_with_ranks():
            self._set_engine(self._make_engine())
        kind = getattr(self.engine, "kind", None)
        if getattr(self.engine, "pids", None) and kind in ("diffusion", "causal_lm"):
            from hsdp.engine.model_info import MODEL_PACKAGES

            start_forkserver([MODEL_PACKAGES[kind]])  # a no-op where one was forked
        self._thread = threading.Thread(target=self._loop, name="hsdp-engine", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch_steps, name="hsdp-watchdog", daemon=True)
        self._watchdog.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the running batch (up to ``timeout_s``), then stop the workers; queued jobs stay queued (an
        interrupted persistent job is queued again on disk and runs after a restart)."""
        self._stopping.set()
        for thread in (self._thread, self._watchdog):
            if thread is not None:
                thread.join(timeout_s)
        if self.engine is not None:
            self.engine.close()
        self.stats.state = "stopped"

    @property
    def state(self) -> str:
        """The engine's state for ``/health``: ``dead`` when the engine thread is gone while the server runs."""
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stopping.is_set():
            return "dead"
        return self.stats.state

    def _cancel_running(self, job: Job) -> None:
        with self._lock:
            call_id, engine = self._call_id, self.engine
            indices = [i for i, j in enumerate(self._batch) if j is job] if call_id is not None else []
        # Before the call starts there is no id yet: _call_started sends the cancel then.
        self._send_cancels(engine, call_id, indices)

    def _call_started(self, call_id: int) -> None:
        with self._lock:
            self._call_id, engine = call_id, self.engine
            indices = [i for i, j in enumerate(self._batch) if j.cancel_requested]
        self._send_cancels(engine, call_id, indices)

    @staticmethod
    def _send_cancels(engine: Engine | None, call_id: int | None, indices: list[int]) -> None:
        for index in indices:
            try:
                engine.cancel(index, call_id)
            except Exception:  # the engine is gone: nothing left to stop
                logger.debug("cancel of request %d of call %s found no engine", index, call_id, exc_info=True)

    def _last_life(self, engine: Engine) -> float:
        return max(self._last_sign_of_life, engine.last_heard or 0.0)

    def _watch_steps(self) -> None:
        """Kill the workers of a call that shows no life for ``step_timeout_s``: they are hung. The engine
        thread then sees the call fail and counts the failure (once)."""
        while not self._stopping.wait(min(1.0, self.step_timeout_s / 4)):
            with self._lock:
                busy, engine = bool(self._batch), self.engine
            if not busy or engine is None:
                continue
            silent = time.monotonic() - self._last_life(engine)
            if silent > self.step_timeout_s:
                logger.warning(
                    "no step, token or computation for %.0fs: the workers are hung; killing them", silent
                )
                self._hung_for = silent
                engine.kill_workers()
                self._last_sign_of_life = time.monotonic()

    def _set_engine(self, engine: Engine) -> None:
        self.engine = engine
        self.store.slots = engine.request_slots
        self.stats.worker_pids = engine.pids
        self.stats.state = "ready"

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._step()
                except Exception as exc:
                    self._thread_error(exc)
        finally:
            if not self._stopping.is_set():
                self.stats.state = "dead"
                logger.critical("the engine thread ended; /health reports the engine dead")

    def _step(self) -> None:
        if self.engine is None or self.engine.closed:
            self._restart()
            return
        batch = self.store.next_batch(self.engine.request_slots * self.max_batch_size, self.poll_s)
        if batch:
            self._run(batch)
        else:
            self._check_idle_workers()

    def _thread_error(self, exc: Exception) -> None:
        """This thread failed outside the engine call: the jobs it holds fail with the reason, and it goes on."""
        logger.exception("the engine thread failed; failing its running jobs and going on")
        self.stats.thread_errors += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._batch, self._call_id = [], None
        self.store.fail_running(
            {
                "code": "internal_error",
                "message": f"the server failed while running this job: {self.stats.last_error}",
            }
        )

    def _check_idle_workers(self) -> None:
        """A round trip to every rank: a dead or hung worker closes the engine, and the loop restarts it."""
        try:
            self.engine.ping(self.ping_timeout_s)
        except WorkerError as exc:
            self.stats.worker_failures += 1
            self.stats.state = "restarting"
            logger.warning("a worker failed while idle (%s); restarting the engine", str(exc).splitlines()[0])

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

        token_counts = [0] * len(padded)

        def on_progress(request_id: int, step: int, total: int) -> None:
            self._last_sign_of_life = time.monotonic()
            if request_id < len(batch):  # the rest are padding
                # 100 means done: the VAE decode and the encoding still follow the last step.
                self.store.set_progress(batch[request_id], min(99, 100 * step // max(1, total)), step, total)

        def on_token(request_id: int, token_id: int) -> None:
            if request_id >= len(batch):
                return
            job = batch[request_id]
            if not job.tokens and job.first_token_at is None:
                self.stats.ttft_seconds_sum += time.time() - job.created_at
                self.stats.ttft_count += 1
            self.stats.generated_tokens += 1
            self.store.push_token(job, token_counts[request_id], token_id)
            token_counts[request_id] += 1

        with self._lock:
            self._batch, self._call_id, self._hung_for = padded, None, None
            self._last_sign_of_life = time.monotonic()
        started = time.perf_counter()
        try:
            outputs = engine.generate(
                [j.prompt for j in padded],
                params,
                on_progress=on_progress,
                on_token=on_token,
                on_start=self._call_started,
                batch_size=self.max_batch_size if engine.kind == "diffusion" else 1,
                # A LoRA adapter and its scale, when the jobs name one (the batch key holds one of each).
                **{k: batch[0].meta[k] for k in ("adapter", "adapter_scale") if k in batch[0].meta},
            )
        except Exception as exc:
            self._fail_batch(batch, exc, engine)
            return
        finally:
            with self._lock:
                self._batch, self._call_id = [], None
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

    def _fail_batch(self, batch: list[Job], exc: Exception, engine: Engine) -> None:
        if isinstance(exc, ValueError) and not engine.closed:  # the request itself is wrong: no retry
            for job in batch:
                self.store.finish(job, "failed", error={"code": "invalid_request", "message": str(exc)})
            return
        error = self._job_error(exc)
        if isinstance(exc, (WorkerRaised, WorkerTimeout)) and not self._stopping.is_set():
            self._fail_culprit(batch, exc, error)
            return
        if self._stopping.is_set():
            error = {
                "code": "server_stopped",
                "message": f"the server stopped while this job ran ({error['message']})",
            }
            # Persistent jobs wait on disk for the next server; nobody is left waiting for the others.
            self.store.retry([j for j in batch if j.persistent], error)
            for job in batch:
                if not job.persistent:
                    self.store.finish(job, "failed", error=error)
            return
        if engine.closed:
            self.stats.worker_failures += 1
            self.stats.state = "restarting"
        logger.warning(
            "batch of %d job(s) interrupted (%s); running them again", len(batch), error["message"]
        )
        self.store.retry(batch, error)

    def _job_error(self, exc: Exception) -> dict:
        if self._hung_for is not None:  # the watchdog killed the workers: the cause is the silence
            return {
                "code": "hung",
                "message": f"the workers showed no life for {self._hung_for:.0f}s (--step-timeout "
                f"{self.step_timeout_s:g}) and were killed",
            }
        if isinstance(exc, WorkerRaised):
            return {"code": "generation_error", "message": f"{exc.error} (rank {exc.rank})"}
        if isinstance(exc, WorkerTimeout):
            limit = f" (--job-timeout {self.job_timeout_s:g})" if self.job_timeout_s else ""
            return {"code": "timeout", "message": f"{_failure(exc)['message']}{limit}"}
        return _failure(exc)

    def _fail_culprit(self, batch: list[Job], exc: Exception, error: dict) -> None:
        """An error the request itself causes (the pipeline raised, or the call overran ``--job-timeout``):
        alone, the job fails at once; in a batch, which job caused it is unknown, so each runs again alone,
        the run not counted against its attempts."""
        if isinstance(exc, WorkerTimeout):
            self.stats.state = "restarting"  # the timed-out group is torn down; the loop starts a new one
        if len(batch) == 1:
            logger.warning("job %s failed: %s", batch[0].id, error["message"])
            self.store.finish(batch[0], "failed", error=error)
            return
        logger.warning("a batch of %d jobs failed (%s); running each alone", len(batch), error["message"])
        self.store.retry(batch, error, spent=False)

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

    @staticmethod
    def _encoded(job: Job, output: GenerationOutput) -> bytes:
        """An image or audio job's file, in the format its request asked for."""
        if job.output_kind == "audio":
            return encode_audio(output.audios[0], output.sample_rate, "." + job.meta.get("format", "wav"))
        # An image pipeline's first image, or a video pipeline's only frame (image endpoints ask for one).
        image = output.images[0] if output.images is not None else output.frames[0]
        job.meta["size"] = f"{image.shape[1]}x{image.shape[0]}"  # pipelines may resize (Kontext's max_area)
        return encode_image(image, "." + job.meta.get("format", "png"))

    def _store_file(self, name: str, data: bytes) -> None:
        """A finished job's output under the output dir, whole or not at all (staged, then renamed)."""
        staging = self.store.videos_dir / f".{name}"
        try:
            staging.write_bytes(data)
            os.replace(staging, self.store.videos_dir / name)
        finally:
            staging.unlink(missing_ok=True)

    def _deliver(self, job: Job, output: GenerationOutput) -> None:
        if job.cancel_requested or output.cancelled:
            self.store.finish(job, "cancelled")
            return
        if job.kind == "video":
            name = f"{job.id}.mp4"
            staging = self.store.videos_dir / f".{name}"
            try:
                save_frames(output.frames, staging, fps=job.meta["fps"], audio=_sound_track(output))
                os.replace(staging, self.store.videos_dir / name)
            finally:
                staging.unlink(missing_ok=True)  # a failed write (a full disk) leaves no partial file
            self.store.finish(job, "completed", output=name)
            return
        if job.kind in ("image_async", "audio_async"):
            name = f"{job.id}.{job.meta['format']}"
            self._store_file(name, self._encoded(job, output))
            self.store.finish(job, "completed", output=name)
            return
        if job.kind == "video_sync":
            staging = self.store.videos_dir / f".{job.id}.mp4"
            try:
                save_frames(output.frames, staging, fps=job.meta["fps"], audio=_sound_track(output))
                job.result = staging.read_bytes()
            finally:
                staging.unlink(missing_ok=True)
        elif job.kind in ("audio", "image"):
            job.result = self._encoded(job, output)
        else:
            conflict = self.store.stream_conflict(job, output.token_ids or [])
            if conflict is not None:  # a re-run that contradicts the streamed text: the stream ends in error
                self.store.finish(job, "failed", error=conflict)
                return
            job.result = output
        self.store.finish(job, "completed")


def _sound_track(output: GenerationOutput) -> tuple | None:
    """The ``(waveform, sample_rate)`` a video pipeline made beside the frames (LTX-2), for the mp4."""
    return (output.audio, output.sample_rate) if output.audio is not None else None
