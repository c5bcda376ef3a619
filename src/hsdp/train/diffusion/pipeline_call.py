"""The denoiser's training inputs, made by the pipeline's own ``__call__``: no per-family code.

A diffusers pipeline builds its denoiser's call in code: packed latents (FLUX, Qwen-Image, LTX), position ids and
rotary embeddings, attention masks, a distilled guidance embedding, added conditioning (SDXL), a list of per-sample
tensors (Z-Image), zero condition channels concatenated to the latents, a timestep per token (Wan 2.2's
``expand_timesteps``), the timestep as a fraction or reversed (``1 - t / 1000``: Lumina 2, Z-Image) and a negated
prediction. Training needs the same call with noised latents and a sampled timestep, so it is recorded from the
pipeline itself rather than written again per family:

* **Captions** (:func:`encode_captions`): ``__call__`` runs with the frozen encoders until its first denoiser call,
  and every return of its encoding methods on the way is kept (:func:`encoding_methods`: ``encode_prompt`` and the
  other ``encode_*`` methods ``__call__`` calls, such as Stable Audio's ``encode_duration``, whose projection of the
  audio's start and end seconds conditions the denoiser beside the caption) (so ``encode_prompt`` is called as ``__call__`` calls it,
  with any number of encoders and masks). What varies per caption (tensors with a row per prompt, or lists with an
  item per prompt) is stored per item; the rest (FLUX's text ids) is the same for every caption
  (:class:`PromptLayout`, read from calls on three captions and on two: the captions' dimension is the one of size 3,
  then 2).
* **The denoiser's call** (:class:`DenoiserCalls`): per micro-batch, ``__call__`` runs again, the encoders replaced
  by the batch's stored encodings and the denoisers by a stand-in that records the arguments it is called with;
  the pipeline's ``randn_tensor`` draws the initial latents (zeros here) and its scheduler gives a forced timestep.
  The recorded keyword arguments are the call, except the two inputs that training changes:

  - the latents: once per size, a pass whose initial latents are *probes* (each element its own index + 1) shows
    where each element of the VAE's latents lands in the denoiser's inputs (packing, permutation, lists, the
    latent part of concatenated channels) and, returning a probe from the stand-in, where each element of the
    denoiser's output lands in the prediction the pipeline gives its scheduler (unpacking, sign); scaling the
    pipeline applies for its sampler (``init_noise_sigma``, ``scale_model_input``) is left out, as training
    scripts leave it out;
  - the timestep: two passes at timesteps 250 and 750 give every element of every timestep-dependent input as
    ``a * t + b`` (``t / 1000``, ``1 - t / 1000``, a timestep per token), evaluated at each row's sampled ``t``.

The objective (noise, target, weights) stays in the VAE's latent layout (:mod:`.objective`), so the loss is that of
the unpacked prediction, as diffusers' training scripts compute it.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from hsdp.models.description import describe

__all__ = [
    "DenoiserBatch",
    "PromptLayout",
    "PaddingMask",
    "DenoiserCalls",
    "call_arguments",
    "encoding_methods",
    "replaced_encoders",
    "set_call_settings",
    "size_problem",
    "encode_captions",
    "prompt_layout",
    "batch_prompts",
    "pad_stack",
    "latent_dims",
    "vae_latents",
    "tensor_leaves",
    "replace_leaves",
    "runnable_pipeline",
]

DENOISERS = ("transformer", "transformer_2", "unet")
_T0, _T1 = 250, 750
"""The forced timesteps of the recording passes (exact in fp32, as are their images under ``t / 1000``)."""


@dataclass(frozen=True)
class DenoiserBatch:
    """One training micro-batch as the diffusion trainer holds it (on the training device)."""

    noisy: torch.Tensor
    """Noised latents as the VAE lays them out: ``[B, C, H, W]`` for image VAEs, ``[B, C, F, H, W]`` for video."""
    timesteps: torch.Tensor
    """``[B]`` on the scheduler's training scale (0 .. ``num_train_timesteps``)."""
    prompts: dict[str, Any]
    """The captions' encodings batched (:func:`batch_prompts`)."""
    size: tuple[int, int]
    """The batch's pixel height and width (its size bucket)."""
    frames: int = 1


class _Stop(Exception):
    """Ends a recording pass where it has what it needs (the denoiser's call, or the scheduler's step)."""


# --- the pipeline's __call__ arguments ---------------------------------------------------------------------------

_SETTINGS = "_hsdp_call_settings"


def set_call_settings(pipe, **settings: Any) -> None:
    """``__call__`` arguments a run sets for every pass of ``pipe`` (``max_sequence_length`` from
    ``--max-sequence-length``); None leaves the pipeline's default. Kept on the pipeline, as every pass (the captions',
    the denoiser call's, the size check's) must call it alike."""
    pipe.__dict__[_SETTINGS] = {name: value for name, value in settings.items() if value is not None}



