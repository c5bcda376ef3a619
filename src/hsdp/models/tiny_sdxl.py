"""A small Stable-Diffusion-XL-architecture image pipeline built offline (random weights, fixed seed): ``tiny-sdxl``.

Every component is the real ``diffusers`` / ``transformers`` class at toy sizes, laid out like a downloaded
``stabilityai/stable-diffusion-xl-base-1.0`` folder: two CLIP text encoders (``CLIPTextModel`` and
``CLIPTextModelWithProjection``, whose penultimate hidden states are concatenated into the cross-attention context
and whose projected pooled vector joins the size/crop "time ids" in the ``text_time`` added embedding), each with a
byte-level tokenizer at CLIP's fixed context length; a two-level ``UNet2DConditionModel``; an 8x ``AutoencoderKL``
and SDXL's ``EulerDiscreteScheduler``. Classifier-free guidance runs as one batched UNet call (uncond, cond).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hsdp.generation_defaults import write_generation_defaults
from hsdp.models.registry import register_builtin
from hsdp.models.tiny import TINY_SEED
from hsdp.models.tiny_flux import (
    TINY_CLIP_VERSION,
    clip_tokenizer,
    fill_zero_params,
    tiny_clip_text_config,
    tiny_flux_vae,
)

__all__ = ["build_tiny_sdxl_pipeline", "build_tiny_sdxl_unet", "TINY_SDXL_DEFAULTS"]

TINY_SDXL_DEFAULTS = {
    "height": 64,
    "width": 64,
    "num_inference_steps": 4,
    "guidance_scale": 5.0,
}
"""Generation defaults written next to the pipeline (read by the engine when a request leaves them unset)."""

ADDITION_TIME_EMBED_DIM = 8
TIME_IDS = 6
"""SDXL's micro-conditioning: original size (2), crop top-left (2) and target size (2), each embedded separately."""


def build_tiny_sdxl_unet(seed: int = TINY_SEED, *, cross_attention_dim: int, pooled_dim: int, **overrides):
    """A two-level ``UNet2DConditionModel`` with SDXL's ``text_time`` added conditioning and linear projections."""
    from diffusers import UNet2DConditionModel

    values = dict(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=8,
        attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 2),
        use_linear_projection=True,
        cross_attention_dim=cross_attention_dim,
        addition_embed_type="text_time",
        addition_time_embed_dim=ADDITION_TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=ADDITION_TIME_EMBED_DIM * TIME_IDS + pooled_dim,
    )
    values.update(overrides)
    torch.manual_seed(seed)
    return fill_zero_params(UNet2DConditionModel(**values))


def build_tiny_sdxl_pipeline(seed: int = TINY_SEED, **unet_overrides):
    """A ``StableDiffusionXLPipeline`` of a few hundred thousand parameters."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = clip_tokenizer()
    tokenizer_2 = clip_tokenizer()
    torch.manual_seed(seed + 1)
    text_encoder = CLIPTextModel(tiny_clip_text_config(len(tokenizer), hidden_size=32)).eval()
    torch.manual_seed(seed + 2)
    text_encoder_2 = CLIPTextModelWithProjection(
        tiny_clip_text_config(len(tokenizer_2), hidden_size=48, projection_dim=32, num_attention_heads=3)
    ).eval()
    unet = build_tiny_sdxl_unet(
        seed,
        cross_attention_dim=text_encoder.config.hidden_size + text_encoder_2.config.hidden_size,
        pooled_dim=text_encoder_2.config.projection_dim,
        **unet_overrides,
    )
    vae = tiny_flux_vae(
        unet.config.in_channels,
        seed + 3,
        scaling_factor=0.13025,
        shift_factor=None,
        use_quant_conv=True,
        use_post_quant_conv=True,
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        prediction_type="epsilon",
        timestep_spacing="leading",
        steps_offset=1,
        interpolation_type="linear",
        use_karras_sigmas=False,
    )
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )


@register_builtin("tiny-sdxl", version=TINY_CLIP_VERSION)
def _write_tiny_sdxl(folder: Path) -> None:
    build_tiny_sdxl_pipeline().save_pretrained(folder)
    write_generation_defaults(folder, TINY_SDXL_DEFAULTS)
