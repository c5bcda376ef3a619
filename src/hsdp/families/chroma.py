"""Chroma (FLUX.1-schnell-derived text-to-image): its pipeline packs latents in 2 x 2 patches before the
transformer as FLUX's does (``ChromaPipeline._pack_latents``), and rounds the requested height and width down to
multiples of 16 in code (``2 * (height // (vae_scale_factor * 2))``), so the size a request or a training item
may have is a fact no config carries: sizes are multiples of VAE factor 8 x packing 2."""

from __future__ import annotations

from hsdp.families.family import Family, register_family

CHROMA = register_family(Family("Chroma", pipelines=r"Chroma(Img2Img|Inpaint)?Pipeline", latent_packing=2))
