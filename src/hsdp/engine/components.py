"""What a rank loads for the engine: the :class:`LoadSpec` the caller sends, and :func:`load_component`, which loads
a causal LM or one component of a pipeline as a runner holds it.

Below both the rank-side entry points (:mod:`hsdp.engine.worker`, which picks the runner) and the runners
(:mod:`hsdp.engine.diffusion`, :mod:`hsdp.engine.causal_lm`), so neither imports the other for it; the diffusion
trainer loads its text encoders through it too.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hsdp.config import ParallelConfig
from hsdp.engine import adapters
from hsdp.launch import emit_event
from hsdp.mesh import ParallelMeshes

logger = logging.getLogger("hsdp")

__all__ = ["LoadSpec", "load_component", "loading_part"]


@dataclass(frozen=True)
class LoadSpec:
    path: Path
    kind: str
    """``diffusion`` or ``causal_lm`` (from :func:`hsdp.engine.model_info.inspect_model`)."""
    config: ParallelConfig
    dtype: str | None = None
    forward_prefetch: bool = True
    cancel_prefix: str | None = None
    """Where in the rendezvous store the caller's :class:`hsdp.engine.control.CancelBoard` writes, when requests
    can be cancelled."""
    weight_dtype: str | None = None
    """``int8`` / ``fp8``: 8-bit weight shards (:mod:`hsdp.quantize`)."""
    load_options: dict[str, dict] | None = None
    """Component -> sharding options replacing the defaults (``--device-memory``'s residency and prefetch)."""
    compile: bool = False
    """``--compile``: regional compilation of the denoisers' repeated blocks (:mod:`hsdp.engine.compile`)."""
    attention_backend: str | None = None
    """``--attention-backend``: the denoisers' or the causal LM's attention kernel (:mod:`hsdp.attention`)."""
    vae_parallel: bool = False
    """``--vae-parallel``: the VAE's tiled decode and encode split over the ranks (:mod:`hsdp.vae_parallel`)."""
    vae_tiling: bool = False
    """``--vae-tiling``: diffusers' ``enable_tiling`` of the VAE."""
    vae_slicing: bool = False
    """``--vae-slicing``: diffusers' ``enable_slicing`` of the VAE."""
    lora: adapters.SlotSpec | None = None
    """Empty LoRA adapter slots (``--lora``, ``--max-loras``) injected into the causal LM or the pipeline's
    denoiser before sharding; the caller fills them (:func:`hsdp.engine.worker.load_adapter`) and picks one per call."""



@contextlib.contextmanager
def loading_part(what: str, index: int, total: int):
    """Tell the caller when part ``index`` of ``total`` of the load (a component) is done, and how long it took:
    the caller's start-up progress names it (a bar on a terminal, a line in a log)."""
    started = time.perf_counter()
    yield
    emit_event({"loaded": what, "index": index, "total": total, "seconds": time.perf_counter() - started})


def load_component(
    spec: LoadSpec,
    meshes: ParallelMeshes,
    component: str | None = None,
    *,
    lora: adapters.SlotSpec | None = None,
    denoiser: bool = True,
) -> torch.nn.Module:
    """Load the model of ``spec`` (a causal LM), or its pipeline's ``component`` folder, as a runner holds it.

    With HSDP it is sharded over ``meshes`` with explicit forward prefetch (``spec.forward_prefetch``), the
    8-bit ``spec.weight_dtype`` and the component's ``spec.load_options`` (a causal LM's are under ``model``);
    without, it loads whole through the same loader (fresh memory, the same dtype conversion). ``lora``: adapter
    slots injected on meta before sharding, all off (:meth:`hsdp.engine.adapters.SlotSpec.inject`). ``--offload-layers``
    offloads the blocks of the model that runs every step (the causal LM, a ``denoiser``), not a text encoder's or
    a VAE's (``denoiser=False``), which run once per request."""
    from hsdp.engine.parallel import overlap_options
    from hsdp.loading import load_pretrained

    config = spec.config
    if not denoiser and config.offload_layers is not None:
        config = replace(config, offload_layers=None).resolved()
    shard = {}
    if config.use_hsdp:
        shard = {
            "meshes": meshes,
            **overlap_options(config, forward_prefetch=spec.forward_prefetch),
            **(spec.load_options or {}).get(component or "model", {}),
        }
    model = load_pretrained(
        spec.path / component if component else spec.path,
        config if config.use_hsdp else ParallelConfig(),
        dtype=spec.dtype or "auto",
        weight_dtype=spec.weight_dtype,
        prepare=lora.inject if lora is not None else None,
        **shard,
    )
    if lora is not None:
        logger.info("%d LoRA slots of rank %d on %s", lora.count, lora.rank, component or "the model")
    return model
