"""LoRA files other tools read, written from (and read back into) the peft-keyed adapters of :mod:`hsdp.lora`.

Three formats, all from the gathered adapters only (:func:`hsdp.lora.adapter_state`), never the frozen base:

- ``peft``: an adapter folder (``adapter_config.json``, ``adapter_model.safetensors``), ``PeftModel`` and
  ``hsdp generate / serve --lora`` read it.
- ``diffusers``: a folder with ``pytorch_lora_weights.safetensors`` keyed ``<component>.<module>.lora_A.weight`` /
  ``lora_B.weight``, as ``<Pipeline>.save_lora_weights`` writes it in diffusers' training scripts
  (``get_peft_model_state_dict`` packed under the component's name). The LoRA config (r, ``lora_alpha``, targets)
  goes into the safetensors metadata under ``lora_adapter_metadata``, keys prefixed by the component
  (``training_utils._collate_lora_metadata``), which ``pipe.load_lora_weights(folder)`` turns back into the
  ``LoraConfig``: without it diffusers would assume ``lora_alpha == r``.
- ``comfyui``: the ``diffusion_model.``-keyed LoRA of ComfyUI and the single-GPU trainers (the original model's
  module names, ``lora_down`` / ``lora_up`` / ``alpha``), written as the inverse of the diffusers converter for the
  family (:attr:`hsdp.families.Family.comfyui_lora`), and checked by running that converter on the result before
  anything is written. A family without a converter is refused with the reason.

:func:`as_peft_folder` goes the other way for ``--lora`` / ``--lora-adapter``: a diffusers-format folder becomes a
peft adapter folder (converted once, cached by content). For ``--lora`` (inference) a single LoRA ``.safetensors``
file does too: kohya / musubi-tuner / ComfyUI / diffusers keys, read by the pipeline's own
``<Pipeline>.lora_state_dict`` (diffusers' converters for the family, so no key map is written here) and configured
as diffusers' ``load_lora_adapter`` configures it (``get_peft_kwargs``: ranks from the tensors, the file's alphas).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from hsdp.distributed import rank
from hsdp.exports import commit, staging_dir
from hsdp.lora_layouts import (
    LAYOUT_FORMATS,
    converted_state,
    layout_problem,
    probe_adapter,
    sample,
    single_file_lora,
)
from hsdp.lora_state import ADAPTER_WEIGHTS, adapter_state
from hsdp.sharding import unwrapped_class

if TYPE_CHECKING:
    from peft import LoraConfig

__all__ = [
    "FORMATS",
    "DIFFUSERS_WEIGHTS",
    "COMFYUI_WEIGHTS",
    "KOHYA_WEIGHTS",
    "save_lora",
    "format_problem",
    "diffusers_lora",
    "comfyui_lora",
    "as_peft_folder",
    "adapter_parts",
]

logger = logging.getLogger("hsdp")

FORMATS = ("peft", "diffusers", *LAYOUT_FORMATS)
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
COMFYUI_WEIGHTS = "lora.safetensors"
KOHYA_WEIGHTS = "lora.safetensors"  # each format into its own folder
_PEFT_PREFIX = "base_model.model."


def _module_keys(peft_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft adapter keys (``base_model.model.<module>.lora_A.weight``) -> ``<module>.lora_A.weight``."""
    return {k.removeprefix(_PEFT_PREFIX): v for k, v in peft_state.items()}


def _config_dict(config: LoraConfig) -> dict[str, Any]:
    """``LoraConfig.to_dict()`` made JSON-safe as diffusers' ``write_lora_layers`` does (sets become lists)."""
    out = config.to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}


