"""Fine-tune a diffusers pipeline's denoiser with the shared training loop (:class:`hsdp.train.trainer.Trainer`).

The denoiser (``transformer``, ``transformer_2`` or ``unet``, as ``model_index.json`` names it) loads sharded with
the same plan rules and ``load_pretrained`` as inference, with peft LoRA adapters injected before sharding when
``--lora-r`` is set. The frozen VAE and text encoders load once, encode every item's latents and caption
encodings (every tensor the pipeline's ``encode_prompt`` returns that the denoiser takes: embeddings, pooled
embeddings, text ids), and are freed before the first step, so the training peak holds only the denoiser, its
gradients, optimizer state and activations. Those that inference shards (:func:`frozen_sharded`: the engine's size
rule, e.g. T5-XXL beside FLUX, UMT5 beside Wan) load sharded on the training mesh with the engine's loader, the
others whole, all on this rank's device (:func:`frozen_pipeline`). With ``--cache-latents`` they go through
:class:`hsdp.train.diffusion.latent_cache.LatentCache`: each rank encodes its share of the missing items, then
every rank reads every item.

The denoiser's call is the family's (:mod:`hsdp.families`): plain latents, timestep and embeddings for DiT
pipelines such as Wan; FLUX's packed latents, position ids and guidance; SDXL's added conditioning.

Noise and timesteps come from one CPU generator seeded by (seed, step, micro-batch) and drawn for the whole
global micro-batch; each data-parallel rank takes its rows. A run therefore sees the same noise at every world
size and layout, which is what the parity tests compare with one process running diffusers + peft.
"""

from __future__ import annotations

import functools
import gc
import inspect
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from hsdp.checkpoint import export_pipeline
from hsdp.config import DTYPES, ParallelConfig, ShardingStrategy
from hsdp.context_parallel import enable_ulysses, has_cp_plan
from hsdp.distributed import copy_ahead, local_device
from hsdp.families import GENERIC, DenoiserBatch, Family, family_for, training_family
from hsdp.train.config import (
    Preflight,
    TrainConfig,
    TrainConfigError,
    check_attention_backend,
    check_export_formats,
    model_fingerprint,
    resume_target,
)
from hsdp.train.data import DatasetError
from hsdp.train.diffusion import evaluation, validation
from hsdp.train.diffusion.latent_cache import LatentCache, agreed_indices, encoder_fingerprint, fill_cache
from hsdp.train.diffusion.media import MediaDataset, MediaSpec
from hsdp.train.diffusion.objective import Objective, objective_for
from hsdp.train.trainer import Trainer, TrainResult

logger = logging.getLogger("hsdp")

__all__ = [
    "DiffusionTrainer",
    "DEFAULT_LORA_TARGETS",
    "is_pipeline",
    "diffusion_preflight",
    "check_trainable",
    "EncodedData",
    "frozen_sharded",
    "frozen_pipeline",
]

DEFAULT_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
"""The attention projections diffusers' training scripts adapt; every diffusers denoiser has them."""
DENOISERS = ("transformer", "transformer_2", "unet")


def is_pipeline(model_dir: Path) -> bool:
    return (Path(model_dir) / "model_index.json").is_file()


def _index(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "model_index.json").read_text())


def trained_component(cfg: TrainConfig, model_dir: Path) -> str:
    """The denoiser ``cfg`` trains: ``--train-component`` or the pipeline's first denoiser."""
    index = _index(model_dir)
    present = [n for n in DENOISERS if isinstance(index.get(n), list) and index[n][0] is not None]
    if not present:
        raise TrainConfigError(
            f"--model {cfg.model}: {index.get('_class_name')} has no trainable denoiser "
            f"(none of {', '.join(DENOISERS)} in model_index.json)"
        )
    if cfg.train_component and cfg.train_component not in present:
        raise TrainConfigError(
            f"--train-component {cfg.train_component}: {index.get('_class_name')} has {', '.join(present)}"
        )
    return cfg.train_component or present[0]


