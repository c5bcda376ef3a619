"""The server's state (settings, job store, engine runner) and the translation of requests into jobs.

Everything a request can get wrong is found here, in the HTTP handler, before a job is queued: the served
model name, the endpoint against the model kind, this server's limits, and the engine's own rules (through
:func:`hsdp.engine.params.build_requests`, the same check ``Engine.generate`` runs), so a queued job only
fails for reasons that are not the client's.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import fields
from pathlib import Path

from hsdp.engine import Engine, SamplingParams
from hsdp.engine.params import build_requests
from hsdp.serve.jobs import Job, JobStore, QueueFull
from hsdp.serve.runner import EngineRunner
from hsdp.serve.schemas import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ImageRequest,
    VideoJob,
    VideoRequest,
    check_limits,
    parse_size,
)
from hsdp.serve.settings import ServeSettings
from hsdp.serve.text import chat_prompt

logger = logging.getLogger("hsdp")

__all__ = ["Server"]

_PER_REQUEST = ("seed", "negative_prompt")


class Server:
    """One model behind one queue. ``start`` loads the model (errors surface before the port is bound)."""

    def __init__(self, settings: ServeSettings):
        problems = settings.problems()
        if problems:
            raise ValueError("invalid server settings:\n" + "\n".join(f"  - {p}" for p in problems))
        self.settings = settings
        self.store = JobStore(settings.output_dir, settings.max_queue)
        self.runner = EngineRunner(self._make_engine, self.store)
        self.tokenizer = None
        self.max_positions: int | None = None

    def _make_engine(self) -> Engine:
        s = self.settings
        return Engine(
            s.model,
            s.parallel_config,
            dtype=s.dtype,
            forward_prefetch=s.forward_prefetch,
            call_timeout_s=s.job_timeout_s,
            start_timeout_s=s.engine_start_timeout_s,
        )

    def start(self) -> None:
        loaded, requeued = self.store.load()
        if loaded:
            logger.info(
                "reloaded %d job record(s) from %s; %d queued again",
                loaded,
                self.settings.output_dir,
                requeued,
            )
        self.runner.start()
        if self.kind == "causal_lm":
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.info.path)
            config = json.loads((Path(self.info.path) / "config.json").read_text())
            self.max_positions = config.get("max_position_embeddings")

    def stop(self) -> None:
        self.runner.stop()

    @property
    def info(self):
        assert self.runner.engine is not None, "start() first"
        return self.runner.engine.info

    @property
    def kind(self) -> str:
        return self.info.kind

    @property
    def name(self) -> str:
        return self.settings.name

    # -- checks ----------------------------------------------------------------------------------------------
    def check_model(self, requested: str | None, needs: str) -> None:
        if requested is not None and requested not in (
            self.name,
            str(self.settings.model),
            str(self.info.path),
        ):
            raise ApiError(
                404,
                f"model {requested!r} is not served here; this server runs {self.name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        if self.kind != needs:
            hint = (
                "POST /v1/completions or /v1/chat/completions"
                if self.kind == "causal_lm"
                else "POST /v1/videos or /v1/images/generations"
            )
            raise ApiError(
                400,
                f"this server runs {self.name!r}, a {self.kind.replace('_', ' ')} model; use {hint}",
                code="wrong_model_kind",
            )

    def _engine_params(self, params: SamplingParams) -> SamplingParams:
        """The engine's own validation (shape rules, defaults) on the caller side; returns concrete params."""
        config = self.runner.engine.config if self.runner.engine else self.settings.parallel_config.resolved()
        try:
            _, resolved = build_requests(self.info, config, ["x"] * max(1, self.store.slots), params)
        except ValueError as exc:
            raise ApiError(
                400, str(exc).replace("invalid generation request:\n", "").strip(), code="invalid_parameters"
            ) from exc
        return resolved

    @staticmethod
    def _shared(params: SamplingParams) -> dict:
        return {f.name: getattr(params, f.name) for f in fields(params) if f.name not in _PER_REQUEST}

    def submit(self, jobs: list[Job]) -> None:
        try:
            self.store.submit(jobs)
        except QueueFull as exc:
            raise ApiError(
                429,
                f"{exc}: {self.store.capacity} requests are already waiting (hsdp serve --max-queue)",
                code="queue_full",
                kind="rate_limit_error",
                headers={"Retry-After": str(exc.retry_after_s)},
            ) from exc

    # -- diffusion -------------------------------------------------------------------------------------------
    def diffusion_jobs(self, request: VideoRequest | ImageRequest, kind: str, count: int = 1) -> list[Job]:
        width, height = parse_size(
            request.size, getattr(request, "width", None), getattr(request, "height", None)
        )
        check_limits(request, self.settings.limits, width, height)
        num_frames = request.num_frames if isinstance(request, VideoRequest) else 1
        params = self._engine_params(
            SamplingParams(
                height=height,
                width=width,
                num_frames=num_frames,
                num_inference_steps=request.num_inference_steps,
                guidance_scale=request.guidance_scale,
            )
        )
        check_limits(request, self.settings.limits, params.width, params.height)  # the model's defaults too
        if params.num_frames > self.settings.limits.max_frames:
            raise ApiError(
                400,
                f"the model's default num_frames={params.num_frames} exceeds --max-frames",
                param="num_frames",
            )
        seed = request.seed if request.seed is not None else random.randrange(2**31)
        fps = getattr(request, "fps", 16)
        meta = {"fps": fps, "model": self.name}
        return [
            Job(
                kind, request.prompt, self._shared(params), seed + i, request.negative_prompt, meta=dict(meta)
            )
            for i in range(count)
        ]

    def video_view(self, job: Job) -> VideoJob:
        p = job.params
        return VideoJob(
            id=job.id,
            model=job.meta.get("model", self.name),
            status=job.status,
            progress=100 if job.status == "completed" else 0,
            created_at=int(job.created_at),
            completed_at=int(job.completed_at) if job.completed_at else None,
            prompt=job.prompt,
            size=f"{p['width']}x{p['height']}",
            seconds=f"{p['num_frames'] / job.meta['fps']:.2f}",
            num_frames=p["num_frames"],
            fps=job.meta["fps"],
            seed=job.seed,
            error=job.error,
        )

    # -- causal LM -------------------------------------------------------------------------------------------
    def text_jobs(self, request: CompletionRequest | ChatCompletionRequest) -> list[Job]:
        check_limits(request, self.settings.limits)
        if isinstance(request, ChatCompletionRequest):
            prompts, max_tokens = [chat_prompt(self.tokenizer, request.messages)], request.token_budget()
        else:
            prompts = [request.prompt] if isinstance(request.prompt, str) else list(request.prompt)
            max_tokens = request.max_tokens
        params = self._engine_params(
            SamplingParams(
                max_new_tokens=max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
            )
        )
        seed = request.seed if request.seed is not None else random.randrange(2**31)
        jobs = []
        for i, prompt in enumerate(prompts):
            prompt_tokens = len(self.tokenizer(prompt)["input_ids"])
            if self.max_positions and prompt_tokens + max_tokens > self.max_positions:
                raise ApiError(
                    400,
                    f"prompt {i} has {prompt_tokens} tokens; with max_tokens={max_tokens} that exceeds the "
                    f"model's context of {self.max_positions} tokens; shorten the prompt or lower max_tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            jobs.append(
                Job("text", prompt, self._shared(params), seed + i, meta={"prompt_tokens": prompt_tokens})
            )
        return jobs
