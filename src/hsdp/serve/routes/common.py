"""What every router shares: the :class:`~hsdp.serve.service.Server` dependency, body parsing, and waiting for jobs.

The server lives on ``app.state.server`` (set by :func:`hsdp.serve.app.create_app`); handlers take it as a
``server: ServerDep`` parameter, which adds nothing to the OpenAPI schema.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ValidationError

from hsdp.serve.http import describe_validation_errors
from hsdp.serve.jobs import Job
from hsdp.serve.schemas import ApiError
from hsdp.serve.service import Server

__all__ = [
    "ServerDep",
    "form_schema",
    "get_server",
    "is_form",
    "json_object",
    "read_form",
    "run_jobs",
    "unused_headers",
    "validate",
]

BaseModelT = TypeVar("BaseModelT", bound=BaseModel)
DISCONNECT_POLL_S = 0.25
"""How often a waiting request checks that its client is still there (a gone client cancels its jobs)."""


async def get_server(request: Request) -> Server:
    """The app's server (async, so FastAPI resolves it without a worker thread)."""
    return request.app.state.server


ServerDep = Annotated[Server, Depends(get_server)]


# -- request bodies ------------------------------------------------------------------------------------------
def form_schema(model: type[BaseModel], files: dict[str, str], required: tuple[str, ...]) -> dict:
    """``model``'s fields plus file parts (name -> description), for the OpenAPI multipart body."""
    schema = model.model_json_schema()
    binary = {name: {"type": "string", "format": "binary", "description": d} for name, d in files.items()}
    return {**schema, "properties": {**schema["properties"], **binary}, "required": list(required)}


def is_form(request: Request) -> bool:
    content_type = request.headers.get("content-type", "")
    return content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded"))


async def read_form(request: Request) -> tuple[dict[str, str], dict[str, list[bytes]]]:
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


async def json_object(request: Request) -> dict:
    try:
        data = json.loads(await request.body() or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(
            400, f"the body is not valid JSON ({exc}); send JSON or multipart form fields"
        ) from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object with at least 'prompt', or multipart form fields")
    return data


def validate(model: type[BaseModelT], data: dict) -> BaseModelT:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_errors(list(exc.errors()))
        raise ApiError(400, message, param=param, code="invalid_request") from exc


UNUSED_HEADER = "X-Hsdp-Unused-Fields"
"""Names the fields of OpenAI's or vLLM-Omni's schema a request gave that the pipeline does not take (accepted,
not applied), comma-separated; absent when every field was used."""


def unused_headers(server: Server, body: BaseModel) -> dict[str, str]:
    unused = server.unused_fields(body)
    return {UNUSED_HEADER: ", ".join(unused)} if unused else {}


def job_file(server: Server, job: Job, what: str, media_type: str) -> FileResponse:
    """The file of a completed job (``what``: how its route names it, ``video ID``); 409 naming the job's status
    and error while it has none."""
    if job.status != "completed" or not job.output:
        why = f": {job.error['message']}" if job.error else ""
        raise ApiError(
            409, f"{what} is {job.status}{why}; its content exists once status is 'completed'", code="not_ready"
        )
    return FileResponse(server.store.videos_dir / job.output, media_type=media_type, filename=job.output)


# -- waiting for jobs ----------------------------------------------------------------------------------------
async def _finished_or_cancelled(server: Server, jobs: list[Job], request: Request) -> None:
    """Wait for ``jobs``; a client that goes away cancels them, so the workers stop at their next step."""
    store = server.store
    waiting = asyncio.ensure_future(asyncio.gather(*(store.wait(job) for job in jobs)))
    while not waiting.done():
        await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
        if not waiting.done() and await request.is_disconnected():
            for job in jobs:
                store.cancel(job, "the client disconnected")
            await waiting


def _raise_failure(jobs: list[Job]) -> None:
    failed = [j for j in jobs if j.status != "completed"]
    if not failed:
        return
    error = failed[0].error or {"code": "failed", "message": "generation failed"}
    if error["code"] == "invalid_request":
        raise ApiError(400, error["message"], code=error["code"])
    # Worker failures were already run again (--max-attempts); only a stopping or a replaced server (a torchrun
    # restart, which ends this process) is worth a retry.
    retry = error["code"] in ("server_stopped", "restarting")
    raise ApiError(
        503 if retry else 500,
        error["message"],
        code=error["code"],
        kind="server_error",
        headers={"Retry-After": str(error.get("retry_after_s", 5))} if retry else None,
    )


async def run_jobs(server: Server, jobs: list[Job], request: Request) -> list[Job]:
    """Queue ``jobs`` and wait for all of them; any that did not complete becomes the error response."""
    server.submit(jobs)
    await _finished_or_cancelled(server, jobs, request)
    _raise_failure(jobs)
    return jobs
