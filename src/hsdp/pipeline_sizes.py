"""The size rules a diffusers pipeline puts on what it makes, as the pipeline itself states them: its VAE's spatial
and temporal compression (heights and widths are multiples of the first, frame counts ``t * k + 1`` for the second).

One implementation for the trainer, which asks its loaded or meta-built pipeline, and for the engine and the server,
which ask before any rank starts (issue 33 item 3). Reading ``vae/config.json`` is not enough: the LTX and LTX-2
VAEs leave ``temporal_compression_ratio`` null there and their class derives it (``patch_size_t * 2 ** sum(
spatio_temporal_scaling)``), so a config reader took 1 where the pipeline checks 2 (or 8), and ``--num-frames 6``
was silently cut to 5 frames by the pipeline.

The caller's choice (issue 34 asks the launching process not to load heavy pipeline modules to inspect a model):
:func:`skeleton_pipeline` runs the pipeline class's own ``__init__`` with its VAE built on the meta device from its
config (no weights read, no memory; a real LTX-2 VAE builds in well under a second) and every other component left
out. It costs the pipeline and VAE classes' imports, which inspecting the model already pays today (the call
signature and the output class come from the pipeline class); a pipeline whose ``__init__`` needs another component
gives None, and the caller falls back to the config rule. Asking the ranks after they build the pipeline would be
exact too, but too late for the refusals ``hsdp generate`` makes before any rank starts.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import warnings
from pathlib import Path
from typing import Any

__all__ = ["SPATIAL_NAMES", "TEMPORAL_NAMES", "pipeline_compression", "skeleton_pipeline"]

logger = logging.getLogger("hsdp")

SPATIAL_NAMES = ("vae_scale_factor_spatial", "vae_spatial_compression_ratio", "vae_scale_factor")
"""The attributes diffusers pipelines name their VAE's spatial compression by, the most specific first."""
TEMPORAL_NAMES = ("vae_scale_factor_temporal", "vae_temporal_compression_ratio")
"""Those of its temporal compression (video pipelines only)."""


def _attribute(pipe: Any, names: tuple[str, ...]) -> int | None:
    value = next((getattr(pipe, n) for n in names if getattr(pipe, n, None) is not None), None)
    return int(value) if value is not None else None


def pipeline_compression(pipe: Any) -> tuple[int | None, int | None]:
    """``(spatial, temporal)`` compression as the pipeline's own attributes state them; None where it names none
    (an image pipeline has no temporal one)."""
    return _attribute(pipe, SPATIAL_NAMES), _attribute(pipe, TEMPORAL_NAMES)


def skeleton_pipeline(folder: Path, pipeline_cls: type) -> Any | None:
    """``pipeline_cls`` as its ``__init__`` sets it up around the VAE of ``folder`` built on the meta device, every
    other component None: what it derives from the VAE (:func:`pipeline_compression`), without weights. None when
    the folder has no VAE config or ``__init__`` needs another component."""
    import torch

    index = json.loads((Path(folder) / "model_index.json").read_text())
    spec = index.get("vae")
    config_file = Path(folder) / "vae" / "config.json"
    if not (isinstance(spec, list) and spec[0] and config_file.is_file()):
        return None
    init = inspect.signature(pipeline_cls.__init__).parameters
    parts = {
        name: None if p.default is inspect.Parameter.empty else p.default
        for name, p in init.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    try:
        vae_cls = getattr(importlib.import_module(spec[0]), spec[1])
        # The ranks build the real VAE and show its warnings (Stable Audio's weight_norm deprecation) then.
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parts["vae"] = vae_cls.from_config(json.loads(config_file.read_text()))
        pipe = pipeline_cls.__new__(pipeline_cls)
        pipe.__init__(**parts)
    except Exception as exc:  # noqa: BLE001 - any failure means "ask the config instead"
        logger.debug("%s.__init__ without its components failed (%s); sizes from the configs", pipeline_cls, exc)
        return None
    return pipe
