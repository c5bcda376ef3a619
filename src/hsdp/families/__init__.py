"""Per-family knowledge of diffusers pipelines that their own metadata does not carry, one small file each.

Almost everything the engine needs is read from the pipeline folder and from diffusers itself: the components
(:mod:`hsdp.models.description`), which of them to shard (their classes and sizes), the arguments a pipeline takes (its
``__call__`` signature), whether guidance runs separate conditional and unconditional passes (its
``cache_context("uncond")`` label), Ulysses support (the transformer's ``_cp_plan``) and the VAE's compression
(its config). What remains are facts a pipeline computes in code that must be known before it runs, such as FLUX
packing 2 x 2 latent patches before its transformer (so sizes are multiples of 16, not 8), and the ComfyUI LoRA
layouts. Training needs none: the denoiser's inputs are recorded from the pipeline's own ``__call__``
(:mod:`hsdp.train.diffusion.pipeline_call`). A family file registers a :class:`Family` with those facts; a
pipeline no family claims runs with the generic rules (:data:`GENERIC`).
"""

from __future__ import annotations

from hsdp.families.family import FAMILIES, GENERIC, Family, family_for, family_of_model, register_family

__all__ = ["Family", "register_family", "family_for", "family_of_model", "FAMILIES", "GENERIC"]

# Family files register themselves on import.
from hsdp.families import chroma, flux, hidream, ltx2, qwenimage, stable_audio, wan  # noqa: E402,F401
