"""Qwen-Image: its pipeline packs latents in 2 x 2 patches before the transformer (``QwenImagePipeline.
_pack_latents``) and rounds the requested height and width down to multiples of 16 in code, so the sizes a
request or a training item may have are a fact no config carries: multiples of VAE factor 8 x packing 2."""

from __future__ import annotations

from hsdp.families.family import Family, register_family

QWEN_IMAGE = register_family(Family("Qwen-Image", pipelines=r"QwenImage\w*Pipeline", latent_packing=2))
