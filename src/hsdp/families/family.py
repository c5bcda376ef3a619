"""The :class:`Family` record and its registry (:mod:`hsdp.families` explains what a family holds and why); below the
family files, which register themselves by importing it, and the package, which imports them all."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Family",
    "register_family",
    "family_for",
    "family_of_model",
    "FAMILIES",
    "GENERIC",
]


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
    original_names: Callable[[str], str] | None = None
    """``diffusers module name -> the original model's``, when the family's single-file LoRAs (ComfyUI, kohya)
    name layers as its original code does (Wan: ``attn1.to_q`` -> ``self_attn.q``); the layouts themselves are
    derived and checked by :mod:`hsdp.lora_layouts`. ``ValueError`` for a module with no original name."""
    lora_pipeline: str = ""
    """The diffusers pipeline whose ``lora_state_dict`` reads the family's LoRA files, when the caller names none."""
    ulysses_problem: str = ""
    """Why the family's denoisers cannot run their attention split across ranks although their class has a
    ``_cp_plan``, as a clause after "the denoiser of NAME" (``--ulysses-degree`` / ``--ring-degree`` are refused
    before loading, naming it); empty: they can."""
    training_config: tuple[tuple[str, Any], ...] = ()
    """``(field, value)`` set over the denoiser's config when it is loaded for training, as the family's diffusers
    training script loads it (HiDream: ``force_inference_output``)."""


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
