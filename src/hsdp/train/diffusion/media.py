"""Training media as users keep it: a folder of images or videos with same-name ``.txt`` captions, or a
``metadata.jsonl`` / ``metadata.csv`` with ``file_name`` and ``text`` columns (Hugging Face's imagefolder
convention, read with ``datasets``).

Sizes. Every item goes to the size bucket nearest its aspect ratio (in log space, so 1:2 and 2:1 are equally far
from 1:1). Buckets are the largest ``height x width`` with both sides multiples of the pipeline's
``spatial_multiple`` (VAE scale x patch x packing) and an area of at most ``resolution ** 2``. An item smaller than
that area is never enlarged to it: its buckets are cut from its own area instead, so the only enlargement is the
rounding to multiples and the aspect crop (and an item below one multiple, which the VAE cannot take smaller). An
item is resized by the smallest factor that covers its bucket and centre-cropped.

Frames. Videos keep ``k * temporal_multiple + 1`` frames (the VAE's temporal compression): the largest such count
the clip has and ``frames`` allows, from the first frame. Images are one frame (video pipelines train on them too).

Audio. An audio pipeline (Stable Audio) trains on ``.wav`` / ``.flac`` files (libsndfile through ``soundfile``, as
``hsdp generate`` writes them), captioned the same ways. Each file is resampled to the VAE's sampling rate (scipy's
polyphase ``resample_poly``), mixed to its channels (several to one: their mean; one to several: repeated; more to
fewer: the first ones, front left and right in WAV order), cut from its start to the longest the pipeline makes
(:attr:`AudioSpec.samples`) and zero-padded to it: every item has that one length (one bucket), and its own kept
length in seconds (:attr:`MediaItem.seconds`) conditions the denoiser as the pipeline's ``audio_end_in_s`` does.

Everything a run would trip over later is refused when the dataset is opened, naming the file: a missing caption,
an empty or unreadable file, a metadata row naming a file that is not there, an empty dataset. Headers are read
there (sizes, frame counts); a file whose pixel data is damaged past its header is refused by :meth:`pixels`,
which the trainer calls for every item while encoding, still before the first step.

Order. :meth:`MediaDataset.step_indices` gives every optimizer step rows of one bucket (one latent shape per step),
from a per-epoch shuffle that depends only on (seed, epoch): any step's rows can be computed alone, so a resumed
run reads what an uninterrupted one would.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hsdp.train.data import DatasetError

__all__ = [
    "Bucket",
    "MediaItem",
    "MediaSpec",
    "MediaDataset",
    "AudioSpec",
    "IMAGE_SUFFIXES",
    "VIDEO_SUFFIXES",
    "AUDIO_SUFFIXES",
    "bucket_for",
    "frame_count",
    "drop_captions",
]

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})
VIDEO_SUFFIXES = frozenset({".mp4", ".webm", ".mov", ".mkv", ".gif"})
AUDIO_SUFFIXES = frozenset({".wav", ".flac"})
METADATA_NAMES = ("metadata.jsonl", "metadata.csv")
_EXIF_ORIENTATION = 0x0112
_TRANSPOSED = frozenset({5, 6, 7, 8})
"""EXIF orientations that swap width and height (phone photos): the pixels are turned upright when read."""


@dataclass(frozen=True)
class Bucket:
    frames: int
    """1 for images."""
    height: int
    width: int


@dataclass(frozen=True)
class MediaItem:
    path: Path
    caption: str
    key: str
    """The file name relative to the dataset folder (``#n`` added for the n-th repeat of a metadata file_name):
    stable across runs."""
    content: str = ""
    """What the item's encodings depend on besides its bucket: a digest of its caption and its file's size and
    modification time (set by :meth:`MediaDataset.from_source`)."""
    seconds: float | None = None
    """An audio item's length in seconds as kept (cut to the pipeline's longest): its duration conditioning."""

    @property
    def cache_key(self) -> str:
        """The latent cache's key: the name and the content, so an edited caption or a replaced file is encoded
        again instead of reusing another content's encodings under the same name."""
        return f"{self.key}@{self.content}" if self.content else self.key


@dataclass(frozen=True)
class AudioSpec:
    """The waveforms an audio pipeline's VAE takes."""

    sampling_rate: int
    channels: int
    samples: int
    """The length every item is cut or padded to: the longest audio the pipeline makes, in samples."""

    @property
    def seconds(self) -> float:
        return self.samples / self.sampling_rate