def diffusion_preflight(cfg: TrainConfig, model_dir: Path) -> Preflight:
    """Check a diffusion run's settings and inputs without loading the model."""
    if not Path(cfg.data).exists():
        raise TrainConfigError(f"--data {cfg.data}: no such folder or metadata file")
    lm_only = [
        flag
        for flag, used in (
            ("--eval-split", cfg.eval_split),
            ("--export-merged", cfg.export_merged),
            ("--tensor-parallel-size", cfg.parallel.tensor_parallel_size > 1),
        )
        if used
    ]
    if lm_only:
        raise TrainConfigError(f"{', '.join(lm_only)}: not available for diffusion training yet")
    component = check_trainable(cfg, model_dir)
    _check_sequence_parallel(cfg, model_dir, component)
    check_attention_backend(cfg, "diffusion")
    check_export_formats(cfg, model_dir / component)
    fingerprint = model_fingerprint(model_dir / component)
    return Preflight(model_dir, fingerprint, resume_target(cfg, fingerprint))


def check_trainable(cfg: TrainConfig, model_dir: Path) -> str:
    """The denoiser ``cfg`` trains, once the pipeline is known to be one the trainer builds inputs for (its
    family's training call, latents as the VAE gives them or packed as the family packs them), with a scheduler
    that gives an objective and LoRA targets that match; refused with a :class:`TrainConfigError` otherwise. It
    reads configs only (no data, no weights): ``hsdp plan --train`` refuses with the same check."""
    from hsdp.lora import adapter_config, check_targets

    component = trained_component(cfg, model_dir)
    pipeline_class = _index(model_dir).get("_class_name", "")
    family = training_family(pipeline_class)
    if family is None or (family is GENERIC and component == "unet"):  # the generic call is a DiT transformer's
        raise TrainConfigError(
            f"--model {cfg.model}: training {pipeline_class} needs inputs besides latents, timestep and text "
            "embeddings (reference images, masks, a UNet's added conditioning), which hsdp's diffusion trainer does "
            "not build yet (text-to-image and text-to-video pipelines of Wan, FLUX.1 and SDXL train)"
        )
    _check_plain_latents(cfg, model_dir, component)
    objective_for(model_dir)  # a pipeline without a usable scheduler fails here
    if cfg.use_lora:
        try:
            if cfg.lora_adapter:
                adapter_config(cfg.lora_adapter, model_dir / component, "--lora-adapter")
            else:
                config = cfg.lora_config(str(model_dir / component), default_targets=DEFAULT_LORA_TARGETS)
                check_targets(config, model_dir / component, "--lora-target-modules")
        except ValueError as exc:
            raise TrainConfigError(str(exc)) from exc
    return component


def check_diffusion_run(cfg: TrainConfig) -> None:
    """Everything that can be checked before ranks start: settings, model, LoRA targets, and the media (every
    file readable, captioned, of a size the VAE takes)."""
    from hsdp.models.builtin import resolve_model

    problems = cfg.problems()
    if problems:
        raise TrainConfigError("invalid training settings:\n" + "\n".join(f"  - {p}" for p in problems))
    model_dir = resolve_model(cfg.model)
    diffusion_preflight(cfg, model_dir)
    component = trained_component(cfg, model_dir)
    spec = media_spec(meta_pipeline(model_dir), model_dir, component)
    try:
        dataset = MediaDataset.from_source(cfg.data, spec, resolution=cfg.resolution, frames=cfg.frames)
    except DatasetError as exc:
        raise TrainConfigError(str(exc)) from exc
    if os.environ.get("RANK", "0") == "0":  # once, also under torchrun (every process checks before joining)
        logger.info("%s", dataset.summary(cfg.data))
    if cfg.eval_data:
        evaluation.open_eval_media(cfg, spec)


