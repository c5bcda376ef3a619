"""Training media as users keep it: a folder of images or videos with same-name ``.txt`` captions, or a
``metadata.jsonl`` / ``metadata.csv`` with ``file_name`` and ``text`` (Hugging Face's imagefolder convention, read
with ``datasets``).

Every item goes to the size bucket nearest its aspect ratio: height and width multiples of the pipeline's
``spatial_multiple`` (VAE scale x patch x packing) with an area close to ``resolution ** 2``; it is resized to cover
the bucket and centre-cropped. Videos keep ``k * temporal_multiple + 1`` frames: the largest such count that the clip
has and ``frames`` allows. Problems are refused when the dataset is opened, naming the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hsdp.train.data import DatasetError

__all__ = ["Bucket", "MediaItem", "MediaSpec", "MediaDataset", "IMAGE_SUFFIXES", "VIDEO_SUFFIXES"]

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})
VIDEO_SUFFIXES = frozenset({".mp4", ".webm", ".mov", ".mkv", ".gif"})


@dataclass(frozen=True)
class Bucket:
    frames: int
    height: int
    width: int


@dataclass(frozen=True)
class MediaItem:
    path: Path
    caption: str
    key: str
    """The file name relative to the dataset root: stable across runs (the latent cache's key)."""


@dataclass(frozen=True)
class MediaSpec:
    spatial_multiple: int
    temporal_multiple: int | None
    """Frame counts ``k * temporal_multiple + 1`` (video pipelines); None for image pipelines."""
    video: bool


def _records(root: Path, flag: str) -> list[tuple[Path, str]]:
    """(file, caption) pairs of a folder or metadata file."""
    folder = root if root.is_dir() else root.parent
    for name in ("metadata.jsonl", "metadata.csv"):
        meta = root if root.is_file() else root / name
        if meta.is_file() and meta.name == name:
            return _metadata_records(meta, folder, flag)
    if root.is_file():
        raise DatasetError(f"{flag} {root}: pass a folder of media with .txt captions, or metadata.jsonl / .csv")
    out = []
    for path in sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES):
        caption = path.with_suffix(".txt")
        if not caption.is_file():
            raise DatasetError(
                f"{flag}: {path} has no caption file {caption.name}; write one (it may be empty) or list the "
                "file in metadata.jsonl with its text"
            )
        out.append((path, caption.read_text().strip()))
    return out


def _metadata_records(meta: Path, folder: Path, flag: str) -> list[tuple[Path, str]]:
    from datasets import load_dataset

    rows = load_dataset("json" if meta.suffix == ".jsonl" else "csv", data_files=str(meta), split="train")
    missing = {"file_name", "text"} - set(rows.column_names)
    if missing:
        raise DatasetError(f"{flag} {meta}: no column {', '.join(sorted(missing))} (needs file_name and text)")
    out = []
    for row in rows:
        path = folder / row["file_name"]
        if not path.is_file():
            raise DatasetError(f"{flag} {meta}: file_name {row['file_name']} does not exist in {folder}")
        out.append((path, str(row["text"] or "")))
    return out


def _read(path: Path) -> np.ndarray:
    """Frames as uint8 ``[F, H, W, 3]``."""
    import imageio.v3 as iio

    try:
        if path.suffix.lower() in IMAGE_SUFFIXES:
            from PIL import Image

            with Image.open(path) as image:
                return np.asarray(image.convert("RGB"))[None]
        frames = np.asarray(iio.imread(path, index=None))
    except Exception as exc:  # PIL, imageio and ffmpeg raise many types for unreadable files
        raise DatasetError(f"cannot read {path}: {exc}") from exc
    if frames.ndim == 3:
        frames = frames[None]
    if frames.shape[0] == 0 or frames.shape[1] == 0 or frames.shape[2] == 0:
        raise DatasetError(f"{path} holds no frames")
    return frames[..., :3]


