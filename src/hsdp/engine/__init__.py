"""The inference engine: :class:`Engine`, :class:`SamplingParams` and the outputs of ``generate``."""

__all__ = ["Engine", "GenerationOutput", "SamplingParams", "Timings"]

_LAZY = {
    "Engine": "hsdp.engine.engine",
    "GenerationOutput": "hsdp.engine.outputs",
    "Timings": "hsdp.engine.outputs",
    "SamplingParams": "hsdp.engine.params",
}
"""Where each public name lives, imported on first use: the command line imports :mod:`hsdp.engine.cli` to build
its parser, which must not pull in the engine (and with it torch's DTensor, peft's loaders, ...)."""


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hsdp.engine' has no attribute {name!r}")
