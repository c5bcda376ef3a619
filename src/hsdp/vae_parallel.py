"""``--vae-parallel``: a VAE's tiled decode (and encode) split over ranks, as diffusers tiles it.

diffusers' tiled VAEs (``AutoencoderKL``, ``AutoencoderKLWan``, HunyuanVideo, LTX, CogVideoX, Mochi, ...) share one
structure: ``tiled_decode`` walks the overlapping tiles, runs the ``decoder`` on each (a video VAE calls it several
times per tile, handing its causal cache from one call to the next), keeps every decoded tile, then blends
neighbours (``blend_v`` / ``blend_h`` / ``blend_t``) and crops. :func:`enable_vae_parallel` replaces the tiled method
with one that runs diffusers' own method twice on every rank of a group:

1. tile ``t`` is computed by rank ``t % world`` (round-robin); the other ranks run the same calls on the meta device,
   which gives each call's output shape without computing it. This pass stops at the first blend.
2. ``all_gather`` brings every rank's decoded tiles to every rank, one collective per round of ``world`` tiles (so
   each tile's buffer can be freed once used); the method then runs again with each ``decoder`` call answered
   from the gathered tiles, so the cropping and blending are diffusers' own.

Tile geometry, blending and the per-class call structure stay in diffusers. What this module knows of the
classes: which method tiles and which child it calls (``_TILED``), that a call handed cached tensors (Wan's
``feat_cache`` list, CogVideoX / Mochi's ``conv_cache``) continues the tile of the previous call, and that a VAE
whose layers keep their causal cache themselves (Magvit) starts a tile after clearing it (``_CLEARS``). A class
whose tiled method does not blend through ``blend_v`` / ``blend_h`` (Allegro accumulates batched tiles itself)
cannot be split this way and is refused (:func:`split_refusal`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["TileSplit", "enable_vae_parallel", "split_refusal", "vae_memory_options"]

_TILED = (("tiled_decode", "decoder"), ("_tiled_encode", "encoder"), ("tiled_encode", "encoder"))
"""(tiled method, the child it runs per tile): AutoencoderKL encodes through ``_tiled_encode`` (its public
``tiled_encode`` is a deprecated copy); the first of the two encode names a class has is the one it uses."""
_BLENDS = ("blend_v", "blend_h", "blend_t")
_CLEARS = ("clear_cache", "_clear_conv_cache")
"""VAE methods that reset a causal cache its layers hold: a decoder call after one starts a new tile."""


def vae_memory_options(vae: nn.Module, *, tiling: bool, slicing: bool) -> None:
    """``--vae-tiling`` / ``--vae-slicing``: diffusers' ``enable_tiling`` (decode and encode tile by tile, one rank)
    and ``enable_slicing`` (a batch one sample at a time)."""
    if tiling:
        vae.enable_tiling()
    if slicing:
        vae.enable_slicing()


def split_refusal(cls: type) -> str | None:
    """Why ``--vae-parallel`` cannot split ``cls``'s tiled decode, or None when it can: the first pass stops at
    the first blend, and the second answers each child call from the gathered tiles, so the class must tile
    through ``tiled_decode`` and blend through diffusers' ``blend_v`` / ``blend_h``."""
    if not callable(getattr(cls, "tiled_decode", None)):
        return f"{cls.__name__} has no tiled_decode"
    if not all(callable(getattr(cls, name, None)) for name in _BLENDS[:2]):
        return f"{cls.__name__}'s tiled decode blends its tiles itself (no blend_v / blend_h to split it at)"
    return None


def enable_vae_parallel(vae: nn.Module, group: dist.ProcessGroup | None = None) -> list[str]:
    """Turn on ``vae``'s tiling and split its tiled decode and encode over the ranks of ``group`` (default: all);
    returns the methods replaced. Every rank of the group must make the same VAE calls with the same inputs.
    Inputs of one tile or less keep diffusers' untiled path (its own size test), so they are computed whole.
    Raises ValueError for a class that cannot be split (:func:`split_refusal`)."""
    if (refusal := split_refusal(type(vae))) is not None:
        raise ValueError(f"--vae-parallel: {refusal}; use --vae-tiling instead")
    vae.enable_tiling()
    replaced = []
    for method, child in _TILED:
        if method == "tiled_encode" and "_tiled_encode" in replaced:
            continue
        if callable(getattr(type(vae), method, None)) and isinstance(getattr(vae, child, None), nn.Module):
            setattr(vae, method, _split_over_ranks(vae, getattr(vae, method), child, group))
            replaced.append(method)
    return replaced


class _TilesDone(Exception):
    """Raised at the first blend of the first pass: every tile has been computed or sized."""


@dataclass(frozen=True)
class TileSplit:
    """What the last split call did on this rank (``vae.tiled_decode.last_split``)."""

    tiles: int
    computed: int
    """Of them, the tiles this rank computed."""
    meta_runs: int = 0
    """Calls of the child this rank ran on the meta device to size another rank's tile (the others reused a
    signature's earlier run or this rank's own computed call)."""


