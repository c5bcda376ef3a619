"""Tiny audio-bearing pipelines hsdp does not ship, built offline with diffusers' and transformers' own classes at
the sizes of diffusers' LTX-2 tests (a Gemma 3 text encoder from a config instead of the hub's tiny checkpoint, and
the byte-level tokenizer of the built-ins)."""

from __future__ import annotations

from pathlib import Path

import torch

from hsdp.models.tiny import build_byte_tokenizer


def build_tiny_ltx2(folder: Path) -> Path:
    """An ``LTX2Pipeline`` (video and its sound track, one joint transformer) saved to ``folder``."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    tokenizer = build_byte_tokenizer()
    tokenizer.model_max_length = 64
    torch.manual_seed(0)
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                            sliding_window=16, pad_token_id=0)  # fmt: skip
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)  # fmt: skip
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    text_encoder = Gemma3ForConditionalGeneration(config).eval()
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=32, rope_double_precision=False, rope_type="split",
    )  # fmt: skip
    connectors = LTX2TextConnectors(
        caption_channels=32, text_proj_in_factor=text.num_hidden_layers + 1, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split",
    )  # fmt: skip
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1,
        patch_size_t=1, encoder_causal=True, decoder_causal=False,
    )  # fmt: skip
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    )  # fmt: skip
    vocoder = LTX2Vocoder(
        in_channels=16, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
        resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000,
    )  # fmt: skip
    LTX2Pipeline(
        transformer=transformer, vae=vae, audio_vae=audio_vae, scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors, vocoder=vocoder,
    ).save_pretrained(folder)  # fmt: skip
    return folder