@dataclass(frozen=True)
class MediaSpec:
    spatial_multiple: int
    """Height and width multiple: VAE scale factor x the denoiser's patch size x latent packing."""
    temporal_multiple: int | None
    """Frame counts are ``k * temporal_multiple + 1`` (the VAE's temporal factor); None: any count."""
    video: bool
    """The pipeline generates videos (takes clips and images); an image pipeline refuses clips."""
    audio: AudioSpec | None = None
    """The pipeline generates audio: its items are audio files, resampled and cut to this."""


# ----------------------------------------------------------------------------------------------- sources


def _records(
    root: Path, flag: str, suffixes: frozenset[str] = IMAGE_SUFFIXES | VIDEO_SUFFIXES
) -> tuple[list[tuple[Path, str, str]], list[tuple[Path, str]]]:
    """(file, caption, key) of a folder with captions, a folder with metadata, or a metadata file; and the files of
    a captioned folder that are left out (not of ``suffixes``), with why."""
    if root.is_file():
        if root.suffix.lower() not in (".jsonl", ".csv"):
            raise DatasetError(
                f"{flag} {root}: pass a folder of media with same-name .txt captions, or a metadata.jsonl / "
                "metadata.csv with file_name and text columns"
            )
        return _metadata_records(root, flag), []
    present = [root / name for name in METADATA_NAMES if (root / name).is_file()]
    if len(present) > 1:
        raise DatasetError(f"{flag} {root}: holds both {' and '.join(p.name for p in present)}; keep one")
    if present:
        return _metadata_records(present[0], flag), []
    return _captioned_records(root, flag, suffixes)


def _captioned_records(
    root: Path, flag: str, suffixes: frozenset[str] = IMAGE_SUFFIXES | VIDEO_SUFFIXES
) -> tuple[list[tuple[Path, str, str]], list[tuple[Path, str]]]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    media = [p for p in files if p.suffix.lower() in suffixes]
    captions = {p.with_suffix(".txt") for p in media}
    kinds = ", ".join(sorted(suffixes))
    what = "audio file" if suffixes == AUDIO_SUFFIXES else "image or video"
    skipped = [
        (p, f"a caption with no {what} of the same name" if p.suffix == ".txt" else f"not an {what} ({kinds})")
        for p in files
        if p not in captions and p.suffix.lower() not in suffixes
        and not any(part.startswith(".") for part in p.relative_to(root).parts)  # .DS_Store, .git: not data
    ]
    out = []
    for path in media:
        caption = path.with_suffix(".txt")
        if not caption.is_file():
            raise DatasetError(
                f"{flag}: {path} has no caption file {caption.name}; write one next to it (an empty file trains "
                "it uncaptioned) or list the file in metadata.jsonl with its text"
            )
        out.append((path, caption.read_text(encoding="utf-8").strip(), path.relative_to(root).as_posix()))
    return out, skipped


def _metadata_records(meta: Path, flag: str) -> list[tuple[Path, str, str]]:
    import datasets

    bars = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # one bar per metadata file is noise in a training log
    try:
        rows = datasets.load_dataset("json" if meta.suffix == ".jsonl" else "csv", data_files=str(meta), split="train")
    except Exception as exc:  # datasets wraps parser errors in several types
        raise DatasetError(f"{flag} {meta}: cannot be read as {meta.suffix[1:]} ({exc})") from exc
    finally:
        if bars:
            datasets.enable_progress_bars()
    missing = {"file_name", "text"} - set(rows.column_names)
    if missing:
        raise DatasetError(
            f"{flag} {meta}: no column {', '.join(sorted(missing))}; it needs file_name (relative to its folder) "
            "and text (the caption)"
        )
    out, seen = [], {}
    for number, row in enumerate(rows, start=1):
        name = str(row["file_name"] or "")
        path = meta.parent / name
        if not name or not path.is_file():
            raise DatasetError(
                f"{flag} {meta}: row {number} names file_name {name!r}, which is not a file in {meta.parent}; fix "
                "the path (relative to the metadata file) or drop the row"
            )
        text = row["text"]
        caption = "" if text is None or (isinstance(text, float) and math.isnan(text)) else str(text).strip()
        seen[name] = seen.get(name, 0) + 1
        out.append((path, caption, name if seen[name] == 1 else f"{name}#{seen[name]}"))
    return out


# ------------------------------------------------------------------------------------------------ reading