@dataclass
class _Call:
    tile: int
    owner: int
    tuple_len: int | None
    """The child returned a tuple of this length (sample, cache): the sample is its first item."""
    shape: torch.Size
    dtype: torch.dtype


class _TileWork:
    """One tiled call: which rank computes each call of the child, and the samples once gathered."""

    def __init__(self, child: nn.Module, rank: int, world: int, sized_calls: dict[object, tuple]):
        """``sized_calls``: key (:meth:`_key`) -> the call's output and list contents on meta, kept by the split
        method across its calls: a server decoding at one resolution sizes other ranks' tiles once, not per
        request."""
        self.child, self.rank, self.world = child, rank, world
        self.forward = child.forward
        self.tile = -1
        self.calls: list[_Call] = []
        self.mine: dict[int, torch.Tensor] = {}
        """Call index -> the sample this rank computed."""
        self._meta_state: dict[str, torch.Tensor] | None = None
        self._sized_calls = sized_calls
        self._sizing = False
        self.clears = False
        """The VAE has a cache-clearing method (``_CLEARS``): its calls, not the arguments, mark the tiles."""
        self.cleared = False
        self.tile_call = 0
        """Calls made so far in the current tile."""
        self.meta_runs = 0

    def _starts_tile(self, args: tuple, kwargs: dict) -> bool:
        if self.tile < 0:
            return True
        if _continues_tile(args, kwargs):
            return False
        return self.cleared or not self.clears

    def compute(self, *args, **kwargs):
        """The child's forward in the first pass: real on the tile's owner; elsewhere run with its weights and
        inputs on the meta device, which sizes the output without computing it."""
        if self._sizing:  # the call functional_call makes below
            return self.forward(*args, **kwargs)
        if self._starts_tile(args, kwargs):
            self.tile, self.tile_call = self.tile + 1, 0
        self.cleared = False
        owner = self.tile % self.world
        out = self._computed(args, kwargs) if owner == self.rank else self._sized(args, kwargs)
        sample = out[0] if isinstance(out, tuple) else out
        if owner == self.rank:
            self.mine[len(self.calls)] = sample
        self.calls.append(
            _Call(self.tile, owner, len(out) if isinstance(out, tuple) else None, sample.shape, sample.dtype)
        )
        self.tile_call += 1
        return out

    def _computed(self, args: tuple, kwargs: dict):
        """The call computed, its output's and caches' shapes kept for :meth:`_sized`: a later tile of the same
        shape that another rank computes is then sized without running (rank 0 computes the first tile of each
        shape in a row of equal tiles, so it sizes the others' without a meta run)."""
        key = self._key(args, kwargs)
        out = self.forward(*args, **kwargs)
        if key not in self._sized_calls:
            self._sized_calls[key] = (tree_map(_to_meta, out), [list(map(_to_meta, v)) for v in _lists(args, kwargs)])
        return out

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        """What the shapes of a call's output and of the cache it leaves depend on. A call handed its cache is
        known by the cache's shapes, so Wan's calls after the first two of a tile share one key (a meta run per
        tile shape, not per frame). A call handed none may still find a cache its layers hold themselves (Magvit):
        its place in the tile stands for that state."""
        place = None if _continues_tile(args, kwargs) else self.tile_call
        return place, _signature((args, kwargs))

    def _sized(self, args: tuple, kwargs: dict):
        """The call run on the meta device, once per signature (the shapes and values it is given, the caches
        included): running a decoder on meta costs its Python overhead, a large share of a small tile's work. A
        repeat (or a call of the same signature this rank computed) gets the first run's output, and its list
        arguments (Wan's ``feat_cache``) the contents that run left in them, so the next call sees the cache handed
        on as it would (the key: :meth:`_key`)."""
        key = self._key(args, kwargs)
        if key not in self._sized_calls:
            if self._meta_state is None:
                named = (*self.child.named_parameters(), *self.child.named_buffers())
                self._meta_state = {name: torch.empty_like(t, device="meta") for name, t in named}
            self._sizing = True
            try:
                meta_args = tuple(map(_to_meta, args)), {k: _to_meta(v) for k, v in kwargs.items()}
                out = torch.func.functional_call(self.child, self._meta_state, *meta_args)
                self.meta_runs += 1
            finally:
                self._sizing = False
            self._sized_calls[key] = (out, [list(v) for v in _lists(args, kwargs)])
        out, contents = self._sized_calls[key]
        for value, content in zip(_lists(args, kwargs), contents, strict=True):
            value[:] = content
        return out

    def gather(self, group: dist.ProcessGroup | None, device: torch.device) -> list[torch.Tensor | None]:
        """Every call's sample: this rank's own, and the others' from one all_gather per round of ``world`` tiles
        (each rank's next tile, flattened and padded to the round's largest). Gathering tile by tile instead of
        all at once lets a tile's buffer go as soon as the tiled method is done with it, so a rank holds each
        tile once, as diffusers' own tiled method does."""
        samples: list[torch.Tensor | None] = [self.mine.pop(i, None) for i in range(len(self.calls))]
        dtype = self.calls[0].dtype
        for first in range(0, self.tile + 1, self.world):
            tiles = range(first, min(first + self.world, self.tile + 1))
            calls = [[i for i, c in enumerate(self.calls) if c.tile == t] for t in tiles]
            width = max(sum(self.calls[i].shape.numel() for i in group_calls) for group_calls in calls)
            own = [samples[i].reshape(-1).to(dtype) for i in calls[self.rank]] if self.rank < len(tiles) else []
            flat = torch.cat(own).to(device) if own else torch.empty(0, dtype=dtype, device=device)
            buffers = [torch.empty(width, dtype=dtype, device=device) for _ in range(self.world)]
            dist.all_gather(buffers, torch.nn.functional.pad(flat, (0, width - flat.numel())), group)
            del own, flat
            for owner, group_calls in enumerate(calls):
                if owner == self.rank:
                    continue
                offset = 0
                for i in group_calls:
                    size = self.calls[i].shape.numel()
                    samples[i] = buffers[owner][offset : offset + size].view(self.calls[i].shape)
                    offset += size
        return samples

    def replay(self, samples: list[torch.Tensor | None]) -> Callable:
        """The child's forward in the second pass: each call answered with its gathered sample, in call order
        (the tiled method makes the same calls again). A cache the call would return is not needed any more."""
        order = iter(range(len(self.calls)))

        def forward(*args, **kwargs):
            i = next(order)
            sample, samples[i] = samples[i], None  # held by the tiled method from here on, as its own would be
            tuple_len = self.calls[i].tuple_len
            return sample if tuple_len is None else (sample, *[None] * (tuple_len - 1))

        return forward


