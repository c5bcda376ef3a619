"""Rank-side functions of the ``--vae-parallel`` tests: tiny VAEs whose tiled decode and encode run split over the
ranks (:mod:`hsdp.vae_parallel`) and alone (diffusers' ``enable_tiling``), on the same inputs."""

from __future__ import annotations

from pathlib import Path

import torch

from hsdp.launch import worker_state

SMALL_TILES = {
    "image": {},  # AutoencoderKL tiles at its config's sample_size (32 pixels here)
    "video": {"tile_sample_min_height": 32, "tile_sample_min_width": 32,
              "tile_sample_stride_height": 24, "tile_sample_stride_width": 24},
}  # fmt: skip
"""enable_tiling arguments giving the tiny VAEs many tiles on small inputs."""


def tiny_vae(kind: str, seed: int = 3) -> torch.nn.Module:
    """``image``: a 4-level (8x) ``AutoencoderKL`` with quant convs and 32-pixel tiles; ``video``: tiny-Wan's
    ``AutoencoderKLWan`` (8x spatial, 4x temporal)."""
    if kind == "image":
        from hsdp.models.tiny_flux import tiny_flux_vae

        return tiny_flux_vae(4, seed=seed, sample_size=32, use_quant_conv=True, use_post_quant_conv=True)
    from hsdp.models.tiny_wan import _tiny_vae

    return _tiny_vae(4, seed)


def sample(kind: str, size: int, frames: int = 1, seed: int = 5) -> torch.Tensor:
    """A ``size`` x ``size`` image in [-1, 1] (a video of ``frames`` frames for the video VAE)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (1, 3, size, size) if kind == "image" else (1, 3, frames, size, size)
    return torch.rand(shape, generator=generator) * 2 - 1


def split_and_alone(kind: str, size: int, frames: int = 1) -> dict:
    """On each rank: encode :func:`sample` and decode its latents, split over all ranks and with diffusers' tiled
    methods in this process alone; the largest differences and how the tiles were split."""
    import torch.distributed as dist

    from hsdp.vae_parallel import enable_vae_parallel

    alone, split, untiled = tiny_vae(kind), tiny_vae(kind), tiny_vae(kind)
    alone.enable_tiling(**SMALL_TILES[kind])
    replaced = enable_vae_parallel(split, dist.group.WORLD)
    split.enable_tiling(**SMALL_TILES[kind])
    x = sample(kind, size, frames)
    with torch.no_grad():
        latents = alone.encode(x).latent_dist.mean
        split_latents = split.encode(x).latent_dist.mean
        decoded, split_decoded = alone.decode(latents).sample, split.decode(latents).sample
        first_split = split.tiled_decode.last_split
        again = split.decode(latents).sample  # sizes other ranks' tiles from the first decode's meta runs
        untiled_decoded = untiled.decode(latents).sample
    return {
        "first_decode_split": first_split,
        "again_diff": (again - split_decoded).abs().max().item(),
        "replaced": replaced,
        "encode_diff": (split_latents - latents).abs().max().item(),
        "decode_diff": (split_decoded - decoded).abs().max().item(),
        "tiling_changes": (decoded - untiled_decoded).abs().max().item(),
        "shape": tuple(split_decoded.shape),
        "split": {name: getattr(split, name).last_split for name in replaced},
    }


def small_tile_cogvideox(root: Path) -> Path:
    """The held-out CogVideoX folder (``tests/heldout_pipelines.py``) with its VAE's ``sample_height`` /
    ``sample_width`` at 64 pixels, from which the class sets its tiles (half of them: 32 pixels), so a 64 x 64
    video is 3 x 3 tiles, and a transformer 4x wider (heads of 32) and 2 layers deep, so that the VAE is small
    beside it and the engine loads it whole (a sharded VAE is not split); written once under ``root``."""
    import json
    import shutil

    from diffusers import CogVideoXTransformer3DModel

    from hsdp.models.tiny_flux import fill_zero_params
    from tests.heldout_pipelines import build

    folder = root / "cogvideox-small-tiles"
    if not folder.is_dir():
        shutil.copytree(build("cogvideox", root), folder)
        config_file = folder / "vae" / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "sample_height": 64,
                                           "sample_width": 64}))  # fmt: skip
        config = CogVideoXTransformer3DModel.load_config(folder / "transformer")
        torch.manual_seed(0)
        wider = CogVideoXTransformer3DModel.from_config({**config, "attention_head_dim": 32, "num_layers": 2})
        shutil.rmtree(folder / "transformer")
        fill_zero_params(wider).save_pretrained(folder / "transformer")
    return folder


def vae_split() -> dict:
    """How the loaded pipeline's VAE split its last tiled decode on this rank (None: it did not tile)."""
    vae = worker_state()["hsdp.engine.runner"][0].pipe.vae
    return getattr(vae.tiled_decode, "last_split", None)


