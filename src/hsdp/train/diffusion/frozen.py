"""The frozen side of diffusion training: the pipeline without its denoisers, and what it encodes.

Below the trainer, its evaluation and validation (which all use it) and the planner: none of these imports
another for it. The frozen VAE and text encoders load once, in fp32 on this rank's device; those that inference
shards (:func:`frozen_sharded`: the engine's size rule, e.g. T5-XXL beside FLUX, UMT5 beside Wan) load sharded
on the training mesh with the engine's loader (:func:`frozen_pipeline`). :func:`meta_pipeline` builds the same
pipeline on meta (no weights read) for what is read before ranks start.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch

from hsdp.config import ParallelConfig, ShardingStrategy
from hsdp.distributed import local_device
from hsdp.families import family_for
from hsdp.pipeline_sizes import pipeline_compression
from hsdp.train.diffusion.media import MediaDataset, MediaSpec
from hsdp.train.diffusion.pipeline_call import DENOISERS, PromptLayout, encode_captions, vae_latents

logger = logging.getLogger("hsdp")

__all__ = [
    "DENOISERS",
    "index_of",
    "meta_pipeline",
    "frozen_sharded",
    "frozen_layout",
    "frozen_pipeline",
    "media_spec",
    "encode_items",
    "encoder_components",
]


def index_of(model_dir: Path) -> dict:
    """The pipeline's ``model_index.json``."""
    return json.loads((Path(model_dir) / "model_index.json").read_text())


def _pipeline_without(model_dir: Path, **components):
    """The pipeline of ``model_dir`` on the CPU with its denoisers left out (they are trained, not encoded) and
    ``components`` in place of loading those."""
    import diffusers

    cls = getattr(diffusers, index_of(model_dir)["_class_name"])
    absent = {name: None for name in DENOISERS if name in index_of(model_dir)}
    return cls.from_pretrained(model_dir, **absent, **components, torch_dtype=torch.float32)


def meta_pipeline(model_dir: Path):
    """The pipeline without scheduler: VAE and text encoders built on meta from their configs (no weights read),
    tokenizers and other weightless components as saved, the denoisers on meta too (``__init__`` reads their
    configs: HunyuanVideo 1.5 sizes its image embeddings by the transformer's). What its sizes are read from before
    ranks start (loading the encoders would hold a Wan 14B's UMT5 whole in the launching process), and what ``hsdp
    plan`` traces captions through."""
    import importlib

    import diffusers

    from hsdp.loading import build_empty_model, model_class_for
    from hsdp.planning.profile import build_meta_model

    index = index_of(model_dir)
    cls = getattr(diffusers, index["_class_name"])
    init = inspect.signature(cls.__init__).parameters
    parts = {n: None for n, p in init.items() if n != "self" and p.default is inspect.Parameter.empty}
    for name in encoder_components(model_dir):
        folder = model_dir / name
        if (folder / "config.json").is_file():
            parts[name] = build_empty_model(model_class_for(folder), folder, None)
        else:  # no weights to leave out: tokenizers, processors, a guider (HunyuanVideo 1.5) load as saved
            library, class_name = index[name][:2]
            parts[name] = getattr(importlib.import_module(library), class_name).from_pretrained(folder)
    for name in DENOISERS:
        if (model_dir / name / "config.json").is_file():
            parts[name] = build_meta_model(model_dir / name, torch.float32)[0]
    return cls(**{k: v for k, v in parts.items() if k in init})


def frozen_sharded(model_dir: Path) -> list[str]:
    """The frozen components inference shards: every component :func:`hsdp.engine.model_info.inspect_model` marks
    shardable (a shard plan, and weights at least ``TEXT_ENCODER_SHARD_FRACTION`` of the largest denoiser's) that
    is not a denoiser. The rule compares sizes, so it holds for any scale of the same pipeline."""
    from hsdp.engine.model_info import inspect_model

    info = inspect_model(model_dir)
    return [name for name in info.shardable if name not in info.denoisers]


