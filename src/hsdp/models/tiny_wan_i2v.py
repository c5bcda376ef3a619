"""A small Wan2.1-architecture image-to-video pipeline built offline (random weights, fixed seed): ``tiny-wan-i2v``.

The same text encoder, tokenizer, VAE and scheduler as ``tiny-wan`` (:mod:`hsdp.models.tiny_wan`), plus what makes
Wan2.1 I2V: a ``CLIPVisionModel`` image encoder (its penultimate hidden states, one token per patch plus the class
token, join the text in cross-attention through the transformer's ``image_dim`` embedder and ``added_kv_proj_dim``
projections) with a ``CLIPImageProcessor`` that resizes to the encoder's 32-pixel input, and a
``WanTransformer3DModel`` whose input is the noise latents concatenated with the VAE-encoded first frame and a
4-channel frame mask (``in_channels = 2 * z_dim + 4``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hsdp.generation_defaults import write_generation_defaults
from hsdp.models.registry import register_builtin
from hsdp.models.tiny import (
    TINY_SEED,
    build_byte_tokenizer,
    build_tiny_wan_transformer,
    tiny_wan_transformer_config,
)
from hsdp.models.tiny_wan import TINY_WAN_DEFAULTS, _tiny_umt5, _tiny_vae

__all__ = ["build_tiny_wan_i2v_pipeline", "TINY_WAN_I2V_DEFAULTS", "IMAGE_SIZE"]

IMAGE_SIZE = 32
"""The CLIP vision encoder's input resolution (224 in the real model); the image processor resizes to it."""

TINY_WAN_I2V_DEFAULTS = dict(TINY_WAN_DEFAULTS)
"""Generation defaults written next to the pipeline (the ``tiny-wan`` ones: 32 x 32, 5 frames, 4 steps, CFG 4)."""

Z_DIM = 4


def _tiny_clip_vision(seed: int, hidden_size: int = 32):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    config = CLIPVisionConfig(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        projection_dim=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=8,
        hidden_act="gelu",
    )
    return CLIPVisionModel(config).eval()


def _tiny_image_processor():
    try:  # transformers >= 5 without torchvision: the PIL backend (what CLIPImageProcessor falls back to anyway)
        from transformers import CLIPImageProcessorPil as Processor
    except ImportError:  # pragma: no cover - older transformers
        from transformers import CLIPImageProcessor as Processor

    return Processor(
        do_resize=True,
        size={"shortest_edge": IMAGE_SIZE},
        do_center_crop=True,
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_normalize=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )


def build_tiny_wan_i2v_pipeline(seed: int = TINY_SEED, **transformer_overrides):
    """A Wan2.1-shaped ``WanImageToVideoPipeline`` of a few hundred thousand parameters."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

    image_encoder = _tiny_clip_vision(seed + 4)
    vision_dim = image_encoder.config.hidden_size
    values = dict(in_channels=2 * Z_DIM + 4, out_channels=Z_DIM, image_dim=vision_dim)
    values.update(transformer_overrides)
    config = tiny_wan_transformer_config(**values)
    # Wan2.1 I2V projects the image tokens' keys/values from the inner dim (added_kv_proj_dim = heads x head dim).
    values.setdefault("added_kv_proj_dim", config["num_attention_heads"] * config["attention_head_dim"])
    transformer = build_tiny_wan_transformer(seed, **values)
    tokenizer = build_byte_tokenizer()
    text_encoder = _tiny_umt5(transformer.config.text_dim, len(tokenizer), seed + 1)
    vae = _tiny_vae(Z_DIM, seed + 2)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    return WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        image_processor=_tiny_image_processor(),
        image_encoder=image_encoder,
        transformer=transformer,
    )


@register_builtin("tiny-wan-i2v")
def _write_tiny_wan_i2v(folder: Path) -> None:
    build_tiny_wan_i2v_pipeline().save_pretrained(folder)
    write_generation_defaults(folder, TINY_WAN_I2V_DEFAULTS)
