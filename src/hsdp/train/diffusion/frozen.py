"""The frozen side of diffusion training: the pipeline without its denoisers, and what it encodes.

Below the trainer, its evaluation and validation (which all use it) and the planner: none of these imports
another for it. The frozen VAE and text encoders load once, in fp32 on this rank's device; those that inference
shards (:func:`frozen_sharded`: the engine's size rule, e.g. T5-XXL beside FLUX, UMT5 beside Wan) load sharded
on the training mesh with the engine's loader (:func:`frozen_pipeline`). :func:`meta_pipeline` builds the same
pipeline on meta (no weights read) for what is read before ranks start.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch

from hsdp.config import ParallelConfig, ShardingStrategy
from hsdp.distributed import local_device
from hsdp.models.description import describe
from hsdp.train.diffusion.media import AudioSpec, MediaDataset, MediaSpec
from hsdp.train.diffusion.pipeline_call import DENOISERS, PromptLayout, encode_captions, vae_latents

logger = logging.getLogger("hsdp")

__all__ = [
    "DENOISERS",
    "meta_pipeline",
    "frozen_sharded",
    "call_modules",
    "load_call_modules",
    "frozen_layout",
    "frozen_pipeline",
    "media_spec",
    "audio_spec",
    "encode_items",
    "encoder_components",
]


def _pipeline_without(model_dir: Path, **components):
    """The pipeline of ``model_dir`` on the CPU with its denoisers left out (they are trained, not encoded) and
    ``components`` in place of loading those."""
    from hsdp.planning.profile import build_meta_model

    model = describe(model_dir)
    absent = [name for name in DENOISERS if name in model.index]
    # On meta while ``__init__`` runs (Stable Audio's reads its transformer's config), then left out.
    meta = {n: build_meta_model(model_dir / n, torch.float32)[0] if model.components[n].has_config else None
            for n in absent if n in model.components}  # fmt: skip
    meta |= {n: None for n in absent if n not in meta}
    pipe = model.pipeline_class().from_pretrained(model_dir, **meta, **components, torch_dtype=torch.float32)
    pipe.register_modules(**dict.fromkeys(absent))
    return pipe


def meta_pipeline(model_dir: Path):
    """The pipeline without scheduler: VAE and text encoders built on meta from their configs (no weights read),
    tokenizers and other weightless components as saved, the denoisers on meta too (``__init__`` reads their
    configs: HunyuanVideo 1.5 sizes its image embeddings by the transformer's). What its sizes are read from before
    ranks start (loading the encoders would hold a Wan 14B's UMT5 whole in the launching process), and what ``hsdp
    plan`` traces captions through."""
    from hsdp.loading import build_component
    from hsdp.planning.profile import build_meta_model

    model = describe(model_dir)
    cls = model.pipeline_class()
    init = inspect.signature(cls.__init__).parameters
    parts = {n: None for n, p in init.items() if n != "self" and p.default is inspect.Parameter.empty}
    for name in encoder_components(model_dir):
        # On meta where there are weights; tokenizers, processors, a guider (HunyuanVideo 1.5) load as saved.
        parts[name] = build_component(model, name)
    for name in DENOISERS:
        if name in model.components and model.components[name].has_config:
            parts[name] = build_meta_model(model_dir / name, torch.float32)[0]
    return cls(**{k: v for k, v in parts.items() if k in init})


def call_modules(model_dir: Path) -> list[str]:
    """Components with weights that the pipeline's ``__call__`` runs itself, not through ``encode_prompt`` (which
    the denoiser's call replays from cached encodings) nor as a denoiser: LTX-2's ``connectors``, which turn the
    text encoder's hidden states into the transformer's video and audio conditioning on every call."""
    model = describe(model_dir)
    try:
        source = inspect.getsource(model.pipeline_class().__call__)
    except (OSError, TypeError):
        return []
    called = set(re.findall(r"self\.(\w+)\(", source))
    return [n for n, c in model.components.items() if n in called and n not in DENOISERS and c.has_config]


def load_call_modules(meta_pipe, model_dir: Path, device: torch.device) -> None:
    """Put the :func:`call_modules` of ``model_dir`` into ``meta_pipe`` (built by :func:`meta_pipeline`) with their
    weights, frozen, in fp32 on ``device`` (as the frozen encoders compute): the denoiser's call runs them."""
    from hsdp.loading import build_component

    model = describe(model_dir)
    for name in call_modules(model_dir):
        module = build_component(model, name, torch.float32, empty=False).to(device).requires_grad_(False)
        meta_pipe.register_modules(**{name: module.eval()})


def frozen_sharded(model_dir: Path) -> list[str]:
    """The frozen components inference shards (:meth:`hsdp.models.description.ModelDescription.shardable`: a shard
    plan, and weights at least a fraction of the largest denoiser's) that are not denoisers. The rule compares
    sizes, so it holds for any scale of the same pipeline."""
    model = describe(model_dir)
    denoisers = model.denoisers()
    return [name for name in model.shardable() if name not in denoisers]


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


def media_spec(model_dir: Path, component: str) -> MediaSpec:
    """Sizes the pipeline takes: its own size rule with ``component``'s patch
    (:meth:`hsdp.models.description.ModelDescription.size_rule`, the rule the engine and server check too); for an
    audio pipeline the waveforms its VAE takes (:func:`audio_spec`)."""
    rule = describe(model_dir).size_rule(component)
    audio = audio_spec(model_dir)  # the size rule then is the engine's, which sizes of audio do not use
    return MediaSpec(rule.spatial_multiple, rule.temporal, video=rule.temporal is not None and audio is None, audio=audio)


def audio_spec(model_dir: Path) -> AudioSpec | None:
    """For a pipeline that makes audio (:func:`hsdp.engine.model_info.inspect_model`), what its VAE takes: the
    sampling rate and channels of its config, and the longest audio the pipeline makes (its family's limit, as
    ``hsdp generate`` checks it), in samples; None for an image or video pipeline. An audio pipeline whose VAE
    takes no waveform (a mel-spectrogram VAE with a vocoder), or whose longest audio no family file knows, is a
    ``ValueError``: the trainer has no data for it."""
    from hsdp.engine.model_info import inspect_model

    info = inspect_model(model_dir)
    if info.output != "audio":
        return None
    model = describe(model_dir)
    vae = model.config("vae") if "vae" in model.components else {}
    rate, channels = vae.get("sampling_rate"), vae.get("audio_channels")
    if not rate or not channels:
        raise ValueError(
            f"{model.class_name}'s VAE ({vae.get('_class_name', 'none')}) takes no waveform (its config names no "
            "sampling_rate and audio_channels), so hsdp's diffusion trainer has no audio data for it; waveform VAEs "
            "(Stable Audio's AutoencoderOobleck) train"
        )
    if info.max_audio_seconds is None:
        raise ValueError(
            f"{model.class_name}: the longest audio it makes is not known (no family file in hsdp.families gives "
            "max_audio_seconds), so the trainer cannot cut its audio to a length the pipeline takes"
        )
    samples = round(info.max_audio_seconds * rate)
    return AudioSpec(int(rate), int(channels), samples)


def encode_items(
    pipe, model_dir: Path, layout: PromptLayout, dataset: MediaDataset, indices: Iterable[int]
) -> list[dict[str, torch.Tensor]]:
    """The ``latents`` and caption encodings of items ``indices`` (what the latent cache stores per item): the VAE's
    normalised latents (:func:`hsdp.train.diffusion.pipeline_call.vae_latents`) and what the pipeline's
    ``__call__`` gets from ``encode_prompt`` for the caption at the item's size (and from ``encode_duration`` for an
    audio item's length)."""
    out = []
    for i in indices:
        bucket, item = dataset.buckets[i], dataset.items[i]
        size, frames = (bucket.height, bucket.width), bucket.frames
        latents = vae_latents(pipe.vae, dataset.media(i).to(_device_of(pipe.vae)))
        captions = encode_captions(pipe, model_dir, layout, [item.caption], size, frames, item.seconds)[0]
        out.append({"latents": latents, **captions})
    return out


def encoder_components(model_dir: Path) -> list[str]:
    """The frozen components cached encodings come from: every component but the denoisers and the scheduler."""
    return [
        name
        for name in describe(model_dir).components
        if name not in (*DENOISERS, "scheduler")
    ]


