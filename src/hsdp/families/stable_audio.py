"""Stable Audio (Open): ``StableAudioPipeline.__call__`` refuses audio longer than its DiT's ``sample_size`` latents
decode to (``sample_size`` x the VAE's hop / its sampling rate), a limit computed in code that no config names;
the engine checks it before loading instead."""

from __future__ import annotations

import math

from hsdp.families.family import Family, register_family


def stable_audio_max_seconds(configs: dict[str, dict]) -> float:
    vae = configs["vae"]
    return configs["transformer"]["sample_size"] * math.prod(vae["downsampling_ratios"]) / vae["sampling_rate"]


STABLE_AUDIO = register_family(
    Family("Stable Audio", pipelines=r"StableAudioPipeline", max_audio_seconds=stable_audio_max_seconds)
)
