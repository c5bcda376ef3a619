"""FLUX.1 (text-to-image, Kontext editing, Fill, ...): latents are packed in 2 x 2 patches before the transformer,
whose own ``patch_size`` is 1, so height and width are multiples of 16 (VAE 8 x packing 2). Its ``guidance_scale``
is a distilled embedding, not classifier-free guidance; ``true_cfg_scale`` with a negative prompt runs the
separate unconditional pass that CFG parallel splits off."""

from hsdp.families import Family, register_family

FLUX = register_family(
    Family(
        "FLUX.1", pipelines=r"Flux(Kontext|Fill|Img2Img|Inpaint|KontextInpaint)?Pipeline", latent_packing=2
    )
)
