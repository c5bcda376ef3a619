"""Latents and caption embeddings encoded once and kept on disk (``--cache-latents``).

One safetensors file per item at ``<root>/<fingerprint hash>/<F>x<H>x<W>/<key>.safetensors``: a different model
(fingerprint), size bucket or content (:attr:`~hsdp.train.diffusion.media.MediaItem.cache_key`: the caption and the
file's size and modification time) never reads another's tensors. Files are written to a temporary name and renamed, so a
reader sees a whole file or none; a file that is still damaged (a copy cut short, a full disk) is treated as
missing, with a warning, and written again. The root must be one folder all ranks see (like ``--output-dir``).
Beside the items, under the same fingerprint, a run keeps what it learned from the loaded pipeline
(:meth:`LatentCache.put_record`), so that a run that reads every item need not load the encoders.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from hsdp.train.diffusion.media import Bucket, MediaDataset

logger = logging.getLogger("hsdp")

__all__ = ["LatentCache", "fill_cache", "encoder_fingerprint", "agreed_indices", "all_agree"]

_KEY_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_SAMPLE_BYTES = 1 << 20


def encoder_fingerprint(model_dir: str | Path, components: list[str], **settings) -> str:
    """A fingerprint of what the cached tensors depend on: each frozen component's config and weight files (name,
    size, and the first and last MiB of each, so retrained weights of the same shapes differ without reading
    gigabytes), plus the encoding ``settings`` (e.g. max_sequence_length)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for component in components:
        folder = Path(model_dir) / component
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(f"{path.relative_to(model_dir).as_posix()}:{path.stat().st_size}".encode())
            with path.open("rb") as f:
                digest.update(f.read(_SAMPLE_BYTES))
                f.seek(max(0, path.stat().st_size - _SAMPLE_BYTES))
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


class LatentCache:
    """Per-item named tensors (latents, prompt embeddings, pooled embeddings, masks) under ``root``, keyed by the
    model fingerprint, the item's bucket and its key."""

    def __init__(self, root: str | Path, model_fingerprint: str):
        self.root = Path(root) / hashlib.sha256(model_fingerprint.encode()).hexdigest()[:16]

    def path(self, item_key: str, bucket: Bucket) -> Path:
        """The file of one item: a readable, filesystem-safe name plus a hash of the exact key (so ``a/b.png`` and
        ``a_b.png`` stay apart)."""
        readable = _KEY_CHARS.sub("_", item_key)[-80:]
        exact = hashlib.sha256(item_key.encode()).hexdigest()[:10]
        return self.root / f"{bucket.frames}x{bucket.height}x{bucket.width}" / f"{readable}-{exact}.safetensors"

    def has(self, item_key: str, bucket: Bucket) -> bool:
        """Whether a whole file is there (its size matches its header), without reading the tensors."""
        path = self.path(item_key, bucket)
        return path.is_file() and _complete(path)

    def get(self, item_key: str, bucket: Bucket) -> dict[str, torch.Tensor] | None:
        """The tensors of an item, or None when they are missing or the file is damaged (warned: it is rewritten)."""
        from safetensors import safe_open

        path = self.path(item_key, bucket)
        if not path.is_file():
            return None
        try:
            if not _complete(path):
                raise ValueError("shorter or longer than its header says")
            with safe_open(str(path), framework="pt") as f:
                if (f.metadata() or {}).get("key") != item_key:
                    raise ValueError(f"holds {(f.metadata() or {}).get('key')!r}")
                return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        except Exception as exc:  # safetensors raises several types for damaged files
            logger.warning("latent cache %s is unreadable (%s); it will be encoded again", path, exc)
            return None

    def put(self, item_key: str, bucket: Bucket, tensors: dict[str, torch.Tensor]) -> Path:
        """Write an item's tensors (CPU copies) atomically: a temporary file in the same folder, then a rename."""
        from safetensors.torch import save_file

        path = self.path(item_key, bucket)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            save_file(
                {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()},
                str(staging),
                metadata={"key": item_key},
            )
            os.replace(staging, path)
        finally:
            staging.unlink(missing_ok=True)
        return path

    def put_record(self, name: str, value: dict) -> Path:
        """Write ``value`` (what the run learned from the loaded pipeline besides the items, so that a run reading
        every item from the cache need not load it) as ``<name>.pt`` beside the items, atomically as :meth:`put`."""
        path = self.root / f"{name}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            torch.save(value, staging)
            os.replace(staging, path)
        finally:
            staging.unlink(missing_ok=True)
        return path

    def get_record(self, name: str, safe: list[type]) -> dict | None:
        """What :meth:`put_record` wrote, or None when it is missing or damaged (warned). Read with
        ``weights_only``: tensors, containers and the classes ``safe`` only, never arbitrary pickled code."""
        path = self.root / f"{name}.pt"
        if not path.is_file():
            return None
        try:
            with torch.serialization.safe_globals(safe):
                return torch.load(path, weights_only=True)
        except Exception as exc:  # a damaged file raises several types
            logger.warning("latent cache %s is unreadable (%s); the encoders will load", path, exc)
            return None

    @staticmethod
    def shard(indices: list[int], rank: int, world: int) -> list[int]:
        """Rank ``rank``'s share of ``indices``: every ``world``-th, so shares differ by at most one item."""
        return list(indices[rank::world])


