"""FLUX.1 (text-to-image, Kontext editing, Fill, ...): latents are packed in 2 x 2 patches before the transformer,
whose own ``patch_size`` is 1, so height and width are multiples of 16 (VAE 8 x packing 2). Its ``guidance_scale``
is a distilled embedding, not classifier-free guidance; ``true_cfg_scale`` with a negative prompt runs the
separate unconditional pass that CFG parallel splits off.

Training builds the transformer's call as ``FluxPipeline.__call__`` does, with its own static helpers: packed
latents, their position ids, the T5 embeddings with their (zero) text ids, the pooled CLIP embedding, the timestep
as a fraction of 1000 and, for guidance-distilled checkpoints, the pipeline's default ``guidance_scale``. Kontext
and Fill add a reference image or a mask, which the trainer does not encode: only ``FluxPipeline`` trains."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from hsdp.families import DenoiserBatch, DenoiserCall, Family, register_family


def flux_training_inputs(pipeline: type, model: nn.Module, batch: DenoiserBatch) -> DenoiserCall:
    """The transformer's inputs for ``batch`` as ``FluxPipeline.__call__`` builds them."""
    rows, channels, height, width = batch.noisy.shape
    noisy = batch.noisy
    kwargs = {
        "hidden_states": pipeline._pack_latents(noisy, rows, channels, height, width),
        "img_ids": pipeline._prepare_latent_image_ids(rows, height // 2, width // 2, noisy.device, noisy.dtype),
        "encoder_hidden_states": batch.prompts["prompt_embeds"],
        "pooled_projections": batch.prompts["pooled_prompt_embeds"],
        "txt_ids": batch.prompts["text_ids"][0],  # the same for every caption (shared_prompt_outputs)
        "timestep": batch.timesteps / 1000,
        "guidance": None,
    }
    if model.config.guidance_embeds:
        scale = inspect.signature(pipeline.__call__).parameters["guidance_scale"].default
        kwargs["guidance"] = torch.full((rows,), float(scale), device=noisy.device, dtype=torch.float32)

    def unpack(prediction: torch.Tensor) -> torch.Tensor:
        # _unpack_latents takes pixel sizes and divides by vae_scale_factor; at factor 1 they are latent sizes.
        return pipeline._unpack_latents(prediction, height, width, 1)

    return DenoiserCall(kwargs, unpack)


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
        trains=r"FluxPipeline",
        prompt_outputs=("prompt_embeds", "pooled_prompt_embeds", "text_ids"),
        shared_prompt_outputs=("text_ids",),
        training_inputs=flux_training_inputs,
    )
)
