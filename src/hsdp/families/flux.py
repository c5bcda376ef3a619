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
        # The inverse of _convert_kohya_flux_lora_to_diffusers is more than renaming: the original model fuses
        # to_q/to_k/to_v into one qkv (single blocks add proj_mlp), so their LoRAs become one block-diagonal LoRA
        # of rank 3r, and the converter hard-codes FLUX.1's 19 + 38 blocks and its 3072 width.
        comfyui_refusal=(
            "FLUX.1's ComfyUI LoRA uses the original fused qkv / linear1 layers, which diffusers' converter "
            "(_convert_kohya_flux_lora_to_diffusers) splits with FLUX.1-dev's fixed 19 + 38 blocks and 3072 width; "
            "hsdp does not write that fused layout"
        ),
    )
)
