"""The FastAPI application: vLLM-Omni / OpenAI shaped routes over one :class:`hsdp.serve.service.Server`.

Handlers only validate, queue and wait; the engine thread does the work. Asynchronous video jobs return at once
and are polled; the other generation endpoints wait for their job without holding a thread (an asyncio future
resolved by the engine thread).
"""

from __future__ import annotations

import base64
import contextlib
import json
import time

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from hsdp.serve.http import GuardMiddleware, describe_validation_errors, install_error_handlers
from hsdp.serve.jobs import Job
from hsdp.serve.metrics import CONTENT_TYPE, render_metrics
from hsdp.serve.schemas import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DeletedVideo,
    ErrorBody,
    Health,
    ImageData,
    ImageRequest,
    ImagesResponse,
    ModelCard,
    ModelList,
    VideoJob,
    VideoList,
    VideoRequest,
    valid_job_id,
)
from hsdp.serve.service import Server
from hsdp.serve.text import TextChoice, apply_stop, chat_body, completion_body, finish_reason, sse_events

__all__ = ["create_app"]

_ERRORS = {status: {"model": ErrorBody} for status in (400, 401, 404, 409, 413, 429)}
_VIDEO_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": VideoRequest.model_json_schema()},
            "multipart/form-data": {"schema": VideoRequest.model_json_schema()},
        },
    }
}
_MP4 = {200: {"content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}}}
_TEXT_OR_SSE = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}


async def _video_request(request: Request) -> VideoRequest:
    """The body as JSON or as form fields (``curl -F``); empty form fields count as unset."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        data = {}
        async with request.form() as form:
            for key, value in form.multi_items():
                if not isinstance(value, str):
                    raise ApiError(
                        400, f"form field {key!r} is a file; this server takes text fields only", param=key
                    )
                if value != "" or key == "prompt":
                    data[key] = value
    else:
        try:
            data = json.loads(await request.body() or b"null")
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(
                400, f"the body is not valid JSON ({exc}); send JSON or multipart form fields"
            ) from exc
        if not isinstance(data, dict):
            raise ApiError(
                400, "the body must be a JSON object with at least 'prompt', or multipart form fields"
            )
    try:
        return VideoRequest.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_errors(list(exc.errors()))
        raise ApiError(400, message, param=param, code="invalid_request") from exc


def create_app(server: Server) -> FastAPI:
    """The ASGI app for a started ``server``; stopping the app (lifespan end) stops the engine."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.stop()

    app = FastAPI(
        title="hsdp serve",
        version="1",
        description="OpenAI-style video, image and text generation over a model sharded with FSDP2 (HSDP).",
        responses=_ERRORS,
        lifespan=lifespan,
    )
    settings = server.settings
    app.add_middleware(
        GuardMiddleware, api_key=settings.api_key, max_body_bytes=settings.limits.max_body_bytes
    )
    install_error_handlers(app)
    store = server.store

    def video_job(video_id: str) -> Job:
        job = store.get(video_id) if valid_job_id(video_id) else None
        if job is None:
            raise ApiError(
                404,
                f"no video job {video_id!r} (GET /v1/videos lists them)",
                param="video_id",
                code="not_found",
            )
        return job

    async def run_jobs(jobs: list[Job]) -> list[Job]:
        server.submit(jobs)
        for job in jobs:
            await store.wait(job)
        failed = [j for j in jobs if j.status != "completed"]
        if failed:
            error = failed[0].error or {"code": "failed", "message": "generation failed"}
            if error["code"] == "invalid_request":
                raise ApiError(400, error["message"], code=error["code"])
            # The workers died, hung or are restarting: the request itself may succeed again shortly.
            unavailable = error["code"] in ("worker_died", "timeout", "worker_error", "server_stopped")
            raise ApiError(
                503 if unavailable else 500,
                error["message"],
                code=error["code"],
                kind="server_error",
                headers={"Retry-After": "5"} if unavailable else None,
            )
        return jobs

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        """200 while the engine is ready; 503 while it starts or restarts (queued jobs still wait)."""
        state = server.runner.stats.state
        body = Health(status="ok" if state == "ready" else "unavailable", model=server.name, engine=state)
        return JSONResponse(body.model_dump(), status_code=200 if state == "ready" else 503)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(
            data=[ModelCard(id=server.name, created=int(server.info.path.stat().st_mtime), kind=server.kind)]
        )

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        return Response(render_metrics(server.name, store, server.runner.stats), media_type=CONTENT_TYPE)

    # -- videos ----------------------------------------------------------------------------------------------
    @app.post("/v1/videos", response_model=VideoJob, openapi_extra=_VIDEO_BODY)
    async def create_video(request: Request) -> VideoJob:
        """Queue a video job; poll ``GET /v1/videos/{id}``, then download ``/content``."""
        body = await _video_request(request)
        server.check_model(body.model, "diffusion")
        jobs = server.diffusion_jobs(body, "video")
        server.submit(jobs)
        return server.video_view(jobs[0])

    @app.post("/v1/videos/sync", response_class=Response, responses=_MP4, openapi_extra=_VIDEO_BODY)
    async def create_video_sync(request: Request) -> Response:
        """Generate and answer with the mp4 bytes (not stored)."""
        body = await _video_request(request)
        server.check_model(body.model, "diffusion")
        [job] = await run_jobs(server.diffusion_jobs(body, "video_sync"))
        return Response(job.result, media_type="video/mp4", headers={"X-Video-Seed": str(job.seed)})

    @app.get("/v1/videos", response_model=VideoList)
    async def list_videos(
        limit: int = Query(20, ge=1, le=1000), order: str = Query("desc", pattern="^(asc|desc)$")
    ) -> VideoList:
        jobs = store.list()
        jobs = jobs[::-1] if order == "desc" else jobs
        return VideoList(data=[server.video_view(j) for j in jobs[:limit]])

    @app.get("/v1/videos/{video_id}", response_model=VideoJob)
    async def get_video(video_id: str) -> VideoJob:
        return server.video_view(video_job(video_id))

    @app.get("/v1/videos/{video_id}/content", response_class=FileResponse, responses=_MP4)
    async def video_content(video_id: str) -> FileResponse:
        job = video_job(video_id)
        if job.status != "completed" or not job.output:
            why = f": {job.error['message']}" if job.error else ""
            raise ApiError(
                409,
                f"video {video_id} is {job.status}{why}; its content exists once status is 'completed'",
                code="not_ready",
            )
        return FileResponse(store.videos_dir / job.output, media_type="video/mp4", filename=job.output)

    @app.delete("/v1/videos/{video_id}", response_model=VideoJob | DeletedVideo)
    async def delete_video(video_id: str) -> VideoJob | DeletedVideo:
        """Cancel a queued or running job (it becomes ``cancelled``); delete a finished one and its video."""
        job = video_job(video_id)
        if job.finished:
            store.delete(job)
            return DeletedVideo(id=job.id, deleted=True)
        store.cancel(job, "cancelled by DELETE /v1/videos/{id}")
        return server.video_view(job)

    # -- images ----------------------------------------------------------------------------------------------
    @app.post("/v1/images/generations", response_model=ImagesResponse)
    async def create_images(body: ImageRequest) -> ImagesResponse:
        """OpenAI images: one frame of the video pipeline per image, as base64 PNG."""
        server.check_model(body.model, "diffusion")
        if body.response_format == "url":
            raise ApiError(
                400,
                "response_format='url' is not served (nothing is hosted); use 'b64_json'",
                param="response_format",
            )
        jobs = await run_jobs(server.diffusion_jobs(body, "image", count=body.n))
        data = [
            ImageData(b64_json=base64.b64encode(j.result).decode(), revised_prompt=j.prompt) for j in jobs
        ]
        return ImagesResponse(created=int(time.time()), data=data)

    # -- text ------------------------------------------------------------------------------------------------
    def text_response(
        body: CompletionRequest | ChatCompletionRequest, jobs: list[Job], chat: bool
    ) -> Response:
        budget = body.token_budget() if chat else body.max_tokens
        choices = []
        for i, job in enumerate(jobs):
            text, stopped = apply_stop(job.result.text or "", body.stop)
            reason = finish_reason(len(job.result.token_ids), budget, stopped)
            choices.append(TextChoice(i, text, reason, job.result.token_ids, job.meta["prompt_tokens"]))
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            events = sse_events(server.name, server.tokenizer, choices, chat=chat, include_usage=usage)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(
            chat_body(server.name, choices[0]) if chat else completion_body(server.name, choices)
        )

    @app.post("/v1/completions", response_class=Response, responses=_TEXT_OR_SSE)
    async def completions(body: CompletionRequest) -> Response:
        server.check_model(body.model, "causal_lm")
        return text_response(body, await run_jobs(server.text_jobs(body)), chat=False)

    @app.post("/v1/chat/completions", response_class=Response, responses=_TEXT_OR_SSE)
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        server.check_model(body.model, "causal_lm")
        return text_response(body, await run_jobs(server.text_jobs(body)), chat=True)

    return app
