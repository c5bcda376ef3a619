"""``/v1/audio/speech``: OpenAI's speech route (what the ``openai`` client's ``audio.speech.create`` calls) on an
audio pipeline: the file in the requested format, in the response body."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from hsdp.serve.routes.common import ServerDep, run_jobs
from hsdp.serve.schemas import AUDIO_MEDIA_TYPES, ApiError, SpeechRequest

__all__ = ["router"]

router = APIRouter()

_AUDIO = {200: {"content": {t: {"schema": {"type": "string", "format": "binary"}} for t in AUDIO_MEDIA_TYPES.values()}}}


@router.post("/v1/audio/speech", response_class=Response, responses=_AUDIO)
async def create_speech(body: SpeechRequest, request: Request, server: ServerDep) -> Response:
    """Audio from ``input``, with the seed, steps, guidance and length (``audio_seconds``) beside it."""
    server.check_model(body.model, "diffusion")
    if body.speed != 1.0:
        raise ApiError(400, f"speed={body.speed}: only 1.0 is served (the pipeline sets the tempo)", param="speed")
    body = body.model_copy(update={"prompt": body.input})
    jobs = server.diffusion_jobs(body, "audio", output_format=body.response_format)
    [job] = await run_jobs(server, jobs, request)
    return Response(
        content=job.result,
        media_type=AUDIO_MEDIA_TYPES[body.response_format],
        headers={"x-hsdp-seed": str(job.seed), "x-hsdp-model": job.meta.get("model", server.name)},
    )
