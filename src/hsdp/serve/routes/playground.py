"""``/``: the playground, a page that runs jobs on this server from a browser (docs/serving.md).

Static files shipped in the package (:file:`hsdp/serve/static`): plain HTML, CSS and JavaScript with nothing
fetched from elsewhere, so the page works on a machine with no internet. The page holds no secret and calls
only the public API (``/v1/models``, ``/v1/jobs``), so it is served without the API key; the key is asked for
in the page and sent by its requests.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

from hsdp.serve.http import OPEN_PREFIX
from hsdp.serve.schemas import ApiError

__all__ = ["router"]
_TYPES = {
    "html": "text/html; charset=utf-8",
    "js": "text/javascript; charset=utf-8",
    "css": "text/css; charset=utf-8",
}
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

router = APIRouter(include_in_schema=False)


def _static(name: str) -> Response:
    path = files("hsdp.serve").joinpath("static", name)
    suffix = name.rsplit(".", 1)[-1]
    if "/" in name or suffix not in _TYPES or not path.is_file():
        raise ApiError(404, f"no file {name!r} in the playground", code="not_found")
    return Response(path.read_bytes(), media_type=_TYPES[suffix], headers=_HEADERS)


@router.get("/")
async def playground() -> Response:
    return _static("index.html")


@router.get(OPEN_PREFIX + "{name}")
async def playground_file(name: str) -> Response:
    return _static(name)
