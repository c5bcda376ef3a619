"""What a model folder is, read from its JSON files, safetensors headers and the library classes they name, so
bad input fails before any rank starts.

A diffusers pipeline folder has an index (:mod:`hsdp.models.description`, read there) naming the pipeline class and its components; a Hugging Face
causal LM folder has ``config.json`` whose ``architectures`` end in ``ForCausalLM``. For a pipeline, everything
the engine needs comes from diffusers' own metadata: the arguments its ``__call__`` accepts (and so whether it
makes video, takes an input image, runs true CFG), which components are denoisers (diffusers models that are not
autoencoders), whether guidance runs a separate unconditional pass (the pipeline labels it
``cache_context("uncond")``), whether Ulysses applies (the transformer's ``_cp_plan``), and the size rules (VAE
compression x patch size, plus a family's latent packing from :mod:`hsdp.families`). Generation defaults come
from the folder's ``hsdp_defaults.json`` when present (the built-in tiny models ship one), otherwise from the
pipeline's own ``__call__`` signature.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hsdp.families import family_for
from hsdp.generation_defaults import DEFAULTS_FILE
from hsdp.models.description import TEXT_ENCODER_SHARD_FRACTION, ModelDescription, describe
from hsdp.vae_parallel import split_refusal

__all__ = ["ModelInfo", "inspect_model", "TEXT_ENCODER_SHARD_FRACTION", "AUDIO_LENGTH_PARAMS"]


_DEFAULT_KEYS = (
    "height",
    "width",
    "num_frames",
    "num_inference_steps",
    "guidance_scale",
    "true_cfg_scale",
    "max_sequence_length",
    "frame_rate",
)
_UNCOND_PASS = re.compile(r"""cache_context\(\s*["']uncond["']""")
_OUTPUT_CLASS = re.compile(r"return\s+(\w+Output)\(")
AUDIO_LENGTH_PARAMS = ("audio_end_in_s", "audio_length_in_s", "audio_duration_s", "audio_duration", "duration")
"""The names diffusers' audio pipelines give the length of the audio to make, in seconds (Stable Audio,
AudioLDM 2, LongCat, ACE-Step, Stable Audio 3): ``--audio-seconds`` / ``audio_seconds`` sets whichever the
pipeline's ``__call__`` takes."""
_CONFIG_GATE = re.compile(r"self\.config\.(\w+) is None and (\w+) is not None")
"""A pipeline's input check refusing an argument while a config value is unset (Wan's ``guidance_scale_2`` needs
``boundary_ratio``, which only Wan 2.2's two-expert folders set)."""
_SINGLE_INPUT = re.compile(r"not isinstance\((\w+), torch\.Tensor\) and not isinstance\(\1, PIL\.Image\.Image\)")
"""A pipeline's input check taking one tensor or image for an input, never a list (Wan image-to-video)."""
MODEL_PACKAGES = {"diffusion": "diffusers", "causal_lm": "transformers"}
"""The library each :attr:`ModelInfo.kind` is built with on the ranks (what their forkserver preloads)."""


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    kind: Literal["diffusion", "causal_lm"]
    class_name: str
    defaults: dict = field(default_factory=dict)
    """Generation defaults (diffusion: height, width, num_frames, num_inference_steps, guidance_scale, ...)."""
    family: str = ""
    """The family's name (:mod:`hsdp.families`), or the pipeline class when no family claims it."""
    output: Literal["video", "image", "audio", "text"] = "text"
    audio_track: bool = False
    """A video pipeline that makes the video's sound too (LTX-2's ``audio`` beside ``frames``)."""
    audio_length_param: str | None = None
    """The ``__call__`` argument that sets the audio's length in seconds (:data:`AUDIO_LENGTH_PARAMS`)."""
    max_audio_seconds: float | None = None
    """The longest audio the pipeline makes, where its family knows the limit (:mod:`hsdp.families`)."""
    call_params: frozenset[str] = frozenset()
    """Arguments the pipeline's ``__call__`` accepts with this folder's config: only these are passed."""
    config_gated: dict[str, str] = field(default_factory=dict)
    """Arguments of ``__call__`` that this folder's pipeline config leaves off (not in :attr:`call_params`):
    argument -> the config value it needs (``guidance_scale_2`` -> ``boundary_ratio`` on Wan 2.1)."""
    required_params: frozenset[str] = frozenset()
    """Arguments ``__call__`` has no default for (e.g. ``image`` for image-to-video)."""
    single_inputs: frozenset[str] = frozenset()
    """Inputs the pipeline's own check takes one of per call (a tensor or an image, not one per prompt: Wan
    image-to-video's ``image``): requests that give one never run batched."""
    components: tuple[str, ...] = ()
    denoisers: tuple[str, ...] = ()
    """Diffusers models that run every denoising step (transformer, transformer_2, unet, prior, ...)."""
    shardable: tuple[str, ...] = ()
    """Components sharded when HSDP is on: the denoisers and the large components with a shard plan (text
    encoders, and autoencoders as large as that: their ``encode`` / ``decode`` gather like ``forward``, see
    :func:`hsdp.sharding.register_entry_points`)."""
    autoencoders: tuple[str, ...] = ()
    """Components that are diffusers autoencoders (``vae``): when one is sharded, every rank of its shard group
    must decode, since decoding all-gathers its weights."""
    vae_options: dict[str, frozenset[str]] = field(default_factory=dict)
    """Autoencoder -> the memory options its class has: ``tiling`` (diffusers' ``enable_tiling`` and
    ``tiled_decode``: what ``--vae-tiling`` and ``--vae-parallel`` use) and ``slicing`` (``enable_slicing``)."""
    vae_unsplittable: dict[str, str] = field(default_factory=dict)
    """Autoencoder that tiles -> why ``--vae-parallel`` cannot split its tiles
    (:func:`hsdp.vae_parallel.split_refusal`)."""
    separate_uncond_pass: bool = False
    """Guidance runs the unconditional branch as its own denoiser call (what CFG parallel splits off)."""
    cfg_scale_param: str = "guidance_scale"
    """The argument that turns that pass on (``true_cfg_scale`` for FLUX / Qwen-Image, else guidance_scale)."""
    ulysses: bool = False
    """Every denoiser's attention can be split across ranks (a diffusers ``_cp_plan`` its family does not fault)."""
    ulysses_problem: str = ""
    """Why not, where ``ulysses`` is False."""
    num_heads: int | None = None
    """Attention heads of the (first) denoiser: Ulysses splits them across ranks."""
    spatial_multiple: int = 16
    """Height and width must be multiples of this (VAE downsampling x patch size x the family's packing)."""
    temporal_factor: int = 1
    """Frame counts must be ``temporal_factor * k + 1`` (video)."""

    @property
    def takes_image(self) -> bool:
        return "image" in self.call_params

    @property
    def takes_mask(self) -> bool:
        return "mask_image" in self.call_params


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable or invalid JSON ({exc})") from exc


def _vae_options(cls: type) -> frozenset[str]:
    """diffusers' ``enable_tiling`` / ``enable_slicing`` work where ``__init__`` sets ``use_tiling`` /
    ``use_slicing`` (the mixin's own test, made on the class instead of an instance)."""
    source = inspect.getsource(cls.__init__)
    tiling = "self.use_tiling" in source and callable(getattr(cls, "tiled_decode", None))
    return frozenset(name for name, ok in (("tiling", tiling), ("slicing", "self.use_slicing" in source)) if ok)


def _output_kind(pipeline_cls: type, call_params: frozenset[str]) -> tuple[str, bool]:
    """``(video | image | audio, whether a video has sound)`` from the fields of the output class the pipeline's
    ``__call__`` returns (``frames``, ``images``, ``audios``; LTX-2's ``audio`` beside its ``frames``), read from
    its source; a pipeline whose source is not readable is a video pipeline when it takes ``num_frames``."""
    import dataclasses
    import sys

    try:
        returned = set(_OUTPUT_CLASS.findall(inspect.getsource(pipeline_cls.__call__)))
    except (OSError, TypeError):
        returned = set()
    namespace = vars(sys.modules[pipeline_cls.__module__])
    names = {
        f.name
        for cls in (namespace.get(name) for name in returned)
        if dataclasses.is_dataclass(cls)
        for f in dataclasses.fields(cls)
    }
    if "frames" in names:
        return "video", bool(names & {"audio", "audios"})
    if names & {"audio", "audios"}:
        return "audio", False
    if names:
        return "image", False
    return ("video" if "num_frames" in call_params else "image"), False


def _config_gated(pipeline_cls: type, source: str, index: dict) -> dict[str, str]:
    """The ``__call__`` arguments the pipeline's own input check refuses with this folder's config (a value
    the pipeline's index leaves unset, or its ``__init__`` default when absent): argument -> config key."""
    init = inspect.signature(pipeline_cls.__init__).parameters
    gated = {}
    for key, argument in _CONFIG_GATE.findall(source):
        default = init[key].default if key in init else None
        if index.get(key, None if default is inspect.Parameter.empty else default) is None:
            gated[argument] = key
    return gated


def _diffusion_info(model: ModelDescription) -> ModelInfo:
    folder, class_name, index = model.path, model.class_name, model.index
    pipeline_cls = model.pipeline_class()
    specs = model.components
    modules = model.modules()
    denoisers = model.denoisers()
    if not denoisers:
        raise ValueError(f"{folder} holds a {class_name} with no denoiser (transformer or UNet) to shard")
    autoencoders = model.autoencoders()
    try:
        source = inspect.getsource(pipeline_cls)
    except (OSError, TypeError):
        source = ""
    gated = _config_gated(pipeline_cls, source, index)
    signature = inspect.signature(pipeline_cls.__call__).parameters
    call_params = frozenset(signature) - {"self"} - set(gated)
    required = frozenset(
        n
        for n, p in signature.items()
        if n != "self" and p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD
    )
    sizes_rule = model.size_rule(denoisers[0])
    family = family_for(class_name)
    defaults = {k: signature[k].default for k in _DEFAULT_KEYS if k in signature}
    if (folder / DEFAULTS_FILE).exists():
        defaults.update(_read_json(folder / DEFAULTS_FILE))
    output, audio_track = _output_kind(pipeline_cls, call_params)
    return ModelInfo(
        path=folder,
        kind="diffusion",
        class_name=class_name,
        defaults=defaults,
        family=family.name if family.name != "generic" else class_name,
        output=output,
        audio_track=audio_track,
        audio_length_param=next((n for n in AUDIO_LENGTH_PARAMS if n in call_params), None),
        max_audio_seconds=family.max_audio_seconds({n: model.config(n) for n in modules if specs[n].has_config})
        if family.max_audio_seconds
        else None,
        call_params=call_params,
        config_gated=gated,
        required_params=required,
        single_inputs=frozenset(_SINGLE_INPUT.findall(source)) & call_params,
        components=tuple(specs),
        denoisers=denoisers,
        shardable=model.shardable(),
        autoencoders=autoencoders,
        vae_options={name: _vae_options(modules[name]) for name in autoencoders},
        vae_unsplittable={name: why for name in autoencoders
                          if "tiling" in _vae_options(modules[name]) and (why := split_refusal(modules[name]))},  # fmt: skip
        separate_uncond_pass=bool(_UNCOND_PASS.search(source)),
        cfg_scale_param="true_cfg_scale" if "true_cfg_scale" in call_params else "guidance_scale",
        ulysses=not _ulysses_problem(modules, denoisers, family),
        ulysses_problem=_ulysses_problem(modules, denoisers, family),
        num_heads=model.config(denoisers[0]).get("num_attention_heads"),
        spatial_multiple=sizes_rule.spatial_multiple,
        temporal_factor=sizes_rule.temporal or 1,
    )


def _ulysses_problem(modules: dict, denoisers: tuple[str, ...] | list[str], family) -> str:
    if not all(getattr(modules[name], "_cp_plan", None) for name in denoisers):
        return "has no diffusers context-parallel plan (_cp_plan)"
    return family.ulysses_problem


def inspect_model(folder: Path) -> ModelInfo:
    """Classify a local model folder (:func:`hsdp.models.description.describe`); raises ``ValueError`` naming the
    folder and what it lacks."""
    model = describe(folder)
    if model.kind == "pipeline":
        return _diffusion_info(model)
    if model.kind == "causal_lm":
        return ModelInfo(path=model.path, kind="causal_lm", class_name=model.class_name)
    architectures = [model.class_name] if model.class_name else []
    raise ValueError(
        f"{model.path / 'config.json'} names architectures {architectures}, none of which is a causal LM "
        "(…ForCausalLM); hsdp generate serves causal LMs and diffusers pipelines"
    )