def frozen_layout(parallel: ParallelConfig) -> ParallelConfig:
    """The layout frozen encoders shard on: the training mesh, computing in fp32 as whole ones do, each block's
    weights freed after its forward (they never run backward: kept gathered, as SHARD_GRAD_OP keeps them until
    the backward, they would stay whole on every rank)."""
    parallel = parallel.resolved()
    return replace(
        parallel,
        reshard_after_forward=parallel.sharding_strategy is not ShardingStrategy.NO_SHARD,
        param_dtype=None,
        reduce_dtype=None,
        offload_layers=None,  # the trained denoiser's blocks are the ones offloaded
    ).resolved()


def frozen_pipeline(model_dir: Path, parallel: ParallelConfig | None = None):
    """The pipeline of ``model_dir`` without its denoisers (they are trained, not encoded with), in fp32 on this
    rank's device. With HSDP, :func:`frozen_sharded` components load sharded over the training mesh through the
    engine's own loader (:func:`hsdp.engine.components.load_component`: the same plan, prefetch and entry points, so a
    sharded VAE's ``encode`` gathers like ``forward``); encoding with them is then collective."""

    from hsdp.engine.components import LoadSpec, load_component
    from hsdp.mesh import build_meshes

    components = {}
    sharded = frozen_sharded(model_dir) if parallel is not None and parallel.use_hsdp else []
    if sharded:
        layout = frozen_layout(parallel)
        spec = LoadSpec(path=Path(model_dir), kind="diffusion", config=layout, dtype="fp32")
        meshes = build_meshes(layout)  # the training mesh (built once per process, reused by the trainer)
        components |= {name: load_component(spec, meshes, name) for name in sharded}
        logger.info("frozen components sharded as inference shards them: %s", ", ".join(sharded))
    pipe = _pipeline_without(model_dir, **components)
    device = local_device()
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module) and name not in sharded:
            module.to(device)
    return pipe


def _device_of(*modules) -> torch.device:
    """Where the (frozen) modules compute: their first parameter's device (a sharded one's local shard)."""
    for module in modules:
        if isinstance(module, torch.nn.Module):
            for param in module.parameters():
                return param.device
    return torch.device("cpu")


def media_spec(pipe, model_dir: Path, component: str) -> MediaSpec:
    """Sizes the pipeline takes, from its own attributes (:func:`hsdp.pipeline_sizes.pipeline_compression`, the
    rule the engine and server use too) and the denoiser's ``patch_size``."""
    config = json.loads((model_dir / component / "config.json").read_text())
    patch = config.get("patch_size") or config.get("all_patch_size") or 1  # Z-Image names it all_patch_size
    patch = patch[-1] if isinstance(patch, (list, tuple)) else patch
    spatial, temporal = pipeline_compression(pipe)
    family = family_for(type(pipe).__name__)
    return MediaSpec((spatial or 8) * int(patch) * family.latent_packing, temporal, video=temporal is not None)


def encode_items(
    pipe, model_dir: Path, layout: PromptLayout, dataset: MediaDataset, indices: Iterable[int]
) -> list[dict[str, torch.Tensor]]:
    """The ``latents`` and caption encodings of items ``indices`` (what the latent cache stores per item): the VAE's
    normalised latents (:func:`hsdp.train.diffusion.pipeline_call.vae_latents`) and what the pipeline's
    ``__call__`` gets from ``encode_prompt`` for the caption at the item's size."""
    out = []
    for i in indices:
        bucket = dataset.buckets[i]
        size, frames = (bucket.height, bucket.width), bucket.frames
        latents = vae_latents(pipe.vae, dataset.pixels(i).to(_device_of(pipe.vae)))
        captions = encode_captions(pipe, model_dir, layout, [dataset.items[i].caption], size, frames)[0]
        out.append({"latents": latents, **captions})
    return out


def encoder_components(model_dir: Path) -> list[str]:
    """The frozen components cached encodings come from: every component but the denoisers and the scheduler."""
    return [
        name
        for name, entry in index_of(model_dir).items()
        if isinstance(entry, list) and entry[0] is not None and name not in (*DENOISERS, "scheduler")
    ]