def call_arguments(pipe, prompts: list[str], size: tuple[int, int], frames: int, seconds: float | None = None) -> dict:
    """``__call__``'s arguments for one denoising step of ``prompts`` at ``size`` x ``frames`` without classifier-free
    guidance (training conditions on the caption alone): the CFG scale at 1 (``true_cfg_scale`` where the pipeline
    has it, FLUX's ``guidance_scale`` being a distilled embedding that keeps its default), latents out. ``seconds``:
    an audio item's length, as the pipeline's audio length argument (``audio_end_in_s``); None: its default."""
    from hsdp.engine.model_info import AUDIO_LENGTH_PARAMS

    params = inspect.signature(type(pipe).__call__).parameters
    args: dict[str, Any] = {"prompt": prompts, "num_inference_steps": 1, "output_type": "latent"}
    if "height" in params and "width" in params:
        args["height"], args["width"] = size
    if "num_frames" in params:
        args["num_frames"] = frames
    length = next((n for n in AUDIO_LENGTH_PARAMS if n in params), None)
    if seconds is not None and length is not None:
        args[length] = seconds
    if "use_resolution_binning" in params:  # the item's size as it is (SANA, PixArt would snap it to a bin)
        args["use_resolution_binning"] = False
    cfg = "true_cfg_scale" if "true_cfg_scale" in params else "guidance_scale"
    if cfg in params:  # a pipeline guided by a guider component takes neither (:func:`_unguided`)
        args[cfg] = _no_guidance(type(pipe)) if cfg == "guidance_scale" else 1.0
    for name in params:  # a second stream's own scale (LTX-2's audio_guidance_scale) turns guidance on too
        if name.endswith("_guidance_scale") and name != cfg and cfg == "guidance_scale":
            args[name] = args[cfg]
    if pipe.config.get("boundary_ratio") is not None:  # Wan 2.2's second expert has its own scale
        args["guidance_scale_2"] = 1.0
    args |= {name: value for name, value in pipe.__dict__.get(_SETTINGS, {}).items() if name in params}
    return args


_ANY_SIZE = (1536, 1536)
"""A size every pipeline's own checks take (a multiple of every VAE factor and patch), to tell a refused size from
arguments :func:`size_problem` guessed wrong."""


def size_problem(pipe, size: tuple[int, int], frames: int) -> str | None:
    """The pipeline's own message refusing ``size`` x ``frames`` (LTX: "`height` and `width` have to be divisible by
    32"), from its ``check_inputs`` called with the arguments ``__call__`` passes for a training step (the rest at
    ``__call__``'s defaults), or None. Read before ranks start, where the recording of the call would raise it on
    every rank after loading. A check that fails at a size every pipeline takes as well speaks of the guessed
    arguments, not of the size: None then (the recording names it)."""
    check = getattr(pipe, "check_inputs", None)
    if check is None:
        return None

    def problem(at: tuple[int, int]) -> str | None:
        try:
            check(**_check_arguments(pipe, check, at, frames))
        except ValueError as exc:
            return str(exc)
        except Exception:  # an argument this guess does not make (a pipeline's own check of other inputs)
            return None
        return None

    found = problem(size)
    return found if found is not None and problem(_ANY_SIZE) is None else None


def _check_arguments(pipe, check: Callable, size: tuple[int, int], frames: int) -> dict:
    """``check_inputs``'s arguments as ``__call__`` passes them for one training step: the step's own
    (:func:`call_arguments`), else ``__call__``'s default of that name, else its own default, else None."""
    ours = call_arguments(pipe, [""], size, frames)
    defaults = {n: p.default for n, p in inspect.signature(type(pipe).__call__).parameters.items()
                if p.default is not inspect.Parameter.empty}  # fmt: skip
    arguments = {}
    for name, param in inspect.signature(check).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name in ours or name in defaults:
            arguments[name] = ours.get(name, defaults.get(name))
        elif param.default is inspect.Parameter.empty:
            arguments[name] = None
    return arguments


@contextmanager
def _default_size(pipe, size: tuple[int, int]) -> Iterator[None]:
    """The pipeline's default size (``default_sample_size`` latents of ``vae_scale_factor`` pixels) made ``size``'s
    area for the pass: pipelines use it for a missing height or width, except HiDream's, which rescales every
    requested size to the default's area (1024 x 1024 for HiDream-I1), where its training script trains at the
    dataset's resolution."""
    saved, factor = getattr(pipe, "default_sample_size", None), getattr(pipe, "vae_scale_factor", None)
    if not isinstance(saved, int) or not factor:
        yield
        return
    side = math.sqrt(size[0] * size[1]) / factor  # exact for square sizes
    # Otherwise a hair above the area's square root: HiDream floors each side times sqrt(default area / area) to
    # its division, so a root rounded down (32 x 48: scale 0.99999...) would floor a whole division off each side.
    pipe.default_sample_size = int(side) if side.is_integer() else side * (1 + 1e-9)
    try:
        yield
    finally:
        pipe.default_sample_size = saved


