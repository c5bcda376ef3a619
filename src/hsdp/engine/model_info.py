"""What a model folder is, read from its JSON files only, so bad input fails before any rank starts.

A diffusers pipeline folder has ``model_index.json`` naming the pipeline class and its components; a Hugging Face
causal LM folder has ``config.json`` whose ``architectures`` end in ``ForCausalLM``. The generation defaults come
from the folder's ``hsdp_defaults.json`` when present (the built-in tiny models ship one), otherwise from the
pipeline's own ``__call__`` signature.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hsdp.models.tiny_wan import DEFAULTS_FILE

__all__ = ["ModelInfo", "inspect_model", "TRANSFORMER_COMPONENTS"]

TRANSFORMER_COMPONENTS = ("transformer", "transformer_2")
"""Pipeline components that are sharded (Wan2.2 has a second, low-noise transformer)."""

_DIFFUSION_DEFAULT_KEYS = (
    "height",
    "width",
    "num_frames",
    "num_inference_steps",
    "guidance_scale",
    "max_sequence_length",
)


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    kind: Literal["diffusion", "causal_lm"]
    class_name: str
    defaults: dict = field(default_factory=dict)
    """Generation defaults (diffusion: height, width, num_frames, num_inference_steps, guidance_scale, ...)."""
    num_heads: int | None = None
    """Attention heads of the (first) transformer: Ulysses splits them across ranks."""
    spatial_multiple: int = 16
    """Height and width must be multiples of this (VAE downsampling x transformer patch)."""
    temporal_factor: int = 4
    """Frame counts must be ``temporal_factor * k + 1``."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    components: tuple[str, ...] = ()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable or invalid JSON ({exc})") from exc


def _diffusion_info(folder: Path) -> ModelInfo:
    import diffusers

    index = _read_json(folder / "model_index.json")
    class_name = index.get("_class_name", "")
    pipeline_cls = getattr(diffusers, class_name, None)
    if pipeline_cls is None:
        raise ValueError(f"{folder / 'model_index.json'}: pipeline class {class_name!r} is not in diffusers")
    components = tuple(k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0])
    transformers = [c for c in TRANSFORMER_COMPONENTS if c in components]
    call_params = inspect.signature(pipeline_cls.__call__).parameters
    missing = [p for p in ("prompt", "height", "width", "num_frames") if p not in call_params]
    if not transformers or missing:
        raise ValueError(
            f"{folder} holds a {class_name}, which is not a text-to-video transformer pipeline (needs a "
            f"'transformer' component and prompt/height/width/num_frames arguments); hsdp generate serves "
            "WanPipeline-style pipelines"
        )
    transformer_config = _read_json(folder / transformers[0] / "config.json")
    vae_config = _read_json(folder / "vae" / "config.json") if "vae" in components else {}
    downsample = vae_config.get("temperal_downsample", [False, True, True])
    patch = tuple(transformer_config.get("patch_size", (1, 2, 2)))
    defaults = {k: call_params[k].default for k in _DIFFUSION_DEFAULT_KEYS if k in call_params}
    if (folder / DEFAULTS_FILE).exists():
        defaults.update(_read_json(folder / DEFAULTS_FILE))
    return ModelInfo(
        path=folder,
        kind="diffusion",
        class_name=class_name,
        defaults=defaults,
        num_heads=transformer_config.get("num_attention_heads"),
        spatial_multiple=2 ** len(downsample) * patch[1],
        temporal_factor=2 ** sum(bool(d) for d in downsample),
        patch_size=patch,
        components=components,
    )


def inspect_model(folder: Path) -> ModelInfo:
    """Classify a local model folder; raises ``ValueError`` naming the folder and what it lacks."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(
            f"model path {folder} is a file; pass a diffusers pipeline folder or a Hugging Face model folder"
        )
    if (folder / "model_index.json").exists():
        return _diffusion_info(folder)
    if (folder / "config.json").exists():
        config = _read_json(folder / "config.json")
        architectures = config.get("architectures") or []
        if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
            return ModelInfo(path=folder, kind="causal_lm", class_name=architectures[0])
        raise ValueError(
            f"{folder / 'config.json'} names architectures {architectures}, none of which is a causal LM "
            "(…ForCausalLM); hsdp generate serves causal LMs and diffusers video pipelines"
        )
    raise ValueError(
        f"{folder} is not a model folder: no model_index.json (diffusers pipeline) and no config.json "
        "(Hugging Face model). Pass a pipeline folder such as a Wan2.x -Diffusers download, or a built-in name"
    )
