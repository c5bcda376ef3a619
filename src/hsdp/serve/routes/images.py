"""``/v1/images/generations`` and ``/v1/images/edits``: OpenAI's images API (base64 answers, nothing hosted)."""

from __future__ import annotations

import base64
import time

from fastapi import APIRouter, Request, Response

from hsdp.serve.jobs import Job
from hsdp.serve.media import Upload
from hsdp.serve.routes.common import (
    ServerDep,
    form_schema,
    is_form,
    read_form,
    run_jobs,
    unused_headers,
    validate,
)
from hsdp.serve.schemas import ApiError, ImageData, ImageEditRequest, ImageRequest, ImagesResponse
from hsdp.serve.service import Server

__all__ = ["router"]

_IMAGE_FIELDS = ("image", "image[]")
"""OpenAI's SDK sends a list of images as ``image[]``, vLLM-Omni's client repeats ``image``."""
_MASK_FIELDS = ("mask", "mask_image")
"""OpenAI's name and vLLM-Omni's."""
_EDIT_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": form_schema(
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

router = APIRouter()


def _one_frame(server: Server) -> int | None:
    """Image endpoints on a video pipeline ask for a single frame; image pipelines take no num_frames."""
    return 1 if server.info.output == "video" else None


async def _images_response(
    server: Server, body: ImageRequest, jobs: list[Job], request: Request, response: Response
) -> ImagesResponse:
    if body.response_format == "url":
        raise ApiError(
            400,
            "response_format='url' is not served (nothing is hosted); use 'b64_json'",
            param="response_format",
        )
    jobs = await run_jobs(server, jobs, request)
    response.headers.update(unused_headers(server, body))
    data = [ImageData(b64_json=base64.b64encode(j.result).decode(), revised_prompt=j.prompt) for j in jobs]
    return ImagesResponse(
        created=int(time.time()), data=data, output_format=body.output_format, size=jobs[0].meta["size"]
    )


@router.post("/v1/images/generations", response_model=ImagesResponse)
async def create_images(
    body: ImageRequest, request: Request, response: Response, server: ServerDep
) -> ImagesResponse:
    """OpenAI images: ``n`` images (seeds ``seed + i``); a video pipeline makes one frame per image."""
    server.check_model(body.model, "diffusion")
    jobs = server.diffusion_jobs(
        body, "image", count=body.n, num_frames=_one_frame(server), output_format=body.output_format
    )
    return await _images_response(server, body, jobs, request, response)


async def _edit_request(server: Server, request: Request) -> tuple[ImageEditRequest, Upload, Upload | None]:
    """The multipart edit: its fields, the first image and the optional mask, checked against the model."""
    if not is_form(request):
        raise ApiError(400, "send the edit as multipart/form-data with an 'image' file part", param="image")
    fields, files = await read_form(request)
    body = validate(ImageEditRequest, fields)
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
        raise ApiError(400, "image: required; send the image to edit as an 'image' file part", param="image")
    mask_field = next((name for name in _MASK_FIELDS if name in files), None)
    mask = Upload(mask_field, "mask_image", files[mask_field][0]) if mask_field else None
    return body, Upload("image", "image", images[0]), mask


@router.post("/v1/images/edits", response_model=ImagesResponse, openapi_extra=_EDIT_BODY)
async def edit_images(request: Request, response: Response, server: ServerDep) -> ImagesResponse:
    """OpenAI image edits (multipart): the first ``image`` (or ``image[]``), an optional ``mask``."""
    body, image, mask = await _edit_request(server, request)
    jobs = server.diffusion_jobs(
        body,
        "image",
        count=body.n,
        num_frames=_one_frame(server),
        output_format=body.output_format,
        image=image,
        mask=mask,
        pipeline_kwargs={"strength": body.strength},
    )
    return await _images_response(server, body, jobs, request, response)
