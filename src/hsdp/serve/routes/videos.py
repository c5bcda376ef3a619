"""``/v1/videos``: asynchronous video jobs (queue, poll, download, cancel or delete) and ``/v1/videos/sync``."""

from __future__ import annotations

from typing import TypeVar

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, Response

from hsdp.serve.jobs import Job
from hsdp.serve.media import Upload, reference_upload
from hsdp.serve.routes.common import (
    ServerDep,
    form_schema,
    is_form,
    job_file,
    json_object,
    read_form,
    run_jobs,
    unused_headers,
    validate,
)
from hsdp.serve.schemas import ApiError, DeletedVideo, VideoJob, VideoList, VideoRequest, valid_job_id
from hsdp.serve.service import Server

__all__ = ["REFERENCE", "parse_video_request", "router"]

VideoRequestT = TypeVar("VideoRequestT", bound=VideoRequest)

REFERENCE = "input_reference"
"""The input image of ``/v1/videos`` (OpenAI's and vLLM-Omni's name)."""


_VIDEO_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": VideoRequest.model_json_schema()},
            "multipart/form-data": {
                "schema": form_schema(
                    VideoRequest, {REFERENCE: "input image (image-to-video pipelines)"}, ("prompt",)
                )
            },
        },
    }
}
_MP4 = {200: {"content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}}}

router = APIRouter()


async def parse_video_request(
    request: Request, model: type[VideoRequestT] = VideoRequest, *, data: dict | None = None
) -> tuple[VideoRequestT, Upload | None]:
    """The body as JSON or as form fields (``curl -F``), and the input image: the ``input_reference`` file part,
    or in JSON a data URL (``"input_reference": {"image_url": "data:..."}``). ``data``: the JSON body when the
    caller has read it already."""
    if is_form(request):
        fields, files = await read_form(request)
        image = files.get(REFERENCE) and Upload(REFERENCE, "image", files[REFERENCE][0])
        return validate(model, fields), image or None
    if data is None:
        data = await json_object(request)
    reference = data.pop(REFERENCE, None)
    image = reference_upload(reference, REFERENCE) if reference is not None else None
    return validate(model, data), image


async def _video_jobs(server: Server, request: Request, kind: str) -> tuple[list[Job], dict[str, str]]:
    """The jobs of one request, and the response headers naming the fields the pipeline did not take."""
    body, image = await parse_video_request(request)
    server.check_model(body.model, "diffusion")
    server.check_video_model()
    jobs = server.diffusion_jobs(
        body,
        kind,
        num_frames=body.frames(server.info.temporal_factor, server.video_fps(body.fps)),
        fps=body.fps,
        image=image,
        image_field=REFERENCE,
    )
    return jobs, unused_headers(server, body)


def _video_job(server: Server, video_id: str) -> Job:
    job = server.store.get(video_id) if valid_job_id(video_id) else None
    if job is None or job.kind != "video":
        raise ApiError(
            404,
            f"no video job {video_id!r} (GET /v1/videos lists them)",
            param="video_id",
            code="not_found",
        )
    return job


@router.post("/v1/videos", response_model=VideoJob, openapi_extra=_VIDEO_BODY)
async def create_video(request: Request, response: Response, server: ServerDep) -> VideoJob:
    """Queue a video job; poll ``GET /v1/videos/{id}``, then download ``/content``."""
    jobs, headers = await _video_jobs(server, request, "video")
    server.submit(jobs)
    response.headers.update(headers)
    return server.video_view(jobs[0])


@router.post("/v1/videos/sync", response_class=Response, responses=_MP4, openapi_extra=_VIDEO_BODY)
async def create_video_sync(request: Request, server: ServerDep) -> Response:
    """Generate and answer with the mp4 bytes (not stored)."""
    jobs, headers = await _video_jobs(server, request, "video_sync")
    [job] = await run_jobs(server, jobs, request)
    return Response(job.result, media_type="video/mp4", headers={"X-Video-Seed": str(job.seed), **headers})


@router.get("/v1/videos", response_model=VideoList)
async def list_videos(
    server: ServerDep,
    limit: int = Query(20, ge=1, le=1000),
    order: str = Query("desc", pattern="^(asc|desc)$"),
) -> VideoList:
    jobs = [j for j in server.store.list() if j.kind == "video"]  # /v1/jobs lists the images and audio too
    jobs = jobs[::-1] if order == "desc" else jobs
    return VideoList(data=[server.video_view(j) for j in jobs[:limit]])


@router.get("/v1/videos/{video_id}", response_model=VideoJob)
async def get_video(video_id: str, server: ServerDep) -> VideoJob:
    return server.video_view(_video_job(server, video_id))


@router.get("/v1/videos/{video_id}/content", response_class=FileResponse, responses=_MP4)
async def video_content(video_id: str, server: ServerDep) -> FileResponse:
    return job_file(server, _video_job(server, video_id), f"video {video_id}", "video/mp4")


@router.delete("/v1/videos/{video_id}", response_model=VideoJob | DeletedVideo)
async def delete_video(video_id: str, server: ServerDep) -> VideoJob | DeletedVideo:
    """Cancel a queued or running job (it becomes ``cancelled``); delete a finished one and its video."""
    job = _video_job(server, video_id)
    if job.finished:
        server.store.delete(job)
        return DeletedVideo(id=job.id, deleted=True)
    server.store.cancel(job, "cancelled by DELETE /v1/videos/{id}")
    return server.video_view(job)
