"""What :meth:`hsdp.Engine.generate` returns, and writing it: video to mp4 / gif (an mp4 with the pipeline's sound
track as AAC), images to png / jpg / webp, audio to wav / flac / mp3 (libsndfile through ``soundfile``)."""

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
    "AUDIO_SUFFIXES",
    "save_audio",
    "encode_audio",
    "openai_pcm",
    "OPENAI_PCM_RATE",
]

VIDEO_SUFFIXES = (".mp4", ".gif")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
AUDIO_SUFFIXES = (".wav", ".flac", ".mp3")
SUFFIXES = {"video": VIDEO_SUFFIXES, "image": IMAGE_SUFFIXES, "audio": AUDIO_SUFFIXES}


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
    """One request's result: ``frames`` (video pipelines, with ``audio`` where the pipeline makes the sound too),
    ``images`` (image pipelines), ``audios`` (audio pipelines) or ``text`` / ``token_ids`` (causal LMs)."""

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
    audios: np.ndarray | None = None
    """``(num_waveforms, channels, samples)`` float32 in [-1, 1], at ``sample_rate``."""
    audio: np.ndarray | None = None
    """A video's sound track (LTX-2): ``(channels, samples)`` float32 in [-1, 1], at ``sample_rate``."""
    sample_rate: int | None = None
    """Samples per second of ``audios`` / ``audio``."""
    text: str | None = None
    token_ids: list[int] | None = None
    cancelled: bool = False
    """Stopped by :meth:`hsdp.Engine.cancel` before it finished; it carries no output."""
    cache: dict | None = None
    """With a step cache (``SamplingParams.cache``): its ``name``, the hooked ``unit`` class, ``calls`` of those
    units, ``computed``, ``skipped``, and ``overruled`` (first-block decisions this rank's tokens alone would
    have taken otherwise) over the whole call (a batch's requests share one count)."""

    def save(self, path: str | Path, fps: int = 8, *, with_audio: bool = True) -> list[Path]:
        """Write the frames (``.mp4`` with the sound track unless ``with_audio`` is False, ``.gif``), the images
        (``.png``, ``.jpg``, ``.webp``) or the audio (``.wav``, ``.flac``, ``.mp3``; several images or waveforms
        get numbered names) or the text (any suffix); returns the files written."""
        path = Path(path)
        if self.frames is not None:
            track = (self.audio, self.sample_rate) if with_audio and self.audio is not None else None
            return [save_frames(self.frames, path, fps=fps, audio=track)]
        if self.images is not None:
            return save_images(self.images, path)
        if self.audios is not None:
            return save_audio(self.audios, self.sample_rate, path)
        path.write_text((self.text or "") + "\n")
        return [path]


def output_suffix_problem(path: Path, output: str) -> str | None:
    """Why ``path`` cannot hold a ``video`` / ``image`` / ``audio`` output (None when it can)."""
    suffix = path.suffix.lower()
    allowed = SUFFIXES.get(output)
    if allowed is None or suffix in allowed:
        return None
    made = next((kind for kind, suffixes in SUFFIXES.items() if suffix in suffixes), None)
    if made is not None:
        what = {"video": "video", "image": "images", "audio": "audio"}
        return (
            f"{path}: this pipeline makes {what[output]}, not {what[made]}; name the output {path.stem}{allowed[0]} "
            f"(or {', '.join(allowed[1:])})"
        )
    return f"{path}: a{'n' if output in ('image', 'audio') else ''} {output} needs one of {', '.join(allowed)}"


def _pixels(values: np.ndarray) -> np.ndarray:
    return (np.clip(values, 0.0, 1.0) * 255).round().astype(np.uint8)


def save_frames(
    frames: np.ndarray, path: Path, fps: int = 8, audio: tuple[np.ndarray, int] | None = None
) -> Path:
    """mp4 (H.264, and the ``(waveform, sample_rate)`` sound track as AAC, through PyAV or the ffmpeg that
    imageio-ffmpeg ships) or animated gif (no sound)."""
    import imageio.v3 as iio

    problem = output_suffix_problem(path, "video")
    if problem:
        raise ValueError(problem)
    pixels = _pixels(frames)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".mp4":
        iio.imwrite(path, pixels, plugin="FFMPEG", fps=fps)  # imageio-ffmpeg ships its own ffmpeg
        if audio is not None:
            _mux_audio(path, *audio)
    else:
        iio.imwrite(path, pixels, extension=".gif", duration=1000 / fps, loop=0)
    return path


