"""The FastAPI application: vLLM-Omni / OpenAI shaped routes over one :class:`hsdp.serve.service.Server`.

Handlers only validate, queue and wait; the engine thread does the work. Asynchronous video jobs return at once
and are polled; the other generation endpoints wait for their job without holding a thread (an asyncio future
resolved by the engine thread).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from hsdp.serve.http import GuardMiddleware, describe_validation_errors, install_error_handlers
from hsdp.serve.jobs import Job
from hsdp.serve.media import Upload, chat_generation, chat_media_body, data_url, reference_upload
from hsdp.serve.metrics import CONTENT_TYPE, render_metrics
from hsdp.serve.schemas import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DeletedVideo,
    ErrorBody,
    Health,
    ImageData,
    ImageEditRequest,
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
from hsdp.serve.text import (
    SseChunks,
    TextChoice,
    TextStream,
    apply_stop,
    chat_body,
    completion_body,
    finish_reason,
)

__all__ = ["create_app"]

BaseModelT = TypeVar("BaseModelT", bound=BaseModel)
REFERENCE = "input_reference"
"""The input image of ``/v1/videos`` (OpenAI's and vLLM-Omni's name)."""
_IMAGE_FIELDS = ("image", "image[]")
"""OpenAI's SDK sends a list of images as ``image[]``, vLLM-Omni's client repeats ``image``."""
_MASK_FIELDS = ("mask", "mask_image")
"""OpenAI's name and vLLM-Omni's."""
_ERRORS = {status: {"model": ErrorBody} for status in (400, 401, 404, 409, 413, 429)}
_DISCONNECT_POLL_S = 0.25
"""How often a waiting request checks that its client is still there (a gone client cancels its jobs)."""


def _form_schema(model: type[BaseModel], files: dict[str, str], required: tuple[str, ...]) -> dict:
    """``model``'s fields plus file parts (name -> description), for the OpenAPI multipart body."""
    schema = model.model_json_schema()
    binary = {name: {"type": "string", "format": "binary", "description": d} for name, d in files.items()}
    return {**schema, "properties": {**schema["properties"], **binary}, "required": list(required)}