def diffusers_lora(
    peft_state: dict[str, torch.Tensor], config: LoraConfig, component: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, safetensors metadata) of the diffusers format for ``component`` (``transformer``, ``unet``...)."""
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY

    tensors = {f"{component}.{k}": v for k, v in _module_keys(peft_state).items()}
    meta = {f"{component}.{k}": v for k, v in _config_dict(config).items()}
    return tensors, {"format": "pt", LORA_ADAPTER_METADATA_KEY: json.dumps(meta, indent=2, sort_keys=True)}


def _scaling(config: LoraConfig, format: str = "comfyui") -> float:
    """The one ``alpha / r`` of ``config`` (``alpha / sqrt(r)`` with rsLoRA), which single-file LoRAs carry as
    ``alpha``; per-module ranks or alphas are refused (hsdp's adapters never set them)."""
    if config.rank_pattern or config.alpha_pattern:
        raise ValueError(
            f"--export-format {format}: the adapter sets rank_pattern / alpha_pattern (per-module ranks); export "
            "it with --export-format diffusers, whose metadata keeps them"
        )
    return config.lora_alpha / (config.r**0.5 if config.use_rslora else config.r)


def comfyui_lora(
    peft_state: dict[str, torch.Tensor],
    config: LoraConfig,
    model: nn.Module,
    pipeline: type | None = None,
    component: str = "transformer",
    format: str = "comfyui",
) -> dict[str, torch.Tensor]:
    """The single-file LoRA (``format``: ``comfyui``, ``kohya``) of ``model``, a ``component`` of ``pipeline``,
    in the layout diffusers' converters for the pipeline read back (:mod:`hsdp.lora_layouts`; ``pipeline`` None:
    the pipeline :func:`lora_pipeline` finds for the model's class). ``ValueError`` with each layout's problem
    and the formats the family takes when none reads back."""
    from hsdp.families import family_of_model

    name = unwrapped_class(model).__name__  # the model's own class, not FSDP2's FSDP<Name> subclass
    pipeline = pipeline or lora_pipeline(name, format)
    try:
        return single_file_lora(format, _module_keys(peft_state), _scaling(config, format), pipeline, component,
                                family_of_model(name).original_names)  # fmt: skip
    except ValueError as exc:
        raise ValueError(f"--export-format {format}: {exc}; use --export-format diffusers") from exc


def lora_pipeline(model_class: str, format: str) -> type:
    """The diffusers pipeline whose ``lora_state_dict`` reads LoRAs of a ``model_class`` denoiser (the family's
    :attr:`hsdp.families.Family.lora_pipeline`)."""
    import diffusers

    from hsdp.families import family_of_model

    name = family_of_model(model_class).lora_pipeline
    if not name:
        raise ValueError(f"--export-format {format}: pass the pipeline of {model_class} (no family names one)")
    return getattr(diffusers, name)


def format_problem(format: str, model_class: str, denoiser_dir: Path | None = None, lora=None) -> str | None:
    """Why adapters of a ``model_class`` denoiser (its own class name, as its ``config.json`` says) cannot be
    written in ``format``, or None; reads no weights, so ``hsdp train`` refuses before any rank starts. For a
    single-file format the layout is derived on a probe adapter (:func:`hsdp.lora_layouts.layout_problem`) of the
    modules ``lora`` (a ``LoraConfig``) targets in the denoiser of ``denoiser_dir`` (its pipeline: the parent
    folder's); the message names the formats this model takes."""
    if format not in LAYOUT_FORMATS or denoiser_dir is None or lora is None:
        return None
    import diffusers

    from hsdp.families import family_of_model

    try:
        pipeline = _pipeline_class(denoiser_dir, denoiser_dir, f"--export-format {format}")
    except ValueError as exc:
        return f"{exc}; use --export-format diffusers"
    config = json.loads((denoiser_dir / "config.json").read_text())
    probe = probe_adapter(getattr(diffusers, model_class), config, lora)
    original = family_of_model(model_class).original_names
    problems = {f: layout_problem(f, pipeline, denoiser_dir.name, probe, original) for f in LAYOUT_FORMATS}
    if problems[format] is None:
        return None
    takes = ["peft", "diffusers", *(f for f, p in problems.items() if p is None)]
    return (
        f"--export-format {format}: {model_class}: {problems[format]}. This model takes --export-format "
        f"{', '.join(takes)}"
    )


def _write(
    out_dir: Path,
    files: dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]],
    config_dirs: list[str],
    config=None,
    run: str = "",
) -> None:
    """Write ``{name: (tensors, metadata)}`` (and a peft ``adapter_config.json`` into each of ``config_dirs``,
    relative; ``""`` is the folder itself) into a temporary sibling, then move it into place
    (:func:`hsdp.exports.commit`: a failed export leaves nothing behind, and only what an earlier export of ``run``
    wrote there is replaced)."""
    from safetensors.torch import save_file

    tmp = staging_dir(out_dir)
    for name, (tensors, metadata) in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / name, metadata=metadata)
    for folder in config_dirs:
        saved = copy.copy(config)
        saved.inference_mode = True  # as PeftModel.save_pretrained writes it
        saved.save_pretrained(tmp / folder)
    commit(tmp, out_dir, run)