def _complete(path: Path) -> bool:
    """A safetensors file is 8 bytes of header length, the JSON header, then the data up to the largest offset."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return False
        length = int.from_bytes(head, "little")
        if length > size - 8:
            return False
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return False
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    return size == 8 + length + max(ends, default=0)


def fill_cache(
    dataset: MediaDataset,
    cache: LatentCache,
    encode: Callable[[list[int]], list[dict[str, torch.Tensor]]],
    rank: int,
    world: int,
    barrier: Callable[[], None] | None = None,
    *,
    batch_size: int = 1,
    group: dist.ProcessGroup | None = None,
) -> list[int]:
    """Encode the items missing from ``cache``, each rank its share, and wait for every rank; returns the indices
    this rank wrote.

    ``encode(indices)`` returns one dict of tensors per index; the indices of one call share a bucket (their pixels
    stack). It may run collective encoders (sharded VAE / text encoders), so every rank calls it the same number of
    times with the same batch size: the missing set is agreed over ``group`` (the union of what each rank sees
    missing), each bucket is split with :meth:`LatentCache.shard`, and a rank's share is padded to the longest share
    (rounded up to whole batches) by repeating its last item (the bucket's first when its share is empty). The
    duplicates' results are discarded. ``barrier`` defaults to the group's barrier, which fails after the group's
    timeout instead of hanging when a rank is gone.
    """
    pairs = zip(dataset.items, dataset.buckets, strict=True)
    missing = agreed_indices([i for i, (item, bucket) in enumerate(pairs) if not cache.has(item.cache_key, bucket)], group)
    groups: dict[Bucket, list[int]] = {}
    for index in missing:
        groups.setdefault(dataset.buckets[index], []).append(index)
    written = []
    for members in groups.values():
        share = cache.shard(members, rank, world)
        calls = math.ceil(math.ceil(len(members) / world) / batch_size)
        filler = share[-1] if share else members[0]
        padded = share + [filler] * (calls * batch_size - len(share))
        for call in range(calls):
            batch = padded[call * batch_size : (call + 1) * batch_size]
            results = encode(batch)
            if len(results) != len(batch):
                raise RuntimeError(f"encode returned {len(results)} results for {len(batch)} items")
            for position, (index, tensors) in enumerate(zip(batch, results, strict=True)):
                if call * batch_size + position < len(share):  # not a padding duplicate
                    cache.put(dataset.items[index].cache_key, dataset.buckets[index], tensors)
                    written.append(index)
    (barrier or (lambda: _barrier(group)))()
    return written


def agreed_indices(missing: list[int], group: dist.ProcessGroup | None = None) -> list[int]:
    """The union of every rank's missing indices, sorted (ranks may see a file another is still renaming into
    place, or one damaged that another read whole)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return missing
    every: list[list[int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, missing, group=group)
    return sorted(set().union(*every))


def all_agree(value: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``value`` is true on every rank (collective: every rank calls it)."""
    return not agreed_indices([] if value else [0], group)


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)