_VIDEO_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": VideoRequest.model_json_schema()},
            "multipart/form-data": {
                "schema": _form_schema(
                    VideoRequest, {REFERENCE: "input image (image-to-video pipelines)"}, ("prompt",)
                )
            },
        },
    }
}
_EDIT_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": _form_schema(
                    ImageEditRequest,
                    {
                        "image": "the image to edit (also image[])",
                        "mask": "white = repaint (also mask_image)",
                    },
                    ("prompt", "image"),
                )
            }
        },
    }
}
_MP4 = {200: {"content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}}}
_TEXT_OR_SSE = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}


def _is_form(request: Request) -> bool:
    content_type = request.headers.get("content-type", "")
    return content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded"))


async def _read_form(request: Request) -> tuple[dict[str, str], dict[str, list[bytes]]]:
    """Text fields (empty ones count as unset, but an empty prompt stays, to be refused as empty) and file
    parts by field name. File parts are read whatever their content type (vLLM-Omni's client sends
    application/octet-stream); decoding decides whether they are images."""
    fields: dict[str, str] = {}
    files: dict[str, list[bytes]] = {}
    async with request.form() as form:
        for key, value in form.multi_items():
            if isinstance(value, str):
                if value != "" or key == "prompt":
                    fields[key] = value
            else:
                files.setdefault(key, []).append(await value.read())
    return fields, files


async def _json_object(request: Request) -> dict:
    try:
        data = json.loads(await request.body() or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(
            400, f"the body is not valid JSON ({exc}); send JSON or multipart form fields"
        ) from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object with at least 'prompt', or multipart form fields")
    return data


def _validate(model: type[BaseModelT], data: dict) -> BaseModelT:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_errors(list(exc.errors()))
        raise ApiError(400, message, param=param, code="invalid_request") from exc


async def _video_request(request: Request) -> tuple[VideoRequest, Upload | None]:
    """The body as JSON or as form fields (``curl -F``), and the input image: the ``input_reference`` file part,
    or in JSON a data URL (``"input_reference": {"image_url": "data:..."}``)."""
    if _is_form(request):
        fields, files = await _read_form(request)
        image = files.get(REFERENCE) and Upload(REFERENCE, "image", files[REFERENCE][0])
        return _validate(VideoRequest, fields), image or None
    data = await _json_object(request)
    reference = data.pop(REFERENCE, None)
    image = reference_upload(reference, REFERENCE) if reference is not None else None
    return _validate(VideoRequest, data), image


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

    async def finished_or_cancelled(jobs: list[Job], request: Request) -> None:
        """Wait for ``jobs``; a client that goes away cancels them, so the workers stop at their next step."""
        waiting = asyncio.ensure_future(asyncio.gather(*(store.wait(job) for job in jobs)))
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=_DISCONNECT_POLL_S)
            if not waiting.done() and await request.is_disconnected():
                for job in jobs:
                    store.cancel(job, "the client disconnected")
                await waiting

    def raise_failure(jobs: list[Job]) -> None:
        failed = [j for j in jobs if j.status != "completed"]
        if not failed:
            return
        error = failed[0].error or {"code": "failed", "message": "generation failed"}
        if error["code"] == "invalid_request":
            raise ApiError(400, error["message"], code=error["code"])
        # Worker failures were already run again (--max-attempts); only a stopping server is worth a retry.
        stopping = error["code"] == "server_stopped"
        raise ApiError(
            503 if stopping else 500,
            error["message"],
            code=error["code"],
            kind="server_error",
            headers={"Retry-After": "5"} if stopping else None,
        )

    async def run_jobs(jobs: list[Job], request: Request) -> list[Job]:
        server.submit(jobs)
        await finished_or_cancelled(jobs, request)
        raise_failure(jobs)
        return jobs

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        """200 while the engine is ready; 503 while it starts or restarts (queued jobs still wait)."""
        state = server.runner.stats.state
        body = Health(status="ok" if state == "ready" else "unavailable", model=server.name, engine=state)
        return JSONResponse(body.model_dump(), status_code=200 if state == "ready" else 503)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        adapter = server.adapter
        card = ModelCard(
            id=server.name,
            created=int(server.info.path.stat().st_mtime),
            kind=server.kind,
            root=str(adapter) if adapter else None,
            parent=str(server.settings.model) if adapter else None,
        )
        return ModelList(data=[card])

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        return Response(render_metrics(server.name, store, server.runner.stats), media_type=CONTENT_TYPE)

    # -- videos ----------------------------------------------------------------------------------------------
    async def video_jobs(request: Request, kind: str) -> list[Job]:
        body, image = await _video_request(request)
        server.check_model(body.model, "diffusion")
        server.check_video_model()
        return server.diffusion_jobs(
            body,
            kind,
            num_frames=body.frames(server.info.temporal_factor),
            fps=body.fps,
            image=image,
            image_field=REFERENCE,
        )

    @app.post("/v1/videos", response_model=VideoJob, openapi_extra=_VIDEO_BODY)
    async def create_video(request: Request) -> VideoJob:
        """Queue a video job; poll ``GET /v1/videos/{id}``, then download ``/content``."""
        jobs = await video_jobs(request, "video")
        server.submit(jobs)
        return server.video_view(jobs[0])

    @app.post("/v1/videos/sync", response_class=Response, responses=_MP4, openapi_extra=_VIDEO_BODY)
    async def create_video_sync(request: Request) -> Response:
        """Generate and answer with the mp4 bytes (not stored)."""
        [job] = await run_jobs(await video_jobs(request, "video_sync"), request)
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
    def one_frame() -> int | None:
        """Image endpoints on a video pipeline ask for a single frame; image pipelines take no num_frames."""
        return 1 if server.info.output == "video" else None

    async def images_response(body: ImageRequest, jobs: list[Job], request: Request) -> ImagesResponse:
        if body.response_format == "url":
            raise ApiError(
                400,
                "response_format='url' is not served (nothing is hosted); use 'b64_json'",
                param="response_format",
            )
        jobs = await run_jobs(jobs, request)
        data = [
            ImageData(b64_json=base64.b64encode(j.result).decode(), revised_prompt=j.prompt) for j in jobs
        ]
        return ImagesResponse(
            created=int(time.time()), data=data, output_format=body.output_format, size=jobs[0].meta["size"]
        )

    @app.post("/v1/images/generations", response_model=ImagesResponse)
    async def create_images(body: ImageRequest, request: Request) -> ImagesResponse:
        """OpenAI images: ``n`` images (seeds ``seed + i``); a video pipeline makes one frame per image."""
        server.check_model(body.model, "diffusion")
        jobs = server.diffusion_jobs(
            body, "image", count=body.n, num_frames=one_frame(), output_format=body.output_format
        )
        return await images_response(body, jobs, request)

    @app.post("/v1/images/edits", response_model=ImagesResponse, openapi_extra=_EDIT_BODY)
    async def edit_images(request: Request) -> ImagesResponse:
        """OpenAI image edits (multipart): the first ``image`` (or ``image[]``), an optional ``mask``."""
        if not _is_form(request):
            raise ApiError(
                400, "send the edit as multipart/form-data with an 'image' file part", param="image"
            )
        fields, files = await _read_form(request)
        body = _validate(ImageEditRequest, fields)
        server.check_model(body.model, "diffusion")
        if not server.info.takes_image:
            raise ApiError(
                400,
                f"image: {server.info.class_name} takes no input image, so it cannot edit; use POST "
                "/v1/images/generations",
                param="image",
                code="wrong_model_kind",
            )
        images = [data for name in _IMAGE_FIELDS for data in files.get(name, [])]
        if not images:
            raise ApiError(
                400, "image: required; send the image to edit as an 'image' file part", param="image"
            )
        mask_field = next((name for name in _MASK_FIELDS if name in files), None)
        mask = Upload(mask_field, "mask_image", files[mask_field][0]) if mask_field else None
        jobs = server.diffusion_jobs(
            body,
            "image",
            count=body.n,
            num_frames=one_frame(),
            output_format=body.output_format,
            image=Upload("image", "image", images[0]),
            mask=mask,
            pipeline_kwargs={"strength": body.strength},
        )
        return await images_response(body, jobs, request)

    # -- text ------------------------------------------------------------------------------------------------
    def text_choices(body: CompletionRequest | ChatCompletionRequest, jobs: list[Job]) -> list[TextChoice]:
        budget = body.token_budget() if isinstance(body, ChatCompletionRequest) else body.max_tokens
        choices = []
        for i, job in enumerate(jobs):
            text, stopped = apply_stop(job.result.text or "", body.stop)
            reason = finish_reason(len(job.result.token_ids), budget, stopped)
            choices.append(TextChoice(i, text, reason, job.result.token_ids, job.meta["prompt_tokens"]))
        return choices

    async def stream_text(
        body: CompletionRequest | ChatCompletionRequest, jobs: list[Job], chat: bool
    ) -> AsyncIterator[str]:
        """Each choice's text as its tokens arrive; a client that goes away cancels what still runs."""
        chunks = SseChunks(server.name, chat=chat)
        budget = body.token_budget() if chat else body.max_tokens
        choices = []
        try:
            for index, job in enumerate(jobs):
                if (opening := chunks.start(index)) is not None:
                    yield opening
                stream, count, finished = TextStream(server.tokenizer, body.stop), 0, False
                while not (finished or stream.stopped):
                    new, finished = await store.tokens_after(job, count)
                    count += len(new)
                    if piece := stream.update(job.tokens[:count], final=finished):
                        yield chunks.piece(index, piece)
                if stream.stopped:
                    store.cancel(job, "a stop string ended the answer")  # the workers need not go on
                elif job.status != "completed":
                    yield chunks.error(job.error or {"code": "failed", "message": "generation failed"})
                    yield chunks.done()
                    return
                tokens = job.tokens[:count]
                choices.append(
                    TextChoice(
                        index,
                        "",
                        finish_reason(len(tokens), budget, stream.stopped),
                        tokens,
                        job.meta["prompt_tokens"],
                    )
                )
                yield chunks.finish(index, choices[-1].finish_reason)
            if body.stream_options and body.stream_options.include_usage:
                yield chunks.usage(choices)
            yield chunks.done()
        finally:
            for job in jobs:
                if not job.finished:
                    store.cancel(job, "the client disconnected")

    async def text_response(
        body: CompletionRequest | ChatCompletionRequest, request: Request, chat: bool
    ) -> Response:
        jobs = server.text_jobs(body)
        if body.stream:
            server.submit(jobs)
            return StreamingResponse(stream_text(body, jobs, chat), media_type="text/event-stream")
        choices = text_choices(body, await run_jobs(jobs, request))
        return JSONResponse(
            chat_body(server.name, choices[0]) if chat else completion_body(server.name, choices)
        )

    @app.post("/v1/completions", response_class=Response, responses=_TEXT_OR_SSE)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model, "causal_lm")
        return await text_response(body, request, chat=False)

    async def chat_media(body: ChatCompletionRequest, request: Request) -> JSONResponse:
        """Chat on a diffusion model, as vLLM-Omni: images (or, from a video pipeline, one mp4) as data URLs."""
        server.check_model(body.model, "diffusion")
        if body.stream:
            raise ApiError(400, "stream: image and video generation answers in one response", param="stream")
        params, image = chat_generation(body)
        video = server.info.output == "video"
        jobs = server.diffusion_jobs(
            params,
            "video_sync" if video else "image",
            count=1 if video else params.num_outputs_per_prompt,
            num_frames=params.num_frames,
            fps=params.fps,
            output_format=params.output_format,
            image=image,
            image_field="messages[].content image_url",
        )
        fmt = "mp4" if video else params.output_format
        urls = [data_url(j.result, fmt) for j in await run_jobs(jobs, request)]
        return JSONResponse(chat_media_body(server.name, params.prompt, urls))

    @app.post("/v1/chat/completions", response_class=Response, responses=_TEXT_OR_SSE)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Text from a causal LM; on a diffusion model, images (vLLM-Omni's shape)."""
        if server.kind == "diffusion":
            return await chat_media(body, request)
        server.check_model(body.model, "causal_lm")
        return await text_response(body, request, chat=True)

    return app