def _is_video(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_SUFFIXES


def _probe(path: Path, limit: int | None) -> tuple[int, int, int]:
    """(frames, height, width) from the file's header, without decoding the pixels; for a clip that has more
    frames than ``limit`` the count may be any number >= ``limit``."""
    if path.stat().st_size == 0:
        raise DatasetError(f"{path} is empty (0 bytes); replace or remove it")
    try:
        if not _is_video(path):
            from PIL import Image

            with Image.open(path) as image:
                width, height = image.size
                if image.getexif().get(_EXIF_ORIENTATION) in _TRANSPOSED:
                    width, height = height, width
            count = 1
        else:
            count, height, width = _video_header(path, limit)
    except Exception as exc:  # PIL, imageio and ffmpeg raise many types for unreadable files
        raise DatasetError(f"cannot read {path}: {exc}; replace or remove it") from exc
    if not count or not height or not width:
        raise DatasetError(f"{path} holds no frames ({count} x {height} x {width}); replace or remove it")
    return int(count), int(height), int(width)


def _video_header(path: Path, limit: int | None) -> tuple[int, int, int]:
    """ffmpeg's metadata gives the size (after any rotation) and duration x fps, an estimate of the frame count.
    The exact count takes a pass over the stream, paid only when the estimate does not clear ``limit`` by a margin
    (a clip whose estimate lied is refused by :func:`_decode`, which counts what it gets). GIFs (Pillow) carry
    their exact shape."""
    import imageio.v3 as iio

    meta = iio.immeta(path)
    if "size" not in meta:
        return iio.improps(path).shape[:3]
    width, height = meta["size"]
    estimate = meta.get("fps", 0) * meta.get("duration", 0)
    if limit and estimate >= limit + 2:
        return limit, height, width
    import imageio_ffmpeg

    return imageio_ffmpeg.count_frames_and_secs(str(path))[0], height, width


def _decode(path: Path, frames: int) -> np.ndarray:
    """The first ``frames`` frames as uint8 ``[F, H, W, 3]``."""
    try:
        if not _is_video(path):
            from PIL import Image, ImageOps

            with Image.open(path) as image:
                return np.array(ImageOps.exif_transpose(image).convert("RGB"))[None]
        import imageio.v3 as iio

        stream = iio.imiter(path)
        try:
            decoded = [np.asarray(frame) for frame in itertools.islice(stream, frames)]
        finally:
            stream.close()  # stops ffmpeg: a long clip is not decoded past what the bucket keeps
    except Exception as exc:
        raise DatasetError(f"cannot read {path}: {exc}; replace or remove it") from exc
    if len(decoded) < frames:
        raise DatasetError(f"{path}: decoded {len(decoded)} frames where its header promised {frames}")
    return np.stack([f[..., None].repeat(3, -1) if f.ndim == 2 else f[..., :3] for f in decoded])


def _audio_header(path: Path) -> tuple[int, int, int]:
    """(sampling rate, channels, frames) of an audio file from its header (libsndfile through ``soundfile``)."""
    if path.suffix.lower() not in AUDIO_SUFFIXES:
        kinds = ", ".join(sorted(AUDIO_SUFFIXES))
        raise DatasetError(f"{path} is not an audio file ({kinds}) and this pipeline makes audio; convert or remove it")
    if path.stat().st_size == 0:
        raise DatasetError(f"{path} is empty (0 bytes); replace or remove it")
    try:
        import soundfile

        info = soundfile.info(str(path))
    except Exception as exc:  # libsndfile's errors, and anything a damaged header raises
        raise DatasetError(f"cannot read {path}: {exc}; replace or remove it") from exc
    if not info.frames or not info.samplerate or not info.channels:
        raise DatasetError(f"{path} holds no audio ({info.frames} frames at {info.samplerate} Hz); replace or remove it")
    return int(info.samplerate), int(info.channels), int(info.frames)


def _audio_seconds(path: Path, audio: AudioSpec) -> float:
    """The item's kept length in seconds: the file's, cut to the pipeline's longest."""
    rate, _, frames = _audio_header(path)
    return min(frames / rate, audio.seconds)


def _waveform(path: Path, audio: AudioSpec) -> torch.Tensor:
    """The file as ``[channels, samples]`` float32 in [-1, 1] at the VAE's rate and channels, cut from its start to
    :attr:`AudioSpec.samples` and zero-padded to it (see the module docstring)."""
    import soundfile

    rate, channels, frames = _audio_header(path)
    # Only the part kept is read (a little more for the resampler's filter at the cut).
    wanted = min(frames, math.ceil(audio.samples * rate / audio.sampling_rate) + 64)
    try:
        data, _ = soundfile.read(str(path), frames=wanted, dtype="float64", always_2d=True)
    except Exception as exc:
        raise DatasetError(f"cannot read {path}: {exc}; replace or remove it") from exc
    if rate != audio.sampling_rate:
        from scipy.signal import resample_poly

        divisor = math.gcd(rate, audio.sampling_rate)
        data = resample_poly(data, audio.sampling_rate // divisor, rate // divisor, axis=0)
    kept = min(len(data), audio.samples, math.ceil(frames * audio.sampling_rate / rate))
    wave = torch.zeros(audio.channels, audio.samples, dtype=torch.float32)
    wave[:, :kept] = torch.from_numpy(_mixed(data[:kept].T, audio.channels, path)).float()
    return wave.clamp(-1, 1)


def _mixed(data: np.ndarray, channels: int, path: Path) -> np.ndarray:
    """``[c, n]`` samples as ``channels`` channels."""
    if len(data) == channels:
        return data
    if channels == 1:
        return data.mean(axis=0, keepdims=True)
    if len(data) == 1:
        return data.repeat(channels, axis=0)
    if len(data) > channels:
        return data[:channels]
    raise DatasetError(
        f"{path} has {len(data)} channels and the pipeline's VAE takes {channels}; mix it to {channels} or to 1"
    )


def _content(path: Path, caption: str) -> str:
    """A digest of the caption and the file's size and modification time (not its bytes: reading every file of a
    large dataset at each start would cost more than encoding a few again)."""
    stat = path.stat()
    text = json.dumps([caption, stat.st_size, stat.st_mtime_ns])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------- sizes


@functools.lru_cache(maxsize=256)
def _maximal_sizes(area: int, multiple: int) -> tuple[tuple[int, int], ...]:
    """Every (height, width) of multiples of ``multiple`` with ``height * width <= area`` where neither side can grow
    by one multiple."""
    units = max(1, area // (multiple * multiple))
    out = []
    for a in range(1, units + 1):
        b = units // a
        if units // b == a:
            out.append((a * multiple, b * multiple))
    return tuple(out)


def bucket_for(height: int, width: int, frames: int, spec: MediaSpec, resolution: int) -> Bucket:
    """The bucket of a ``height x width`` item: the maximal size (see :func:`_maximal_sizes`) nearest its aspect
    ratio, within ``resolution ** 2`` pixels and within the item's own area (never enlarged to the resolution)."""
    area = min(resolution * resolution, height * width)
    ratio = math.log(height / width)
    h, w = min(
        _maximal_sizes(area, spec.spatial_multiple),
        key=lambda s: (abs(math.log(s[0] / s[1]) - ratio), -s[0] * s[1], s[0]),
    )
    return Bucket(frames, h, w)


def frame_count(available: int, spec: MediaSpec, limit: int | None, path: Path) -> int:
    """Frames kept of a clip with ``available`` frames: the largest ``k * t + 1 <= min(available, limit)``."""
    if not _is_video(path):
        return 1
    if not spec.video:
        raise DatasetError(f"{path} is a video and this pipeline generates images; remove it or train a video model")
    top = min(available, limit) if limit else available
    if top < 1:
        raise DatasetError(f"{path} is too short: {available} frames; replace or remove it")
    step = spec.temporal_multiple or 1
    return (top - 1) // step * step + 1


# ----------------------------------------------------------------------------------------------- dataset


class MediaDataset:
    """Captioned images and clips with their size buckets; pixels are decoded on demand (:meth:`pixels`)."""

    def __init__(self, items: list[MediaItem], buckets: list[Bucket], skipped: list[tuple[Path, str]] | None = None):
        self.items = items
        self.buckets = buckets
        self.skipped = skipped or []
        """Files of the source folder that are not items, with why (a PDF, a caption without its image)."""
        self.enlarged: list[tuple[int, int, int]] = []
        """(index, height, width) of items smaller than their bucket on a side, which are upscaled to it."""
        self._plans: dict[tuple[int, int, int], list[list[int]]] = {}
        self.audio: AudioSpec | None = None
        """Set for audio items (:meth:`waveform`)."""

    @classmethod
    def from_source(
        cls,
        source: str | Path,
        spec: MediaSpec,
        *,
        resolution: int,
        frames: int | None = None,
        flag: str = "--data",
    ) -> MediaDataset:
        """Open and check a folder or metadata file (see the module docstring); every problem is a
        :class:`DatasetError` naming the file or flag."""
        root = Path(source)
        if not root.exists():
            raise DatasetError(f"{flag} {source}: no such file or folder")
        if resolution < spec.spatial_multiple and spec.audio is None:  # audio has no resolution
            raise DatasetError(
                f"--resolution {resolution} is below one multiple of the pipeline's VAE and patch size "
                f"({spec.spatial_multiple}); use a multiple of {spec.spatial_multiple}, e.g. "
                f"{max(spec.spatial_multiple, 256 // spec.spatial_multiple * spec.spatial_multiple)}"
            )
        suffixes = AUDIO_SUFFIXES if spec.audio else IMAGE_SUFFIXES | VIDEO_SUFFIXES
        records, skipped = _records(root, flag, suffixes)
        if not records:
            kinds = ", ".join(sorted(suffixes))
            if spec.audio:
                raise DatasetError(
                    f"{flag} {source}: no audio files found ({kinds}); this pipeline makes audio: pass a folder of "
                    "audio files with same-name .txt captions, or a metadata.jsonl / metadata.csv naming them"
                )
            raise DatasetError(f"{flag} {source}: no images or videos found ({kinds})")
        if spec.audio:
            return cls._audio(records, skipped, spec.audio)
        items, buckets, enlarged = [], [], []
        for path, caption, key in records:
            available, height, width = _probe(path, frames)
            count = frame_count(available, spec, frames, path)
            buckets.append(bucket_for(height, width, count, spec, resolution))
            items.append(MediaItem(path, caption, key, _content(path, caption)))
            if height < buckets[-1].height or width < buckets[-1].width:
                enlarged.append((len(items) - 1, height, width))
        dataset = cls(items, buckets, skipped)
        dataset.enlarged = enlarged
        return dataset

    @classmethod
    def _audio(cls, records: list[tuple[Path, str, str]], skipped: list[tuple[Path, str]], audio: AudioSpec) -> MediaDataset:
        """Audio items: one bucket (every item is cut or padded to the pipeline's length), each its kept seconds."""
        bucket = Bucket(1, 1, audio.samples)
        items = [MediaItem(path, caption, key, _content(path, caption), _audio_seconds(path, audio))
                 for path, caption, key in records]  # fmt: skip
        dataset = cls(items, [bucket] * len(items), skipped)
        dataset.audio = audio
        return dataset

    def summary(self, source: str | Path) -> str:
        """What the run trains on, for the log at start: the item count, the size buckets with their items, and
        every file left out or upscaled, with why."""
        if self.audio is not None:
            lines = [f"--data {source}: {len(self)} audio files, each cut or padded to {self.audio.samples} samples "
                     f"({self.audio.seconds:g} s at {self.audio.sampling_rate} Hz, {self.audio.channels} channels)"]
            shorter = sum(item.seconds < self.audio.seconds for item in self.items)
            if shorter:
                lines.append(f"  {shorter} shorter than that: zero-padded, conditioned on their own length")
            return "\n".join(lines + [f"  skipped {path}: {why}" for path, why in self.skipped])
        clips = sum(b.frames > 1 for b in self.buckets)
        lines = [f"--data {source}: {len(self)} items ({len(self) - clips} images, {clips} clips) in "
                 f"{len(self._groups)} size buckets (frames x height x width: items)"]  # fmt: skip
        for members in self._groups:
            bucket = self.buckets[members[0]]
            lines.append(f"  {bucket.frames} x {bucket.height} x {bucket.width}: {len(members)}")
        lines += [f"  skipped {path}: {why}" for path, why in self.skipped]
        for index, height, width in self.enlarged:
            bucket = self.buckets[index]
            lines.append(
                f"  upscaled {self.items[index].path}: {height} x {width} is below its bucket {bucket.height} x "
                f"{bucket.width} on a side (bucket sides are multiples of what the pipeline takes)"
            )
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self.items)

    def pixels(self, index: int) -> torch.Tensor:
        """Item ``index`` as ``[C, F, H, W]`` float32 in [-1, 1]: resized by the smallest factor that covers its
        bucket (bilinear, antialiased), centre-cropped."""
        import torch.nn.functional as F

        bucket = self.buckets[index]
        frames = torch.from_numpy(_decode(self.items[index].path, bucket.frames))
        video = frames.permute(0, 3, 1, 2).float() / 127.5 - 1  # F C H W
        h, w = video.shape[-2:]
        scale = max(bucket.height / h, bucket.width / w)
        size = (max(bucket.height, round(h * scale)), max(bucket.width, round(w * scale)))
        if size != (h, w):
            video = F.interpolate(video, size=size, mode="bilinear", antialias=True, align_corners=False)
        top, left = (size[0] - bucket.height) // 2, (size[1] - bucket.width) // 2
        video = video[..., top : top + bucket.height, left : left + bucket.width]
        return video.clamp(-1, 1).permute(1, 0, 2, 3).contiguous()

    def waveform(self, index: int) -> torch.Tensor:
        """Audio item ``index`` as ``[channels, samples]`` float32 in [-1, 1] at the VAE's rate (module docstring)."""
        if self.audio is None:
            raise ValueError("not an audio dataset")
        return _waveform(self.items[index].path, self.audio)

    def media(self, index: int) -> torch.Tensor:
        """What the VAE encodes of item ``index``: :meth:`waveform` for audio, else :meth:`pixels`."""
        return self.waveform(index) if self.audio is not None else self.pixels(index)

    @functools.cached_property
    def _groups(self) -> list[list[int]]:
        """Item indices per bucket, buckets in order of first appearance (stable for a given source)."""
        groups: dict[Bucket, list[int]] = {}
        for index, bucket in enumerate(self.buckets):
            groups.setdefault(bucket, []).append(index)
        return list(groups.values())

    def _epoch_plan(self, epoch: int, rows: int, seed: int) -> list[list[int]]:
        """Epoch ``epoch``'s steps of ``rows`` rows each: every bucket's items shuffled and cut into steps, its last
        step filled from the start of its shuffle (a bucket smaller than a step repeats items), steps shuffled."""
        key = (epoch, rows, seed)
        if key not in self._plans:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            steps = []
            for members in self._groups:
                order = [members[i] for i in torch.randperm(len(members), generator=generator).tolist()]
                count = -(-len(order) // rows)
                order = (order * -(-count * rows // len(order)))[: count * rows]
                steps += [order[i * rows : (i + 1) * rows] for i in range(count)]
            self._plans = {key: [steps[i] for i in torch.randperm(len(steps), generator=generator).tolist()]}
        return self._plans[key]

    def steps_per_epoch(self, batch_size: int, grad_accum: int) -> int:
        """Optimizer steps until every item has been seen once (each bucket rounds up to whole steps)."""
        rows = batch_size * grad_accum
        return sum(-(-len(members) // rows) for members in self._groups)

    def step_indices(
        self, step: int, micro: int, *, batch_size: int, grad_accum: int, dp_rank: int, dp_size: int, seed: int
    ) -> list[int]:
        """This data-parallel rank's item indices in micro-batch ``micro`` of optimizer step ``step``.

        ``batch_size`` is the global micro-batch (split evenly over ``dp_size`` ranks), as in
        :meth:`hsdp.train.data.TokenDataset.batch`. All ``batch_size * grad_accum`` rows of a step come from one
        bucket; the rows depend only on (seed, step), so resuming at step k reads what an uninterrupted run reads.
        """
        if batch_size % dp_size:
            raise DatasetError(
                f"--batch-size={batch_size} must be a multiple of the data-parallel size {dp_size} "
                "(each rank takes an equal share)"
            )
        if not 0 <= micro < grad_accum:
            raise ValueError(f"micro-batch {micro} outside 0..{grad_accum - 1}")
        epoch, position = divmod(step, self.steps_per_epoch(batch_size, grad_accum))
        rows = self._epoch_plan(epoch, batch_size * grad_accum, seed)[position]
        per_rank = batch_size // dp_size
        start = micro * batch_size + dp_rank * per_rank
        return rows[start : start + per_rank]

    def micro_batch(self, number: int, batch_size: int, seed: int) -> list[int]:
        """All ranks' rows of global micro-batch ``number`` when every micro-batch is drawn as its own step (one
        bucket per micro-batch): :meth:`step_indices` at ``grad_accum=1`` on one rank. The trainer slices it."""
        return self.step_indices(number, 0, batch_size=batch_size, grad_accum=1, dp_rank=0, dp_size=1, seed=seed)


def drop_captions(captions: list[str], probability: float, generator: torch.Generator) -> list[str]:
    """Captions with each replaced by ``""`` with ``probability`` (classifier-free guidance training). One draw per
    caption from ``generator``, whatever the probability, so the generator's later draws do not depend on it."""
    if not 0 <= probability <= 1:
        raise ValueError(f"--caption-dropout={probability} must be in [0, 1]")
    dropped = (torch.rand(len(captions), generator=generator) < probability).tolist()
    return ["" if drop else caption for caption, drop in zip(captions, dropped, strict=True)]
