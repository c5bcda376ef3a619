"""``hsdp serve``: an OpenAI-style HTTP server for video, image and text generation over a sharded model.

:class:`~hsdp.serve.service.Server` owns the job store and the engine thread; :func:`~hsdp.serve.app.create_app`
puts the HTTP API in front of it. See docs/serving.md.
"""

from hsdp.serve.settings import ServeLimits, ServeSettings

__all__ = ["ServeLimits", "ServeSettings"]
