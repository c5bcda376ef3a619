"""Planning ``hsdp train`` on a diffusers pipeline: the trained denoiser's profile and its step's activations.

The diffusion trainer (:mod:`hsdp.train.diffusion.trainer`) frees the VAE and text encoders before the first step,
so a training step holds the denoiser alone: its shards, gradients and AdamW state (of the LoRA adapters only, when
``lora_r`` is set; the frozen base in its stored dtype), gathered units, and the activations of one micro-batch.
Weights, gradients and optimizer state are the planner's exact arithmetic over the profile of the denoiser as the
trainer builds it (fp32 for full fine-tuning, adapters injected by the trainer's own hook for LoRA).

Activations are traced, not guessed: the denoiser built from its config runs one forward and backward on fake
tensors with the inputs the trainer gives it (:mod:`hsdp.planning.trace`), and torch's ``MemTracker`` reads what
that step holds besides the parameters (saved activations, the backward's temporaries, gradients), phase by phase
as FSDP2 gathers and reduces the shard plan's blocks; the estimate adds each layout's gathered blocks, buffers and
sharded gradients to each phase. A DiT's cross-attention to the text tokens, its modulation and attention kernels
are then counted as they run. With ``activation_checkpointing`` the traced denoiser has diffusers' gradient
checkpointing on, as the trainer turns it on (``enable_gradient_checkpointing``), so the trace holds each block's
inputs and one block's activations recomputed during the backward, beside the gradients already reduced.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hsdp.config import DTYPES
from hsdp.models.description import describe
from hsdp.planning.estimate import Workload
from hsdp.planning.profile import ModelProfile, PlanError, build_meta_model, profile_module
from hsdp.planning.trace import memory_tracker, trace_training_step

__all__ = ["DiffusionTraining", "diffusion_training", "trainer_step_peak"]


@dataclass(frozen=True)
class DiffusionTraining:
    """What ``hsdp plan --train`` needs for a pipeline: the trained denoiser's profile and the workload."""

    profile: ModelProfile
    work: Workload
    latent_shape: tuple[int, ...]
    """One sample's latents as the VAE gives them (``[C, F, H, W]`` or ``[C, H, W]``)."""


def _denoiser_inputs(pipe, model_dir: Path, batch: int, size: tuple[int, int], frames: int, latent) -> tuple:
    """The trained denoiser's keyword arguments for one micro-batch and the map of its output to latents, as the
    trainer builds them (:class:`hsdp.train.diffusion.pipeline_call.DenoiserCalls`), on the CPU with zeros for
    values. The caption encodings' layout and shapes come from the pipeline's ``__call__`` with its text encoders
    computing on fake tensors (:func:`_on_fake_tensors`)."""
    from hsdp.train.diffusion.frozen import DENOISERS, meta_pipeline
    from hsdp.train.diffusion.pipeline_call import (
        DenoiserBatch,
        DenoiserCalls,
        batch_prompts,
        encode_captions,
        prompt_layout,
        runnable_pipeline,
    )

    encoding = runnable_pipeline(pipe, model_dir, torch.device("cpu"))
    for name, module in encoding.components.items():
        # the text encoders, and what else encodes besides the VAE (Stable Audio's projection model)
        if name not in ("vae", *DENOISERS) and isinstance(module, nn.Module):
            _on_fake_tensors(module)
    layout = prompt_layout(encoding, model_dir, size, frames)
    items = encode_captions(encoding, model_dir, layout, [""], size, frames)
    zeros = [{n: torch.zeros(t.shape) for n, t in items[0].items()}] * batch
    calls = DenoiserCalls(meta_pipeline(model_dir), model_dir, layout, torch.device("cpu"))
    step = DenoiserBatch(torch.zeros(batch, *latent), torch.zeros(batch), batch_prompts(layout, zeros), size, frames)
    return calls.kwargs(step)


