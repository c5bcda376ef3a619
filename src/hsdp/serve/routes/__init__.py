"""The HTTP routes, one :class:`fastapi.APIRouter` per area; :func:`hsdp.serve.app.create_app` includes them in
:data:`ROUTERS` order (which is also the order of the OpenAPI paths).

- :mod:`~hsdp.serve.routes.system`: ``/health``, ``/v1/models``, ``/metrics``
- :mod:`~hsdp.serve.routes.videos`: ``/v1/videos`` (asynchronous jobs) and ``/v1/videos/sync``
- :mod:`~hsdp.serve.routes.jobs`: ``/v1/jobs`` (asynchronous jobs of any output: video, image, audio)
- :mod:`~hsdp.serve.routes.images`: ``/v1/images/generations``, ``/v1/images/edits``
- :mod:`~hsdp.serve.routes.audio`: ``/v1/audio/speech``
- :mod:`~hsdp.serve.routes.completions`: ``/v1/completions``, ``/v1/chat/completions``
- :mod:`~hsdp.serve.routes.adapters`: ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``
- :mod:`~hsdp.serve.routes.playground`: ``/`` and ``/playground/*``, the browser page (static files)

Handlers read the :class:`~hsdp.serve.service.Server` from ``app.state`` through
:data:`~hsdp.serve.routes.common.ServerDep`.
"""

from hsdp.serve.routes import adapters, audio, completions, images, jobs, playground, system, videos

__all__ = ["ROUTERS"]

ROUTERS = (
    system.router,
    videos.router,
    jobs.router,
    images.router,
    audio.router,
    completions.router,
    adapters.router,
    playground.router,
)