def _check_sequence_parallel(cfg: TrainConfig, model_dir: Path, component: str) -> None:
    """``--ulysses-degree`` needs the denoiser's ``_cp_plan`` (where diffusers splits and gathers the sequence)."""
    import diffusers

    if cfg.parallel.ulysses_degree <= 1:
        return
    name = json.loads((model_dir / component / "config.json").read_text()).get("_class_name", "")
    if not has_cp_plan(getattr(diffusers, name, None)):
        raise TrainConfigError(
            f"--ulysses-degree={cfg.parallel.ulysses_degree}: {component} ({name}) has no _cp_plan, so diffusers "
            "cannot split its sequence; train it with --hsdp-shard-size instead"
        )


def _check_plain_latents(cfg: TrainConfig, model_dir: Path, component: str) -> None:
    """The denoiser must take the VAE's latents as they are, or packed as its family packs them (FLUX: 2 x 2
    patches, 4x the channels): other counts mean concatenated conditions (Wan image-to-video, FLUX Fill) or a
    packing no family builds (Qwen-Image)."""
    denoiser = json.loads((model_dir / component / "config.json").read_text())
    vae_config = model_dir / "vae" / "config.json"
    if not vae_config.is_file():
        return
    vae = json.loads(vae_config.read_text())
    latent = vae.get("z_dim") or vae.get("latent_channels")
    taken = denoiser.get("in_channels")
    packing = family_for(_index(model_dir).get("_class_name", "")).latent_packing
    if latent and taken and taken != latent * packing**2:
        raise TrainConfigError(
            f"--model {cfg.model}: its {component} takes {taken} input channels, the VAE gives {latent}: packed "
            "latents or concatenated conditions, which hsdp's diffusion trainer does not build yet"
        )


@dataclass(frozen=True)
class _MicroBatch:
    """This rank's rows of one micro-batch, on its device: what the denoiser takes, and what the loss compares its
    prediction with and weights the rows by."""

    batch: DenoiserBatch
    target: torch.Tensor
    weights: torch.Tensor


@dataclass
class EncodedData:
    """Latents and caption encodings of every item, encoded once (the frozen encoders are gone)."""

    dataset: MediaDataset
    latents: list[torch.Tensor]
    prompts: list[dict[str, torch.Tensor]]
    """Per item, the tensors the family names in ``prompt_outputs`` (e.g. prompt_embeds, pooled_prompt_embeds)."""
    empty_prompt: dict[str, torch.Tensor] | None
    """The encodings of the empty caption (caption dropout; None without it)."""


def _pipeline_without(model_dir: Path, **components):
    """The pipeline of ``model_dir`` on the CPU with its denoisers left out (they are trained, not encoded) and
    ``components`` in place of loading those."""
    import diffusers

    cls = getattr(diffusers, _index(model_dir)["_class_name"])
    absent = {name: None for name in DENOISERS if name in _index(model_dir)}
    return cls.from_pretrained(model_dir, **absent, **components, torch_dtype=torch.float32)


def meta_pipeline(model_dir: Path):
    """The pipeline without denoisers or scheduler: VAE and text encoders built on meta from their configs (no
    weights read), tokenizers as saved. What its sizes are read from before ranks start (loading the encoders
    would hold a Wan 14B's UMT5 whole in the launching process), and what ``hsdp plan`` traces captions through."""
    import importlib

    import diffusers

    from hsdp.loading import build_empty_model, model_class_for

    index = _index(model_dir)
    cls = getattr(diffusers, index["_class_name"])
    init = inspect.signature(cls.__init__).parameters
    parts = {n: None for n, p in init.items() if n != "self" and p.default is inspect.Parameter.empty}
    for name in encoder_components(model_dir):
        folder = model_dir / name
        if (folder / "config.json").is_file():
            parts[name] = build_empty_model(model_class_for(folder), folder, None)
        elif name.startswith("tokenizer"):
            library, class_name = index[name][:2]
            parts[name] = getattr(importlib.import_module(library), class_name).from_pretrained(folder)
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
    """Sizes the pipeline takes, from its own attributes and the denoiser's ``patch_size``."""
    config = json.loads((model_dir / component / "config.json").read_text())
    patch = config.get("patch_size") or 1
    patch = patch[-1] if isinstance(patch, (list, tuple)) else patch
    spatial = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", 8)
    temporal = getattr(pipe, "vae_scale_factor_temporal", None)
    family = family_for(type(pipe).__name__)
    return MediaSpec(int(spatial) * int(patch) * family.latent_packing, temporal, video=temporal is not None)


