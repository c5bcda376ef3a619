"""A small Wan-architecture text-to-video pipeline built offline (random weights, fixed seed): ``tiny-wan``.

Every component is the real ``diffusers`` / ``transformers`` class at toy sizes, so the engine loads it through
exactly the path a downloaded ``Wan-AI/Wan2.x-*-Diffusers`` folder takes: a byte-level ``tokenizers`` tokenizer
wrapped in ``PreTrainedTokenizerFast``, ``UMT5EncoderModel`` (``d_model`` equals the transformer's ``text_dim``),
``WanTransformer3DModel``, ``AutoencoderKLWan`` (``z_dim`` equals the transformer's channels) and the
flow-matching ``UniPCMultistepScheduler`` Wan ships with. ``hsdp_defaults.json`` holds small generation
defaults (shapes and steps) so ``hsdp generate --model tiny-wan`` runs in seconds on a CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hsdp.generation_defaults import DEFAULTS_FILE, write_generation_defaults
from hsdp.models.registry import register_builtin
from hsdp.models.tiny import TINY_SEED, build_byte_tokenizer, build_tiny_wan_transformer

__all__ = ["build_tiny_wan_pipeline", "TINY_WAN_DEFAULTS", "DEFAULTS_FILE"]

TINY_WAN_DEFAULTS = {
    "height": 32,
    "width": 32,
    "num_frames": 5,
    "num_inference_steps": 4,
    "guidance_scale": 4.0,
    "max_sequence_length": 32,
}
"""Generation defaults written next to the pipeline (read by the engine when a request leaves them unset)."""


def _tiny_umt5(d_model: int, vocab_size: int, seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
    )
    return UMT5EncoderModel(config).eval()


def _tiny_vae(z_dim: int, seed: int):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    ).eval()


def build_tiny_wan_pipeline(
    seed: int = TINY_SEED, *, boundary_ratio: float | None = None, **transformer_overrides
):
    """A ``WanPipeline`` of a few hundred thousand parameters; ``transformer_overrides`` widen the DiT.

    ``boundary_ratio`` makes it Wan2.2-shaped: a second (low-noise) transformer ``transformer_2`` takes over
    once the timestep falls below ``boundary_ratio x 1000``.
    """
    from diffusers import UniPCMultistepScheduler, WanPipeline

    transformer = build_tiny_wan_transformer(seed, **transformer_overrides)
    second = (
        build_tiny_wan_transformer(seed + 3, **transformer_overrides) if boundary_ratio is not None else None
    )
    tokenizer = build_byte_tokenizer()
    text_encoder = _tiny_umt5(transformer.config.text_dim, len(tokenizer), seed + 1)
    vae = _tiny_vae(transformer.config.in_channels, seed + 2)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
        transformer_2=second,
        boundary_ratio=boundary_ratio,
    )


@register_builtin("tiny-wan")
def _write_tiny_wan(folder: Path) -> None:
    build_tiny_wan_pipeline().save_pretrained(folder)
    write_generation_defaults(folder, TINY_WAN_DEFAULTS)
