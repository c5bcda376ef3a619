"""What :meth:`hsdp.Engine.generate` returns, and writing it: video to mp4 / gif, images to png / jpg / webp."""

from __future__ import annotations

import io
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "Timings",
    "GenerationOutput",
    "save_frames",
    "save_images",
    "encode_image",
    "output_suffix_problem",
    "numbered",
    "VIDEO_SUFFIXES",
    "IMAGE_SUFFIXES",
]

VIDEO_SUFFIXES = (".mp4", ".gif")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


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
    """One request's result: ``frames`` (video pipelines), ``images`` (image pipelines) or ``text`` /
    ``token_ids`` (causal LMs)."""

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
    images: np.ndarray | None = None
    """``(num_images, height, width, 3)`` float32 in [0, 1]."""
    text: str | None = None
    token_ids: list[int] | None = None
    cancelled: bool = False
    """Stopped by :meth:`hsdp.Engine.cancel` before it finished; it carries no output."""
    cache: dict | None = None
    """With a step cache (``SamplingParams.cache``): its ``name``, the hooked ``unit`` class, ``calls`` of those
    units, ``computed``, ``skipped``, and ``overruled`` (first-block decisions this rank's tokens alone would
    have taken otherwise) over the whole call (a batch's requests share one count)."""

    def save(self, path: str | Path, fps: int = 8) -> list[Path]:
        """Write the frames (``.mp4``, ``.gif``), the images (``.png``, ``.jpg``, ``.webp``; several images get
        numbered names) or the text (any suffix); returns the files written."""
        path = Path(path)
        if self.frames is not None:
            return [save_frames(self.frames, path, fps=fps)]
        if self.images is not None:
            return save_images(self.images, path)
        path.write_text((self.text or "") + "\n")
        return [path]


def output_suffix_problem(path: Path, output: str) -> str | None:
    """Why ``path`` cannot hold a ``video`` / ``image`` output (None when it can)."""
    suffix = path.suffix.lower()
    allowed = {"video": VIDEO_SUFFIXES, "image": IMAGE_SUFFIXES}.get(output)
    if allowed is None or suffix in allowed:
        return None
    if output == "image" and suffix in VIDEO_SUFFIXES:
        return (
            f"{path}: this pipeline makes images, not video; name the output {path.stem}.png (or .jpg, .webp)"
        )
    if output == "video" and suffix in IMAGE_SUFFIXES:
        return f"{path}: this pipeline makes video; name the output {path.stem}.mp4 (or .gif)"
    return f"{path}: a {output} needs one of {', '.join(allowed)}"


def _pixels(values: np.ndarray) -> np.ndarray:
    return (np.clip(values, 0.0, 1.0) * 255).round().astype(np.uint8)


def save_frames(frames: np.ndarray, path: Path, fps: int = 8) -> Path:
    """mp4 (H.264 through imageio-ffmpeg) or animated gif."""
    import imageio.v3 as iio

    problem = output_suffix_problem(path, "video")
    if problem:
        raise ValueError(problem)
    pixels = _pixels(frames)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".mp4":
        iio.imwrite(path, pixels, plugin="FFMPEG", fps=fps)  # imageio-ffmpeg ships its own ffmpeg
    else:
        iio.imwrite(path, pixels, extension=".gif", duration=1000 / fps, loop=0)
    return path


def encode_image(image: np.ndarray, suffix: str = ".png") -> bytes:
    """One ``(H, W, 3)`` float image in [0, 1] as the bytes of a png / jpg / webp file."""
    from PIL import Image

    buffer = io.BytesIO()
    fmt = {".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}.get(suffix.lower(), "PNG")
    Image.fromarray(_pixels(image)).save(buffer, format=fmt)
    return buffer.getvalue()


def save_images(images: np.ndarray, path: Path) -> list[Path]:
    """One file per image: ``path`` itself for one image, ``stem_0``, ``stem_1``, ... for several."""
    problem = output_suffix_problem(path, "image")
    if problem:
        raise ValueError(problem)
    path.parent.mkdir(parents=True, exist_ok=True)
    paths = [path] if len(images) == 1 else [numbered(path, i) for i in range(len(images))]
    for image, target in zip(images, paths, strict=True):
        target.write_bytes(encode_image(image, path.suffix))
    return paths


def numbered(path: Path, index: int) -> Path:
    """``out.png`` -> ``out_3.png``."""
    return path.with_name(f"{path.stem}_{index}{path.suffix}")