@torch.no_grad()
def encode_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """``[C, F, H, W]`` pixels -> normalised latents (the mode of the VAE's posterior, as diffusers' scripts do),
    laid out as the denoiser takes them (5-D for video VAEs, 4-D for image ones)."""
    video = pixels[None].to(_device_of(vae))
    config = vae.config
    if "latents_mean" in config and config.get("latents_mean") is not None:  # Wan-style per-channel statistics
        latents = vae.encode(video).latent_dist.mode().cpu()
        shape = (1, -1) + (1,) * (latents.dim() - 2)
        mean = torch.tensor(config.latents_mean).view(shape)
        std = torch.tensor(config.latents_std).view(shape)
        return ((latents - mean) / std)[0]
    latents = vae.encode(video[:, :, 0]).latent_dist.mode().cpu()
    shift = config.get("shift_factor") or 0.0
    return ((latents - shift) * config.scaling_factor)[0]


@torch.no_grad()
def encode_captions(pipe, captions: list[str]) -> list[dict[str, torch.Tensor]]:
    """Each caption's encodings from the pipeline's own ``encode_prompt`` (no guidance), named by the family's
    ``prompt_outputs``: every tensor the denoiser's call takes, so the latent cache holds all of them."""
    family = training_family(type(pipe).__name__)
    params = inspect.signature(pipe.encode_prompt).parameters
    encoders = [module for name, module in pipe.components.items() if name.startswith("text_encoder")]
    kwargs = {"device": _device_of(*encoders)}
    if "do_classifier_free_guidance" in params:
        kwargs["do_classifier_free_guidance"] = False
    out = pipe.encode_prompt(prompt=captions, **{k: v for k, v in kwargs.items() if k in params})
    outputs = out if isinstance(out, tuple) else (out,)
    # Pipelines return more than the family names (e.g. Wan's negative embeddings, None without guidance).
    named = {
        name: t.float().cpu() for name, t in zip(family.prompt_outputs, outputs, strict=False) if name is not None
    }
    return [
        {name: t if name in family.shared_prompt_outputs else t[row] for name, t in named.items()}
        for row in range(len(captions))
    ]


def encode_items(pipe, dataset: MediaDataset, indices: Iterable[int]) -> list[dict[str, torch.Tensor]]:
    """The ``latents`` and caption encodings of items ``indices`` (what the latent cache stores per item)."""
    return [
        {"latents": encode_latents(pipe.vae, dataset.pixels(i)), **encode_captions(pipe, [dataset.items[i].caption])[0]}
        for i in indices
    ]


def encoder_components(model_dir: Path) -> list[str]:
    """The frozen components cached encodings come from: every component but the denoisers and the scheduler."""
    return [
        name
        for name, entry in _index(model_dir).items()
        if isinstance(entry, list) and entry[0] is not None and name not in (*DENOISERS, "scheduler")
    ]