def save_lora(
    model: nn.Module | Mapping[str, nn.Module],
    config: LoraConfig,
    out_dir: str | Path,
    format: str = "peft",
    component: str = "transformer",
    *,
    dtype: torch.dtype | None = None,
    run: str = "",
    pipeline: type | None = None,
) -> Path:
    """Write the adapters of ``model`` (injected with ``config``) in ``format``; collective: every rank gathers the
    adapters (only they: never the frozen base), rank 0 checks and writes, then a barrier. ``component`` names the
    pipeline component the adapters belong to (the diffusers format's key prefix); ``dtype`` casts the tensors
    (default: as trained, fp32); ``run`` names the run for :mod:`hsdp.exports` (an earlier export of the same run
    in ``out_dir`` is replaced, anything else there refused); ``pipeline`` the diffusers pipeline class whose
    converters the single-file formats are derived from and checked by (:func:`comfyui_lora`). A problem (a format the model's family cannot take)
    is a ``ValueError`` on every rank, raised before anything is written. ``model`` a mapping (a pipeline's
    denoisers by name, Wan 2.2's experts): one subfolder of ``out_dir`` per model, named by its key, each as
    ``model`` alone would be written, all in one export."""
    models = dict(model) if isinstance(model, Mapping) else {"": model}
    files: dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]] = {}
    for folder, one in models.items():
        for name, written in _lora_files(one, config, format, component, pipeline).items():
            files[f"{folder}/{name}" if folder else name] = written
    if dtype is not None:  # every tensor of the file (ComfyUI's alpha scalars too)
        files = {name: ({k: v.to(dtype) for k, v in tensors.items()}, meta) for name, (tensors, meta) in files.items()}
    out_dir = Path(out_dir)
    if rank() == 0:
        _write(out_dir, files, list(models) if format == "peft" else [], config, run)
    if dist.is_initialized():
        dist.barrier()
    return out_dir


def _lora_files(
    model: nn.Module, config: LoraConfig, format: str, component: str, pipeline: type | None = None
) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """{file name: (tensors, metadata)} of ``model``'s adapters in ``format`` (:func:`save_lora`); collective."""
    if format not in FORMATS:
        raise ValueError(f"--export-format {format!r}: use one of {', '.join(FORMATS)}")
    if format != "peft" and not _is_diffusers_model(model):
        raise ValueError(
            f"--export-format {format}: {type(model).__name__} is not a diffusers model, and this format is a "
            "diffusers pipeline LoRA; use --export-format peft"
        )
    state = adapter_state(model)  # collective
    if format == "peft":
        return {ADAPTER_WEIGHTS: (state, {"format": "pt"})}
    if format == "diffusers":
        return {DIFFUSERS_WEIGHTS: diffusers_lora(state, config, component)}
    tensors = comfyui_lora(state, config, model, pipeline, component, format)
    return {KOHYA_WEIGHTS if format == "kohya" else COMFYUI_WEIGHTS: (tensors, {"format": "pt"})}


def _is_diffusers_model(model: nn.Module) -> bool:
    try:
        from diffusers import ModelMixin
    except ImportError:
        return False
    return isinstance(model, ModelMixin)


