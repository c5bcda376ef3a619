"""Rank-side functions of the ``--vae-parallel`` tests: tiny VAEs whose tiled decode and encode run split over the
ranks (:mod:`hsdp.vae_parallel`) and alone (diffusers' ``enable_tiling``), on the same inputs."""

from __future__ import annotations

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
        untiled_decoded = untiled.decode(latents).sample
    return {
        "replaced": replaced,
        "encode_diff": (split_latents - latents).abs().max().item(),
        "decode_diff": (split_decoded - decoded).abs().max().item(),
        "tiling_changes": (decoded - untiled_decoded).abs().max().item(),
        "shape": tuple(split_decoded.shape),
        "split": {name: getattr(split, name).last_split for name in replaced},
    }


def vae_split() -> dict:
    """How the loaded pipeline's VAE split its last tiled decode on this rank (None: it did not tile)."""
    vae = worker_state()["hsdp.engine.runner"][0].pipe.vae
    return getattr(vae.tiled_decode, "last_split", None)