class DiffusionTrainer(Trainer):
    """:class:`Trainer` for a diffusers pipeline's denoiser (see the module docstring)."""

    unit = "samples"

    def _preflight(self) -> Preflight:
        import diffusers

        from hsdp.models.builtin import resolve_model

        problems = self.cfg.problems()
        if problems:
            raise TrainConfigError("invalid training settings:\n" + "\n".join(f"  - {p}" for p in problems))
        model_dir = resolve_model(self.cfg.model)
        self.component = trained_component(self.cfg, model_dir)
        checks = diffusion_preflight(self.cfg, model_dir)
        self.pipeline_class = getattr(diffusers, _index(model_dir)["_class_name"])
        self.family: Family = training_family(self.pipeline_class.__name__)
        return checks

    def _weights_dir(self) -> Path:
        return self.model_dir / self.component

    def _lora_config(self):
        return self.cfg.lora_config(str(self._weights_dir()), default_targets=DEFAULT_LORA_TARGETS)

    def _enable_activation_checkpointing(self) -> None:
        """diffusers' per-block gradient checkpointing (its ``_supports_gradient_checkpointing`` flag, not the
        ``supports_gradient_checkpointing`` property transformers models have)."""
        if not getattr(self.model, "_supports_gradient_checkpointing", False):
            raise TrainConfigError(f"--activation-checkpointing: {type(self.model).__name__} does not support it")
        self.model.enable_gradient_checkpointing()

    def _enable_sequence_parallel(self) -> None:
        enable_ulysses(self.model, self.parallel, self.meshes)

    def _items_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.grad_accum

    def _data_state(self) -> dict:
        cfg = self.cfg
        return {"path": str(cfg.data), "resolution": cfg.resolution, "frames": cfg.frames, "seed": cfg.seed}

    def _load_data(self) -> tuple:
        cfg = self.cfg
        boundary = _index(self.model_dir).get("boundary_ratio")
        timestep_range = (0.0, 1.0)
        if boundary is not None:  # Wan 2.2: transformer denoises high noise (t >= boundary), transformer_2 the rest
            timestep_range = (boundary, 1.0) if self.component == "transformer" else (0.0, boundary)
        self.objective: Objective = objective_for(
            self.model_dir, sampling=cfg.timestep_sampling, shift=cfg.flow_shift, timestep_range=timestep_range
        )
        pipe = frozen_pipeline(self.model_dir, self.parallel)
        spec = media_spec(pipe, self.model_dir, self.component)
        try:
            dataset = MediaDataset.from_source(cfg.data, spec, resolution=cfg.resolution, frames=cfg.frames)
        except DatasetError as exc:
            raise TrainConfigError(str(exc)) from exc
        encode = functools.partial(encode_items, pipe, dataset)
        items = self._through_cache(dataset, encode) if cfg.cache_latents else encode(range(len(dataset)))
        empty = encode_captions(pipe, [""])[0] if cfg.caption_dropout else None
        held_out = evaluation.load_evaluation(cfg, pipe, spec) if cfg.eval_data else None
        prompts = cfg.validation_prompts
        self.validation = validation.capture_encodings(pipe, self.model_dir, cfg) if prompts else None
        del pipe, encode  # the frozen encoders are not needed again: free them before the first step
        gc.collect()
        latents = [item.pop("latents") for item in items]
        return EncodedData(dataset, latents, items, empty), held_out

    def _through_cache(self, dataset: MediaDataset, encode) -> list[dict[str, torch.Tensor]]:
        """``--cache-latents``: each rank encodes its share of the items missing from the cache (under
        ``<output-dir>/latent-cache``, keyed by the encoders' fingerprint), then every rank reads every item."""
        fingerprint = encoder_fingerprint(
            self.model_dir, encoder_components(self.model_dir), pipeline=self.pipeline_class.__name__
        )
        cache = LatentCache(Path(self.cfg.output_dir or ".") / "latent-cache", fingerprint)
        fill_cache(dataset, cache, encode, self.rank, self.world_size)
        items = [cache.get(item.cache_key, bucket) for item, bucket in zip(dataset.items, dataset.buckets, strict=True)]
        # An item damaged since it was written (get warns) is encoded again here rather than failing the run; every
        # rank encodes the same ones (sharded encoders are collective), whichever rank found them damaged.
        for index in agreed_indices([i for i, tensors in enumerate(items) if tensors is None]):
            encoded = encode([index])[0]
            if items[index] is None:
                items[index] = encoded
        return items

    def _micro_inputs(self, number: int) -> _MicroBatch:
        cfg = self.cfg
        rows = self.data.dataset.micro_batch(number, cfg.batch_size, cfg.seed)
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + number)
        drop = torch.rand(len(rows), generator=generator) < cfg.caption_dropout
        latents = torch.stack([self.data.latents[i] for i in rows])
        noised = self.objective.noise(latents, generator)
        prompts = [self.data.empty_prompt if d else self.data.prompts[i] for i, d in zip(rows, drop.tolist(), strict=True)]
        per_rank = cfg.batch_size // self.dp_size
        mine = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        bucket = self.data.dataset.buckets[rows[0]]  # one bucket per micro-batch
        ahead = functools.partial(copy_ahead, device=self.device)
        batch = DenoiserBatch(
            noisy=ahead(noised.noisy[mine]), timesteps=ahead(noised.timesteps[mine]),
            prompts={name: ahead(t) for name, t in _batch_prompts(prompts[mine]).items()},
            size=(bucket.height, bucket.width),
        )  # fmt: skip
        return _MicroBatch(batch, target=ahead(noised.target[mine]), weights=ahead(noised.weights[mine]))

    def _micro_loss(self, inputs: _MicroBatch) -> torch.Tensor:
        prediction = self._predict(inputs.batch)
        per_row = F.mse_loss(prediction.float(), inputs.target.float(), reduction="none").flatten(1).mean(1)
        return (per_row * inputs.weights).mean() / self.cfg.grad_accum

    def denoise(
        self, noisy: torch.Tensor, timesteps: torch.Tensor, prompts: dict[str, torch.Tensor], size: tuple[int, int]
    ) -> torch.Tensor:
        """The denoiser's prediction for one batch of this rank (training and ``--eval-data``), as latents."""
        batch = DenoiserBatch(
            noisy=noisy.to(self.device),
            timesteps=timesteps.to(self.device),
            prompts={name: t.to(self.device) for name, t in prompts.items()},
            size=size,
        )
        return self._predict(batch)

    def _predict(self, batch: DenoiserBatch) -> torch.Tensor:
        """The denoiser's prediction for a batch already on this rank's device, as latents."""
        call = self.family.training_inputs(self.pipeline_class, self.model, batch)
        with self._autocast():
            return call.to_latents(self.model(**call.kwargs, return_dict=False)[0])

    def sample(self) -> list:
        """Validation samples of the model as it is now (collective; rank 0 writes them): :mod:`.validation`."""
        return validation.generate_samples(self, self.validation)

    def _validate(self) -> None:
        cfg, every = self.cfg, self.cfg.validation_every
        if self.validation and (self.step == 0 or (every and self.step % every == 0) or self.step == cfg.steps):
            self.sample()

    def evaluate(self) -> tuple[float, None]:
        """(loss at fixed timesteps on ``--eval-data``, no perplexity): :mod:`hsdp.train.diffusion.evaluation`."""
        return evaluation.evaluate(self), None

    def _export(self, result: TrainResult) -> None:
        cfg = self.cfg
        if not cfg.export:
            return
        if self.lora:
            result.export = str(self._export_lora(self.component, diffusers=True))
            return
        # Full fine-tuning: the pipeline folder with the trained denoiser (save_pretrained layout).
        dtype = DTYPES[cfg.export_dtype] if cfg.export_dtype else None
        out = export_pipeline(self.model, self.model_dir, self.component, cfg.export, dtype=dtype, run=cfg.run_name())
        result.export = str(out)


def _batch_prompts(prompts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One micro-batch's caption encodings, stacked per name (shared ones too: the family's call picks one)."""
    return {name: _pad_stack([p[name] for p in prompts]) for name in prompts[0]}


def _pad_stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Stack, zero-padding the first dimension to the longest (encoders give fixed lengths; kept general)."""
    length = max(t.shape[0] for t in tensors)
    return torch.stack([F.pad(t, (0, 0) * (t.dim() - 1) + (0, length - t.shape[0])) for t in tensors])