def _on_fake_tensors(module: nn.Module) -> None:
    """``module`` (on meta) computes on fake tensors: outputs with the real shapes, no weights. Its attention mask
    is left out: transformers reads the mask's values (``padding_mask.all()``), which fake tensors have not, and it
    changes no shape. The pipeline's own code around the encoder runs on real tensors (Wan trims each caption to
    its token count and pads it back)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        module.to_empty(device="cpu")
    signature = inspect.signature(type(module).forward)
    original = module.forward

    def forward(*args, **kwargs):
        bound = signature.bind(module, *args, **kwargs).arguments
        bound.pop("self")
        extra = next((n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
        bound |= bound.pop(extra, {}) if extra else {}
        bound.pop("attention_mask", None)
        with mode:
            return original(**bound)

    module.forward = forward


def _patch(config: dict) -> tuple[int, int, int]:
    """The denoiser's (frames, height, width) patch: Wan's ``[1, 2, 2]``, an image DiT's ``2``."""
    patch = config.get("patch_size") or 1
    return tuple(patch) if isinstance(patch, (list, tuple)) else (1, patch, patch)


def _latent_shape(
    spec, model_dir: Path, config: dict, packing: int, height: int, width: int, frames: int
) -> tuple[int, ...]:
    """One sample's latents as the VAE gives them for a ``height x width`` item of ``frames`` frames (``packing``:
    the family's latent packing); sizes the VAE cannot take are refused naming the flag, as the trainer refuses
    such media."""
    for flag, value in (("--height", height), ("--width", width)):
        if value % spec.spatial_multiple:
            raise PlanError(f"{flag}={value} must be a multiple of {spec.spatial_multiple} for this pipeline")
    scale = spec.spatial_multiple // _patch(config)[-1] // packing
    vae = describe(model_dir).config("vae")
    channels = vae.get("z_dim") or vae.get("latent_channels") or config.get("in_channels") or 4
    if not spec.video:
        if frames != 1:
            raise PlanError(f"--frames={frames}: this pipeline makes images (use --frames 1)")
        return (channels, height // scale, width // scale)
    if (frames - 1) % spec.temporal_multiple:
        raise PlanError(f"--frames={frames} must be k * {spec.temporal_multiple} + 1 for this pipeline's VAE")
    return (channels, (frames - 1) // spec.temporal_multiple + 1, height // scale, width // scale)


def _audio_latent_shape(pipe, audio) -> tuple[int, ...]:
    """One audio item's latents (``[C, L]``): the pipeline's VAE (on meta) encoding a waveform of the length the
    trainer cuts every item to."""
    with torch.no_grad():
        encoded = pipe.vae.encode(torch.empty(1, audio.channels, audio.samples, device="meta"))
    output = encoded[0] if isinstance(encoded, tuple) else encoded
    return tuple(output.latent_dist.mode().shape[1:])


def _tokens(latent: tuple[int, ...], config: dict, packing: int) -> int:
    """Tokens per sample: the latent divided into the denoiser's patches and the family's packing."""
    sizes = (1,) * (4 - len(latent)) + tuple(latent[1:])
    tokens = 1
    for size, patch in zip(sizes, _patch(config), strict=True):
        tokens *= max(1, size // patch)
    return max(1, tokens // packing**2)


def trainer_step_peak(trainer) -> int:
    """Per-rank peak bytes of live tensors over one step of a running :class:`hsdp.train.trainer.Trainer` (torch's
    ``MemTracker``: what ``max_memory_allocated`` counts on a GPU, without the CPU's allocator and Python
    overheads): what the plan is checked against. Run it after the first step, which creates the AdamW state."""
    tracker = memory_tracker()
    tracker.track_external(trainer.model, trainer.optimizer)
    with tracker:
        trainer.train_step()
    return int(tracker.get_tracker_snapshot("peak")[trainer.device]["Total"])


def diffusion_training(
    model: str,
    *,
    height: int | None,
    width: int | None,
    frames: int = 1,
    batch: int = 1,
    lora_r: int = 0,
    lora_targets: tuple[str, ...] = (),
    component: str | None = None,
    param_dtype: str | None = None,
    dtype: torch.dtype | None = None,
    activation_checkpointing: bool = False,
) -> DiffusionTraining:
    """The trained denoiser of pipeline ``model`` as ``hsdp train`` builds it, and a workload of ``batch`` samples
    of ``height x width x frames`` per rank (``seq_len``: the denoiser's tokens per sample). ``dtype``: LoRA's
    frozen base as stored (default: the checkpoint's); full fine-tuning always holds fp32 masters.
    ``activation_checkpointing``: per-block recomputation (``hsdp train --activation-checkpointing``).

    A pipeline ``hsdp train`` refuses (conditioned on images or masks, latents packed as no family packs them, a
    LoRA target matching nothing) is refused with the trainer's own reason (:func:`check_trainable`), before the
    item size is asked for."""

    from hsdp import lora
    from hsdp.distributed import local_device
    from hsdp.families import family_for
    from hsdp.models.builtin import resolve_model
    from hsdp.train.config import TrainConfig
    from hsdp.train.diffusion.frozen import media_spec, meta_pipeline
    from hsdp.train.diffusion.pipeline_call import replace_leaves, tensor_leaves
    from hsdp.train.diffusion.trainer import DEFAULT_LORA_TARGETS, check_trainable, trained_components

    folder = resolve_model(model)
    cfg = TrainConfig(model=model, data="", lora_r=lora_r, lora_target_modules=lora_targets,
                      train_component=component)  # fmt: skip
    try:
        component = check_trainable(cfg, folder)
        trained = trained_components(cfg, folder)
    except ValueError as exc:  # TrainConfigError, or the scheduler's objective refused
        raise PlanError(f"--train: hsdp train refuses this run: {exc}") from exc
    if len(trained) > 1:
        raise PlanError(
            f"--train-component {cfg.train_component}: the planner plans one denoiser, and this run trains {len(trained)} "
            f"({', '.join(trained)}, one a step, all held sharded); plan each with --train-component NAME"
        )
    audio = media_spec(folder, component).audio
    if audio is None and (height is None or width is None):
        raise PlanError("--train on a pipeline plans its denoiser for an item size: give --height and --width")
    try:
        cls = describe(folder).pipeline_class()
    except ValueError as exc:
        raise PlanError(str(exc)) from exc
    packing = family_for(cls.__name__).latent_packing
    # As the trainer loads it: LoRA keeps the stored dtype (adapters fp32), full fine-tuning fp32 masters.
    denoiser, config = build_meta_model(folder / component, dtype if lora_r else torch.float32)
    if lora_r:
        lora.injector(cfg.lora_config(str(folder / component), default_targets=DEFAULT_LORA_TARGETS))(denoiser)
    profile = profile_module(denoiser, component, config)

    pipe = meta_pipeline(folder)
    spec = media_spec(folder, component)
    if audio is not None:  # one length, the pipeline's longest: the trainer cuts and pads every item to it
        size, frames = (1, audio.samples), 1
        latent = _audio_latent_shape(pipe, audio)
    else:
        size = (height, width)
        latent = _latent_shape(spec, folder, config, packing, height, width, frames)
    compute = DTYPES[param_dtype] if param_dtype else torch.float32
    kwargs, to_latents = _denoiser_inputs(pipe, folder, batch, size, frames, latent)
    real = dict(tensor_leaves(kwargs))

    def inputs() -> dict:
        """What the trainer holds for the step (fake, on the device): every tensor input of the denoiser."""
        device = local_device()
        return {path: torch.empty(t.shape, dtype=compute if t.is_floating_point() else t.dtype, device=device)
                for path, t in real.items()}  # fmt: skip

    def loss(model: nn.Module, held: dict) -> torch.Tensor:
        prediction = to_latents(model(**replace_leaves(kwargs, held), return_dict=False)[0])
        return F.mse_loss(prediction.float(), torch.empty(prediction.shape, device=prediction.device))

    denoiser.train()
    if activation_checkpointing:  # as the trainer does (DiffusionTrainer._enable_activation_checkpointing)
        if not getattr(denoiser, "_supports_gradient_checkpointing", False):
            raise PlanError(f"--activation-checkpointing: {type(denoiser).__name__} does not support it")
        denoiser.enable_gradient_checkpointing()
    # FSDP2's mixed precision computes every parameter in param_dtype (its gradients too, until reduced)
    trace = trace_training_step(denoiser, inputs, loss, compute if param_dtype else None)
    tokens = _tokens(latent, config, packing)
    work = Workload(training=True, batch=batch, seq_len=tokens, guidance=False, activation_bytes=trace.peak,
                    activation_trace=trace)  # fmt: skip
    return DiffusionTraining(profile, work, latent)
