"""Stable Diffusion XL: a UNet with "added conditioning" besides the CLIP embeddings, the pooled embedding of the
second text encoder (``text_embeds``) and the micro-conditioning ``time_ids`` (original size, crop corner, target
size). Training builds them as ``StableDiffusionXLPipeline.__call__`` does at its defaults: original and target
size the batch's pixel size, crop corner (0, 0). The refiner (Img2Img, aesthetic-score time ids) and Inpaint (mask
and masked-image channels) take conditions the trainer does not encode: only ``StableDiffusionXLPipeline`` trains.
The engine needs nothing from this family, so it claims no pipeline (SDXL runs with the generic rules)."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from hsdp.families import DenoiserBatch, DenoiserCall, Family, register_family


def sdxl_training_inputs(pipeline: type, model: nn.Module, batch: DenoiserBatch) -> DenoiserCall:
    """The UNet's inputs for ``batch`` as ``StableDiffusionXLPipeline.__call__`` builds them."""
    pooled = batch.prompts["pooled_prompt_embeds"]
    # _get_add_time_ids reads only self.unet (to check the embedding width against the UNet's): the trained one.
    time_ids = pipeline._get_add_time_ids(
        SimpleNamespace(unet=model),
        batch.size,
        (0, 0),
        batch.size,
        dtype=pooled.dtype,
        text_encoder_projection_dim=pooled.shape[-1],
    ).to(pooled.device)
    return DenoiserCall(
        {
            "sample": batch.noisy,
            "timestep": batch.timesteps,
            "encoder_hidden_states": batch.prompts["prompt_embeds"],
            "added_cond_kwargs": {"text_embeds": pooled, "time_ids": time_ids.repeat(len(pooled), 1)},
        }
    )


SDXL = register_family(
    Family(
        "Stable Diffusion XL",
        trains=r"StableDiffusionXLPipeline",
        prompt_outputs=("prompt_embeds", None, "pooled_prompt_embeds", None),
        training_inputs=sdxl_training_inputs,
    )
)
