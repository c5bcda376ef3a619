"""Fine-tune a diffusers pipeline's denoiser with the shared training loop (:class:`hsdp.train.trainer.Trainer`).

The denoiser (``transformer``, ``transformer_2`` or ``unet``, as ``model_index.json`` names it) loads sharded with
the same plan rules and ``load_pretrained`` as inference, with peft LoRA adapters injected before sharding when
``--lora-r`` is set. The frozen VAE and text encoders load once, encode every item's latents and caption
embeddings (or read them from ``--cache-latents``), and are freed before the first step, so the training peak
holds only the denoiser, its gradients, optimizer state and activations.

Noise and timesteps come from one CPU generator seeded by (seed, step, micro-batch) and drawn for the whole
global micro-batch; each data-parallel rank takes its rows. A run therefore sees the same noise at every world
size and layout, which is what the parity tests compare with one process running diffusers + peft.
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hsdp.checkpoint import export_safetensors
from hsdp.config import DTYPES
from hsdp.families import family_for
from hsdp.lora_formats import save_lora
from hsdp.train.config import Preflight, TrainConfig, TrainConfigError, model_fingerprint, resume_target
from hsdp.train.data import DatasetError
from hsdp.train.diffusion.media import MediaDataset, MediaSpec
from hsdp.train.diffusion.objective import Objective, objective_for
from hsdp.train.trainer import Trainer, TrainResult

logger = logging.getLogger("hsdp")

__all__ = ["DiffusionTrainer", "DEFAULT_LORA_TARGETS", "is_pipeline", "diffusion_preflight", "EncodedData"]

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
    from hsdp.lora import adapter_config, check_targets

    if not Path(cfg.data).exists():
        raise TrainConfigError(f"--data {cfg.data}: no such folder or metadata file")
    lm_only = [
        flag
        for flag, used in (
            ("--eval-data/--eval-split", cfg.eval_data or cfg.eval_split),
            ("--export-merged", cfg.export_merged),
            ("--tensor-parallel-size", cfg.parallel.tensor_parallel_size > 1),
        )
        if used
    ]
    if lm_only:
        raise TrainConfigError(f"{', '.join(lm_only)}: not available for diffusion training yet")
    component = trained_component(cfg, model_dir)
    family = family_for(_index(model_dir).get("_class_name", ""))
    if family.latent_packing != 1 or component == "unet":
        raise TrainConfigError(
            f"--model {cfg.model}: training {_index(model_dir).get('_class_name')} needs its latent packing / "
            "added conditioning, which hsdp's diffusion trainer does not build yet (DiT pipelines such as Wan train)"
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
    fingerprint = model_fingerprint(model_dir / component)
    return Preflight(model_dir, fingerprint, resume_target(cfg, fingerprint))


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
    pipe = _pipeline_without(model_dir, [n for n in DENOISERS if n in _index(model_dir)])
    try:
        MediaDataset.from_source(cfg.data, media_spec(pipe, model_dir, component), resolution=cfg.resolution,
                                 frames=cfg.frames)
    except DatasetError as exc:
        raise TrainConfigError(str(exc)) from exc


def _check_plain_latents(cfg: TrainConfig, model_dir: Path, component: str) -> None:
    """The denoiser must take the VAE's latents as they are: more input channels than the VAE's latent channels
    mean packed latents or concatenated conditions (FLUX, Qwen-Image, Wan image-to-video), which the generic
    trainer does not build."""
    denoiser = json.loads((model_dir / component / "config.json").read_text())
    vae_config = model_dir / "vae" / "config.json"
    if not vae_config.is_file():
        return
    vae = json.loads(vae_config.read_text())
    latent = vae.get("z_dim") or vae.get("latent_channels")
    taken = denoiser.get("in_channels")
    if latent and taken and taken != latent:
        raise TrainConfigError(
            f"--model {cfg.model}: its {component} takes {taken} input channels, the VAE gives {latent}: packed "
            "latents or concatenated conditions, which hsdp's diffusion trainer does not build yet"
        )


@dataclass
class EncodedData:
    """Latents and caption embeddings of every item, encoded once (the frozen encoders are gone)."""

    dataset: MediaDataset
    latents: list[torch.Tensor]
    prompts: list[torch.Tensor]
    empty_prompt: torch.Tensor
    """The embedding of the empty caption (caption dropout)."""


def _pipeline_without(model_dir: Path, component_names: list[str]):
    """The pipeline of ``model_dir`` on the CPU with its denoisers left out (they are trained, not encoded)."""
    import diffusers

    cls = getattr(diffusers, _index(model_dir)["_class_name"])
    return cls.from_pretrained(model_dir, **{name: None for name in component_names}, torch_dtype=torch.float32)


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
    video = pixels[None]
    config = vae.config
    if "latents_mean" in config and config.get("latents_mean") is not None:  # Wan-style per-channel statistics
        latents = vae.encode(video).latent_dist.mode()
        shape = (1, -1) + (1,) * (latents.dim() - 2)
        mean = torch.tensor(config.latents_mean).view(shape)
        std = torch.tensor(config.latents_std).view(shape)
        return ((latents - mean) / std)[0]
    latents = vae.encode(video[:, :, 0]).latent_dist.mode()
    shift = config.get("shift_factor") or 0.0
    return ((latents - shift) * config.scaling_factor)[0]


@torch.no_grad()
def encode_captions(pipe, captions: list[str]) -> list[torch.Tensor]:
    """Caption embeddings from the pipeline's own ``encode_prompt`` (no guidance: one embedding per caption)."""
    params = inspect.signature(pipe.encode_prompt).parameters
    kwargs = {"device": torch.device("cpu")}
    if "do_classifier_free_guidance" in params:
        kwargs["do_classifier_free_guidance"] = False
    out = pipe.encode_prompt(prompt=captions, **{k: v for k, v in kwargs.items() if k in params})
    embeds = out[0] if isinstance(out, tuple) else out
    return [e for e in embeds.float()]


