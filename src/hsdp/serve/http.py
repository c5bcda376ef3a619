"""HTTP plumbing shared by every route: bearer-token auth, the body-size cap, and OpenAI-style error bodies.

Both guards are one pure ASGI middleware, so they run before FastAPI parses anything (an oversized or
unauthenticated body is never read into a model) and also cover ``/openapi.json`` and ``/docs``.
"""

from __future__ import annotations

import hmac
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hsdp.serve.schemas import UNION_TAGS, UNKNOWN_FIELD, ApiError, unknown_fields_problem

__all__ = ["GuardMiddleware", "install_error_handlers", "describe_validation_errors", "OPEN_PATHS", "OPEN_PREFIX"]

OPEN_PATHS = frozenset({"/health", "/"})
"""Paths served without the API key: load balancers probe ``/health``; ``/`` is the playground's page."""
OPEN_PREFIX = "/playground/"
"""The playground's static files (they hold no secret; the page asks for the key and sends it)."""


async def _send_error(send: Send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """``Authorization: Bearer <key>`` on every path but :data:`OPEN_PATHS`; bodies over ``max_body_bytes`` get 413."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path = scope["path"]
        if self.api_key is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIX):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                await _send_error(
                    send,
                    ApiError(
                        401,
                        "missing or wrong API key: send 'Authorization: Bearer <key>' (the key given to hsdp serve "
                        "--api-key or HSDP_API_KEY)",
                        code="invalid_api_key",
                        kind="authentication_error",
                        headers={"WWW-Authenticate": "Bearer"},
                    ),
                )
                return
        declared = headers.get(b"content-length")
        too_big = ApiError(
            413,
            f"request body exceeds this server's {self.max_body_bytes} bytes (hsdp serve --max-body-bytes)",
            code="body_too_large",
        )
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _send_error(send, too_big)
            return
        # Read the body here (it is small by construction) so a chunked upload cannot exceed the cap either.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await _send_error(send, too_big)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic errors as one line per field (``num_frames: Input should be ...``) and the first field's name."""
    parts, first = [], None
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p not in ("body", *UNION_TAGS)]
        if error.get("type") == UNKNOWN_FIELD:  # raised by the body itself: its fields are in ctx
            prefix, ctx = "".join(f"{p}." for p in loc), error["ctx"]
            first = first or prefix + next(iter(ctx["closest"]))
            parts.append(unknown_fields_problem(ctx["closest"], ctx["hint"], prefix))
            continue
        field = ".".join(loc) or "body"
        first = first or field
        parts.append(f"{field}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request", first


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return _error_response(ApiError(400, message, param=param, code="invalid_request"))

    @app.exception_handler(ValidationError)
    async def model_validation(request: Request, exc: ValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return _error_response(ApiError(400, message, param=param, code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = ApiError(
            exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None
        )
        error.headers = dict(exc.headers or {})
        return _error_response(error)