def bucket_for(height: int, width: int, frames: int, spec: MediaSpec, resolution: int) -> Bucket:
    """The bucket of an item: its aspect ratio at an area close to ``resolution ** 2``, in multiples."""
    m = spec.spatial_multiple
    ratio = height / width
    h = max(m, round(resolution * math.sqrt(ratio) / m) * m)
    w = max(m, round(resolution / math.sqrt(ratio) / m) * m)
    return Bucket(frames, h, w)


def frame_count(available: int, spec: MediaSpec, limit: int | None, path: Path) -> int:
    """The largest ``k * t + 1 <= min(available, limit)``; an image pipeline takes one frame."""
    if not spec.video or not spec.temporal_multiple:
        return 1
    top = min(available, limit) if limit else available
    if top < 1:
        raise DatasetError(f"{path}: no frames")
    return (top - 1) // spec.temporal_multiple * spec.temporal_multiple + 1


class MediaDataset:
    def __init__(self, items: list[MediaItem], buckets: list[Bucket]):
        self.items = items
        self.buckets = buckets

    @classmethod
    def from_source(
        cls, source: str | Path, spec: MediaSpec, *, resolution: int, frames: int | None = None, flag: str = "--data"
    ) -> MediaDataset:
        root = Path(source)
        if not root.exists():
            raise DatasetError(f"{flag} {source}: no such file or folder")
        if resolution < spec.spatial_multiple:
            raise DatasetError(
                f"--resolution {resolution} is below one multiple of the pipeline's VAE and patch size "
                f"({spec.spatial_multiple}); use a multiple of {spec.spatial_multiple}"
            )
        records = _records(root, flag)
        if not records:
            raise DatasetError(f"{flag} {source}: no images or videos found")
        base = root if root.is_dir() else root.parent
        items, buckets = [], []
        for path, caption in records:
            media = _read(path)
            count = frame_count(media.shape[0], spec, frames, path)
            buckets.append(bucket_for(media.shape[1], media.shape[2], count, spec, resolution))
            items.append(MediaItem(path, caption, str(path.relative_to(base))))
        return cls(items, buckets)

    def __len__(self) -> int:
        return len(self.items)

    def pixels(self, index: int) -> torch.Tensor:
        """Item ``index`` as ``[C, F, H, W]`` float32 in [-1, 1], resized to cover its bucket, centre-cropped."""
        import torch.nn.functional as F

        bucket = self.buckets[index]
        frames = torch.from_numpy(_read(self.items[index].path)[: bucket.frames].copy())
        video = frames.permute(0, 3, 1, 2).float() / 127.5 - 1  # F C H W
        h, w = video.shape[-2:]
        scale = max(bucket.height / h, bucket.width / w)
        size = (max(bucket.height, round(h * scale)), max(bucket.width, round(w * scale)))
        video = F.interpolate(video, size=size, mode="bilinear", antialias=True, align_corners=False)
        top, left = (size[0] - bucket.height) // 2, (size[1] - bucket.width) // 2
        video = video[..., top : top + bucket.height, left : left + bucket.width]
        return video.clamp(-1, 1).permute(1, 0, 2, 3).contiguous()

    def global_batches(self, batch_size: int, epoch: int, seed: int) -> list[list[int]]:
        """One epoch's global micro-batches: each bucket's items shuffled and cut into full batches (a bucket with
        fewer items than a batch repeats its items), batch order shuffled; deterministic in (seed, epoch)."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        groups: dict[Bucket, list[int]] = {}
        for index, bucket in enumerate(self.buckets):
            groups.setdefault(bucket, []).append(index)
        batches = []
        for members in groups.values():
            order = [members[i] for i in torch.randperm(len(members), generator=generator).tolist()]
            while len(order) < batch_size:
                order = order + order
            batches += [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
        return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]

    def micro_batch(self, number: int, batch_size: int, seed: int) -> list[int]:
        """The global micro-batch ``number`` (counting over epochs) of ``batch_size`` rows."""
        per_epoch = len(self.global_batches(batch_size, 0, seed))
        epoch, position = divmod(number, per_epoch)
        return self.global_batches(batch_size, epoch, seed)[position]
