"""A pipeline whose autoencoder is large enough to be sharded decodes, and equals one process exactly.

The engine shards any non-denoiser component with a shard plan that is at least 30% of the denoiser
(``TEXT_ENCODER_SHARD_FRACTION``); ``AutoencoderKL`` has one (``_no_split_modules``). The pipeline calls
``vae.decode`` (and ``encode``), not ``forward``, so without :func:`hsdp.sharding.register_entry_points` the
decoder's own convolutions met sharded DTensor weights ("got mixed torch.Tensor and DTensor"). The built-ins'
VAEs are small beside their transformers, so these tests build FLUX- and SD3-shaped pipelines with a VAE about
the transformer's size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hsdp import ParallelConfig
from hsdp.engine import Engine, SamplingParams
from hsdp.engine.model_info import inspect_model
from hsdp.sharding import entry_point_names
from tests.engine_refs import reference_pipeline

pytestmark = pytest.mark.slow

PROMPT = "A red fox in the snow"
BIG_VAE = {"block_out_channels": [32, 64, 64, 64], "norm_num_groups": 8}
"""About the size of the tiny transformers (the built-ins use [8, 16, 16, 16])."""


def _flux_with_big_vae(folder: Path) -> Path:
    from hsdp.models.tiny_flux import TINY_FLUX_DEFAULTS, build_tiny_flux_pipeline, tiny_flux_vae
    from hsdp.models.tiny_wan import write_generation_defaults

    pipe = build_tiny_flux_pipeline()
    pipe.vae = tiny_flux_vae(4, seed=3, **BIG_VAE)
    pipe.register_modules(vae=pipe.vae)
    pipe.save_pretrained(folder)
    write_generation_defaults(folder, {**TINY_FLUX_DEFAULTS, "num_inference_steps": 2})
    return folder


def _sd3_with_big_vae(folder: Path) -> Path:
    """A ``StableDiffusion3Pipeline``: two CLIP encoders with projections, T5, an SD3 transformer, and an
    ``AutoencoderKL`` with quant convs about the transformer's size."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from hsdp.models.tiny import build_byte_tokenizer
    from hsdp.models.tiny_flux import clip_tokenizer, fill_zero_params, tiny_clip_text_config, tiny_flux_vae
    from hsdp.models.tiny_wan import write_generation_defaults

    tokenizer = clip_tokenizer()
    torch.manual_seed(1)
    clip_1 = CLIPTextModelWithProjection(tiny_clip_text_config(len(tokenizer), hidden_size=32)).eval()
    clip_2 = CLIPTextModelWithProjection(tiny_clip_text_config(len(tokenizer), hidden_size=32)).eval()
    tokenizer_3 = build_byte_tokenizer()
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_3),
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=0,
        )
    ).eval()
    torch.manual_seed(2)
    transformer = fill_zero_params(
        SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=64,
            caption_projection_dim=32,
            pooled_projection_dim=64,
            out_channels=4,
            pos_embed_max_size=16,
        )
    )
    vae = tiny_flux_vae(4, seed=3, use_quant_conv=True, use_post_quant_conv=True, **BIG_VAE)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=clip_1,
        tokenizer=tokenizer,
        text_encoder_2=clip_2,
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5,
        tokenizer_3=tokenizer_3,
    )
    pipe.save_pretrained(folder)
    defaults = {"height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 4.0}
    write_generation_defaults(folder, {**defaults, "max_sequence_length": 32})
    return folder


BUILDERS = {"flux": _flux_with_big_vae, "sd3": _sd3_with_big_vae}


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("big-vae")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_pipeline_with_sharded_vae_equals_one_process(name, pipelines, dist_run):
    path = pipelines[name]
    info = inspect_model(path)
    assert "vae" in info.shardable, info.shardable  # the size rule shards it: the case that failed
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2).resolved()
    with Engine(path, config, workers=dist_run.group(2)) as engine:
        assert "vae" in engine.load_report[0]["sharded"]
        [out] = engine.generate(PROMPT, SamplingParams(seed=4))
    defaults = {k: v for k, v in info.defaults.items() if k in info.call_params}
    expected = reference_pipeline(path, PROMPT, 4, **defaults)
    assert np.isfinite(expected).all() and expected.std() > 0
    np.testing.assert_array_equal(out.images, expected)


def test_entry_points_are_the_model_classes_own_methods():
    from diffusers import AutoencoderKL

    names = entry_point_names(AutoencoderKL(block_out_channels=[8], norm_num_groups=4))
    assert {"encode", "decode", "_encode", "_decode", "tiled_decode"} <= set(names)
    # library plumbing and forward itself are not wrapped
    assert not {"forward", "save_pretrained", "enable_tiling", "to"} & set(names)