# -- reading a diffusers-format folder as a peft adapter ----------------------------------------------------------
def _denoiser_tensors(path: Path, flag: str) -> tuple[str, dict[str, torch.Tensor], dict[str, Any] | None]:
    """(component, ``<module>.lora_X.weight`` tensors, its LoraConfig kwargs or None) of a diffusers LoRA file."""
    from diffusers.utils.state_dict_utils import _load_sft_state_dict_metadata
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as exc:
        raise ValueError(
            f"{flag} {path.parent}: {DIFFUSERS_WEIGHTS} (diffusers' LoRA format) is not readable as safetensors "
            f"({exc}); pass the folder that save_lora_weights or hsdp train --export-format diffusers wrote"
        ) from exc
    components = sorted({k.split(".", 1)[0] for k in tensors})
    if len(components) != 1:
        raise ValueError(
            f"{flag} {path.parent}: {DIFFUSERS_WEIGHTS} adapts {', '.join(components) or 'nothing'}; hsdp applies "
            "a LoRA to one component (the denoiser), so keep only its keys"
        )
    component = components[0]
    meta = _load_sft_state_dict_metadata(str(path)) or {}
    config = {k.removeprefix(f"{component}."): v for k, v in meta.items() if k.startswith(f"{component}.")}
    return component, {k.split(".", 1)[1]: v for k, v in tensors.items()}, config or None


