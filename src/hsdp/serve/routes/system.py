"""``/health``, ``/v1/models`` and ``/metrics``: what load balancers, clients and Prometheus ask about the server."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from hsdp.serve.fields import model_parameters
from hsdp.serve.metrics import CONTENT_TYPE, render_metrics
from hsdp.serve.routes.common import ServerDep
from hsdp.serve.schemas import Health, ModelCard, ModelList
from hsdp.serve.service import ROUTES

__all__ = ["router"]

router = APIRouter()


@router.get("/health", response_model=Health, responses={503: {"model": Health}})
async def health(server: ServerDep) -> JSONResponse:
    """200 while the engine is ready; 503 while it starts or restarts (queued jobs still wait), or when the
    engine thread is dead (``engine: dead``: restart the server)."""
    state = server.runner.state
    body = Health(status="ok" if state == "ready" else "unavailable", model=server.name, engine=state)
    return JSONResponse(body.model_dump(), status_code=200 if state == "ready" else 503)


@router.get("/v1/models", response_model=ModelList)
async def models(server: ServerDep) -> ModelList:
    """The base, then each LoRA adapter as vLLM lists one: its folder as ``root``, the base as ``parent``. The
    base's card has ``parameters``: the fields its requests take, with the model's defaults and this server's
    limits."""
    created = int(server.info.path.stat().st_mtime)
    makes = {"kind": server.kind, "outputs": [server.outputs], "routes": list(ROUTES[server.outputs])}
    route = "/v1/jobs" if server.kind == "diffusion" else None
    parameters = model_parameters(server.info, server.settings.limits, route)
    base = ModelCard(id=server.name, created=created, parameters=parameters, **makes)
    adapters = [
        ModelCard(id=name, created=created, root=str(path), parent=server.name, **makes)
        for name, path in sorted(server.adapter_paths.items())
    ]
    return ModelList(data=[base, *adapters])


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(server: ServerDep) -> Response:
    counts = {**server.adapter_counts(), "base_loads": server.base_loads}
    engine = server.runner.engine
    quantized = engine.quantized if engine is not None and not engine.closed else None
    return Response(
        render_metrics(server.name, server.store, server.runner.stats, counts, quantized), media_type=CONTENT_TYPE
    )