class DiffusionTrainer(Trainer):
    """:class:`Trainer` for a diffusers pipeline's denoiser (see the module docstring)."""

    unit = "samples"

    def _preflight(self) -> Preflight:
        from hsdp.models.builtin import resolve_model

        problems = self.cfg.problems()
        if problems:
            raise TrainConfigError("invalid training settings:\n" + "\n".join(f"  - {p}" for p in problems))
        model_dir = resolve_model(self.cfg.model)
        self.component = trained_component(self.cfg, model_dir)
        return diffusion_preflight(self.cfg, model_dir)

    def _weights_dir(self) -> Path:
        return self.model_dir / self.component

    def _lora_config(self):
        return self.cfg.lora_config(str(self._weights_dir()), default_targets=DEFAULT_LORA_TARGETS)

    def _enable_activation_checkpointing(self) -> None:
        self.model.enable_gradient_checkpointing()

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
        pipe = _pipeline_without(self.model_dir, [n for n in DENOISERS if n in _index(self.model_dir)])
        spec = media_spec(pipe, self.model_dir, self.component)
        try:
            dataset = MediaDataset.from_source(cfg.data, spec, resolution=cfg.resolution, frames=cfg.frames)
        except DatasetError as exc:
            raise TrainConfigError(str(exc)) from exc
        cache = Path(cfg.output_dir or ".") / "latent-cache" if cfg.cache_latents else None
        latents, prompts = [], []
        for index, item in enumerate(dataset.items):
            cached = _read_cache(cache, self.fingerprint, dataset, index) if cache else None
            if cached is None:
                cached = {
                    "latents": encode_latents(pipe.vae, dataset.pixels(index)),
                    "prompt": encode_captions(pipe, [item.caption])[0],
                }
                if cache:
                    _write_cache(cache, self.fingerprint, dataset, index, cached)
            latents.append(cached["latents"])
            prompts.append(cached["prompt"])
        empty = encode_captions(pipe, [""])[0]
        del pipe  # the frozen encoders are not needed again: free them before the first step
        gc.collect()
        return EncodedData(dataset, latents, prompts, empty), None

    def _micro_loss(self, micro: int) -> torch.Tensor:
        cfg = self.cfg
        number = self.step * cfg.grad_accum + micro
        rows = self.data.dataset.micro_batch(number, cfg.batch_size, cfg.seed)
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + number)
        drop = torch.rand(len(rows), generator=generator) < cfg.caption_dropout
        latents = torch.stack([self.data.latents[i] for i in rows])
        noised = self.objective.noise(latents, generator)
        prompts = [self.data.empty_prompt if d else self.data.prompts[i] for i, d in zip(rows, drop.tolist(), strict=True)]
        per_rank = cfg.batch_size // self.dp_size
        mine = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        embeds = _pad_stack(prompts[mine])
        with self._autocast():
            prediction = self.model(
                hidden_states=noised.noisy[mine].to(self.device),
                timestep=noised.timesteps[mine].to(self.device),
                encoder_hidden_states=embeds.to(self.device),
                return_dict=False,
            )[0]
        target = noised.target[mine].to(self.device)
        per_row = F.mse_loss(prediction.float(), target.float(), reduction="none").flatten(1).mean(1)
        return (per_row * noised.weights[mine].to(self.device)).mean() / cfg.grad_accum

    def _export(self, result: TrainResult) -> None:
        cfg = self.cfg
        if not cfg.export:
            return
        if self.lora:
            result.export = str(
                save_lora(self.model, self.lora, cfg.export, format=cfg.export_format, component=self.component)
            )
            return
        # Full fine-tuning: the pipeline folder with the trained denoiser (save_pretrained layout).
        out = Path(cfg.export)
        if self.rank == 0:
            shutil.copytree(self.model_dir, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(self.component, ".complete"))
        dtype = DTYPES[cfg.export_dtype] if cfg.export_dtype else None
        export_safetensors(self.model, out / self.component, dtype=dtype, source_dir=self._weights_dir())
        result.export = str(out)


def _pad_stack(embeds: list[torch.Tensor]) -> torch.Tensor:
    """Caption embeddings of one batch, zero-padded to the longest (encoders give fixed lengths; kept general)."""
    length = max(e.shape[0] for e in embeds)
    return torch.stack([F.pad(e, (0, 0, 0, length - e.shape[0])) for e in embeds])


def _cache_file(root: Path, fingerprint: dict, dataset: MediaDataset, index: int) -> Path:
    import hashlib

    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    bucket = dataset.buckets[index]
    key = dataset.items[index].key.replace("/", "__")
    return root / digest / f"{bucket.frames}x{bucket.height}x{bucket.width}" / f"{key}.safetensors"


def _read_cache(root: Path, fingerprint: dict, dataset: MediaDataset, index: int) -> dict | None:
    from safetensors.torch import load_file

    path = _cache_file(root, fingerprint, dataset, index)
    if not path.is_file():
        return None
    try:
        return load_file(path)
    except Exception:  # a partial or corrupt file: encode again
        logger.warning("latent cache %s is unreadable; encoding the item again", path)
        return None


def _write_cache(root: Path, fingerprint: dict, dataset: MediaDataset, index: int, tensors: dict) -> None:
    import os

    from safetensors.torch import save_file

    path = _cache_file(root, fingerprint, dataset, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, staging)
    os.replace(staging, path)