def _tiled_vae_classes() -> list[str]:
    """The diffusers autoencoder classes with a ``tiled_decode``: every class ``--vae-parallel`` may be handed."""
    import inspect

    import diffusers.models
    from diffusers.models.autoencoders.vae import AutoencoderMixin

    return sorted(name for name in dir(diffusers.models)
                  if inspect.isclass(cls := getattr(diffusers.models, name)) and issubclass(cls, AutoencoderMixin)
                  and hasattr(cls, "tiled_decode"))  # fmt: skip


TILED_VAES = _tiled_vae_classes()
_KL = {"block_out_channels": [8, 16], "norm_num_groups": 4, "latent_channels": 4, "sample_size": 32,
       "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2}
_HUNYUAN_3D = {"block_out_channels": (8, 8, 8, 8), "latent_channels": 4, "layers_per_block": 1}
TINY_VAES = {
    # class: (its diffusers test-suite dummy config, sample shape (batch, channels[, frames], height, width)[,
    # enable_tiling arguments besides SMALL_TILING: HunyuanVideo 1.5 takes its latent tile apart from the sample's])
    "AutoencoderDC": ({"in_channels": 3, "latent_channels": 4, "attention_head_dim": 2,
                       "encoder_block_types": ("ResBlock", "EfficientViTBlock"),
                       "decoder_block_types": ("ResBlock", "EfficientViTBlock"),
                       "encoder_block_out_channels": (8, 8), "decoder_block_out_channels": (8, 8),
                       "encoder_qkv_multiscales": ((), (5,)), "decoder_qkv_multiscales": ((), (5,)),
                       "encoder_layers_per_block": (1, 1), "decoder_layers_per_block": [1, 1],
                       "downsample_block_type": "conv", "upsample_block_type": "interpolate",
                       "decoder_norm_types": "rms_norm", "decoder_act_fns": "silu"}, (1, 3, 48, 48)),
    "AutoencoderKL": (_KL, (1, 3, 64, 64)),
    "AutoencoderKLAllegro": ({"down_block_types": ("AllegroDownBlock3D",) * 4,
                              "up_block_types": ("AllegroUpBlock3D",) * 4, "block_out_channels": (8, 8, 8, 8),
                              "latent_channels": 4, "layers_per_block": 1, "norm_num_groups": 2,
                              "temporal_compression_ratio": 4}, (1, 3, 9, 64, 64)),
    "AutoencoderKLCogVideoX": ({"down_block_types": ("CogVideoXDownBlock3D",) * 4,
                                "up_block_types": ("CogVideoXUpBlock3D",) * 4, "block_out_channels": (8, 8, 8, 8),
                                "latent_channels": 4, "layers_per_block": 1, "norm_num_groups": 2,
                                "temporal_compression_ratio": 4}, (1, 3, 9, 64, 64)),
    "AutoencoderKLFlux2": ({**_KL, "latent_channels": 1}, (1, 3, 64, 64)),
    "AutoencoderKLHunyuanImage": ({"in_channels": 3, "out_channels": 3, "latent_channels": 4,
                                   "block_out_channels": (32, 64, 64, 64), "layers_per_block": 1,
                                   "spatial_compression_ratio": 8, "sample_size": 32}, (1, 3, 64, 64)),
    "AutoencoderKLHunyuanImageRefiner": ({**_HUNYUAN_3D, "spatial_compression_ratio": 8,
                                          "downsample_match_channel": False, "upsample_match_channel": False},
                                         (1, 3, 5, 64, 64)),
    "AutoencoderKLHunyuanVideo": ({**_HUNYUAN_3D, "norm_num_groups": 4,
                                   "down_block_types": ("HunyuanVideoDownBlock3D",) * 4,
                                   "up_block_types": ("HunyuanVideoUpBlock3D",) * 4}, (1, 3, 9, 64, 64)),
    "AutoencoderKLHunyuanVideo15": ({"latent_channels": 4, "block_out_channels": (16, 16), "layers_per_block": 1,
                                     "spatial_compression_ratio": 4, "temporal_compression_ratio": 2,
                                     "downsample_match_channel": False, "upsample_match_channel": False},
                                    (1, 3, 5, 64, 64), {"tile_latent_min_height": 8, "tile_latent_min_width": 8}),
    "AutoencoderKLKVAE": ({"channels": 32, "num_enc_blocks": 1, "num_dec_blocks": 1, "z_channels": 4, "ch_mult": (1, 2),
                           "sample_size": 32}, (1, 3, 64, 64)),
    "AutoencoderKLLTX2Video": ({"latent_channels": 8, "block_out_channels": (8, 8, 8, 8),
                                "decoder_block_out_channels": (16, 32, 64), "layers_per_block": (1, 1, 1, 1, 1),
                                "decoder_layers_per_block": (1, 1, 1, 1),
                                "spatio_temporal_scaling": (True, True, True, True),
                                "decoder_spatio_temporal_scaling": (True, True, True),
                                "decoder_inject_noise": (False, False, False, False),
                                "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
                                "upsample_residual": (True, True, True), "upsample_factor": (2, 2, 2),
                                "timestep_conditioning": False, "patch_size": 1, "patch_size_t": 1,
                                "decoder_spatial_padding_mode": "zeros"}, (1, 3, 17, 64, 64)),
    "AutoencoderKLLTXVideo": ({"latent_channels": 8, "block_out_channels": (8, 8, 8, 8),
                               "decoder_block_out_channels": (16, 32, 64), "layers_per_block": (1, 1, 1, 1),
                               "decoder_layers_per_block": (1, 1, 1, 1),
                               "spatio_temporal_scaling": (True, True, True, False),
                               "decoder_spatio_temporal_scaling": (True, True, True),
                               "decoder_inject_noise": (True, True, True, False),
                               "upsample_residual": (True, True, True),
                               "upsample_factor": (2, 2, 2), "timestep_conditioning": True, "patch_size": 1,
                               "patch_size_t": 1}, (1, 3, 17, 64, 64)),
    "AutoencoderKLMagvit": ({"latent_channels": 4, "block_out_channels": [8, 8, 8, 8],
                             "down_block_types": ["SpatialDownBlock3D"] + ["SpatialTemporalDownBlock3D"] * 3,
                             "up_block_types": ["SpatialUpBlock3D"] + ["SpatialTemporalUpBlock3D"] * 3,
                             "layers_per_block": 1, "norm_num_groups": 8, "spatial_group_norm": True},
                            (1, 3, 9, 64, 64)),
    "AutoencoderKLMochi": ({"in_channels": 15, "latent_channels": 4, "encoder_block_out_channels": (32, 32, 32, 32),
                            "decoder_block_out_channels": (32, 32, 32, 32), "layers_per_block": (1, 1, 1, 1, 1)},
                           (1, 3, 7, 64, 64)),
    "AutoencoderKLQwenImage": ({"base_dim": 24, "z_dim": 4, "dim_mult": [1, 2, 4], "num_res_blocks": 1,
                                "temperal_downsample": [False, True], "latents_mean": [0.0] * 4,
                                "latents_std": [1.0] * 4}, (1, 3, 1, 64, 64)),
    "AutoencoderKLQwenImage21": ({"base_dim": 4, "decoder_base_dim": 4, "z_dim": 4, "dim_mult": [1, 1, 1, 1, 1],
                                  "num_res_blocks": 1, "attn_scales": [],
                                  "temperal_downsample": [False, True, True, True],
                                  "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4}, (1, 4, 1, 128, 128),
                                 {"tile_sample_min_height": 48, "tile_sample_min_width": 48,
                                  "tile_sample_stride_height": 32, "tile_sample_stride_width": 32}),
    "AutoencoderKLWan": ({"base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
                          "temperal_downsample": [False, True, True]}, (1, 3, 9, 64, 64)),
    "AutoencoderVidTok": ({"is_causal": False, "ch": 16, "ch_mult": [1, 2, 4, 4, 4], "z_channels": 6,
                           "double_z": False, "num_res_blocks": 1, "regularizer": "fsq", "codebook_size": 262144},
                          (1, 3, 16, 64, 64)),
}  # fmt: skip
UNTILED_ENCODE = {"AutoencoderKLHunyuanImage", "AutoencoderKLHunyuanImageRefiner"}
"""Classes whose own tiled encode fails in one process (diffusers 0.42: HunyuanImage's unpacks a video's 5-D shape
from its images, the refiner's strides the pixels by its latent tile sizes): only their decode is compared, on
latents encoded whole."""
SMALL_TILING = {"tile_sample_min_height": 32, "tile_sample_min_width": 32, "tile_sample_stride_height": 24,
                "tile_sample_stride_width": 24, "tile_overlap_factor_height": 0.25, "tile_overlap_factor_width": 0.25,
                "tile_sample_min_size": 32, "tile_overlap_factor": 0.25, "tile_sample_min_num_frames": 8,
                "tile_sample_stride_num_frames": 4}  # fmt: skip
"""``enable_tiling`` arguments (each class takes its own subset) giving 32-pixel tiles, 8 pixels of overlap and,
where a class tiles time, 8-frame tiles at a 4-frame stride; a class without arguments tiles at its config's
``sample_size``."""


def tiny_tiled_vae(name: str, seed: int = 3) -> torch.nn.Module:
    """A random ``name`` (a diffusers VAE class) of :data:`TINY_VAES`' config, its tiling on with small tiles."""
    import inspect

    import diffusers.models

    cls = getattr(diffusers.models, name)
    torch.manual_seed(seed)
    config, _, *tiling = TINY_VAES[name]
    vae = cls(**config).eval()
    accepted = inspect.signature(vae.enable_tiling).parameters
    vae.enable_tiling(**{k: v for k, v in {**SMALL_TILING, **(tiling or [{}])[0]}.items() if k in accepted})
    return vae


def _tensor(output) -> torch.Tensor:
    """The tensor an ``encode`` / ``decode`` returned, whichever of diffusers' output types it came in."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple):
        return _tensor(output[0])
    for field in ("latent_dist", "latent", "sample"):
        if (value := getattr(output, field, None)) is not None:
            return value.mean if field == "latent_dist" else _tensor(value)
    raise TypeError(f"no tensor in {type(output).__name__}")


def class_split_and_alone(name: str) -> dict:
    """:func:`split_and_alone` for a class of :data:`TINY_VAES`: encode and decode its sample split over all ranks
    and with diffusers' tiled methods alone; the differences, or the refusal ``enable_vae_parallel`` raised."""
    import inspect

    import torch.distributed as dist

    from hsdp.vae_parallel import enable_vae_parallel

    alone, split = tiny_tiled_vae(name), tiny_tiled_vae(name)
    try:
        replaced = enable_vae_parallel(split, dist.group.WORLD)
    except ValueError as exc:
        return {"refused": str(exc)}
    x = torch.rand(TINY_VAES[name][1], generator=torch.Generator().manual_seed(5)) * 2 - 1
    # LTX's timestep-conditioned decoder takes the decode timestep
    temb = {"temb": torch.tensor([0.05])} if "temb" in inspect.signature(alone.decode).parameters else {}
    with torch.no_grad():
        if name in UNTILED_ENCODE:
            alone.use_tiling = False
            latents = split_latents = _tensor(alone.encode(x))
            alone.use_tiling = True
        else:
            latents, split_latents = _tensor(alone.encode(x)), _tensor(split.encode(x))
        decoded, split_decoded = _tensor(alone.decode(latents, **temb)), _tensor(split.decode(latents, **temb))
    return {
        "replaced": replaced,
        "encode_diff": (split_latents - latents).abs().max().item(),
        "decode_diff": (split_decoded - decoded).abs().max().item(),
        "split": {method: getattr(getattr(split, method), "last_split", None) for method in replaced},
    }


def class_exact_and_whole(name: str) -> dict:
    """On each rank: a :data:`TINY_VAES` class's latents (its sample encoded whole) and a random latent of 9 rows
    (split 5 / 4) decoded with the exact row split (:func:`hsdp.vae_parallel.enable_exact_split`) and whole, no
    tiling; the largest differences relative to the whole decode's largest value, or why the class decodes whole."""
    import inspect

    import diffusers.models
    import torch.distributed as dist

    from hsdp.vae_parallel import enable_exact_split

    cls = getattr(diffusers.models, name)
    config, shape, *_ = TINY_VAES[name]
    torch.manual_seed(3)
    whole = cls(**config).eval()
    torch.manual_seed(3)
    split = cls(**config).eval()
    reason = enable_exact_split(split, dist.group.WORLD)
    if reason is not None:
        return {"whole": reason}
    x = torch.rand(shape, generator=torch.Generator().manual_seed(5)) * 2 - 1
    temb = {"temb": torch.tensor([0.05])} if "temb" in inspect.signature(whole.decode).parameters else {}
    with torch.no_grad():
        latents = _tensor(whole.encode(x))
        uneven = torch.randn((*latents.shape[:-2], 9, latents.shape[-1]), generator=torch.Generator().manual_seed(7))
        result = {"splits": 0}
        for key, z in (("rel", latents), ("uneven_rel", uneven)):
            expected, got = _tensor(whole.decode(z, **temb)), _tensor(split.decode(z, **temb))
            assert got.shape == expected.shape, (got.shape, expected.shape)
            result[key] = ((got - expected).abs().max() / expected.abs().max()).item()
    result["splits"] = split.decoder.forward.splits
    result["latent"] = tuple(latents.shape)
    return result


def exact_splits() -> int:
    """Decoder calls the loaded pipeline's VAE ran split by rows on this rank."""
    vae = worker_state()["hsdp.engine.runner"][0].pipe.vae
    return getattr(vae.decoder.forward, "splits", 0)