def _meta_denoisers(pipe, model_dir: Path) -> dict:
    """Meta-device models of the pipeline's denoisers, built from their configs in fp32 once per pipeline
    (``__call__`` reads their configs and dtype)."""
    from hsdp.planning.profile import build_meta_model

    cached = pipe.__dict__.get("_hsdp_meta_denoisers")
    if cached is None:
        names = [n for n in DENOISERS if (Path(model_dir) / n / "config.json").is_file()]
        cached = {n: build_meta_model(Path(model_dir) / n, torch.float32)[0] for n in names}
        pipe.__dict__["_hsdp_meta_denoisers"] = cached
    return cached


class _StandIn:
    """A denoiser's stand-in: its attributes are the meta model's (config, dtype, ``cache_context``), its calls go
    to ``forward(model, arguments)``, positional arguments named. Not a module, so a call runs no module hooks
    (a memory tracker's, a profiler's), which an unfinished call would leave unbalanced."""

    def __init__(self, model: torch.nn.Module, forward: Callable):
        self._model, self._forward = model, forward
        self._signature = inspect.signature(type(model).forward)

    def __call__(self, *args, **kwargs):
        bound = self._signature.bind(self._model, *args, **kwargs).arguments
        bound.pop("self", None)
        extra = next((n for n, p in self._signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
        bound |= bound.pop(extra, {}) if extra else {}
        bound.pop("return_dict", None)
        return self._forward(self._model, bound)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def _returns_like(model: torch.nn.Module, arguments: dict, made: torch.Tensor) -> tuple:
    """What the denoiser returns (``return_dict=False``) on ``arguments``, with ``made`` as its first tensor: a
    joint denoiser returns one tensor per stream (LTX-2: video, audio), which its pipeline unpacks; the others are
    zeros of their shapes, read from a forward of the meta model. A model whose meta forward fails returns one
    tensor, as most do."""
    on_meta = replace_leaves(arguments, {p: t.to("meta") for p, t in tensor_leaves(arguments)})
    try:
        with torch.no_grad():
            returned = model(**on_meta, return_dict=False)
    except Exception:  # noqa: BLE001 - a forward that cannot run on meta: the one-tensor return
        return (made,)
    if not (isinstance(returned, tuple) and len(returned) > 1 and all(isinstance(t, torch.Tensor) for t in returned)):
        return (made,)  # one return (a tensor, or Z-Image's list of per-row tensors)
    return (made, *(torch.zeros(t.shape, dtype=made.dtype, device=made.device) for t in returned[1:]))


@contextmanager
def _unguided(pipe) -> Iterator[None]:
    """The pipeline's guider component (diffusers' ``BaseGuidance``, which HunyuanVideo 1.5 guides with instead of
    a ``guidance_scale`` argument) disabled for the pass: one conditional call of the denoiser, its prediction as
    it is."""
    guider = getattr(pipe, "guider", None)
    if not getattr(guider, "_enabled", False):
        yield
        return
    guider.disable()
    try:
        yield
    finally:
        guider.enable()


def _no_guidance(pipeline_class: type) -> float:
    """The ``guidance_scale`` that turns classifier-free guidance off, asked of the pipeline's own
    ``do_classifier_free_guidance`` (``scale > 1`` for most, ``scale > 0`` for Z-Image); 1 where it has none."""
    rule = getattr(pipeline_class, "do_classifier_free_guidance", None)
    params = inspect.signature(pipeline_class.__call__).parameters
    names = ["guidance_scale", *(n for n in params if n.endswith("_guidance_scale"))]  # LTX-2 reads its audio one
    for scale in (1.0, 0.0):
        try:
            if not isinstance(rule, property) or not rule.fget(SimpleNamespace(**{f"_{n}": scale for n in names})):
                return scale
        except AttributeError:  # the rule reads more than the scale
            return 1.0
    return 1.0


@contextmanager
def _stand_ins(pipe, model_dir: Path, forward: Callable) -> Iterator[None]:
    """The pipeline's denoisers replaced by :class:`_StandIn` s of meta models whose calls go to
    ``forward(model, arguments)`` (the keyword arguments of the denoiser's ``forward``): the real ones are not
    run. Set as plain attributes: the pipeline's config (what it saves) is left alone."""
    meta = _meta_denoisers(pipe, model_dir)
    saved = {name: pipe.__dict__.get(name) for name in meta}
    for name, model in meta.items():
        object.__setattr__(pipe, name, _StandIn(model, forward))
    try:
        yield
    finally:
        for name, value in saved.items():
            object.__setattr__(pipe, name, value)


def _stop(model, arguments):
    raise _Stop(arguments)


# --- captions -----------------------------------------------------------------------------------------------------


def encoding_methods(pipeline_class: type) -> tuple[str, ...]:
    """The pipeline's encoding methods whose returns the trainer records and replays: ``encode_prompt`` and every
    other ``encode_*`` method its ``__call__`` calls (Stable Audio's ``encode_duration``: the seconds conditioning,
    computed by a frozen projection model). Those a training pass does not call (an IP-Adapter's ``encode_image``)
    record nothing."""
    try:
        source = inspect.getsource(pipeline_class.__call__)
    except (OSError, TypeError):
        source = ""
    called = re.findall(r"self\.(encode_\w+)\(", source)
    return tuple(n for n in dict.fromkeys(["encode_prompt", *called]) if callable(getattr(pipeline_class, n, None)))


@contextmanager
def replaced_encoders(pipe, make: Callable[[str, Callable], Callable]) -> Iterator[None]:
    """Each of :func:`encoding_methods` replaced on ``pipe`` by ``make(name, original)`` for the block (instance
    attributes, deleted after: the class's methods again)."""
    names = encoding_methods(type(pipe))
    for name in names:
        setattr(pipe, name, make(name, getattr(pipe, name)))
    try:
        yield
    finally:
        for name in names:
            pipe.__dict__.pop(name, None)


def replaying(returns: list, convert: Callable = lambda value: value) -> Callable[[str, Callable], Callable]:
    """A ``make`` for :func:`replaced_encoders`: every encoding method returns the next of ``returns`` (in the
    order ``__call__`` called them when they were recorded), through ``convert``, whatever it is asked."""
    replay = iter(returns)
    return lambda name, original: lambda *args, **kwargs: convert(next(replay))


def recording(recorded: list, methods: list | None = None) -> Callable[[str, Callable], Callable]:
    """A ``make`` for :func:`replaced_encoders`: every encoding method's return appended to ``recorded`` (and its
    name to ``methods``)."""

    def make(name: str, original: Callable) -> Callable:
        def record(*args, **kwargs):
            recorded.append(original(*args, **kwargs))
            if methods is not None:
                methods.append(name)
            return recorded[-1]

        return record

    return make



@dataclass(frozen=True)
class Rows:
    """A tensor with a row per caption along ``dim`` (0 for most; 1 for HiDream's Llama 3 hidden states, stacked
    ``[layers, captions, tokens, width]``)."""

    dim: int = 0


@dataclass(frozen=True)
class PaddingMask:
    """A position ``encode_prompt`` fills only for captions of different lengths (Qwen-Image's mask, None when every
    token counts): the padding mask of its call's first ``"rows"`` tensor, made per batch (:func:`batch_prompts`)."""

    dtype: torch.dtype


@dataclass(frozen=True)
class PromptLayout:
    """How ``__call__``'s ``encode_prompt`` returns are laid out: per call, whether it returns a tuple and, per
    position, :class:`Rows` (a tensor with a row per caption), ``"list"`` (an item per caption), a
    :class:`PaddingMask` or a value the same for every caption (kept here: None, FLUX's text ids, an empty list)."""

    calls: tuple[tuple[bool, tuple[Any, ...]], ...]
    methods: tuple[str, ...] = ()
    """The encoding method of each call (:func:`encoding_methods`); empty in layouts recorded before it was kept,
    when every call was ``encode_prompt``'s."""

    def caption_names(self, names) -> list[str]:
        """Those of ``names`` (``prompt.<call>.<position>``) that ``encode_prompt`` returned: what a dropped caption
        replaces (the others, Stable Audio's seconds conditioning, are the item's whatever its caption)."""
        return [n for n in names if not self.methods or self.methods[int(n.split(".")[1])] == "encode_prompt"]

    def names(self) -> Iterator[tuple[str, str]]:
        """``(name, kind)`` of every per-caption value: ``prompt.<call>.<position>``."""
        for c, (_, positions) in enumerate(self.calls):
            for p, kind in enumerate(positions):
                if isinstance(kind, Rows) or kind == "list":
                    yield f"prompt.{c}.{p}", kind

    def masks(self) -> Iterator[tuple[str, torch.dtype, str, int]]:
        """``(name, dtype, padded, dim)`` of every :class:`PaddingMask`: ``padded`` names the rows it masks, ``dim``
        their tokens' dimension in an item."""
        for c, (_, positions) in enumerate(self.calls):
            for p, kind in enumerate(positions):
                if isinstance(kind, PaddingMask):
                    padded = next(q for q, other in enumerate(positions) if isinstance(other, Rows))
                    yield f"prompt.{c}.{p}", kind.dtype, f"prompt.{c}.{padded}", positions[padded].dim

    def returns(self, batch: dict[str, Any], device: torch.device) -> list:
        """The ``encode_prompt`` returns of a batch of captions (:func:`batch_prompts`), in call order."""
        out = []
        for c, (is_tuple, positions) in enumerate(self.calls):
            values = tuple(
                batch.get(f"prompt.{c}.{p}") if _per_caption(kind) else _to(kind, device)
                for p, kind in enumerate(positions)
            )
            out.append(values if is_tuple else values[0])
        return out


def _per_caption(kind: Any) -> bool:
    return isinstance(kind, (Rows, PaddingMask)) or (isinstance(kind, str) and kind == "list")


def _kind(three: Any, two: Any) -> Any:
    """The kind of a position returned for three captions as ``three`` and for two as ``two``: the caption
    dimension is the one of size 3, then 2 (not the first one of the captions' count: Llama 3's layers lead)."""
    if isinstance(three, torch.Tensor) and isinstance(two, torch.Tensor) and three.dim() == two.dim():
        dim = next((d for d in range(three.dim()) if (three.shape[d], two.shape[d]) == (3, 2)), None)
        if dim is not None:
            return Rows(dim)
    if all(isinstance(v, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in v) for v in (three, two)) \
            and (len(three), len(two)) == (3, 2):
        return "list"
    return _to(three, torch.device("cpu"))


def _record_encodings(
    pipe,
    model_dir: Path,
    captions: list[str],
    size: tuple[int, int],
    frames: int,
    seconds: float | None = None,
    methods: list | None = None,
) -> list:
    """Every return of the encoding methods (:func:`encoding_methods`) of ``__call__`` on ``captions`` up to its
    first denoiser call, in call order (collective when the encoders are sharded: every rank runs it); their names
    appended to ``methods``."""
    recorded: list = []
    pipe.set_progress_bar_config(disable=True)
    try:
        with replaced_encoders(pipe, recording(recorded, methods)), _stand_ins(pipe, model_dir, _stop), _unguided(pipe), \
                _default_size(pipe, size), torch.no_grad():
            pipe(**call_arguments(pipe, captions, size, frames, seconds))
    except _Stop:
        pass
    if not recorded:
        raise ValueError(f"{type(pipe).__name__}.__call__ reaches its denoiser without calling encode_prompt")
    return recorded


def _positions(returned) -> tuple:
    return returned if isinstance(returned, tuple) else (returned,)


_UNEVEN = ["", "a caption of several words"]


def prompt_layout(pipe, model_dir: Path, size: tuple[int, int], frames: int) -> PromptLayout:
    """The layout of ``pipe``'s caption encodings, read from calls on three empty captions and on two of different
    lengths: a position that is None for the first and rows for the second is a :class:`PaddingMask`."""
    methods: list[str] = []
    even = _record_encodings(pipe, model_dir, ["", "", ""], size, frames, methods=methods)
    uneven = _record_encodings(pipe, model_dir, _UNEVEN, size, frames)
    calls = []
    for r, u in zip(even, uneven, strict=True):
        kinds = []
        for v, w in zip(_positions(r), _positions(u), strict=True):
            kind = _kind(v, w)
            mask = v is None and isinstance(w, torch.Tensor) and w.dim() > 0 and w.shape[0] == 2
            kinds.append(PaddingMask(w.dtype) if mask else kind)
        calls.append((isinstance(r, tuple), tuple(kinds)))
    # Only where another method encodes too: a layout of encode_prompt calls alone stays as it was recorded before.
    named = tuple(methods) if set(methods) != {"encode_prompt"} else ()
    return PromptLayout(tuple(calls), named)


def encode_captions(
    pipe,
    model_dir: Path,
    layout: PromptLayout,
    captions: list[str],
    size: tuple[int, int],
    frames: int,
    seconds: float | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Each caption's encodings (``prompt.<call>.<position>`` -> its row, on the CPU, embeddings in fp32), from the pipeline's
    ``encode_prompt`` (and its other encoding methods) as its ``__call__`` calls it; ``seconds``: an audio item's
    length (:func:`call_arguments`)."""
    recorded = [_positions(r) for r in _record_encodings(pipe, model_dir, captions, size, frames, seconds)]
    items: list[dict[str, torch.Tensor]] = [{} for _ in captions]
    for name, kind in layout.names():
        c, p = (int(i) for i in name.split(".")[1:])
        for row, item in enumerate(items):
            value = recorded[c][p]
            item[name] = _fp32(value.select(kind.dim, row) if isinstance(kind, Rows) else value[row]).cpu()
    return items


def _fp32(tensor: torch.Tensor) -> torch.Tensor:
    """Embeddings in fp32 (the trainer's autocast casts them as the model computes); masks and ids as they are."""
    return tensor.float() if tensor.is_floating_point() else tensor


def batch_prompts(layout: PromptLayout, items: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """One micro-batch's caption encodings: rows stacked (zero-padded to the longest, masks included), list items
    listed, and each :class:`PaddingMask` where the rows it masks were padded (absent where none was, as the
    pipeline gives None then): what ``encode_prompt`` returns for the batch's captions together."""
    kinds = dict(layout.names())
    batch = {
        name: pad_stack([i[name] for i in items], kind.dim) if isinstance(kind, Rows) else [i[name] for i in items]
        for name, kind in kinds.items()
    }
    for name, dtype, padded, dim in layout.masks():
        lengths = torch.tensor([i[padded].shape[dim] for i in items])
        if (lengths != lengths[0]).any():
            batch[name] = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).to(dtype)
    return batch


def pad_stack(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Stack along ``dim``, zero-padding each tensor's dimension ``dim`` (its tokens) to the longest (most encoders
    give fixed lengths; Qwen's do not)."""
    if all(t.dim() == 0 for t in tensors):
        return torch.stack(tensors)
    length = max(t.shape[dim] for t in tensors)
    return torch.stack([F.pad(t, (0, 0) * (t.dim() - 1 - dim) + (0, length - t.shape[dim])) for t in tensors], dim)


def _to(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


# --- latents ------------------------------------------------------------------------------------------------------


def latent_dims(vae) -> int:
    """2 for an image VAE (``[B, C, H, W]``), 3 for one that convolves in time (``[B, C, F, H, W]``: Wan, LTX,
    CogVideoX, Qwen-Image's)."""
    return 3 if any(isinstance(m, torch.nn.Conv3d) for m in vae.modules()) else 2


def _statistic(vae, name: str):
    value = vae.config.get(name)
    if value is None:
        value = dict(vae.named_buffers(recurse=False)).get(name)  # LTX keeps them as buffers
    return None if value is None else torch.as_tensor(value, dtype=torch.float32).cpu()


@torch.no_grad()
def vae_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """``[C, F, H, W]`` pixels, or a ``[channels, samples]`` waveform for an audio VAE (on the VAE's device) -> one
    item's normalised latents (the mode of the posterior,
    as diffusers' training scripts take it; DC-AE's deterministic ``latent``), ``[C, F', H', W']`` for a video VAE,
    ``[C, H', W']`` for an image one. Normalised with the VAE's own statistics, as its pipelines do before
    decoding, inverted: ``((x - latents_mean) / latents_std - shift_factor) * scaling_factor``, each where the
    VAE has it."""
    if pixels.dim() == 2:  # a waveform [channels, samples] (an audio VAE: Oobleck)
        video = pixels[None]
    else:
        video = pixels[None] if latent_dims(vae) == 3 else pixels[None, :, 0]
    encoded = vae.encode(video)
    output = encoded[0] if isinstance(encoded, tuple) else encoded
    dist = getattr(output, "latent_dist", None)
    latents = (dist.mode() if dist is not None else output.latent).cpu().float()
    mean, std = _statistic(vae, "latents_mean"), _statistic(vae, "latents_std")
    if mean is not None and std is not None:
        shape = (1, -1) + (1,) * (latents.dim() - 2)
        latents = (latents - mean.view(shape)) / std.view(shape)
    shift = vae.config.get("shift_factor")
    if shift:
        latents = latents - shift
    scale = vae.config.get("scaling_factor")
    if scale is not None and scale != 1.0:
        latents = latents * scale
    return latents[0]


# --- the denoiser's call ------------------------------------------------------------------------------------------


def tensor_leaves(value, path=()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """``(path, tensor)`` of every tensor in nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from tensor_leaves(item, (*path, key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from tensor_leaves(item, (*path, i))


def replace_leaves(value, new: dict, path=()):
    """``value`` with the tensors at the paths of ``new`` replaced."""
    if path in new:
        return new[path]
    if isinstance(value, dict):
        return {k: replace_leaves(v, new, (*path, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(replace_leaves(v, new, (*path, i)) for i, v in enumerate(value))
    return value


def _probe_indices(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Probe elements ``c * (index + 1)`` -> (index, sign of c) with ``|c|`` the smallest magnitude (index 0 is
    always there): the pipeline's own scaling of the probe read off and left out."""
    scale = values.abs().min()
    ratio = (values.double() / scale.double()).abs()
    index = ratio.round().long() - 1
    if (ratio - ratio.round()).abs().max() > 1e-3:
        raise ValueError("the pipeline transforms its latents beyond packing and a scale, which the trainer cannot read")
    return index, torch.sign(values)


@dataclass(frozen=True)
class _Layout:
    """Where the VAE's latents go in, and the prediction comes out, for one batch shape."""

    latent_leaves: dict[tuple, tuple[torch.Tensor, torch.Tensor]]
    """path -> (flat positions in the leaf, flat indices into the VAE-layout batch)."""
    time_leaves: dict[tuple, tuple[torch.Tensor, torch.Tensor]]
    """path -> (a, b) in float64: the leaf is ``a * t + b``."""
    output_index: torch.Tensor
    """VAE-layout flat index -> flat index into the denoiser's output (its tensors flattened in order)."""
    output_sign: torch.Tensor
    output_shapes: list[tuple[int, ...]]
    """The shapes of the output's tensors that the pipeline's call path reads."""


class DenoiserCalls:
    """Builds the trained denoiser's call on a :class:`DenoiserBatch` from the pipeline's ``__call__`` (module
    docstring). One per trainer (or planner); the pipeline it runs has no weights: encoders and VAE on meta (their
    configs and dtypes are read), the scheduler from its config."""

    def __init__(self, meta_pipe, model_dir: Path, layout: PromptLayout, device: torch.device):
        self.model_dir = Path(model_dir)
        self.layout = layout
        self.device = torch.device(device)
        self.pipe = runnable_pipeline(meta_pipe, self.model_dir, self.device)
        self._layouts: dict[tuple, _Layout] = {}

    def kwargs(self, batch: DenoiserBatch) -> tuple[dict, Callable[[Any], torch.Tensor]]:
        """``(keyword arguments, to_latents)``: the denoiser's call on ``batch`` (``return_dict=False`` is the
        caller's) and the map of its output (``[0]`` of the return) to the layout of ``batch.noisy``."""
        key = (tuple(batch.noisy.shape), batch.size, batch.frames)
        if key not in self._layouts:
            self._layouts[key] = self._read_layout(batch)
        found = self._layouts[key]
        recorded = self._record(batch, torch.zeros_like(batch.noisy), _T0)
        new = {}
        flat = batch.noisy.reshape(-1)
        leaves = dict(tensor_leaves(recorded))
        for path, (positions, indices) in found.latent_leaves.items():
            leaf = leaves[path].detach().clone(memory_format=torch.contiguous_format)
            leaf.view(-1)[positions] = flat[indices].to(leaf.dtype)
            new[path] = leaf
        for path, (a, b) in found.time_leaves.items():
            leaf = leaves[path]
            t = batch.timesteps.double().view(-1, *([1] * a.dim()))  # a, b: one row's
            dtype = leaf.dtype if leaf.is_floating_point() else batch.timesteps.dtype
            new[path] = (a * t + b).to(dtype)
        kwargs = replace_leaves(recorded, new)

        def to_latents(output) -> torch.Tensor:
            shapes = [tuple(t.shape) for _, t in tensor_leaves(output)]
            if shapes != found.output_shapes:  # the same elements in another layout would be a silently wrong loss
                raise ValueError(
                    f"{type(self.pipe).__name__}'s denoiser returns tensors of shapes {shapes} in training, "
                    f"where the pipeline's call reads {found.output_shapes}: a training-mode layout that hsdp cannot "
                    "map to the latents (a family file's training_config loads the denoiser as its training script does)"
                )
            out = torch.cat([t.reshape(-1) for _, t in tensor_leaves(output)])
            return (out[found.output_index] * found.output_sign.to(out.dtype)).view(batch.noisy.shape)

        return kwargs, to_latents

    def _record(self, batch: DenoiserBatch, latents: torch.Tensor, timestep: int, output=None) -> Any:
        """One pass of ``__call__``: the denoiser's arguments, or (with ``output``: what the stand-in returns) the
        scheduler step's ``(model_output, sample)``."""
        pipe = self.pipe
        rows = batch.noisy.shape[0]
        returns = self.layout.returns(batch.prompts, self.device)

        def forward(model, arguments):
            if output is None:
                raise _Stop(arguments)
            return _returns_like(model, arguments, output(arguments))

        scheduler = pipe.scheduler
        original_step, original_set = scheduler.step, scheduler.set_timesteps

        @functools.wraps(original_step)  # pipelines read the signatures (``eta``, ``sigmas``)
        def step(*args, **kwargs):
            bound = inspect.signature(original_step).bind(*args, **kwargs).arguments
            raise _Stop((bound["model_output"], bound["sample"]))

        @functools.wraps(original_set)
        def set_timesteps(*args, **kwargs):
            original_set(*args, **kwargs)
            scheduler.timesteps = torch.full_like(scheduler.timesteps, timestep)

        scheduler.step, scheduler.set_timesteps = step, set_timesteps
        args = call_arguments(pipe, [""] * rows, batch.size, batch.frames)
        try:
            with replaced_encoders(pipe, replaying(returns)), _stand_ins(pipe, self.model_dir, forward), \
                    _initial_latents(type(pipe), latents), _unguided(pipe), _default_size(pipe, batch.size), \
                    torch.no_grad():
                pipe(**args)
        except _Stop as stop:
            return stop.args[0]
        finally:
            del scheduler.step, scheduler.set_timesteps
        raise ValueError(f"{type(pipe).__name__}.__call__ finished without calling its denoiser")

    def _read_layout(self, batch: DenoiserBatch) -> _Layout:
        zeros = torch.zeros_like(batch.noisy)
        probe = torch.arange(1, batch.noisy.numel() + 1, dtype=torch.float32, device=batch.noisy.device)
        probe = probe.view(batch.noisy.shape)
        base = dict(tensor_leaves(self._record(batch, zeros, _T0)))
        later = dict(tensor_leaves(self._record(batch, zeros, _T1)))
        time_leaves = {}
        for path, leaf in base.items():
            if not torch.equal(leaf, later[path]):
                v0, v1 = leaf.double(), later[path].double()
                a = (v1 - v0) / (_T1 - _T0)
                time_leaves[path] = (a[0] if a.dim() else a, (v0 - a * _T0)[0] if a.dim() else v0 - a * _T0)
        latent_leaves, shapes, returned = {}, {}, []

        def output(arguments):
            probed = dict(tensor_leaves(arguments))
            changed = {path: leaf != base[path] for path, leaf in probed.items()}
            changed = {path: mask for path, mask in changed.items() if mask.any()}
            positions = {path: mask.reshape(-1).nonzero().flatten() for path, mask in changed.items()}
            values = [probed[path].reshape(-1)[where] for path, where in positions.items()]
            if values:  # one scale for every leaf (Z-Image lists a tensor per row)
                index, _ = _probe_indices(torch.cat(values))
                for path, part in zip(positions, index.split([len(v) for v in values]), strict=True):
                    latent_leaves[path] = (positions[path], part)
                    shapes[path] = _bounding_shape(changed[path])
            if not latent_leaves:
                raise ValueError("the pipeline's latents reach no input of its denoiser")
            tops = {path[0] for path in latent_leaves}
            if len(tops) != 1:
                raise ValueError(f"the pipeline passes its latents in several inputs ({sorted(tops)})")
            count = 0
            made = {}
            for path in sorted(latent_leaves, key=str):
                numel = int(torch.tensor(shapes[path]).prod())
                made[path] = torch.arange(count + 1, count + numel + 1, dtype=torch.float32).view(shapes[path])
                made[path] = made[path].to(self.device)
                count += numel
            top = tops.pop()
            returned.append(replace_leaves(arguments[top], {path[1:]: t for path, t in made.items()}))
            return returned[-1]

        model_output, sample = self._record(batch, probe, _T0, output=output)
        out_index, sign = _probe_indices(model_output.reshape(-1).float())
        vae_index, _ = _probe_indices(sample.reshape(-1).float())
        if sorted(vae_index.tolist()) != list(range(batch.noisy.numel())):
            raise ValueError("the pipeline's scheduler does not step on every latent element once")
        output_index = torch.empty_like(out_index)
        output_sign = torch.empty_like(sign)
        output_index[vae_index] = out_index
        output_sign[vae_index] = sign
        output_shapes = [tuple(t.shape) for _, t in tensor_leaves(returned[-1])]
        return _Layout(latent_leaves, time_leaves, output_index, output_sign, output_shapes)


def _bounding_shape(mask: torch.Tensor) -> tuple[int, ...]:
    """The shape of the smallest box holding every True of ``mask`` (the latent part of concatenated inputs)."""
    shape = []
    for dim in range(mask.dim()):
        other = tuple(d for d in range(mask.dim()) if d != dim)
        present = mask.any(dim=other) if other else mask
        where = present.nonzero().flatten()
        shape.append(int(where.max() - where.min() + 1))
    return tuple(shape)


@contextmanager
def _initial_latents(pipeline_class: type, latents: torch.Tensor) -> Iterator[None]:
    """The pipeline's ``randn_tensor`` gives ``latents`` (VAE layout, its dimensions matched to the shape asked
    for by size, equal sizes in order) where it draws the initial latents. Other draws come from a fixed seed, one
    row repeated, so every recording pass, rank and micro-batch layout gives the denoiser the same values: LTX-2's audio latents, the joint
    transformer's second stream, which a run on video media has no data for, are the pipeline's own initial noise."""
    modules = {sys.modules[c.__module__] for c in pipeline_class.__mro__ if hasattr(sys.modules[c.__module__], "randn_tensor")}
    originals = {m: m.randn_tensor for m in modules}
    original = next(iter(originals.values()))
    asked = []

    def randn_tensor(shape, *args, **kwargs):
        asked.append(tuple(int(s) for s in shape))
        order = _dims_order(tuple(latents.shape), asked[-1])
        if order is None:
            bound = inspect.signature(original).bind(shape, *args, **kwargs).arguments
            device = bound.get("device") or "cpu"
            bound["generator"] = torch.Generator(device=device).manual_seed(_OTHER_DRAWS_SEED)
            # One draw for every row: a row's values do not depend on how many rows this rank's micro-batch has.
            bound["shape"] = (1, *tuple(shape)[1:])
            return original(**bound).expand(tuple(shape)).contiguous()
        asked.append(None)
        dtype = kwargs.get("dtype") or latents.dtype
        return latents.permute(order).to(dtype=dtype)

    for module in modules:
        module.randn_tensor = randn_tensor
    try:
        yield
    except _Stop:
        if None not in asked:
            raise ValueError(
                f"{pipeline_class.__name__} draws initial latents of shape {asked or 'none'} with randn_tensor, "
                f"not the VAE's latents {tuple(latents.shape)} in some order: it takes sizes, or conditions, "
                "that the trainer does not build"
            ) from None
        raise
    finally:
        for module, fn in originals.items():
            module.randn_tensor = fn


_OTHER_DRAWS_SEED = 0
"""The seed of :func:`_initial_latents`' draws other than the latents."""


def _dims_order(have: tuple[int, ...], want: tuple[int, ...]) -> tuple[int, ...] | None:
    """The permutation of ``have``'s dimensions giving ``want`` (equal sizes kept in order), else None."""
    if len(have) != len(want) or sorted(have) != sorted(want):
        return None
    free = list(range(len(have)))
    order = []
    for size in want:
        dim = next(d for d in free if have[d] == size)
        free.remove(dim)
        order.append(dim)
    return tuple(order)


def runnable_pipeline(pipe, model_dir: Path, device: torch.device):
    """``pipe`` (encoders and VAE on meta: :func:`hsdp.train.diffusion.frozen.meta_pipeline`) with the scheduler
    from its config, executing on ``device`` (``_execution_device`` would otherwise be the meta modules')."""
    cls = type(pipe)
    recording = type(cls.__name__, (cls,), {"_execution_device": property(lambda self: device),
                                             "device": property(lambda self: device)})  # fmt: skip
    pipe.__class__ = recording
    scheduler = describe(model_dir).components.get("scheduler")
    if scheduler is not None:
        pipe.register_modules(scheduler=scheduler.cls().from_pretrained(scheduler.folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe
