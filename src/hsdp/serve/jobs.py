"""Jobs, the bounded queue in front of the engine, and their records on disk.

Every request that needs the engine becomes one :class:`Job` per output (an image request with ``n=3`` is three
jobs). Jobs wait in a FIFO queue of bounded length (``submit`` refuses with :class:`QueueFull` past it); the
engine thread takes batches of *compatible* jobs (same kind and sampling parameters, differing only in prompt,
seed and the values of the per-request inputs) so request-parallel HSDP runs them side by side. Whether a
negative prompt or an input image is given at all changes the number of sharded forwards (an extra text
encoding, true CFG's second pass, the image encoder), so it is part of the batch key: ranks that share a
collective always run the same forwards.

The LoRA adapters loaded at run time are recorded in ``<output_dir>/adapters.json`` (name -> folder), so that a
restarted server serves them again and the queued jobs that name them run.

Asynchronous video jobs are *persistent*: their record is written to ``<output_dir>/jobs/<id>.json`` at every
state change (atomically: temp file, then rename) and their video to ``<output_dir>/videos/<id>.mp4`` before
the record says ``completed``; an input image is written once beside its record (``<id>.image``). A restarted
server reloads the records: finished jobs are served again, queued ones are queued again, and one that was
running when the server stopped is queued again (or failed once its attempts are spent). One server owns an
output dir (:meth:`JobStore.lock`); staging files a crash left behind are swept when it loads. Uploaded images
are held in memory only until their job finishes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("hsdp")

__all__ = ["ASYNC_KINDS", "Job", "JobStore", "QueueFull", "Unavailable", "FINISHED", "answered_by"]

FINISHED = ("completed", "failed", "cancelled")
ASYNC_KINDS = ("video", "image_async", "audio_async")
"""The kinds of persistent jobs (``POST /v1/videos`` and ``POST /v1/jobs``): queued, polled and downloaded."""


def answered_by(meta: dict, base: str) -> str:
    """The ``model`` a response names: the adapter of the job's ``meta`` (composed ones joined by ``+``), else
    ``base``."""
    adapter = meta.get("adapter")
    if adapter is None:
        return base
    return "+".join(adapter) if isinstance(adapter, list) else adapter


_PERSISTED = (
    "id",
    "kind",
    "prompt",
    "params",
    "seed",
    "negative_prompt",
    "created_at",
    "status",
    "started_at",
    "completed_at",
    "error",
    "output",
    "meta",
    "progress",
    "step",
    "steps",
    "attempts",
)


@dataclass(eq=False)
class Job:
    kind: str
    """``video``, ``image_async`` or ``audio_async`` (asynchronous, persisted: :data:`ASYNC_KINDS`),
    ``video_sync``, ``image``, ``audio`` or ``text``."""
    prompt: str
    params: dict
    """:class:`hsdp.engine.SamplingParams` fields shared by the batch (not seed / negative prompt)."""
    seed: int
    negative_prompt: str | None = None
    meta: dict = field(default_factory=dict)
    """What the response needs and the engine does not (fps, size, ...)."""
    id: str = ""
    created_at: float = field(default_factory=time.time)
    status: str = "queued"
    started_at: float | None = None
    completed_at: float | None = None
    error: dict | None = None
    """``{"code": ..., "message": ...}`` when failed or cancelled."""
    output: str | None = None
    """File name under ``<output_dir>/videos`` of a finished persistent job."""
    progress: int = 0
    """0-100: denoising steps done (100 once completed)."""
    step: int = 0
    """Denoising steps done in the current attempt."""
    steps: int | None = None
    """The denoising steps of the run, as the pipeline counts them (None until its first step)."""
    inputs: dict[str, bytes | None] = field(default_factory=dict)
    """Input images as uploaded, by pipeline argument (``image``, ``mask_image``); stored beside the record.
    Once the job is finished only the names remain (values None): the engine needs them no more."""
    result: Any = None
    """In memory only: image or mp4 bytes, or a :class:`hsdp.engine.GenerationOutput` for the waiting request."""
    cancel_requested: bool = False
    attempts: int = 0
    """Engine runs started for this job; a run interrupted by a worker failure or a restart is run again."""
    solo: bool = False
    """Run alone: set after a failed batch, so a job that breaks the workers cannot take its neighbours down."""
    tokens: list[int] = field(default_factory=list)
    """Causal LM: the tokens produced so far, as the ranks produce them (streaming)."""
    sent: int = 0
    """How many of ``tokens`` have been handed to a stream: a re-run must reproduce them exactly."""
    first_token_at: float | None = None
    _waiters: list = field(default_factory=list, repr=False)
    _token_waiters: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{self.output_kind}_{uuid.uuid4().hex}"

    @property
    def output_kind(self) -> str:
        """What the job makes: ``video``, ``image``, ``audio`` or ``text`` (its kind without the route's suffix)."""
        return self.kind.split("_")[0]

    @property
    def persistent(self) -> bool:
        return self.kind in ASYNC_KINDS

    @property
    def finished(self) -> bool:
        """The engine is done with it (a cancelled running job is not finished until its batch ends)."""
        return self.completed_at is not None

    def batch_key(self) -> str:
        if self.solo:
            return self.id
        # One set of adapters and scales per engine call (hsdp.engine.adapters): they are part of the key, so a
        # composed request never shares a batch with one naming another set (or the same in another order).
        adapter = [self.meta.get("adapter"), self.meta.get("adapter_scale")]
        # Given-or-absent per-request inputs change the forwards a request runs (see the module docstring).
        given = [self.negative_prompt is not None, sorted(self.inputs)]
        return json.dumps([self.output_kind, self.params, adapter, given], sort_keys=True)

    def record(self) -> dict:
        record = {k: v for k, v in asdict(self).items() if k in _PERSISTED}
        return record | {"inputs": sorted(self.inputs)}


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        super().__init__(f"the job queue is full; retry in {retry_after_s}s")
        self.retry_after_s = retry_after_s


class Unavailable(Exception):
    """Jobs that live in memory are refused: this process is about to be replaced (:meth:`JobStore.fail_transient`);
    ``error`` is the reason, with ``retry_after_s``."""

    def __init__(self, error: dict):
        super().__init__(error["message"])
        self.error = error


class OutputDirInUse(ValueError):
    """Another live server holds the output dir's lock."""


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written temp file behind
        raise


def _diverged(job: Job, index: int, token_id: int) -> dict:
    return {
        "code": "stream_diverged",
        "message": (
            f"the job ran again after a failure and produced token {token_id} at position {index}, where "
            f"{job.tokens[index]} was already streamed; the streamed text is void (resend the request)"
        ),
    }


class JobStore:
    """Thread-safe: HTTP handlers (event loop) submit and read; the engine thread takes and finishes jobs."""

    def __init__(self, output_dir: Path, capacity: int, max_attempts: int = 3):
        self.capacity = capacity
        self.max_attempts = max_attempts
        self.jobs_dir = Path(output_dir) / "jobs"
        self.videos_dir = Path(output_dir) / "videos"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.videos_dir.mkdir(parents=True, exist_ok=True)
        self._jobs: dict[str, Job] = {}
        self._queue: deque[Job] = deque()
        self._running: list[Job] = []
        self._cond = threading.Condition()
        self.finished_counts: Counter[str] = Counter()
        self.batch_seconds = 0.0
        """Moving average of an engine call, for ``Retry-After``."""
        self.slots = 1
        self.on_cancel_running: Callable[[Job], None] | None = None
        """Called (outside the lock) when a running job is cancelled, so the engine can stop it."""
        self.requeued = 0
        self.write_errors = 0
        """Job records that could not be written (a full disk): the job goes on in memory."""
        self._lock_file: int | None = None
        self._transient_refusal: dict | None = None
        """Set by :meth:`fail_transient`: the error that refuses new in-memory jobs."""

    def lock(self) -> None:
        """Own the output dir: an exclusive lock on ``<output_dir>/.lock`` holding this pid, released when the
        process ends however it ends. A second server on the same dir would run the same queued jobs twice;
        :class:`OutputDirInUse` (naming the flag and the holder's pid) refuses it before anything loads."""
        import fcntl

        path = self.jobs_dir.parent / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputDirInUse(
                f"--output-dir {self.jobs_dir.parent} is in use by another hsdp serve (pid {holder}); give each "
                "server its own --output-dir, or stop that server first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_file = fd

    def unlock(self) -> None:
        if self._lock_file is not None:
            os.close(self._lock_file)  # closing the descriptor releases the lock
            self._lock_file = None

    # -- persistence -----------------------------------------------------------------------------------------
    def load(self) -> tuple[int, int]:
        """Reload persisted jobs; returns (jobs loaded, jobs queued again). Input images are read back only for
        jobs that will run; staging files of a server that crashed are removed."""
        self._sweep()
        loaded = requeued = 0
        for path in sorted(self.jobs_dir.glob("*.json")):
            try:
                record = json.loads(path.read_text())
                names = record.pop("inputs", [])
                job = Job(**record)
                pending = job.status not in FINISHED
                job.inputs = {n: self._input_path(job, n).read_bytes() if pending else None for n in names}
            except (OSError, ValueError, TypeError) as exc:
                logger.warning("skipping unreadable job record %s: %s", path, exc)
                continue
            if job.status in FINISHED and job.completed_at is None:  # cancelled while it ran
                job.completed_at = time.time()
            if job.status == "in_progress":  # the server stopped while it ran: run it again
                self._retry_or_fail(
                    job, {"code": "server_restarted", "message": "the server stopped while it ran"}
                )
            elif job.status == "completed" and not (job.output and (self.videos_dir / job.output).exists()):
                job.status = "failed"
                job.error = {
                    "code": "output_missing",
                    "message": f"the output file {job.output} is gone from the output dir",
                }
                self._save(job)
            self._jobs[job.id] = job
            loaded += 1
        queued = sorted((j for j in self._jobs.values() if j.status == "queued"), key=lambda j: j.created_at)
        self._queue.extend(queued)
        requeued = len(queued)
        return loaded, requeued

    @property
    def _adapters_file(self) -> Path:
        return self.jobs_dir.parent / "adapters.json"

    def save_adapters(self, adapters: dict[str, Path]) -> None:
        """Record the adapters loaded at run time (name -> folder), which queued jobs may name after a restart."""
        _write_json_atomic(self._adapters_file, {name: str(path) for name, path in adapters.items()})

    def load_adapters(self) -> dict[str, Path]:
        """The adapters :meth:`save_adapters` recorded (none when there is no readable record)."""
        try:
            record = json.loads(self._adapters_file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("skipping the unreadable adapter record %s: %s", self._adapters_file, exc)
            return {}
        return {str(name): Path(path) for name, path in record.items()}

    def _sweep(self) -> None:
        """Staging leftovers of a crashed server (``.<id>.mp4`` and other outputs, ``<id>.<pid>.tmp`` records);
        only the lock holder loads, so none of them belongs to a live writer."""
        leftovers = [*self.videos_dir.glob(".*"), *self.jobs_dir.glob("*.tmp")]
        for path in leftovers:
            path.unlink(missing_ok=True)
        if leftovers:
            logger.info("removed %d staging file(s) a stopped server left behind", len(leftovers))

    def _save(self, job: Job) -> None:
        if job.persistent:
            _write_json_atomic(self.jobs_dir / f"{job.id}.json", job.record())

    def _try_save(self, job: Job) -> None:
        """Write the record where a failure must not undo the state change (the job ends, its waiters wake):
        the in-memory job is what clients see; a record that cannot be written is logged and counted."""
        try:
            self._save(job)
        except OSError as exc:
            self.write_errors += 1
            logger.error("could not write the record of %s (%s): it is current in memory only", job.id, exc)

    @staticmethod
    def _ended(job: Job, status: str, error: dict | None) -> None:
        """A job's end in memory: its uploads are dropped (the names stay, for the record and ``delete``)."""
        job.status, job.error, job.completed_at = status, error, time.time()
        job.inputs = dict.fromkeys(job.inputs)

    def _input_path(self, job: Job, name: str) -> Path:
        return self.jobs_dir / f"{job.id}.{name}"

    # -- queue -----------------------------------------------------------------------------------------------
    def submit(self, jobs: list[Job]) -> None:
        """Queue all of ``jobs`` or none (raises :class:`QueueFull` with a retry estimate, or the ``OSError`` of
        a record that could not be written, leaving no file behind)."""
        with self._cond:
            if self._transient_refusal is not None and not all(j.persistent for j in jobs):
                raise Unavailable(self._transient_refusal)
            if len(self._queue) + len(jobs) > self.capacity:
                waves = math.ceil((len(self._queue) + len(jobs)) / max(1, self.slots))
                raise QueueFull(max(1, math.ceil(waves * (self.batch_seconds or 1.0))))
            written: list[Job] = []
            try:
                for job in (j for j in jobs if j.persistent):
                    written.append(job)
                    for name, data in job.inputs.items():  # before the record that names them
                        self._input_path(job, name).write_bytes(data)
                    self._save(job)
            except OSError:
                for job in written:
                    self._remove_files(job)
                raise
            for job in jobs:
                if job.persistent:
                    self._jobs[job.id] = job
                self._queue.append(job)
            self._cond.notify_all()

    def next_batch(self, max_jobs: int, timeout_s: float) -> list[Job]:
        """The oldest queued job plus up to ``max_jobs - 1`` compatible ones, marked in progress."""
        with self._cond:
            if not self._queue and not self._cond.wait_for(lambda: bool(self._queue), timeout=timeout_s):
                return []
            first = self._queue.popleft()
            batch = [first]
            key = first.batch_key()
            for job in list(self._queue):
                if len(batch) >= max_jobs:
                    break
                if job.batch_key() == key:
                    self._queue.remove(job)
                    batch.append(job)
            now = time.time()
            for job in batch:
                job.status, job.started_at = "in_progress", now
                job.attempts += 1
                self._try_save(job)
            self._running = list(batch)
            return batch

    def _retry_or_fail(self, job: Job, error: dict, spent: bool = True) -> bool:
        """Back to ``queued`` for another attempt, or ``failed`` with the reason once its attempts are spent
        (``spent=False``: the run does not count against them). Caller holds the lock (or owns the job);
        returns whether it was queued again."""
        if not spent:
            job.attempts -= 1
        if job.cancel_requested or job.attempts >= self.max_attempts:
            if job.cancel_requested:  # cancelled, or failed by the store (a diverged stream): that end stands
                status, error = job.status, job.error or {"code": "cancelled", "message": "cancelled"}
            else:
                status = "failed"
                error = {
                    **error,
                    "message": f"{error['message']} (attempt {job.attempts} of {self.max_attempts})",
                }
            self._ended(job, status, error)
            self.finished_counts[job.status] += 1
            self._try_save(job)
            return False
        job.status, job.started_at, job.progress, job.step = "queued", None, 0, 0
        self._try_save(job)
        self.requeued += 1
        return True

    def retry(self, jobs: list[Job], error: dict, *, spent: bool = True) -> None:
        """Jobs whose run was interrupted (a worker died or hung, the server stopped): back to the front of the
        queue, in order, each to run alone; a job out of attempts fails with ``error`` and its attempt count.
        ``spent=False``: the batch failed for a reason one job holds (an error its request raised); the run is
        not counted, each job runs alone next to find which."""
        with self._cond:
            again = []
            for job in jobs:
                if job in self._running:
                    self._running.remove(job)
                if job.finished:  # ended while it ran (fail_transient): that end stands
                    continue
                job.solo = job.solo or len(jobs) > 1
                if self._retry_or_fail(job, error, spent):
                    again.append(job)
            self._queue.extendleft(reversed(again))
            done = [j for j in jobs if j not in again]
            self._cond.notify_all()
        for job in done:
            self._wake(job)

    def _wake(self, job: Job) -> None:
        waiters, job._waiters = job._waiters, []
        token_waiters, job._token_waiters = job._token_waiters, []
        for loop, future in waiters + token_waiters:
            loop.call_soon_threadsafe(_resolve, future)

    def finish(self, job: Job, status: str, *, error: dict | None = None, output: str | None = None) -> None:
        """Record the end of a job (a job ended early, cancelled or failed by the store, keeps that end) and
        wake whoever waits on it; a record that cannot be written does not keep it from ending."""
        with self._cond:
            if job.finished:
                return
            if job.cancel_requested:
                status, error = job.status, job.error
            self._ended(job, status, error)
            if status == "completed":
                job.progress = 100
            if output is not None:
                job.output = output
            self._try_save(job)
            self.finished_counts[status] += 1
            if job in self._running:
                self._running.remove(job)
        self._wake(job)

    def fail_running(self, error: dict) -> list[Job]:
        """Fail every job the engine thread took and did not finish (it met an error of its own, e.g. a record
        it could not write); returns them."""
        with self._cond:
            stranded = [j for j in self._running if not j.finished]
        for job in stranded:
            self.finish(job, "failed", error=error)
        with self._cond:
            self._running = [j for j in self._running if not j.finished]
        return stranded

    def fail_transient(self, error: dict) -> list[Job]:
        """End every job that lives in memory only (the synchronous routes' jobs), queued or running, with
        ``error`` and answer whoever waits on it; refuse new ones with :class:`Unavailable` from now on. For a
        process about to be replaced (a torchrun restart): a persistent job stays queued on disk for the next
        one, an in-memory job would be lost with its client's connection. Returns the jobs ended."""
        with self._cond:
            self._transient_refusal = error
            ended = [j for j in (*self._queue, *self._running) if not j.persistent and not j.finished]
            for job in ended:
                if job in self._queue:
                    self._queue.remove(job)
                else:  # running: the engine call's end finds it finished and leaves it so
                    self._running.remove(job)
                self._ended(job, "failed", error)
                self.finished_counts["failed"] += 1
        for job in ended:
            self._wake(job)
        return ended

    def set_progress(self, job: Job, percent: int, step: int = 0, steps: int | None = None) -> None:
        """A running job's progress (from the engine's per-step callback: ``step`` of ``steps`` done); written
        to its record."""
        with self._cond:
            if job.finished or percent <= job.progress:
                return
            job.progress, job.step, job.steps = percent, step, steps if steps is not None else job.steps
            self._try_save(job)

    def cancel(self, job: Job, reason: str) -> None:
        """A queued job leaves the queue at once; a running one is stopped by the engine at its next denoising
        step or token (through ``on_cancel_running``) and finishes ``cancelled``."""
        with self._cond:
            if job.finished or job.cancel_requested:
                return
            error = {"code": "cancelled", "message": reason}
            running = job not in self._queue
            if running:
                self._end_early(job, "cancelled", error)
            else:
                self._queue.remove(job)
        if running:  # the engine thread calls finish() when the batch ends
            if self.on_cancel_running is not None:
                self.on_cancel_running(job)
            return
        self.finish(job, "cancelled", error=error)

    def _end_early(self, job: Job, status: str, error: dict) -> None:
        """A running job's end decided outside the engine (caller holds the lock): the engine stops it at its
        next step or token and :meth:`finish` keeps this status and error."""
        job.cancel_requested = True
        job.status, job.error = status, error
        self._try_save(job)

    def push_token(self, job: Job, index: int, token_id: int) -> None:
        """The ``index``-th token of the job's current run. A run repeated after a failure should produce the
        same tokens (same seed), but another rank or batch may not: a token not yet streamed is replaced; one
        that differs from what a client already holds fails the job (``stream_diverged``) and stops it."""
        with self._cond:
            if (
                job.finished
                or job.cancel_requested
                or (index < len(job.tokens) and job.tokens[index] == token_id)
            ):
                return
            diverged = index < job.sent
            if diverged:
                self._end_early(job, "failed", _diverged(job, index, token_id))
            else:
                del job.tokens[index:]
                job.tokens.append(token_id)
                if job.first_token_at is None:
                    job.first_token_at = time.time()
            waiters, job._token_waiters = job._token_waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)
        if diverged and self.on_cancel_running is not None:
            self.on_cancel_running(job)

    def stream_conflict(self, job: Job, token_ids: list[int]) -> dict | None:
        """The error for a finished run whose tokens contradict what was already streamed (a re-run that
        diverged or stopped earlier), None when the streamed tokens are a prefix of ``token_ids``."""
        with self._cond:
            sent = job.tokens[: job.sent]
        if list(token_ids[: len(sent)]) == sent:
            return None
        index = next((i for i, t in enumerate(sent) if i >= len(token_ids) or token_ids[i] != t), len(sent))
        if index < len(token_ids):
            return _diverged(job, index, token_ids[index])
        return {
            "code": "stream_diverged",
            "message": f"the job ran again after a failure and ended after {len(token_ids)} tokens, but "
            f"{len(sent)} were already streamed; the streamed text is void (resend the request)",
        }

    async def tokens_after(self, job: Job, count: int) -> tuple[list[int], bool]:
        """The job's tokens past the first ``count`` once there are any (or it finished), and whether it has."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if len(job.tokens) > count or job.finished:
                return self._hand_out(job, count)
            job._token_waiters.append((loop, future))
        await future
        with self._cond:
            return self._hand_out(job, count)

    @staticmethod
    def _hand_out(job: Job, count: int) -> tuple[list[int], bool]:
        """Tokens past ``count`` for a stream (caller holds the lock): from now on a re-run must repeat them."""
        job.sent = max(job.sent, len(job.tokens))
        return job.tokens[count:], job.finished

    async def wait(self, job: Job) -> None:
        """Return when ``job`` is finished (without blocking the event loop or a thread)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if job.finished:
                return
            job._waiters.append((loop, future))
        await future

    # -- reading ---------------------------------------------------------------------------------------------
    def get(self, job_id: str) -> Job | None:
        with self._cond:
            return self._jobs.get(job_id)

    def list(self) -> list[Job]:
        with self._cond:
            return sorted(self._jobs.values(), key=lambda j: j.created_at)

    def delete(self, job: Job) -> None:
        with self._cond:
            self._jobs.pop(job.id, None)
            self._remove_files(job)

    def _remove_files(self, job: Job) -> None:
        inputs = [self._input_path(job, name) for name in job.inputs]
        for path in (self.jobs_dir / f"{job.id}.json", self.videos_dir / (job.output or ""), *inputs):
            if path.is_file():
                path.unlink()

    def depth(self) -> int:
        with self._cond:
            return len(self._queue)

    def running(self) -> int:
        with self._cond:
            return len(self._running)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
