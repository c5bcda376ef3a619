"""``/v1/jobs``: asynchronous jobs of whatever the served pipeline makes (video, image or audio): queue, poll
(progress as step ``k`` of ``n`` with an ETA), download, cancel or delete. The same fields as ``/v1/videos``;
on a video pipeline its jobs are the ``/v1/videos`` jobs. The playground at ``/`` runs every job through here."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse

from hsdp.serve.jobs import Job
from hsdp.serve.media import Upload, reference_upload
from hsdp.serve.routes.common import (
    ServerDep,
    form_schema,
    is_form,
    job_file,
    json_object,
    read_form,
    unused_headers,
    validate,
)
from hsdp.serve.routes.videos import REFERENCE, parse_video_request
from hsdp.serve.schemas import ApiError, DeletedJob, JobList, JobObject, JobRequest, valid_job_id
from hsdp.serve.service import ASYNC_KIND, CONTENT_TYPES, Server

__all__ = ["router"]

MASK = "mask"
"""The inpainting mask's field, as ``/v1/images/edits`` names it (``mask_image`` is accepted too)."""

_JOB_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": JobRequest.model_json_schema()},
            "multipart/form-data": {
                "schema": form_schema(
                    JobRequest,
                    {
                        REFERENCE: "input image (pipelines that take one)",
                        MASK: "inpainting mask, white = repaint",
                    },
                    ("prompt",),
                )
            },
        },
    }
}
_FILE = {
    200: {
        "content": {
            t: {"schema": {"type": "string", "format": "binary"}} for t in set(CONTENT_TYPES.values())
        }
    }
}
_FORMATS = {"image": ("png", "jpeg", "webp"), "audio": ("wav", "flac", "mp3")}

router = APIRouter()


def _format(server: Server, body: JobRequest) -> str:
    """The output file's format: the request's, checked against what the pipeline makes."""
    made = server.outputs
    if made == "video":
        if body.output_format is not None:
            raise ApiError(
                400, "output_format: video jobs make mp4; drop output_format", param="output_format"
            )
        return "mp4"
    formats = _FORMATS[made]
    if body.output_format is not None and body.output_format not in formats:
        raise ApiError(
            400,
            f"output_format={body.output_format!r}: {made} jobs make {', '.join(formats)}",
            param="output_format",
        )
    return body.output_format or formats[0]


async def _parse(request: Request) -> tuple[JobRequest, Upload | None, Upload | None]:
    """The body and its input image (``input_reference``) as ``/v1/videos`` reads them, and the inpainting mask:
    the ``mask`` (or ``mask_image``) file part, or in JSON a data URL as ``mask``."""
    if is_form(request):
        fields, files = await read_form(request)
        image = Upload(REFERENCE, "image", files[REFERENCE][0]) if REFERENCE in files else None
        field = next((name for name in (MASK, "mask_image") if name in files), None)
        return (
            validate(JobRequest, fields),
            image,
            Upload(field, "mask_image", files[field][0]) if field else None,
        )
    data = await json_object(request)
    mask = data.pop(MASK, None)
    body, image = await parse_video_request(request, JobRequest, data=data)
    return body, image, reference_upload(mask, MASK) if mask is not None else None


async def _jobs(server: Server, request: Request) -> tuple[list[Job], dict[str, str]]:
    """The jobs of one request, and the response headers naming the fields the pipeline did not take."""
    body, image, mask = await _parse(request)
    server.check_model(body.model, "diffusion")
    made = server.outputs
    fmt = _format(server, body)
    if made != "video" and (body.num_frames is not None or body.seconds is not None):
        name = "num_frames" if body.num_frames is not None else "seconds"
        raise ApiError(
            400, f"{name}: this server's pipeline makes {made}, not video; drop {name}", param=name
        )
    frames = body.frames(server.info.temporal_factor, server.video_fps(body.fps)) if made == "video" else None
    jobs = server.diffusion_jobs(
        body,
        ASYNC_KIND[made],
        num_frames=frames,
        fps=body.fps,
        output_format=fmt,
        image=image,
        mask=mask,
        image_field=REFERENCE,
    )
    return jobs, unused_headers(server, body)


def _job(server: Server, job_id: str) -> Job:
    job = server.store.get(job_id) if valid_job_id(job_id) else None
    if job is None:
        raise ApiError(404, f"no job {job_id!r} (GET /v1/jobs lists them)", param="job_id", code="not_found")
    return job


@router.post("/v1/jobs", response_model=JobObject, openapi_extra=_JOB_BODY)
async def create_job(request: Request, response: Response, server: ServerDep) -> JobObject:
    """Queue a job; poll ``GET /v1/jobs/{id}`` (step ``k`` of ``n``, ETA), then download ``/content``."""
    if server.kind != "diffusion":
        raise ApiError(
            400, f"this server runs a causal LM; use {server.routes_hint()}", code="wrong_model_kind"
        )
    jobs, headers = await _jobs(server, request)
    server.submit(jobs)
    response.headers.update(headers)
    return server.job_view(jobs[0])


@router.get("/v1/jobs", response_model=JobList)
async def list_jobs(
    server: ServerDep,
    limit: int = Query(20, ge=1, le=1000),
    order: str = Query("desc", pattern="^(asc|desc)$"),
) -> JobList:
    jobs = server.store.list()
    jobs = jobs[::-1] if order == "desc" else jobs
    return JobList(data=[server.job_view(j) for j in jobs[:limit]])


@router.get("/v1/jobs/{job_id}", response_model=JobObject)
async def get_job(job_id: str, server: ServerDep) -> JobObject:
    return server.job_view(_job(server, job_id))


@router.get("/v1/jobs/{job_id}/content", response_class=FileResponse, responses=_FILE)
async def job_content(job_id: str, server: ServerDep) -> FileResponse:
    job = _job(server, job_id)
    return job_file(server, job, f"job {job_id}", server.job_view(job).content_type)


@router.delete("/v1/jobs/{job_id}", response_model=JobObject | DeletedJob)
async def delete_job(job_id: str, server: ServerDep) -> JobObject | DeletedJob:
    """Cancel a queued or running job (it becomes ``cancelled``); delete a finished one and its file."""
    job = _job(server, job_id)
    if job.finished:
        server.store.delete(job)
        return DeletedJob(id=job.id, deleted=True)
    server.store.cancel(job, "cancelled by DELETE /v1/jobs/{id}")
    return server.job_view(job)
