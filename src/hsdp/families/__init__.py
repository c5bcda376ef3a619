"""Per-family knowledge of diffusers pipelines that their own metadata does not carry, one small file each.

Almost everything the engine needs is read from the pipeline folder and from diffusers itself: the components
(``model_index.json``), which of them to shard (their classes and sizes), the arguments a pipeline takes (its
``__call__`` signature), whether guidance runs separate conditional and unconditional passes (its
``cache_context("uncond")`` label), Ulysses support (the transformer's ``_cp_plan``) and the VAE's compression
(its config). What remains are facts a pipeline computes in code, such as FLUX packing 2 x 2 latent patches
before its transformer (so sizes are multiples of 16, not 8), or the inputs its ``__call__`` builds for the
denoiser besides latents, timestep and caption embeddings (FLUX's position ids and guidance, SDXL's added
conditioning), which training must build the same way. A family file registers a :class:`Family` with those
facts; a pipeline no family claims runs with the generic rules (:data:`GENERIC`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "Family",
    "DenoiserBatch",
    "DenoiserCall",
    "plain_inputs",
    "register_family",
    "family_for",
    "family_of_model",
    "training_family",
    "FAMILIES",
    "GENERIC",
]


@dataclass(frozen=True)
class DenoiserBatch:
    """One training micro-batch as the generic diffusion trainer holds it (on the training device)."""

    noisy: torch.Tensor
    """Noised latents as the VAE lays them out: ``[B, C, H, W]`` for images, ``[B, C, F, H, W]`` for videos."""
    timesteps: torch.Tensor
    """``[B]`` on the scheduler's training scale (0 .. ``num_train_timesteps``)."""
    prompts: dict[str, torch.Tensor]
    """The captions' encodings batched along dimension 0, named by :attr:`Family.prompt_outputs`."""
    size: tuple[int, int]
    """The batch's pixel height and width (its size bucket)."""


def _unchanged(prediction: torch.Tensor) -> torch.Tensor:
    return prediction


@dataclass(frozen=True)
class DenoiserCall:
    """How to call the denoiser on a :class:`DenoiserBatch`, and how to read its prediction back."""

    kwargs: dict[str, Any]
    """Keyword arguments of the denoiser's ``forward`` (``return_dict=False`` is added by the caller)."""
    to_latents: Callable[[torch.Tensor], torch.Tensor] = _unchanged
    """The prediction in the layout of :attr:`DenoiserBatch.noisy` (FLUX unpacks its 2 x 2 patches)."""


def plain_inputs(pipeline: type, model: nn.Module, batch: DenoiserBatch) -> DenoiserCall:
    """The call of DiT pipelines such as Wan: latents, timestep and caption embeddings, nothing else."""
    return DenoiserCall(
        {
            "hidden_states": batch.noisy,
            "timestep": batch.timesteps,
            "encoder_hidden_states": batch.prompts["prompt_embeds"],
        }
    )


@dataclass(frozen=True)
class Family:
    name: str
    """Shown in logs and errors (a pipeline no family claims is named by its class)."""
    pipelines: str = r"$^"
    """Regular expression matched (in full) against the diffusers pipeline class name."""
    latent_packing: int = 1
    """Latent pixels per token side that the pipeline packs before its transformer (FLUX: 2), on top of the
    transformer's own ``patch_size``; sizes must be multiples of VAE factor x patch x packing."""
    denoisers: str = r"$^"
    """Regular expression matched (in full) against the denoiser's model class name (LoRA export)."""
    max_audio_seconds: Callable[[dict[str, dict]], float] | None = None
    """``(component configs by name) -> seconds``: the longest audio the pipeline makes, when its ``__call__``
    computes that limit in code (Stable Audio: the DiT's ``sample_size`` latents), so that a longer request is
    refused before loading."""
    comfyui_lora: Callable[[dict[str, torch.Tensor], float], dict[str, torch.Tensor]] | None = None
    """``(diffusers-keyed adapter tensors, alpha / r) -> the diffusion_model.-keyed ComfyUI LoRA``: the inverse of
    diffusers' converter for the family (:mod:`hsdp.lora_formats`)."""
    comfyui_check: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], str | None] | None = None
    """``(ComfyUI tensors, diffusers-keyed tensors) -> problem or None``: diffusers' converter reads them back."""
    comfyui_refusal: str = ""
    """Why the family has no ComfyUI export (when ``comfyui_lora`` is None)."""
    trains: str = r"$^"
    """Regular expression of the pipeline classes whose denoiser calls :attr:`training_inputs` builds (matched
    apart from ``pipelines``: a family may train a pipeline the engine runs with the generic rules). A pipeline
    the family claims but does not train takes conditions (reference images, masks) the trainer does not
    encode, and is refused."""
    prompt_outputs: tuple[str | None, ...] = ("prompt_embeds",)
    """Names of the values the pipeline's ``encode_prompt`` returns, by position (None: not kept, such as the
    negative embeddings it returns without guidance); the training cache stores them per caption."""
    shared_prompt_outputs: tuple[str, ...] = ()
    """Those of :attr:`prompt_outputs` without a batch dimension (one tensor for every caption of a call)."""
    training_inputs: Callable[[type, nn.Module, DenoiserBatch], DenoiserCall] = plain_inputs
    """``(pipeline class, denoiser, batch) -> call``: the denoiser's inputs as the pipeline's ``__call__``
    builds them."""


GENERIC = Family("generic")
FAMILIES: list[Family] = []


def register_family(family: Family) -> Family:
    FAMILIES.append(family)
    return family


def family_for(pipeline_class: str) -> Family:
    """The registered family whose pattern matches ``pipeline_class``, else :data:`GENERIC`."""
    return next((f for f in FAMILIES if re.fullmatch(f.pipelines, pipeline_class)), GENERIC)


def family_of_model(model_class: str) -> Family:
    """The registered family whose ``denoisers`` pattern matches ``model_class``, else :data:`GENERIC`."""
    return next((f for f in FAMILIES if re.fullmatch(f.denoisers, model_class)), GENERIC)


def training_family(pipeline_class: str) -> Family | None:
    """The family whose ``trains`` pattern matches ``pipeline_class``; :data:`GENERIC` for a pipeline no family
    claims or trains; None for one a family claims (``pipelines``) but does not train."""
    trained = next((f for f in FAMILIES if re.fullmatch(f.trains, pipeline_class)), None)
    if trained is not None:
        return trained
    return GENERIC if family_for(pipeline_class) is GENERIC else None


# Family files register themselves on import (after register_family exists).
from hsdp.families import flux, sdxl, stable_audio, wan  # noqa: E402,F401
