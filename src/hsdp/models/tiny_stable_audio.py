"""A small Stable Audio Open pipeline built offline (random weights, fixed seed): ``tiny-stable-audio``.

The real ``diffusers`` / ``transformers`` classes at the sizes of diffusers' own Stable Audio tests, a little
wider: ``StableAudioDiTModel`` (the denoiser; it names no ``_no_split_modules``, so hsdp shards it by its
repeated ``transformer_blocks``), ``AutoencoderOobleck`` (stereo, 8x hop, 8 kHz: the lowest rate mp3 takes), a
``T5EncoderModel`` text encoder behind the byte-level tokenizer of the other built-ins, the projection model of
the seconds conditioning, and the ``CosineDPMSolverMultistepScheduler`` (v-prediction) Stable Audio ships with.
``hsdp generate --model tiny-stable-audio --output sound.wav`` writes 0.256 s in a few seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hsdp.generation_defaults import write_generation_defaults
from hsdp.models.registry import register_builtin
from hsdp.models.tiny import TINY_SEED, build_byte_tokenizer

__all__ = ["build_tiny_stable_audio_pipeline", "TINY_STABLE_AUDIO_DEFAULTS"]

TINY_STABLE_AUDIO_DEFAULTS = {"num_inference_steps": 4, "guidance_scale": 7.0}
"""Generation defaults written next to the pipeline (the length defaults to the model's longest, 0.256 s)."""


def build_tiny_stable_audio_pipeline(seed: int = TINY_SEED):
    """A ``StableAudioPipeline`` of about 100 thousand parameters: up to 2048 stereo samples at 8 kHz."""
    from diffusers import (
        AutoencoderOobleck,
        CosineDPMSolverMultistepScheduler,
        StableAudioDiTModel,
        StableAudioPipeline,
        StableAudioProjectionModel,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    transformer = StableAudioDiTModel(
        sample_size=256,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        num_key_value_attention_heads=1,
        out_channels=4,
        cross_attention_dim=16,
        time_proj_dim=8,
        global_states_input_dim=32,  # the start and end seconds' projections, side by side
        cross_attention_input_dim=16,
    )
    vae = AutoencoderOobleck(
        encoder_hidden_size=8,
        downsampling_ratios=[2, 4],
        decoder_channels=8,
        decoder_input_channels=4,
        audio_channels=2,
        channel_multiples=[1, 2],
        sampling_rate=8000,
    )
    tokenizer = build_byte_tokenizer()
    tokenizer.model_max_length = 32  # the pipeline pads every prompt to it
    text_encoder = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                 pad_token_id=0, eos_token_id=2)  # fmt: skip
    ).eval()
    projection_model = StableAudioProjectionModel(
        text_encoder_dim=16, conditioning_dim=16, min_value=0, max_value=32
    )
    scheduler = CosineDPMSolverMultistepScheduler(
        solver_order=2, prediction_type="v_prediction", sigma_data=1.0, sigma_schedule="exponential"
    )
    return StableAudioPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        projection_model=projection_model,
    )


@register_builtin("tiny-stable-audio")
def _write_tiny_stable_audio(folder: Path) -> None:
    build_tiny_stable_audio_pipeline().save_pretrained(folder)
    write_generation_defaults(folder, TINY_STABLE_AUDIO_DEFAULTS)