def _mux_audio(video: Path, waveform: np.ndarray, sample_rate: int) -> None:
    """Add ``waveform`` ``(channels, samples)`` to the mp4 as an AAC track (the video stream copied, not
    re-encoded), through the ffmpeg binary that imageio-ffmpeg ships."""
    import subprocess
    import tempfile

    import imageio_ffmpeg

    with tempfile.TemporaryDirectory(dir=video.parent) as tmp:
        sound, muxed = Path(tmp) / "track.wav", Path(tmp) / video.name
        (Path(tmp) / "track.wav").write_bytes(encode_audio(waveform, sample_rate, ".wav"))
        command = [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-y", "-i", str(video), "-i", str(sound),
                   "-map", "0:v", "-map", "1:a", "-c:v", "copy", "-c:a", "aac", str(muxed)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"ffmpeg could not add the sound track to {video}: {done.stderr.strip()}")
        muxed.replace(video)


OPENAI_PCM_RATE = 24_000
"""Samples per second of OpenAI's ``pcm`` (mono, 16-bit little-endian): what its clients play it at."""


def openai_pcm(waveform: np.ndarray, sample_rate: int) -> bytes:
    """One ``(channels, samples)`` waveform as OpenAI defines ``pcm``: mono (the channels' mean), 24 kHz, 16-bit
    little-endian; its clients assume exactly this (the ``openai`` SDK's player reads int16 at 24 kHz, one channel).
    The rate changes with scipy's polyphase resampler (``resample_poly``: up by ``24000 / gcd``, an anti-aliasing
    Kaiser-windowed FIR, down by ``sample_rate / gcd``; scipy comes with the diffusers extra)."""
    from math import gcd

    from scipy.signal import resample_poly

    mono = np.asarray(waveform, dtype=np.float64).mean(axis=0)
    divisor = gcd(OPENAI_PCM_RATE, int(sample_rate))
    up, down = OPENAI_PCM_RATE // divisor, int(sample_rate) // divisor
    resampled = resample_poly(mono, up, down) if up != down else mono
    return (np.clip(resampled, -1.0, 1.0) * 32767).round().astype("<i2").tobytes()


def encode_audio(waveform: np.ndarray, sample_rate: int, suffix: str = ".wav") -> bytes:
    """One ``(channels, samples)`` float waveform in [-1, 1] as the bytes of a wav (16-bit PCM), flac (16-bit) or
    mp3 file; ``.pcm`` gives OpenAI's ``pcm`` (:func:`openai_pcm`: 24 kHz mono 16-bit little-endian)."""
    import soundfile

    if suffix.lower() == ".pcm":
        return openai_pcm(waveform, sample_rate)
    samples = np.clip(np.asarray(waveform, dtype=np.float32), -1.0, 1.0).T  # soundfile takes (frames, channels)
    buffer = io.BytesIO()
    fmt = suffix.lower().lstrip(".").upper()
    try:
        soundfile.write(buffer, samples, sample_rate, format=fmt, subtype=None if fmt == "MP3" else "PCM_16")
    except soundfile.LibsndfileError as exc:  # mp3 takes 8 to 48 kHz only
        raise ValueError(f"cannot write {sample_rate} Hz audio as {suffix}: {exc}; write .wav or .flac") from exc
    return buffer.getvalue()


def save_audio(waveforms: np.ndarray, sample_rate: int | None, path: Path) -> list[Path]:
    """One file per waveform of ``(n, channels, samples)``: ``path`` itself for one, numbered for several."""
    problem = output_suffix_problem(path, "audio")
    if problem:
        raise ValueError(problem)
    if not sample_rate:
        raise ValueError(f"{path}: the pipeline gave no sample rate for its audio")
    path.parent.mkdir(parents=True, exist_ok=True)
    paths = [path] if len(waveforms) == 1 else [numbered(path, i) for i in range(len(waveforms))]
    for waveform, target in zip(waveforms, paths, strict=True):
        target.write_bytes(encode_audio(waveform, sample_rate, path.suffix))
    return paths


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