def _continues_tile(args: tuple, kwargs: dict) -> bool:
    """A call handed cached tensors (a list or dict holding some) continues the previous call's tile."""
    for value in (*args, *kwargs.values()):
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        if any(isinstance(item, torch.Tensor) for item in items):
            return True
    return False


def _lists(args: tuple, kwargs: dict) -> list[list]:
    return [value for value in (*args, *kwargs.values()) if isinstance(value, list)]


def _signature(value) -> object:
    """What a call's output shape can depend on: tensors' shapes and dtypes, containers' structure, other values."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(_signature, value))
    if isinstance(value, dict):
        return ("dict", *((k, _signature(v)) for k, v in value.items()))
    return value if isinstance(value, (int, float, str, bool, type(None))) else (type(value).__name__, id(value))


def _to_meta(value):
    return value.to("meta") if isinstance(value, torch.Tensor) else value


@contextlib.contextmanager
def _child_forward(child: nn.Module, forward: Callable) -> Iterator[None]:
    """Route ``child``'s forward through ``forward`` (its hooks still run: ``__call__`` is unchanged)."""
    own = child.__dict__.get("forward")
    child.forward = forward
    try:
        yield
    finally:
        if own is None:
            del child.forward
        else:
            child.forward = own


@contextlib.contextmanager
def _watch_clears(vae: nn.Module, work: _TileWork) -> Iterator[None]:
    """Note each call of the VAE's cache-clearing method (``_CLEARS``) in ``work``: the next child call starts a
    tile."""
    present = [name for name in _CLEARS if callable(getattr(vae, name, None))]
    work.clears = bool(present)

    def watched(method: Callable) -> Callable:
        def clear(*args, **kwargs):
            work.cleared = True
            return method(*args, **kwargs)

        return clear

    for name in present:
        setattr(vae, name, watched(getattr(vae, name)))
    try:
        yield
    finally:
        for name in present:
            delattr(vae, name)


@contextlib.contextmanager
def _stop_at_blend(vae: nn.Module) -> Iterator[None]:
    def stop(*args, **kwargs):
        raise _TilesDone

    present = [name for name in _BLENDS if callable(getattr(vae, name, None))]
    for name in present:
        setattr(vae, name, stop)
    try:
        yield
    finally:
        for name in present:
            delattr(vae, name)


_SIZED_CALLS_KEPT = 4096
"""A bound on the sizes a split method keeps (a few per tile shape and call place), in case some argument made
every call's key new."""


def _split_over_ranks(vae: nn.Module, tiled: Callable, child_name: str, group: dist.ProcessGroup | None) -> Callable:
    sized_calls: dict[object, tuple] = {}

    @functools.wraps(tiled)
    def call(*args, **kwargs):
        child = getattr(vae, child_name)
        if len(sized_calls) > _SIZED_CALLS_KEPT:
            sized_calls.clear()
        work = _TileWork(child, dist.get_rank(group), dist.get_world_size(group), sized_calls)
        with _child_forward(child, work.compute), _watch_clears(vae, work), _stop_at_blend(vae), contextlib.suppress(
            _TilesDone
        ):
            tiled(*args, **kwargs)
        samples = work.gather(group, next(vae.parameters()).device)
        call.last_split = TileSplit(tiles=work.tile + 1, computed=len(range(work.rank, work.tile + 1, work.world)),
                                    meta_runs=work.meta_runs)  # fmt: skip
        with _child_forward(child, work.replay(samples)):
            return tiled(*args, **kwargs)

    return call
