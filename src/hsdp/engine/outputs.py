"""What :meth:`hsdp.Engine.generate` returns, and writing frames to mp4 / gif / png."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["Timings", "GenerationOutput", "save_frames", "VIDEO_SUFFIXES"]

VIDEO_SUFFIXES = (".mp4", ".gif", ".png")


@dataclass
class Timings:
    """Seconds spent on one request, measured on the rank that produced it."""

    total_s: float
    encode_s: float = 0.0
    """Text encoding (diffusion) or prompt prefill (causal LM)."""
    decode_s: float = 0.0
    """VAE decoding of the final latents (diffusion)."""
    step_s: list[float] = field(default_factory=list)
    """One entry per denoising step (diffusion) or per generated token (causal LM)."""

    @property
    def seconds_per_step(self) -> float:
        """Median step time: robust to the first step's warm-up."""
        return statistics.median(self.step_s) if self.step_s else float("nan")


@dataclass
class GenerationOutput:
    """One request's result. ``frames`` for video pipelines, ``text`` / ``token_ids`` for causal LMs."""

    request_id: int
    prompt: str
    seed: int
    timings: Timings
    peak_memory_bytes: list[int]
    """Per rank (index = rank): peak accelerator memory allocated, or peak resident memory (RSS) on CPU."""
    memory_kind: str
    rank: int = 0
    """The rank that produced this output."""
    frames: np.ndarray | None = None
    """``(num_frames, height, width, 3)`` float32 in [0, 1]."""
    text: str | None = None
    token_ids: list[int] | None = None

    def save(self, path: str | Path, fps: int = 8) -> Path:
        """Write the frames (``.mp4``, ``.gif``, ``.png``) or the text (any other suffix)."""
        path = Path(path)
        if self.frames is None:
            path.write_text((self.text or "") + "\n")
            return path
        return save_frames(self.frames, path, fps=fps)


def save_frames(frames: np.ndarray, path: Path, fps: int = 8) -> Path:
    """mp4 (H.264 through imageio-ffmpeg), animated gif, or png (the frames side by side in one image)."""
    import imageio.v3 as iio

    pixels = (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)
    suffix = path.suffix.lower()
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".mp4":
        iio.imwrite(path, pixels, plugin="FFMPEG", fps=fps)  # imageio-ffmpeg ships its own ffmpeg
    elif suffix == ".gif":
        iio.imwrite(path, pixels, extension=".gif", duration=1000 / fps, loop=0)
    elif suffix == ".png":
        iio.imwrite(path, np.concatenate(list(pixels), axis=1))
    else:
        raise ValueError(
            f"output {path}: unknown video suffix {suffix!r}; use one of {', '.join(VIDEO_SUFFIXES)}"
        )
    return path