def _inferred_config(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A file without metadata: diffusers' own convention (``utils.peft_utils.get_peft_kwargs``), ``lora_alpha``
    equal to each module's rank (scale 1), the most common rank as ``r`` and the others as a pattern."""
    from collections import Counter

    ranks = {k.rsplit(".lora_A.", 1)[0]: v.shape[0] for k, v in tensors.items() if ".lora_A." in k}
    r = Counter(ranks.values()).most_common(1)[0][0]
    pattern = {m: rank for m, rank in ranks.items() if rank != r}
    return {
        "r": r,
        "lora_alpha": r,
        "target_modules": sorted(ranks),
        "rank_pattern": pattern,
        "alpha_pattern": dict(pattern),
    }


def _holds_adapter(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file() or (folder / DIFFUSERS_WEIGHTS).is_file()


def adapter_parts(folder: str | Path, targets: list[str], owner: str, flag: str = "--lora") -> dict[str, Path]:
    """The adapter folders in ``folder`` by the model each adapts, of ``targets`` (the names of the models an
    adapter may adapt: a pipeline's denoisers, in the pipeline's order). An export of several denoisers (Wan 2.2's
    experts, as ``hsdp train`` writes them) has one subfolder per denoiser, named by its component; any other
    folder is one adapter, of the denoiser its diffusers keys name when that is one of ``targets`` (a
    ``transformer_2.``-keyed file), else of the first, as diffusers' ``load_lora_weights`` loads into its
    ``transformer``. Reads only file names and safetensors headers. A subfolder of a denoiser that ``owner`` (the
    model's name, for the message) does not have is a ``ValueError`` naming ``flag``: half an export is not
    applied."""
    path = Path(folder)
    parts = {t: path / t for t in targets if _holds_adapter(path / t)}
    if not parts and _holds_adapter(path):
        return {_named_target(path, targets): path}
    others = sorted(p.name for p in path.iterdir() if p.name not in targets and _holds_adapter(p)) if path.is_dir() else []
    if others:
        raise ValueError(
            f"{flag} {folder}: holds an adapter of {', '.join(others)}, which {owner} does not have (its "
            f"denoisers: {', '.join(targets)}); pass an adapter of this model's own denoisers"
        )
    return parts or {targets[0]: path}  # nothing there: hsdp.lora.adapter_config names what is missing


def _named_target(path: Path, targets: list[str]) -> str:
    """The one of ``targets`` that the keys of the diffusers LoRA file in ``path`` name, else the first."""
    from safetensors import SafetensorError, safe_open

    if (path / "adapter_config.json").is_file() or not (path / DIFFUSERS_WEIGHTS).is_file():
        return targets[0]
    try:
        with safe_open(path / DIFFUSERS_WEIGHTS, framework="pt") as handle:
            named = {k.split(".", 1)[0] for k in handle.keys()}  # noqa: SIM118
    except (OSError, SafetensorError):
        return targets[0]  # as_peft_folder names the problem
    return next((t for t in targets if named == {t}), targets[0])


def as_peft_folder(folder: str | Path, flag: str = "--lora", model_dir: Path | None = None) -> Path:
    """``folder`` itself when it is a peft adapter folder (or anything else: the caller's checks name the problem);
    for a diffusers-format folder (``pytorch_lora_weights.safetensors``, no ``adapter_config.json``), a peft adapter
    folder converted from it: keys ``base_model.model.<module>.lora_X.weight``, the ``LoraConfig`` from the file's
    metadata (else diffusers' convention, alpha = r). A LoRA ``.safetensors`` file is converted by the pipeline of
    ``model_dir`` (the denoiser folder the adapter is for; :func:`_converted_file`). Converted once into the hsdp
    cache, keyed by the file's content (and the pipeline); every rank may call it (the folder is written to a
    temporary sibling and renamed). A file that cannot be read is a ``ValueError`` naming ``flag``."""
    path = Path(folder)
    if path.is_file() and path.suffix == ".safetensors":
        if model_dir is None:
            raise ValueError(
                f"{flag} {path}: a single LoRA file is read by hsdp generate and hsdp serve --lora (through the "
                "pipeline's converters); here pass a peft adapter folder"
            )
        pipeline = _pipeline_class(path, model_dir, flag)
        key = f"{pipeline.__name__}/{model_dir.name}".encode()
        return _cached(path, key, lambda: _converted_file(path, pipeline, model_dir.name, flag))
    source = path / DIFFUSERS_WEIGHTS
    if (path / "adapter_config.json").is_file() or not source.is_file():
        return path

    def convert() -> tuple[dict[str, torch.Tensor], LoraConfig]:
        from peft import LoraConfig

        _, tensors, kwargs = _denoiser_tensors(source, flag)
        return tensors, LoraConfig(**(kwargs or _inferred_config(tensors)))

    return _cached(source, b"", convert)


def _cached(source: Path, key: bytes, convert: Callable[[], tuple[dict[str, torch.Tensor], LoraConfig]]) -> Path:
    """The peft adapter folder ``convert()`` gives (``<module>.lora_X.weight`` tensors and their config), written
    once into the hsdp cache under the digest of ``source``'s bytes and ``key``."""
    from hsdp.models.tiny import default_cache_dir

    digest = hashlib.sha256(source.read_bytes() + key).hexdigest()[:16]
    out = default_cache_dir() / "lora-from-diffusers" / digest
    if (out / ADAPTER_WEIGHTS).is_file():
        return out
    tensors, config = convert()
    peft_state = {_PEFT_PREFIX + k: v for k, v in tensors.items()}
    tmp = out.with_name(f".tmp-{digest}-{os.getpid()}")
    _write(tmp, {ADAPTER_WEIGHTS: (peft_state, {"format": "pt"})}, [""], config)
    try:
        os.replace(tmp, out)
    except OSError:  # another rank renamed its copy first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _pipeline_class(path: Path, model_dir: Path, flag: str) -> type:
    """The diffusers pipeline class of the denoiser folder ``model_dir`` (its parent pipeline's,
    :func:`hsdp.models.description.describe`), which must read LoRA files (``lora_state_dict``)."""
    from hsdp.models.description import describe, is_pipeline

    name = describe(model_dir.parent).class_name if is_pipeline(model_dir.parent) else ""
    import diffusers

    pipeline = getattr(diffusers, name, None) if name else None
    if pipeline is None or not hasattr(pipeline, "lora_state_dict"):
        what = f"the pipeline {name}" if name else f"the model {model_dir} (not a diffusers pipeline's denoiser)"
        raise ValueError(
            f"{flag} {path}: a LoRA file is read by the pipeline's lora_state_dict (diffusers' converters), and "
            f"{what} has none; pass a peft adapter folder"
        )
    return pipeline


def _converted_file(
    path: Path, pipeline: type, component: str, flag: str
) -> tuple[dict[str, torch.Tensor], LoraConfig]:
    """The LoRA file ``path`` for the pipeline's ``component`` as diffusers' ``load_lora_weights`` reads it
    (:func:`hsdp.lora_layouts.converted_state`)."""
    return converted_state(str(path), pipeline, component, flag)


_sample = sample
