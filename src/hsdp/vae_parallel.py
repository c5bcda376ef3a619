"""``--vae-parallel``: a VAE's decode split over ranks.

Two splits. :func:`enable_exact_split` (``--vae-parallel``) splits the whole, untiled decode by rows: each rank
decodes a band of the latent's rows, exchanging what the layers read across the bands (:class:`_RowSplit`), and the
output is the whole decode's within float rounding. :func:`enable_vae_parallel` (``--vae-parallel --vae-tiling``)
splits diffusers' tiled decode and encode tile by tile; its output is diffusers' tiled one, described here:

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
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

__all__ = ["TileSplit", "Unsplittable", "enable_exact_split", "enable_vae_parallel", "split_refusal", "vae_memory_options"]

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


# --------------------------------------------------------------------------------------------------------------------
# The exact split: the whole decode, its rows split over the ranks


class Unsplittable(Exception):
    """A layer of the decoder that the row split cannot keep equal to the whole decode (its reason)."""


_SPLIT = -2
"""The split axis: height, in both (batch, channels, height, width) and (batch, channels, frames, height, width)."""
_EXACT_RTOL = 1e-5
"""How far the probe (:func:`_probe`) lets the split decode be from the whole one, relative to the output's largest
magnitude: see :func:`enable_exact_split` for the derivation."""
_NEAREST = ("nearest", "nearest-exact")
_ROW_MIXING = {
    F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.avg_pool2d, F.avg_pool3d, F.max_pool2d,
    F.max_pool3d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.unfold, F.fold, torch.roll, torch.flip,
}  # fmt: skip
"""Functions whose output rows depend on other rows in a way the split does not exchange: refused by name."""


def _rows(height: int, world: int) -> list[tuple[int, int]]:
    """Contiguous rows ``[start, end)`` per rank, as even as can be (the first ranks one more)."""
    base, extra = divmod(height, world)
    bounds = [0]
    for rank in range(world):
        bounds.append(bounds[-1] + base + (rank < extra))
    return list(zip(bounds, bounds[1:], strict=False))


class _RowSplit(TorchFunctionMode):
    """Runs a decoder on this rank's rows of its input as if on the whole frame. Every function that reads
    neighbouring rows is answered with the neighbours' rows: a convolution (``conv2d`` / ``conv3d``, whatever module
    calls it, diffusers' causal wrappers included) and a spatial ``pad`` exchange the rows of their receptive field
    with the adjacent ranks (the halo), the frame's own padding staying at its top and bottom; ``group_norm`` takes
    its statistics over all ranks' rows; attention (``scaled_dot_product_attention``) gathers every rank's keys and
    values so that this rank's queries see the whole frame. Row-local functions (pointwise, channel norms, nearest
    upsampling, pixel shuffles) run as they are. The sizes of other ranks' tensors follow from the latent rows: at
    any layer a rank holds ``f`` times its latent rows, ``f`` the same on every rank (:meth:`_sizes`)."""

    def __init__(self, group: dist.ProcessGroup | None, rows: list[tuple[int, int]]):
        super().__init__()
        self.group, self.rows = group, rows
        self.rank = dist.get_rank(group)
        self.first, self.last = self.rank == 0, self.rank == len(rows) - 1

    def _sizes(self, local: int) -> list[int]:
        own = self.rows[self.rank][1] - self.rows[self.rank][0]
        if local % own:
            raise Unsplittable(f"a layer holds {local} rows of a split of {own} latent rows (not a multiple)")
        return [(local // own) * (end - start) for start, end in self.rows]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.conv2d, F.conv3d):
            return self._conv(func, *args, **kwargs)
        if func is F.pad:
            return self._pad(*args, **kwargs)
        if func is F.group_norm:
            return self._group_norm(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        if func is F.interpolate:
            self._check_interpolate(*args, **kwargs)
        elif func in _ROW_MIXING:
            raise Unsplittable(f"{getattr(func, '__name__', func)} mixes rows")
        return func(*args, **kwargs)

    # -- halos

    def _edges(self, x: torch.Tensor, top: int, bottom: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The adjacent ranks' ``top`` rows above this band and ``bottom`` rows below it (None at the frame's top or
        bottom edge): one all_gather of every rank's edge rows."""
        smallest = min(self._sizes(x.shape[_SPLIT]))
        if smallest < max(top, bottom):
            raise Unsplittable(f"a halo of {max(top, bottom)} rows is more than a rank's {smallest}")
        h = x.shape[_SPLIT]
        parts = [x.narrow(_SPLIT, h - top, top), x.narrow(_SPLIT, 0, bottom)]
        send = torch.cat([p.reshape(-1) for p in parts]).contiguous()
        got = [torch.empty_like(send) for _ in self.rows]
        dist.all_gather(got, send, self.group)
        above = None if self.first else got[self.rank - 1][: parts[0].numel()].view(parts[0].shape)
        below = None if self.last else got[self.rank + 1][parts[0].numel() :].view(parts[1].shape)
        return above, below

    def _conv(self, func, x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        """A convolution over the band: with its own padding along the rows, computed on the band as it is (every
        row right but the ``padding`` rows at each inner edge, which saw zeros), then those edge rows recomputed
        from slabs of the neighbours' rows and this band's (no copy of the band); after a ``pad`` that took the
        halo (diffusers' causal wrappers), as called."""
        spatial = weight.ndim - 2
        stride, dilation = (_per_dim(v, spatial) for v in (stride, dilation))
        if isinstance(padding, str):
            if padding == "valid":
                padding = 0
            else:
                padding = [d * (k - 1) // 2 for d, k in zip(dilation, weight.shape[2:], strict=True)]
        padding = list(_per_dim(padding, spatial))
        kernel, own_pad, attached = weight.shape[-2], padding[-2], getattr(x, "_hsdp_halo", (0, 0))
        reach = dilation[-2] * (kernel - 1)
        if stride[-2] != 1:
            raise Unsplittable(f"a convolution strides the rows by {stride[-2]}")
        if sum(attached) + 2 * own_pad != reach:
            raise Unsplittable(f"a convolution of {kernel} rows (dilation {dilation[-2]}) padded by {own_pad} after "
                               f"{attached} does not keep the rows' count")  # fmt: skip
        out = func(x, weight, bias, stride, tuple(padding), dilation, groups)
        if not own_pad:
            return out
        if min(self._sizes(x.shape[_SPLIT])) < reach:
            raise Unsplittable(f"a convolution reaches {reach} rows, more than a rank's band")
        above, below = self._edges(x, own_pad, own_pad)
        padding[-2] = 0
        h = x.shape[_SPLIT]
        for halo, rows, at in ((above, x.narrow(_SPLIT, 0, reach), 0), (below, x.narrow(_SPLIT, h - reach, reach), None)):
            if halo is None:
                continue
            slab = torch.cat([halo, rows] if at == 0 else [rows, halo], dim=_SPLIT)
            edge = func(slab, weight, bias, stride, tuple(padding), dilation, groups)
            out.narrow(_SPLIT, 0 if at == 0 else out.shape[_SPLIT] - own_pad, own_pad).copy_(edge)
        return out

    def _pad(self, x, pad, mode="constant", value=None):
        """A pad along the rows: the layer's own pad, then the inner edges' padded rows overwritten with the
        neighbours' rows (padded as the layer pads the other axes); the result is marked with the halo it holds."""
        if x.ndim < 4 or len(pad) < 4 or not (pad[2] or pad[3]):
            return F.pad(x, pad, mode, value)
        if hasattr(x, "_hsdp_halo"):
            raise Unsplittable("rows padded twice")
        top, bottom = pad[2], pad[3]
        out = F.pad(x, pad, mode, value)
        above, below = self._edges(x, top, bottom)
        rest = list(pad)
        rest[2] = rest[3] = 0
        if above is not None and top:
            out.narrow(_SPLIT, 0, top).copy_(F.pad(above, rest, mode, value) if any(rest) else above)
        if below is not None and bottom:
            out.narrow(_SPLIT, out.shape[_SPLIT] - bottom, bottom).copy_(F.pad(below, rest, mode, value) if any(rest) else below)
        out._hsdp_halo = (top, bottom)
        return out

    # -- whole-frame layers

    def _group_norm(self, x, num_groups, weight=None, bias=None, eps=1e-5):
        """Group statistics over every rank's rows: each rank's mean and variance of its band (``var_mean``, one
        fused pass in float32), all-gathered and combined as Chan et al.'s parallel variance does (the sum of the
        bands' squared deviations plus each band's count times its mean's squared distance from the whole mean:
        no cancellation), then the normalisation by those statistics in one fused kernel (``batch_norm`` in
        inference mode) and the affine in place, so no band-sized temporaries beyond the output."""
        own = self.rows[self.rank][1] - self.rows[self.rank][0]
        groups = x.reshape(x.shape[0], num_groups, -1)
        stats_dtype = torch.promote_types(x.dtype, torch.float32)
        var, mean = torch.var_mean(groups.to(stats_dtype), dim=-1, correction=0)
        local = torch.stack([mean, var])
        gathered = [torch.empty_like(local) for _ in self.rows]
        dist.all_gather(gathered, local, self.group)
        # every rank holds the same multiple of its latent rows: its count of a group's elements scales with them
        counts = [groups.shape[-1] * (end - start) / own for start, end in self.rows]
        total = sum(counts)
        whole_mean = sum(n * g[0] for n, g in zip(counts, gathered, strict=True)) / total
        whole_var = sum(n * (g[1] + (g[0] - whole_mean).square()) for n, g in zip(counts, gathered, strict=True)) / total
        shape = (1, -1) + (1,) * (x.ndim - 2)
        if x.dtype == stats_dtype:
            out = F.batch_norm(groups.reshape(1, -1, groups.shape[-1]), whole_mean.flatten(), whole_var.flatten(),
                               training=False, eps=eps).reshape(x.shape)  # fmt: skip
        else:  # a half-precision band: normalised in float32, as PyTorch's own group norm computes
            out = ((groups.to(stats_dtype) - whole_mean.unsqueeze(-1)) * torch.rsqrt(whole_var + eps).unsqueeze(-1))
            out = out.reshape(x.shape)
        if weight is not None:
            out = out.mul_(weight.reshape(shape))
        if bias is not None:
            out = out.add_(bias.reshape(shape))
        return out.to(x.dtype)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        """This rank's queries against every rank's keys and values, gathered in rank order (the frame's order)."""
        if attn_mask is not None or is_causal:
            raise Unsplittable("attention with a mask over the frame's tokens")
        key, value = (self._gather(t, -2) for t in (key, value))
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, **kwargs)

    def _gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` joined along ``dim`` (each padded to the largest for the collective)."""
        sizes = self._sizes(x.shape[dim])
        return _gather_padded(x, dim, sizes, self.group)

    def _check_interpolate(self, x, size=None, scale_factor=None, mode="nearest", *args, **kwargs):
        if mode in _NEAREST or x.ndim < 4:
            return
        scale = _per_dim(scale_factor, x.ndim - 2)[-2] if scale_factor is not None else None
        if scale != 1 and (size is None or _per_dim(size, x.ndim - 2)[-2] != x.shape[_SPLIT]):
            raise Unsplittable(f"{mode} interpolation reads neighbouring rows")


def _per_dim(value, n: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def _gather_padded(x: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
    width = max(sizes)
    padded = F.pad(x, [0, 0] * (x.ndim - 1 - dim % x.ndim) + [0, width - x.shape[dim]]).contiguous()
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded, group)
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(out, sizes, strict=True)], dim=dim)


_MIN_ROWS = 4
"""Latent rows each rank needs for the split (a latent smaller than ``world`` times this decodes whole): the probe
runs at this size, so every halo it exchanged fits at any larger one."""


def enable_exact_split(vae: nn.Module, group: dist.ProcessGroup | None = None) -> str | None:
    """Split ``vae``'s decoder over the rows of the frame on the ranks of ``group`` (:class:`_RowSplit`), the output
    the whole decode's; None when split, else why ``vae`` decodes whole. Every rank of the group must make the same
    decode calls with the same latents; a latent of fewer than ``world`` x ``_MIN_ROWS`` rows decodes whole.

    A probe decodes a small random latent whole and split on every rank first: the split stands only if it equals
    the whole decode within ``_EXACT_RTOL`` of the output's magnitude, so a layer that reads other rows in a way the
    split does not see (a sum over the frame's tokens outside attention, a global pooling) turns it off instead of
    changing the output. The bound: the split computes every value from the same inputs with the same operations
    except for three reductions that run in another order or blocking, group norm's statistics (per-band float32
    moments combined across the bands against PyTorch's one pass: the mean and variance within a few float32 ulps), attention's keys and values in smaller
    query blocks (softmax sums a few ulps apart) and the convolutions' kernels on other shapes (accumulation order):
    each a few float32 ulps (6e-8) relative per layer, carried through the decoder's few dozen normalised layers,
    well below 1e-5 of the output's range; measured per class in docs/performance.md."""
    decoder = getattr(vae, "decoder", None)
    if not isinstance(decoder, nn.Module):
        return f"{type(vae).__name__} has no decoder module"
    world = dist.get_world_size(group)
    reason = _probe(vae, group, world)
    if reason is None:
        decoder.forward = _split_forward(decoder.forward, group, world)
    vae._hsdp_whole_reason = reason
    return reason


def _split_forward(forward: Callable, group: dist.ProcessGroup | None, world: int) -> Callable:
    @functools.wraps(forward)
    def call(*args, **kwargs):
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.ndim < 4 or x.shape[_SPLIT] < world * _MIN_ROWS:
            return forward(*args, **kwargs)
        rows = _rows(x.shape[_SPLIT], world)
        start, end = rows[dist.get_rank(group)]
        mode = _RowSplit(group, rows)
        call.splits += 1
        with mode:
            out = forward(x.narrow(_SPLIT, start, end - start), *args[1:], **kwargs)
        if isinstance(out, tuple):  # (sample, the causal cache it hands on: this rank's rows)
            return (_gather_padded(out[0], _SPLIT, mode._sizes(out[0].shape[_SPLIT]), group), *out[1:])
        return _gather_padded(out, _SPLIT, mode._sizes(out.shape[_SPLIT]), group)

    call.splits = 0
    """Decoder calls run split (the rest were too small)."""
    return call


def _probe(vae: nn.Module, group, world: int) -> str | None:
    """Why the split cannot stand for ``vae`` (see :func:`enable_exact_split`), or None: a latent of ``world`` x
    ``_MIN_ROWS`` rows decoded whole and split on every rank, compared, the verdict agreed by all. It runs in
    float32 (a copy of a VAE in another dtype), where the bound can tell a layer that mixes rows from rounding."""
    import copy
    import inspect

    if next(vae.parameters()).dtype != torch.float32:
        vae = copy.deepcopy(vae).float()
    decoder = vae.decoder
    split = _split_forward(decoder.forward, group, world)
    conv = next((m for m in decoder.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))), None)
    if conv is None:
        return f"{type(decoder).__name__} has no convolution to size a probe latent from"
    param = next(vae.parameters())
    extra = {"temb": torch.zeros(1, device=param.device)} if "temb" in inspect.signature(vae.decode).parameters else {}
    tiling, vae.use_tiling = getattr(vae, "use_tiling", False), False
    reason, diff = None, torch.zeros(2, dtype=torch.float64, device=param.device)
    try:
        with torch.no_grad():
            latent, whole = _probe_latent(vae, conv, world, param, extra)
            with _child_forward(decoder, split):
                parts = _sample(vae.decode(latent, **extra))
        diff[0] = ((parts - whole).abs().max() / whole.abs().max().clamp_min(1e-12)).item()
    except Unsplittable as exc:
        reason, diff[1] = str(exc), 1.0
    except Exception as exc:  # noqa: BLE001 - a probe the class's own decode refuses: it decodes whole
        reason, diff[1] = f"the probe decode failed ({type(exc).__name__}: {exc})", 1.0
    finally:
        vae.use_tiling = tiling
    dist.all_reduce(diff, dist.ReduceOp.MAX, group)
    if reason is None and diff[1] > 0:
        reason = "another rank's probe failed"
    if reason is None and diff[0] > _EXACT_RTOL:
        reason = (f"a layer reads rows the split does not exchange: the probe's split decode is {diff[0].item():.1e} "
                  f"of the output's range from the whole one (bound {_EXACT_RTOL:g})")  # fmt: skip
    return reason


def _probe_latent(vae: nn.Module, conv: nn.Module, world: int, param: torch.Tensor, extra: dict) -> tuple:
    """A latent ``vae`` decodes (its first convolution's channels; a video of 2 latent frames, of 1, or an image,
    the image first where that convolution is 2-D) and its whole decode."""
    frames = ((2,), (1,), ()) if conv.weight.ndim == 5 else ((), (1,), (2,))
    for shape in frames:
        latent = torch.randn((1, conv.in_channels, *shape, world * _MIN_ROWS, 8),
                             generator=torch.Generator().manual_seed(0)).to(param.device, param.dtype)  # fmt: skip
        try:
            return latent, _sample(vae.decode(latent, **extra))
        except Exception:  # noqa: BLE001 - another kind of latent, else the last error
            if shape is frames[-1]:
                raise
    raise AssertionError("unreachable")


def _sample(output) -> torch.Tensor:
    """The tensor of a decode's output, whichever of diffusers' output types."""
    if isinstance(output, torch.Tensor):
        return output
    return _sample(output[0] if isinstance(output, tuple) else output.sample)
