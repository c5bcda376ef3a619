"""Diffusion training media (hsdp.train.diffusion.media) and the latent cache (hsdp.train.diffusion.latent_cache):
sources as users keep them, size buckets, frame counts, refusals naming the file, the step order, caption dropout,
and the cache's keys, atomic writes and the collective-safe fill."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hsdp.train.data import DatasetError
from hsdp.train.diffusion.latent_cache import LatentCache, encoder_fingerprint, fill_cache
from hsdp.train.diffusion.media import Bucket, MediaDataset, MediaItem, MediaSpec, bucket_for, drop_captions

VIDEO = MediaSpec(spatial_multiple=16, temporal_multiple=4, video=True)
IMAGE = MediaSpec(spatial_multiple=16, temporal_multiple=None, video=False)


def _pixels(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def _image(path: Path, h: int, w: int, caption: str | None = "a cat", seed: int = 0) -> np.ndarray:
    from PIL import Image

    data = _pixels((h, w), seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(data).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return data


def _video(path: Path, frames: int, h: int, w: int, caption: str | None = "a clip") -> None:
    """A GIF keeps odd sizes exactly; an mp4 (libx264, yuv420p) needs even ones."""
    import imageio.v3 as iio

    path.parent.mkdir(parents=True, exist_ok=True)
    data = _pixels((frames, h, w))
    iio.imwrite(path, data, **({"fps": 8, "macro_block_size": 1} if path.suffix == ".mp4" else {}))
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """Odd, portrait and landscape images, 1- and 17-frame GIFs, a 17-frame mp4, one empty caption."""
    root = tmp_path_factory.mktemp("mixed")
    _image(root / "odd.png", 37, 91)
    _image(root / "portrait.jpg", 96, 40, caption="")
    _image(root / "sub" / "landscape.webp", 40, 96)
    _video(root / "one.gif", 1, 37, 91)
    _video(root / "long.gif", 17, 37, 91)
    _video(root / "clip.mp4", 17, 48, 96)
    return root


# ------------------------------------------------------------------------------------------------- sources


def test_folder_of_images_and_videos(mixed):
    data = MediaDataset.from_source(mixed, VIDEO, resolution=32)
    assert [item.key for item in data.items] == [
        "clip.mp4", "long.gif", "odd.png", "one.gif", "portrait.jpg", "sub/landscape.webp"
    ]
    by_key = {item.key: (item, bucket) for item, bucket in zip(data.items, data.buckets, strict=True)}
    assert by_key["portrait.jpg"][0].caption == ""  # an empty caption file is an uncaptioned item
    assert by_key["odd.png"][0].caption == "a cat"
    assert {k: b.frames for k, (_, b) in by_key.items()} == {
        "clip.mp4": 17, "long.gif": 17, "odd.png": 1, "one.gif": 1, "portrait.jpg": 1, "sub/landscape.webp": 1
    }
    assert by_key["portrait.jpg"][1].height > by_key["portrait.jpg"][1].width
    assert by_key["sub/landscape.webp"][1].width > by_key["sub/landscape.webp"][1].height
    for index, bucket in enumerate(data.buckets):
        pixels = data.pixels(index)
        assert pixels.dtype == torch.float32
        assert pixels.shape == (3, bucket.frames, bucket.height, bucket.width)
        assert -1 <= pixels.min() < pixels.max() <= 1


@pytest.mark.parametrize(("limit", "kept"), [(None, 17), (17, 17), (16, 13), (8, 5), (4, 1), (1, 1)])
def test_frame_counts_are_k_t_plus_1_within_the_clip_and_the_limit(mixed, limit, kept):
    data = MediaDataset.from_source(mixed, VIDEO, resolution=32, frames=limit)
    frames = {item.key: bucket.frames for item, bucket in zip(data.items, data.buckets, strict=True)}
    assert frames["long.gif"] == frames["clip.mp4"] == kept
    assert frames["one.gif"] == 1
    assert data.pixels(data.items.index(next(i for i in data.items if i.key == "long.gif"))).shape[1] == kept


def test_pixels_are_exact_at_the_bucket_size_and_centre_cropped(tmp_path):
    exact = _image(tmp_path / "exact.png", 32, 32)
    wide = _image(tmp_path / "wide.png", 32, 48, seed=1)  # bucket 32x32 at resolution 32: 8 columns cut each side
    data = MediaDataset.from_source(tmp_path, IMAGE, resolution=32)
    assert data.buckets == [Bucket(1, 32, 32), Bucket(1, 32, 32)]
    scaled = lambda a: torch.from_numpy(a).permute(2, 0, 1).float()[:, None] / 127.5 - 1  # noqa: E731
    assert torch.equal(data.pixels(0), scaled(exact))
    assert torch.equal(data.pixels(1), scaled(wide[:, 8:40]))


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_metadata_files(tmp_path, fmt):
    _image(tmp_path / "imgs" / "a.png", 40, 64, caption=None)
    _image(tmp_path / "b.png", 64, 40, caption=None)
    rows = [
        {"file_name": "imgs/a.png", "text": 'a "quoted", comma caption'},
        {"file_name": "b.png", "text": "second"},
        {"file_name": "b.png", "text": "second, again"},  # two captions of one file: two items
    ]
    meta = tmp_path / f"metadata.{fmt}"
    if fmt == "jsonl":
        meta.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import csv

        with meta.open("w", newline="") as f:
            writer = csv.DictWriter(f, ["file_name", "text"])
            writer.writeheader()
            writer.writerows(rows)
    for source in (tmp_path, meta):  # the folder or the file itself
        data = MediaDataset.from_source(source, IMAGE, resolution=32)
        assert [i.caption for i in data.items] == [r["text"] for r in rows]
        assert [i.key for i in data.items] == ["imgs/a.png", "b.png", "b.png#2"]
        assert data.items[0].path == tmp_path / "imgs" / "a.png"


# ------------------------------------------------------------------------------------------------ refusals


def _refused(root: Path, match: str, spec: MediaSpec = VIDEO, resolution: int = 32, **kw) -> None:
    with pytest.raises(DatasetError, match=match):
        MediaDataset.from_source(root, spec, resolution=resolution, **kw)


def test_bad_media_is_refused_naming_the_file(tmp_path):
    _image(tmp_path / "uncaptioned" / "a.png", 32, 32, caption=None)
    _refused(tmp_path / "uncaptioned", r"uncaptioned/a\.png has no caption file a\.txt")
    (tmp_path / "empty_video").mkdir()
    (tmp_path / "empty_video" / "v.mp4").write_bytes(b"")
    (tmp_path / "empty_video" / "v.txt").write_text("x")
    _refused(tmp_path / "empty_video", r"v\.mp4 is empty \(0 bytes\)")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "v.mp4").write_bytes(b"not a video at all" * 100)
    (tmp_path / "garbage" / "v.txt").write_text("x")
    _refused(tmp_path / "garbage", r"cannot read .*garbage/v\.mp4")
    (tmp_path / "broken_image").mkdir()
    (tmp_path / "broken_image" / "i.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "broken_image" / "i.txt").write_text("x")
    _refused(tmp_path / "broken_image", r"cannot read .*broken_image/i\.png")
    _video(tmp_path / "clips" / "c.gif", 5, 32, 32)
    _refused(tmp_path / "clips", r"c\.gif is a video and this pipeline generates images", spec=IMAGE)


def test_bad_sources_and_sizes_are_refused(tmp_path):
    _refused(tmp_path / "nowhere", r"--data .*nowhere: no such file or folder")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no media here")
    _refused(tmp_path / "empty", r"--data .*empty: no images or videos found")
    _image(tmp_path / "ok" / "a.png", 32, 32)
    _refused(tmp_path / "ok", r"--resolution 8 is below one multiple .* \(16\)", resolution=8)
    _refused(tmp_path / "ok" / "a.png", r"pass a folder of media")
    with pytest.raises(DatasetError, match="--train-data"):
        MediaDataset.from_source(tmp_path / "nowhere", VIDEO, resolution=32, flag="--train-data")


def test_bad_metadata_is_refused_naming_the_file_and_row(tmp_path):
    _image(tmp_path / "a.png", 32, 32, caption=None)
    meta = tmp_path / "metadata.jsonl"
    meta.write_text('{"file_name": "a.png", "text": "ok"}\n{"file_name": "gone.png", "text": "lost"}\n')
    _refused(tmp_path, r"metadata\.jsonl: row 2 names file_name 'gone\.png', which is not a file")
    meta.write_text('{"file_name": "a.png", "caption": "ok"}\n')
    _refused(tmp_path, r"metadata\.jsonl: no column text")
    (tmp_path / "metadata.csv").write_text("file_name,text\na.png,ok\n")
    _refused(tmp_path, r"holds both metadata\.jsonl and metadata\.csv")


# ------------------------------------------------------------------------------------------------- buckets


@pytest.mark.parametrize("multiple", [8, 16, 32])
def test_buckets_are_maximal_multiples_nearest_the_aspect_ratio(multiple):
    spec = MediaSpec(multiple, None, video=False)
    sizes = [(37, 91), (91, 37), (480, 832), (832, 480), (1080, 1920), (1024, 1024), (300, 200), (7, 5)]
    for resolution in (64, 256, 512):
        if resolution < multiple:
            continue
        for h, w in sizes:
            b = bucket_for(h, w, 1, spec, resolution)
            area = max(min(resolution**2, h * w), multiple**2)
            assert b.height % multiple == 0 and b.width % multiple == 0, (multiple, resolution, h, w, b)
            assert b.height * b.width <= area, (multiple, resolution, h, w, b)
            # maximal: neither side can grow by one multiple within the area
            assert (b.height + multiple) * b.width > area and b.height * (b.width + multiple) > area
            # nearest aspect: no other maximal size at this area is nearer (log ratio)
            units = area // multiple**2
            err = abs(math.log(b.height / b.width) - math.log(h / w))
            for a in range(1, units + 1):
                for c in range(1, units // a + 1):
                    if (a + 1) * c > units and a * (c + 1) > units:
                        assert abs(math.log(a / c) - math.log(h / w)) >= err - 1e-12
            if h != w and b.height != b.width:
                assert (b.height > b.width) == (h > w)  # portrait stays portrait


def test_items_are_never_enlarged_to_the_resolution():
    big = bucket_for(1080, 1920, 1, VIDEO, 512)
    assert (big.height, big.width) == (384, 672)  # 16:9 at ~512^2
    small = bucket_for(100, 100, 1, VIDEO, 512)
    assert (small.height, small.width) == (96, 96)  # its own area, not 512^2
    tiny = bucket_for(5, 5, 1, VIDEO, 512)
    assert (tiny.height, tiny.width) == (16, 16)  # one multiple: the least the VAE takes


# ---------------------------------------------------------------------------------------------- step order


def _synthetic(counts: dict[Bucket, int]) -> MediaDataset:
    """Items in interleaved buckets (no files: the order needs only the buckets)."""
    buckets = [b for b, n in counts.items() for _ in range(n)]
    buckets = buckets[::2] + buckets[1::2]
    items = [MediaItem(Path(f"{i}.png"), "", f"{i}.png") for i in range(len(buckets))]
    return MediaDataset(items, buckets)


COUNTS = {Bucket(1, 32, 32): 13, Bucket(1, 16, 64): 6, Bucket(5, 32, 32): 3}


@pytest.mark.parametrize(("batch_size", "grad_accum", "dp_size"), [(4, 1, 2), (2, 2, 2), (4, 2, 4), (3, 1, 1)])
def test_step_indices(batch_size, grad_accum, dp_size):
    data = _synthetic(COUNTS)
    kw = dict(batch_size=batch_size, grad_accum=grad_accum, dp_size=dp_size, seed=7)
    steps = 2 * data.steps_per_epoch(batch_size, grad_accum) + 3  # into a third epoch
    run = []
    for step in range(steps):
        ranks = [[data.step_indices(step, m, dp_rank=r, **kw) for r in range(dp_size)] for m in range(grad_accum)]
        rows = [i for micro in ranks for rank in micro for i in rank]
        assert all(len(rank) == batch_size // dp_size for micro in ranks for rank in micro)
        assert len({data.buckets[i] for i in rows}) == 1, (step, rows)  # one bucket per optimizer step
        for micro in ranks:  # ranks' rows disjoint where the bucket has enough items
            flat = [i for rank in micro for i in rank]
            if COUNTS[data.buckets[flat[0]]] >= batch_size * grad_accum:
                assert len(set(flat)) == len(flat)
        run.append(ranks)
    per_epoch = data.steps_per_epoch(batch_size, grad_accum)
    for epoch in range(2):  # every item once an epoch at least
        seen = {i for ranks in run[epoch * per_epoch : (epoch + 1) * per_epoch] for m in ranks for r in m for i in r}
        assert seen == set(range(len(data)))
    assert run[:per_epoch] != run[per_epoch : 2 * per_epoch]  # a new shuffle each epoch
    # deterministic, and a resumed run (a fresh dataset starting at step k) reads what the uninterrupted one did
    resumed = _synthetic(COUNTS)
    for step in range(steps - 1, per_epoch - 2, -1):
        assert [[resumed.step_indices(step, m, dp_rank=r, **kw) for r in range(dp_size)]
                for m in range(grad_accum)] == run[step]
    other = _synthetic(COUNTS)
    assert [other.step_indices(s, 0, dp_rank=0, **(kw | {"seed": 8})) for s in range(steps)] != [
        r[0][0] for r in run
    ]


def test_step_indices_refuse_uneven_data_parallel_shares():
    with pytest.raises(DatasetError, match="--batch-size=3 must be a multiple of the data-parallel size 2"):
        _synthetic(COUNTS).step_indices(0, 0, batch_size=3, grad_accum=1, dp_rank=0, dp_size=2, seed=0)


def test_micro_batch_is_one_step_per_micro_batch():
    data = _synthetic(COUNTS)
    for number in range(12):
        full = data.step_indices(number, 0, batch_size=4, grad_accum=1, dp_rank=0, dp_size=1, seed=3)
        assert data.micro_batch(number, 4, 3) == full


def test_drop_captions():
    captions = [f"c{i}" for i in range(2000)]
    assert drop_captions(captions, 0.0, torch.Generator().manual_seed(0)) == captions
    assert drop_captions(captions, 1.0, torch.Generator().manual_seed(0)) == [""] * 2000
    half = drop_captions(captions, 0.5, torch.Generator().manual_seed(0))
    assert half == drop_captions(captions, 0.5, torch.Generator().manual_seed(0))
    assert 900 < half.count("") < 1100
    assert all(h in ("", c) for h, c in zip(half, captions, strict=True))
    # one draw per caption whatever the probability: later draws (noise) do not depend on it
    a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    drop_captions(captions, 0.0, a), drop_captions(captions, 0.3, b)
    assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))
    with pytest.raises(ValueError, match="--caption-dropout=1.5"):
        drop_captions(captions, 1.5, torch.Generator())


# --------------------------------------------------------------------------------------------- latent cache


BUCKET = Bucket(5, 32, 48)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "latents": torch.randn(4, 2, 4, 6, generator=g),
        "prompt_embeds": torch.randn(7, 16, generator=g).bfloat16(),
        "pooled": torch.randn(16, generator=g),
        "mask": torch.ones(7, dtype=torch.bool),
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_cache_roundtrip_and_keys(tmp_path):
    cache = LatentCache(tmp_path, "model-a")
    assert cache.get("sub/x.png", BUCKET) is None and not cache.has("sub/x.png", BUCKET)
    path = cache.put("sub/x.png", BUCKET, _tensors(0))
    assert path.parent == tmp_path / path.parent.parent.name / "5x32x48"
    assert _same(cache.get("sub/x.png", BUCKET), _tensors(0)) and cache.has("sub/x.png", BUCKET)
    assert LatentCache(tmp_path, "model-b").get("sub/x.png", BUCKET) is None  # another model's fingerprint
    assert cache.get("sub/x.png", Bucket(5, 32, 32)) is None  # another size
    assert cache.get("sub_x.png", BUCKET) is None  # keys that sanitise alike stay apart
    cache.put("sub_x.png", BUCKET, _tensors(1))
    assert _same(cache.get("sub/x.png", BUCKET), _tensors(0)) and _same(cache.get("sub_x.png", BUCKET), _tensors(1))
    assert not list(tmp_path.rglob("*.tmp"))  # staging files renamed away


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_cache_file_is_missing_with_a_warning_and_rewritten(tmp_path, caplog, damage):
    cache = LatentCache(tmp_path, "fp")
    path = cache.put("a.png", BUCKET, _tensors(0))
    raw = path.read_bytes()
    path.write_bytes({"truncate": raw[: len(raw) - 10], "garbage": b"\xff" * 64, "empty": b""}[damage])
    with caplog.at_level(logging.WARNING, logger="hsdp"):
        assert cache.get("a.png", BUCKET) is None
    assert "unreadable" in caplog.text and path.name in caplog.text
    data = MediaDataset([MediaItem(Path("a.png"), "", "a.png")], [BUCKET])
    assert fill_cache(data, cache, lambda idx: [_tensors(5) for _ in idx], rank=0, world=1) == [0]
    assert _same(cache.get("a.png", BUCKET), _tensors(5))


def test_encoder_fingerprint_follows_weights_and_settings(tmp_path):
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text("{}")
    (tmp_path / "vae" / "w.safetensors").write_bytes(b"\0" * 100)
    first = encoder_fingerprint(tmp_path, ["vae"], max_sequence_length=64)
    assert first == encoder_fingerprint(tmp_path, ["vae"], max_sequence_length=64)
    assert first != encoder_fingerprint(tmp_path, ["vae"], max_sequence_length=128)
    (tmp_path / "vae" / "w.safetensors").write_bytes(b"\0" * 99 + b"\1")  # same size, new values
    assert first != encoder_fingerprint(tmp_path, ["vae"], max_sequence_length=64)


def _fill_dataset() -> MediaDataset:
    """Seven items in two buckets (5 and 2)."""
    buckets = [BUCKET] * 5 + [Bucket(1, 32, 32)] * 2
    return MediaDataset([MediaItem(Path(f"{i}.png"), "", f"{i}.png") for i in range(7)], buckets)


def _recording_encode(calls: list[list[int]], data: MediaDataset):
    def encode(indices: list[int]) -> list[dict[str, torch.Tensor]]:
        assert len({data.buckets[i] for i in indices}) == 1  # one bucket per call: pixels stack
        calls.append(list(indices))
        return [{"latents": torch.full((2,), float(i))} for i in indices]

    return encode


def test_fill_cache_encodes_only_missing_items(tmp_path):
    data, cache = _fill_dataset(), LatentCache(tmp_path, "fp")
    cache.put("3.png", BUCKET, {"latents": torch.full((2,), 3.0)})
    calls: list[list[int]] = []
    barriers = []
    written = fill_cache(data, cache, _recording_encode(calls, data), 0, 1, lambda: barriers.append(1), batch_size=2)
    assert sorted(written) == [0, 1, 2, 4, 5, 6] and barriers == [1]
    assert calls == [[0, 1], [2, 4], [5, 6]]
    assert all(torch.equal(cache.get(f"{i}.png", b)["latents"], torch.full((2,), float(i)))
               for i, b in enumerate(data.buckets))
    calls.clear()
    assert fill_cache(data, cache, _recording_encode(calls, data), 0, 1, lambda: None, batch_size=2) == []
    assert calls == []


def test_summary_counts_items_buckets_and_names_what_was_left_out(tmp_path):
    """The log at start (issue 26 item 5): item count, the bucket table, every skipped or upscaled file with why."""
    _image(tmp_path / "a.png", 32, 48)
    _image(tmp_path / "b.png", 48, 32)
    _image(tmp_path / "sub" / "c.png", 32, 48)
    _image(tmp_path / "tiny.png", 8, 8)
    (tmp_path / "notes.pdf").write_bytes(b"%PDF")
    (tmp_path / "orphan.txt").write_text("a caption whose image was deleted")
    data = MediaDataset.from_source(tmp_path, IMAGE, resolution=48)
    text = data.summary(tmp_path)
    assert f"--data {tmp_path}: 4 items (4 images, 0 clips) in 3 size buckets" in text
    assert "  1 x 32 x 48: 2" in text and "  1 x 48 x 32: 1" in text and "  1 x 16 x 16: 1" in text
    assert f"skipped {tmp_path / 'notes.pdf'}: not an image or video" in text
    assert f"skipped {tmp_path / 'orphan.txt'}: a caption with no image or video" in text
    assert f"upscaled {tmp_path / 'tiny.png'}: 8 x 8 is below its bucket 16 x 16" in text
    assert "a.png" not in text  # items that fit are counted, not listed


def test_cache_is_keyed_by_content_not_by_name(tmp_path):
    """Captions edited, a file replaced under the same name: those items are encoded again, the others reused
    (issue 27 item 3: the old captions' encodings were reused for the new ones)."""
    import os

    for i, caption in enumerate(["a cat", "a dog", "a fox"]):
        _image(tmp_path / "data" / f"{i}.png", 32, 32, caption, seed=i)
    cache = LatentCache(tmp_path / "cache", "fp")

    def encoded() -> list[int]:
        data = MediaDataset.from_source(tmp_path / "data", IMAGE, resolution=32)
        calls: list[list[int]] = []
        fill_cache(data, cache, _recording_encode(calls, data), 0, 1, lambda: None)
        return sorted(i for call in calls for i in call)

    assert encoded() == [0, 1, 2]
    assert encoded() == []  # nothing changed: every item from the cache
    (tmp_path / "data" / "1.txt").write_text("a wolf")
    replaced = tmp_path / "data" / "2.png"
    stat = replaced.stat()
    _image(replaced, 32, 32, None, seed=9)
    os.utime(replaced, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a new file, however quickly written
    assert encoded() == [1, 2]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fill_cache_calls_encode_alike_on_every_rank(tmp_path, world):
    """The ranks' calls (as each rank would make them; no process group) have the same count and batch size,
    padding included, and together write every item once."""
    data = _fill_dataset()
    calls = {r: [] for r in range(world)}
    written = {}
    for rank in range(world):
        cache = LatentCache(tmp_path / f"r{rank}", "fp")  # each its own folder: every rank sees all missing
        written[rank] = fill_cache(data, cache, _recording_encode(calls[rank], data), rank, world, lambda: None,
                                   batch_size=2)
    assert len({tuple(len(c) for c in calls[r]) for r in range(world)}) == 1
    every = [i for r in range(world) for i in written[r]]
    assert sorted(every) == list(range(7))


def fill_on_rank(root: str) -> tuple[list[int], list[int]]:
    """fill_cache under the worker group's process group. Each rank gets its own folder, where rank 1 already holds
    the whole second bucket: without the agreed missing set it would skip the calls rank 0 makes (a hang with
    collective encoders)."""
    import torch.distributed as dist

    data, rank, world = _fill_dataset(), dist.get_rank(), dist.get_world_size()
    cache = LatentCache(Path(root) / f"rank{rank}", "fp")
    if rank == 1:
        for i in (5, 6):
            cache.put(f"{i}.png", data.buckets[i], {"latents": torch.zeros(2)})
    calls: list[list[int]] = []
    written = fill_cache(data, cache, _recording_encode(calls, data), rank, world, batch_size=2)
    return written, [len(c) for c in calls]


def test_fill_cache_world_2(dist_run, tmp_path):
    (w0, c0), (w1, c1) = dist_run(2, fill_on_rank, str(tmp_path))
    assert c0 == c1 == [2, 2, 2]  # bucket of 5: shares of 3 and 2, two calls of 2; bucket of 2: one call
    assert not set(w0) & set(w1) and sorted(w0 + w1) == list(range(7))


@pytest.mark.parametrize("name", ["tiny-wan", "tiny-flux", "tiny-sdxl"])
def test_sizes_are_read_before_launch_without_loading_the_encoders(name):
    """The launcher checks media against the pipeline's size multiples from a pipeline built on meta (a Wan 14B's
    UMT5 would otherwise be held whole in the launching process): the same multiples as the loaded pipeline."""
    from hsdp.models.builtin import resolve_model
    from hsdp.train.config import TrainConfig
    from hsdp.train.diffusion.frozen import media_spec, meta_pipeline
    from hsdp.train.diffusion.trainer import trained_component

    folder = resolve_model(name)
    component = trained_component(TrainConfig(model=name, data="unused"), folder)
    pipe = meta_pipeline(folder)
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    assert modules and all(p.is_meta for m in modules for p in m.parameters())
    # The sizes themselves come from the model description's size rule (the pipeline's own, asked around a meta
    # VAE), the rule every command checks: tests/test_model_description.py compares them across commands.
    spec = media_spec(folder, component)
    assert spec.spatial_multiple > 0 and spec.video == (name == "tiny-wan")
