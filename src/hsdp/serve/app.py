"""The FastAPI application: vLLM-Omni / OpenAI shaped routes over one :class:`hsdp.serve.service.Server`.

Handlers only validate, queue and wait; the engine thread does the work. Asynchronous video jobs return at once
and are polled; the other generation endpoints wait for their job without holding a thread (an asyncio future
resolved by the engine thread). The routes live in :mod:`hsdp.serve.routes`, one router per area; this module
builds the app around them: the server on ``app.state``, the auth and body-size guard, OpenAI-style errors.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from hsdp.serve.http import GuardMiddleware, install_error_handlers
from hsdp.serve.routes import ROUTERS
from hsdp.serve.schemas import ErrorBody
from hsdp.serve.service import Server

__all__ = ["create_app"]

_ERRORS = {status: {"model": ErrorBody} for status in (400, 401, 404, 409, 413, 429)}
"""The error statuses every operation documents (OpenAI's error body)."""


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Stopping the app stops the engine."""
    yield
    app.state.server.stop()


def create_app(server: Server) -> FastAPI:
    """The ASGI app for a started ``server``; stopping the app (lifespan end) stops the engine."""
    app = FastAPI(
        title="hsdp serve",
        version="1",
        description="OpenAI-style video, image and text generation over a model sharded with FSDP2 (HSDP).",
        responses=_ERRORS,
        lifespan=_lifespan,
    )
    app.state.server = server
    limits = server.settings.limits
    app.add_middleware(GuardMiddleware, api_key=server.settings.api_key, max_body_bytes=limits.max_body_bytes)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app
