"""FLUX.1 (text-to-image, Kontext editing, Fill, ...): latents are packed in 2 x 2 patches before the transformer,
whose own ``patch_size`` is 1, so height and width are multiples of 16 (VAE 8 x packing 2). Its ``guidance_scale``
is a distilled embedding, not classifier-free guidance; ``true_cfg_scale`` with a negative prompt runs the
separate unconditional pass that CFG parallel splits off."""

from __future__ import annotations

from hsdp.families.family import Family, register_family

FLUX = register_family(
    Family(
        "FLUX.1",
        pipelines=r"Flux(Kontext|Fill|Img2Img|Inpaint|KontextInpaint)?Pipeline",
        latent_packing=2,
        denoisers=r"FluxTransformer2DModel",
        # Its kohya files with original names fuse to_q/to_k/to_v into one qkv, which diffusers' converter splits
        # with FLUX.1-dev's fixed widths; hsdp writes OneTrainer's diffusers-named layout, which it reads at any size.
        lora_pipeline="FluxPipeline",
    )
)
