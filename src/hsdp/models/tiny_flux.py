"""Small FLUX.1-architecture image pipelines built offline (random weights, fixed seed): ``tiny-flux`` and
``tiny-flux-kontext``.

Every component is the real ``diffusers`` / ``transformers`` class at toy sizes, laid out like a downloaded
``black-forest-labs/FLUX.1-dev`` (or ``FLUX.1-Kontext-dev``) folder: a CLIP text encoder (pooled prompt vector) and
a T5 encoder (per-token prompt states), each with a byte-level ``tokenizers`` tokenizer wrapped in
``PreTrainedTokenizerFast``; a guidance-distilled ``FluxTransformer2DModel`` (``guidance_embeds=True``, so
``guidance_scale`` is an input of the transformer, not a second branch); a 16x-downsampling-overall ``AutoencoderKL``
(8x VAE, then 2x2 latent packing) without quant convs, and the dynamically shifted
``FlowMatchEulerDiscreteScheduler``. The T5 encoder is about a third of the transformer's size and CLIP far less,
as in the real model. ``tiny-flux-kontext`` is the same weights under ``FluxKontextPipeline`` (image editing: the
encoded input image is appended to the image tokens).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hsdp.generation_defaults import write_generation_defaults
from hsdp.models.registry import register_builtin
from hsdp.models.tiny import TINY_SEED, build_byte_tokenizer

__all__ = [
    "build_tiny_flux_pipeline",
    "build_tiny_flux_components",
    "TINY_FLUX_DEFAULTS",
    "TINY_FLUX_KONTEXT_DEFAULTS",
]

CLIP_MAX_LENGTH = 77
"""The CLIP tokenizer's ``model_max_length``, as in the real model; FLUX and SDXL pad CLIP prompts to it. The byte
tokenizer makes one token per character, so a prompt of up to 77 characters fits without the tokenizer's
"sequence length is longer than the specified maximum" warning (it was 16, which every docs prompt overran)."""
TINY_CLIP_VERSION = "2: CLIP context 77"
"""The cache version of the built-ins with this CLIP (:data:`hsdp.models.builtin.BUILTIN_VERSIONS`)."""

TINY_FLUX_DEFAULTS = {
    "height": 64,
    "width": 64,
    "num_inference_steps": 4,
    "guidance_scale": 3.5,
    "max_sequence_length": 32,
}
"""Generation defaults written next to the pipeline (read by the engine when a request leaves them unset).

64 x 64 pixels are 4 x 4 packed latent tokens (8x VAE, 2x2 packing); ``guidance_scale`` is embedded, not CFG."""

TINY_FLUX_KONTEXT_DEFAULTS = {
    **TINY_FLUX_DEFAULTS,
    "max_area": 64 * 64,
    "_auto_resize": False,
}
"""Kontext rescales ``height`` x ``width`` to ``max_area`` (1024**2 by default) and, with ``_auto_resize``, the input
image to a ~1 Mpx preferred resolution; the tiny model needs both kept small."""


def fill_zero_params(model: torch.nn.Module) -> torch.nn.Module:
    # diffusers zero-inits some output projections; give them values so outputs depend on every weight.
    with torch.no_grad():
        for param in model.parameters():
            if param.abs().sum() == 0:
                param.normal_(0.0, 0.02)
    return model.eval()


def tiny_clip_text_config(vocab_size: int, hidden_size: int = 32, **overrides):
    from transformers import CLIPTextConfig

    values = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=hidden_size,
        hidden_act="gelu",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    values.update(overrides)
    return CLIPTextConfig(**values)


def clip_tokenizer():
    """The byte tokenizer with CLIP's fixed context length (pipelines pad CLIP prompts to ``model_max_length``)."""
    tokenizer = build_byte_tokenizer()
    tokenizer.model_max_length = CLIP_MAX_LENGTH
    return tokenizer


def _tiny_t5(d_model: int, vocab_size: int, seed: int):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=16,
        d_ff=2 * d_model,
        num_layers=4,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
    )
    return T5EncoderModel(config).eval()


def tiny_flux_vae(latent_channels: int, seed: int, **overrides):
    """A 4-level (8x) ``AutoencoderKL`` shaped like FLUX's: no quant convs, a shift and a scaling factor."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    values = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[8, 16, 16, 16],
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
        force_upcast=True,
    )
    values.update(overrides)
    return AutoencoderKL(**values).eval()


def build_tiny_flux_transformer(seed: int = TINY_SEED, **overrides):
    """A ``FluxTransformer2DModel`` (2 double-stream + 2 single-stream blocks, 2 heads of 32, guidance-distilled)."""
    from diffusers import FluxTransformer2DModel

    values = dict(
        patch_size=1,
        in_channels=16,  # 4 latent channels x 2x2 packing
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(8, 12, 12),
    )
    values.update(overrides)
    torch.manual_seed(seed)
    return fill_zero_params(FluxTransformer2DModel(**values))


def build_tiny_flux_components(seed: int = TINY_SEED, **transformer_overrides) -> dict:
    """The FLUX.1 components (``FluxPipeline`` and ``FluxKontextPipeline`` take the same ones)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextModel

    transformer = build_tiny_flux_transformer(seed, **transformer_overrides)
    tokenizer = clip_tokenizer()
    torch.manual_seed(seed + 1)
    text_encoder = CLIPTextModel(
        tiny_clip_text_config(len(tokenizer), hidden_size=transformer.config.pooled_projection_dim)
    ).eval()
    tokenizer_2 = build_byte_tokenizer()
    text_encoder_2 = _tiny_t5(transformer.config.joint_attention_dim, len(tokenizer_2), seed + 2)
    vae = tiny_flux_vae(transformer.config.in_channels // 4, seed + 3)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return dict(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def build_tiny_flux_pipeline(seed: int = TINY_SEED, *, kontext: bool = False, **transformer_overrides):
    """A ``FluxPipeline`` (or, with ``kontext``, a ``FluxKontextPipeline``) of a few hundred thousand parameters."""
    from diffusers import FluxKontextPipeline, FluxPipeline

    cls = FluxKontextPipeline if kontext else FluxPipeline
    return cls(**build_tiny_flux_components(seed, **transformer_overrides))


@register_builtin("tiny-flux", version=TINY_CLIP_VERSION)
def _write_tiny_flux(folder: Path) -> None:
    build_tiny_flux_pipeline().save_pretrained(folder)
    write_generation_defaults(folder, TINY_FLUX_DEFAULTS)


@register_builtin("tiny-flux-kontext", version=TINY_CLIP_VERSION)
def _write_tiny_flux_kontext(folder: Path) -> None:
    build_tiny_flux_pipeline(kontext=True).save_pretrained(folder)
    write_generation_defaults(folder, TINY_FLUX_KONTEXT_DEFAULTS)
