"""``/v1/completions`` and ``/v1/chat/completions``: text (JSON or an SSE stream) from a causal LM, and, on a
diffusion model, chat answered with images or a video as data URLs (vLLM-Omni's shape)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hsdp.serve.jobs import Job, answered_by
from hsdp.serve.media import chat_audio_body, chat_generation, chat_media_body, data_url
from hsdp.serve.routes.common import ServerDep, run_jobs, unused_headers
from hsdp.serve.schemas import ApiError, ChatCompletionRequest, ChatImageParams, CompletionRequest
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

__all__ = ["router"]

_TEXT_OR_SSE = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}

router = APIRouter()


def _text_choices(body: CompletionRequest | ChatCompletionRequest, jobs: list[Job]) -> list[TextChoice]:
    budget = body.token_budget() if isinstance(body, ChatCompletionRequest) else body.max_tokens
    choices = []
    for i, job in enumerate(jobs):
        text, stopped = apply_stop(job.result.text or "", body.stop)
        reason = finish_reason(len(job.result.token_ids), budget, stopped)
        choices.append(TextChoice(i, text, reason, job.result.token_ids, job.meta["prompt_tokens"]))
    return choices


def _answered_by(server: Server, jobs: list[Job]) -> str:
    """The ``model`` of the response: the adapter that served it (named by ``model``, vLLM's convention, or by
    the ``lora`` field, vLLM-Omni's), else the base."""
    return answered_by(jobs[0].meta, server.name) if jobs else server.name


async def _stream_text(
    server: Server, body: CompletionRequest | ChatCompletionRequest, jobs: list[Job], chat: bool
) -> AsyncIterator[str]:
    """Each choice's text as its tokens arrive; a client that goes away cancels what still runs."""
    store = server.store
    chunks = SseChunks(_answered_by(server, jobs), chat=chat)
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
            reason = finish_reason(len(tokens), budget, stream.stopped)
            choices.append(TextChoice(index, "", reason, tokens, job.meta["prompt_tokens"]))
            yield chunks.finish(index, reason)
        if body.stream_options and body.stream_options.include_usage:
            yield chunks.usage(choices)
        yield chunks.done()
    finally:
        for job in jobs:
            if not job.finished:
                store.cancel(job, "the client disconnected")


async def _text_response(
    server: Server, body: CompletionRequest | ChatCompletionRequest, request: Request, chat: bool
) -> Response:
    jobs = server.text_jobs(body)
    if body.stream:
        server.submit(jobs)
        return StreamingResponse(_stream_text(server, body, jobs, chat), media_type="text/event-stream")
    choices = _text_choices(body, await run_jobs(server, jobs, request))
    model = _answered_by(server, jobs)
    return JSONResponse(chat_body(model, choices[0]) if chat else completion_body(model, choices))


def _choices(jobs: list[Job], per_choice: int) -> list[list[Job]]:
    return [jobs[i : i + per_choice] for i in range(0, len(jobs), per_choice)]


def _check_outputs(server: Server, choices: int, per_choice: int) -> None:
    """``n`` choices of ``per_choice`` outputs each, within ``--max-images`` in all."""
    limit = server.settings.limits.max_images
    if choices * per_choice > limit:
        raise ApiError(
            400,
            f"n={choices} x num_outputs_per_prompt={per_choice} outputs exceed this server's {limit} per request "
            "(hsdp serve --max-images)",
            param="n",
            code="limit_exceeded",
        )


async def _chat_media(server: Server, body: ChatCompletionRequest, request: Request) -> JSONResponse:
    """Chat on a diffusion model, as vLLM-Omni: images (or, from a video pipeline, one mp4) as data URLs; OpenAI's
    ``n`` makes that many choices (seeds ``seed + i`` over every output)."""
    server.check_model(body.model, "diffusion")
    if body.stream:
        raise ApiError(400, "stream: image and video generation answers in one response", param="stream")
    params, image = chat_generation(body)
    if server.info.output == "audio":
        return await _chat_audio(server, params, body.n, request)
    video = server.info.output == "video"
    per_choice = 1 if video else params.num_outputs_per_prompt
    _check_outputs(server, body.n, per_choice)
    jobs = server.diffusion_jobs(
        params,
        "video_sync" if video else "image",
        count=body.n * per_choice,
        num_frames=params.num_frames,
        fps=params.fps,
        output_format=params.output_format,
        image=image,
        image_field="messages[].content image_url",
    )
    fmt = "mp4" if video else params.output_format
    done = await run_jobs(server, jobs, request)
    urls = [[data_url(j.result, fmt) for j in choice] for choice in _choices(done, per_choice)]
    body = chat_media_body(_answered_by(server, jobs), params.prompt, urls)
    return JSONResponse(body, headers=unused_headers(server, params))


async def _chat_audio(server: Server, params: ChatImageParams, choices: int, request: Request) -> JSONResponse:
    """Chat on an audio pipeline: OpenAI's ``message.audio`` when ``modalities`` asks for audio (one file per
    choice, ``n`` choices), else vLLM-Omni's ``audio_url`` content parts (data URLs, ``num_outputs_per_prompt``
    per choice)."""
    fmt = (params.audio.format if params.audio else "wav").removesuffix("16")  # OpenAI's pcm16 is our pcm
    openai_shape = "audio" in (params.modalities or [])
    per_choice = params.num_outputs_per_prompt
    if openai_shape and per_choice > 1:
        raise ApiError(
            400,
            f"num_outputs_per_prompt={per_choice}: message.audio holds one file; ask for n={per_choice} choices "
            "instead (or drop modalities for audio_url parts)",
            param="num_outputs_per_prompt",
        )
    _check_outputs(server, choices, per_choice)
    jobs = server.diffusion_jobs(params, "audio", count=choices * per_choice, output_format=fmt)
    done = await run_jobs(server, jobs, request)
    model = done[0].meta.get("model", server.name)
    headers = unused_headers(server, params)
    if openai_shape:
        return JSONResponse(chat_audio_body(model, params.prompt, [j.result for j in done]), headers=headers)
    urls = [[data_url(j.result, fmt) for j in choice] for choice in _choices(done, per_choice)]
    return JSONResponse(chat_media_body(model, params.prompt, urls, "audio_url"), headers=headers)


@router.post("/v1/completions", response_class=Response, responses=_TEXT_OR_SSE)
async def completions(body: CompletionRequest, request: Request, server: ServerDep) -> Response:
    server.check_model(body.model, "causal_lm")
    return await _text_response(server, body, request, chat=False)


@router.post("/v1/chat/completions", response_class=Response, responses=_TEXT_OR_SSE)
async def chat_completions(body: ChatCompletionRequest, request: Request, server: ServerDep) -> Response:
    """Text from a causal LM; on a diffusion model, images (vLLM-Omni's shape)."""
    if server.kind == "diffusion":
        return await _chat_media(server, body, request)
    server.check_model(body.model, "causal_lm")
    if body.n > 1:
        raise ApiError(400, f"n={body.n}: a causal LM answers one choice per request here; send n requests", param="n")
    if problem := body.unknown_problem():
        raise ApiError(400, problem, param=next(iter(body.model_extra)), code="invalid_request")
    return await _text_response(server, body, request, chat=True)
