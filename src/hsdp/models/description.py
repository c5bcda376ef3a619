"""One description of a model folder, read once, for every command: what ``hsdp generate``, ``serve``, ``train`` and
``plan`` know of a model before they load it (issue 35 item 4).

A diffusers pipeline folder has an index file (:data:`INDEX_FILE`) naming the pipeline class and its components as
``[library, class]``; the library is ``diffusers``, ``transformers`` or one of diffusers' pipeline modules (LTX-2's
``connectors`` and ``vocoder`` live in ``diffusers.pipelines.ltx2``). Classes resolve through diffusers' own
loading helper (``get_class_obj_and_candidates``), as ``DiffusionPipeline.from_pretrained`` resolves them, so every
command resolves the same class for the same entry. A component folder on its own (``config.json`` with
``_class_name`` or ``architectures``) resolves through its pipeline's entry when it sits in one, else through the
library its config names.

The size rules (:class:`SizeRule`) are the pipeline's own: its ``__init__`` run around its VAE built on the meta
device (:func:`skeleton_pipeline`) states the VAE's compression (:func:`pipeline_compression`); reading
``vae/config.json`` alone is not enough (the LTX and LTX-2 VAEs leave ``temporal_compression_ratio`` null there and
their class derives it), so the config is only the fallback for a pipeline whose ``__init__`` needs another
component. The engine, the server, the trainer and the planner read these rules from here.

This module is below ``engine/``, ``train/`` and ``planning/`` (and below :mod:`hsdp.loading`, whose
:func:`hsdp.loading.build_component` builds a component from a description): it imports no other ``hsdp`` module
but the families' size packing and the checkpoint error.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsdp.families import family_for
from hsdp.safetensors_index import CheckpointError, read_checkpoint_index

logger = logging.getLogger("hsdp")

__all__ = [
    "INDEX_FILE",
    "TEXT_ENCODER_SHARD_FRACTION",
    "Component",
    "ModelDescription",
    "SizeRule",
    "describe",
    "is_pipeline",
    "pipeline_index",
    "component_class",
    "class_for_folder",
    "is_denoiser_class",
    "pipeline_compression",
    "skeleton_pipeline",
    "SPATIAL_NAMES",
    "TEMPORAL_NAMES",
]

TEXT_ENCODER_SHARD_FRACTION = 0.3
"""A non-denoiser component with a shard plan (T5, UMT5, Qwen2.5-VL, Llama text encoders) is sharded when its
weights are at least this fraction of the largest denoiser's: T5-XXL beside FLUX (39%), UMT5-XXL beside Wan 14B
(40%) and Qwen2.5-VL beside Qwen-Image (35%) are; CLIP-L (5%) and CLIP-G beside SDXL's UNet (27%) load whole,
where sharding saves little memory and costs a collective per block."""
INDEX_FILE = "model_index.json"
"""The file a diffusers pipeline folder names its class and components in."""
SPATIAL_NAMES = ("vae_scale_factor_spatial", "vae_spatial_compression_ratio", "vae_scale_factor")
"""The attributes diffusers pipelines name their VAE's spatial compression by, the most specific first."""
TEMPORAL_NAMES = ("vae_scale_factor_temporal", "vae_temporal_compression_ratio")
"""Those of its temporal compression (video pipelines only)."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable or invalid JSON ({exc})") from exc


def is_pipeline(folder: Path | str) -> bool:
    """Whether ``folder`` is a diffusers pipeline folder (it has :data:`INDEX_FILE`)."""
    return (Path(folder) / INDEX_FILE).is_file()


def pipeline_index(folder: Path | str) -> dict:
    """The pipeline's index (its class, components and pipeline config values such as Wan 2.2's
    ``boundary_ratio``), as saved."""
    return _read_json(Path(folder) / INDEX_FILE)


def component_class(library: str, class_name: str, where: str = "") -> type:
    """The class a ``[library, class]`` entry names, resolved as ``DiffusionPipeline.from_pretrained`` resolves it:
    from diffusers' pipeline module ``library`` when diffusers has one by that name (``ltx2``), else from the
    package ``library``. ``where`` names the entry in the error."""
    import diffusers
    from diffusers.pipelines.pipeline_loading_utils import (
        ALL_IMPORTABLE_CLASSES,
        get_class_obj_and_candidates,
    )

    try:
        cls, _ = get_class_obj_and_candidates(
            library, class_name, ALL_IMPORTABLE_CLASSES, diffusers.pipelines, hasattr(diffusers.pipelines, library)
        )
    except (AttributeError, ImportError) as exc:
        version = getattr(importlib.import_module(library), "__version__", "") if _importable(library) else ""
        raise CheckpointError(
            f"{where or 'model'}: class {class_name!r} is not in {library} {version} (nor in diffusers "
            f"{diffusers.__version__}'s pipeline modules); upgrade {library} or fix the folder"
        ) from exc
    return cls


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Component:
    """One entry of a pipeline: its library and class as the index names them, and its folder."""

    name: str
    library: str
    class_name: str
    folder: Path

    @property
    def has_config(self) -> bool:
        """A model component with a ``config.json`` (not a scheduler, tokenizer or processor)."""
        return (self.folder / "config.json").is_file()

    @property
    def in_library(self) -> bool:
        """Its class is one of diffusers' or transformers' own (not a pipeline module's, like LTX-2's connectors)."""
        return self.library in ("diffusers", "transformers")

    def cls(self) -> type:
        return component_class(self.library, self.class_name, f"{self.folder.parent / INDEX_FILE}: {self.name!r}")

    def config(self) -> dict:
        return _read_json(self.folder / "config.json")


@dataclass(frozen=True)
class SizeRule:
    """What sizes a pipeline takes: heights and widths multiples of :attr:`spatial_multiple` (VAE compression x
    the denoiser's patch x the family's latent packing), frame counts ``temporal * k + 1`` (None: not video)."""

    spatial_multiple: int
    temporal: int | None


@dataclass(frozen=True)
class ModelDescription:
    """A model folder as every command sees it: a pipeline (class, components, config values) or one model."""

    path: Path
    kind: str
    """``pipeline`` (diffusers), ``causal_lm`` (transformers ``...ForCausalLM``) or ``model`` (one component)."""
    class_name: str
    index: dict = field(default_factory=dict)
    components: dict[str, Component] = field(default_factory=dict)
    """Every named component (null entries such as Wan 2.1's ``transformer_2`` left out), in the index's order."""

    def pipeline_class(self) -> type:
        import diffusers

        cls = getattr(diffusers, self.class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
            raise CheckpointError(
                f"{self.path / INDEX_FILE}: pipeline class {self.class_name!r} is not in diffusers "
                f"{diffusers.__version__}; upgrade diffusers or fix _class_name"
            )
        return cls

    def modules(self) -> dict[str, type]:
        """Component -> class, for the components that are torch modules of diffusers or transformers (what the
        engine shards and the planner profiles; a pipeline module's own classes load whole with the pipeline)."""
        import torch

        classes = {name: c.cls() for name, c in self.components.items() if c.in_library}
        return {n: cls for n, cls in classes.items() if isinstance(cls, type) and issubclass(cls, torch.nn.Module)}

    def denoisers(self) -> tuple[str, ...]:
        """Diffusers models that run every denoising step (transformer, transformer_2, unet, prior, ...): the
        :meth:`modules` that are diffusers models and not autoencoders."""
        return tuple(n for n, c in self.modules().items() if is_denoiser_class(c))

    def autoencoders(self) -> tuple[str, ...]:
        return tuple(n for n, c in self.modules().items() if _is_autoencoder(c))

    def stored_bytes(self, name: str) -> int:
        """The bytes of component ``name``'s weights, from its safetensors headers (0 where it has none)."""
        try:
            index = read_checkpoint_index(self.path / name)
        except CheckpointError:
            return 0  # reported by the loader, with the file, if the component is ever loaded
        return sum(math.prod(e.shape) * e.dtype.itemsize for e in index.tensors.values())

    def shardable(self) -> tuple[str, ...]:
        """Components sharded when HSDP is on: every denoiser (one without a plan of its own shards by its
        repeated blocks, :mod:`hsdp.shard_rules`), and the others with a shard plan whose weights are at least
        :data:`TEXT_ENCODER_SHARD_FRACTION` of the largest denoiser's. The engine loads these sharded, the trainer
        shards its frozen ones alike, the planner counts them sharded."""
        modules, denoisers = self.modules(), self.denoisers()
        sizes = {name: self.stored_bytes(name) for name in modules}
        largest = max((sizes[name] for name in denoisers), default=0)
        return tuple(
            name
            for name, cls in modules.items()
            if name in denoisers or (_has_shard_plan(cls) and sizes[name] >= TEXT_ENCODER_SHARD_FRACTION * largest)
        )

    def config(self, name: str) -> dict:
        """``config.json`` of component ``name`` ({} when it has none)."""
        component = self.components.get(name)
        return component.config() if component is not None and component.has_config else {}

    def size_rule(self, denoiser: str) -> SizeRule:
        """The pipeline's own size rule with ``denoiser``'s patch: what the engine checks requests against and the
        trainer buckets its media by (one answer for both)."""
        skeleton = skeleton_pipeline(self)
        by_config = _config_compression(self.config("vae"))
        spatial, temporal = pipeline_compression(skeleton) if skeleton is not None else by_config
        spatial = spatial or by_config[0]
        config = self.config(denoiser)
        patch = config.get("patch_size") or config.get("all_patch_size") or 1  # Z-Image names it all_patch_size
        patch = int(patch[-1] if isinstance(patch, (list, tuple)) else patch)
        return SizeRule(spatial * patch * family_for(self.class_name).latent_packing, temporal)


def _is_autoencoder(cls: type) -> bool:
    from diffusers.models.autoencoders.vae import AutoencoderMixin

    return issubclass(cls, AutoencoderMixin)


def is_denoiser_class(cls: type) -> bool:
    """A diffusers model that is not an autoencoder (what runs every denoising step)."""
    from diffusers import ModelMixin

    return issubclass(cls, ModelMixin) and not _is_autoencoder(cls)


def _has_shard_plan(cls: type) -> bool:
    return bool(getattr(cls, "_hsdp_shard_conditions", None) or getattr(cls, "_no_split_modules", None))


def _config_compression(vae: dict) -> tuple[int, int | None]:
    """(spatial, temporal) compression of a VAE from its config, for a pipeline that cannot be set up without its
    other components: Wan-style ``temperal_downsample``, explicit ratios (HunyuanVideo, LTX), or one halving per
    extra ``block_out_channels`` level (AutoencoderKL, no temporal one)."""
    if "temperal_downsample" in vae:
        downsample = vae["temperal_downsample"]
        return 2 ** len(downsample), 2 ** sum(bool(d) for d in downsample)
    if vae.get("spatial_compression_ratio"):
        return int(vae["spatial_compression_ratio"]), int(vae.get("temporal_compression_ratio") or 1)
    blocks = vae.get("block_out_channels")
    return (2 ** (len(blocks) - 1) if blocks else 8), None


def _attribute(pipe: Any, names: tuple[str, ...]) -> int | None:
    value = next((getattr(pipe, n) for n in names if getattr(pipe, n, None) is not None), None)
    return int(value) if value is not None else None


def pipeline_compression(pipe: Any) -> tuple[int | None, int | None]:
    """``(spatial, temporal)`` compression as the pipeline's own attributes state them; None where it names none
    (an image pipeline has no temporal one, and None has neither)."""
    if pipe is None:
        return None, None
    return _attribute(pipe, SPATIAL_NAMES), _attribute(pipe, TEMPORAL_NAMES)


def skeleton_pipeline(description: ModelDescription) -> Any | None:
    """The pipeline class as its ``__init__`` sets it up around the folder's VAE built on the meta device, every
    other component None: what it derives from the VAE (:func:`pipeline_compression`), without weights. None when
    the folder has no VAE config or ``__init__`` needs another component (the caller then reads the configs)."""
    import torch

    vae = description.components.get("vae")
    if vae is None or not vae.has_config:
        return None
    try:
        pipeline_cls = description.pipeline_class()
        init = inspect.signature(pipeline_cls.__init__).parameters
        parts = {
            name: None if p.default is inspect.Parameter.empty else p.default
            for name, p in init.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        }
        # The ranks build the real VAE and show its warnings (Stable Audio's weight_norm deprecation) then.
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parts["vae"] = vae.cls().from_config(vae.config())
        pipe = pipeline_cls.__new__(pipeline_cls)
        pipe.__init__(**parts)
    except Exception as exc:  # noqa: BLE001 - any failure means "ask the config instead"
        logger.debug("%s.__init__ without its components failed (%s); sizes from the configs", description, exc)
        return None
    return pipe


_CACHE: dict[tuple[str, int], ModelDescription] = {}


def describe(folder: Path | str) -> ModelDescription:
    """The description of a local model folder (a built-in, hub name or single-file base is resolved to its folder
    first: :func:`hsdp.models.builtin.resolve_model`). Read once per folder and index version; raises
    :class:`~hsdp.safetensors_index.CheckpointError` (a ``ValueError``) naming the folder and what it lacks."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(
            f"model path {folder} is not a folder; pass a diffusers pipeline folder or a Hugging Face model folder"
        )
    marker = folder / INDEX_FILE if is_pipeline(folder) else folder / "config.json"
    try:
        key = (str(folder.resolve()), os.stat(marker).st_mtime_ns)
    except OSError:
        key = None
    if key is not None and key in _CACHE:
        return _CACHE[key]
    description = _describe(folder)
    if key is not None:
        _CACHE[key] = description
    return description


def _describe(folder: Path) -> ModelDescription:
    if is_pipeline(folder):
        index = pipeline_index(folder)
        components = {
            name: Component(name, entry[0], entry[1], folder / name)
            for name, entry in index.items()
            if not name.startswith("_") and isinstance(entry, list) and len(entry) == 2 and entry[0] and entry[1]
        }
        return ModelDescription(folder, "pipeline", index.get("_class_name", ""), index, components)
    if (folder / "config.json").is_file():
        config = _read_json(folder / "config.json")
        architectures = config.get("architectures") or []
        if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
            return ModelDescription(folder, "causal_lm", architectures[0])
        return ModelDescription(folder, "model", config.get("_class_name") or (architectures or [""])[0])
    raise CheckpointError(
        f"{folder} is not a model folder: no {INDEX_FILE} (diffusers pipeline) and no config.json "
        "(Hugging Face model). Pass a pipeline folder such as a FLUX.1 or Wan2.x -Diffusers download, or a "
        "built-in name"
    )


def class_for_folder(folder: Path) -> type:
    """The model class of a component folder: its pipeline's entry when the folder is one of a pipeline's
    components (so LTX-2's ``connectors`` resolves to ``diffusers.pipelines.ltx2.LTX2TextConnectors``), else the
    class its ``config.json`` names (diffusers ``_class_name`` or transformers ``architectures``)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")
    if is_pipeline(folder) and not config_file.exists():
        raise CheckpointError(
            f"{folder} is a diffusers pipeline folder; load one of its components, e.g. {folder / 'transformer'}"
        )
    if not config_file.exists():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face model or diffusers component folder")
    if is_pipeline(folder.parent):
        component = describe(folder.parent).components.get(folder.name)
        if component is not None:
            return component.cls()
    config = _read_json(config_file)
    if "_class_name" in config:
        return component_class("diffusers", config["_class_name"], str(config_file))
    if config.get("architectures"):
        return component_class("transformers", config["architectures"][0], str(config_file))
    raise CheckpointError(f"{config_file} names no model class (_class_name or architectures); pass model_class=")
