"""The request fields a served diffusion model takes, with its defaults and this server's limits: what
``GET /v1/models`` tells clients in ``parameters``, so a form (the playground at ``/``) can be built from the
public API alone.

A field is listed when the pipeline's ``__call__`` takes the argument it sets (the engine refuses the others),
so the list follows diffusers' signatures, not a per-model table.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from hsdp.engine.model_info import ModelInfo
from hsdp.serve.schemas import DEFAULT_FPS, SEED_MAX, FieldInfo, ModelParameters
from hsdp.serve.settings import ServeLimits

__all__ = ["model_parameters"]

_GUIDANCE = {
    "guidance_scale": "Classifier-free guidance scale",
    "guidance_scale_2": "Wan 2.2: the low-noise transformer's guidance scale",
    "true_cfg_scale": "True CFG scale (> 1 with a negative prompt runs the unconditional pass)",
}


def _plain(value: Any) -> Any:
    """A default as JSON can carry it (None for what it cannot: tensors, callables)."""
    return value if isinstance(value, (int, float, str, bool)) or value is None else None


def _video_fields(info: ModelInfo, limits: ServeLimits) -> list[FieldInfo]:
    rule = f"{info.temporal_factor}k+1 frames" if info.temporal_factor > 1 else "any count"
    return [
        FieldInfo(
            name="num_frames",
            type="integer",
            default=_plain(info.defaults.get("num_frames")),
            minimum=1,
            maximum=limits.max_frames,
            description=f"Frames of the video ({rule})",
        ),
        FieldInfo(
            name="fps",
            type="integer",
            default=DEFAULT_FPS,
            minimum=1,
            maximum=240,
            description="Frames per second",
        ),
    ]


def model_parameters(info: ModelInfo, limits: ServeLimits, job_route: str | None) -> ModelParameters:
    """The fields of a generation request on the diffusion model ``info`` (empty for causal LMs, whose
    routes take OpenAI's sampling fields)."""
    listed = {k: v for k, v in asdict(limits).items() if k != "max_prompts"}
    if info.kind != "diffusion":
        return ModelParameters(job_route=None, fields=[], limits=listed)
    takes, defaults = info.call_params, info.defaults
    fields = [
        FieldInfo(
            name="prompt",
            type="text",
            required=True,
            maximum=limits.max_prompt_chars,
            description="What to make",
        )
    ]
    if "negative_prompt" in takes:
        fields.append(
            FieldInfo(
                name="negative_prompt",
                type="text",
                maximum=limits.max_prompt_chars,
                description="What to avoid",
            )
        )
    if {"height", "width"} <= takes:
        width, height = defaults.get("width"), defaults.get("height")
        fields.append(
            FieldInfo(
                name="size",
                type="size",
                default=f"{width}x{height}" if width and height else None,
                minimum=info.spatial_multiple,
                maximum=limits.max_side,
                multiple_of=info.spatial_multiple,
                description="WIDTHxHEIGHT in pixels",
            )
        )
    if info.output == "video" and "num_frames" in takes:
        fields += _video_fields(info, limits)
    if info.audio_length_param is not None:
        fields.append(
            FieldInfo(
                name="audio_seconds",
                type="number",
                default=_plain(defaults.get(info.audio_length_param)),
                minimum=0,
                maximum=info.max_audio_seconds,
                description="Seconds of audio",
            )
        )
    if "num_inference_steps" in takes:
        fields.append(
            FieldInfo(
                name="num_inference_steps",
                type="integer",
                default=_plain(defaults.get("num_inference_steps")),
                minimum=1,
                maximum=limits.max_steps,
                description="Denoising steps",
            )
        )
    fields += [
        FieldInfo(
            name=name,
            type="number",
            default=_plain(defaults.get(name)),
            minimum=0,
            maximum=100,
            description=text,
        )
        for name, text in _GUIDANCE.items()
        if name in takes
    ]
    fields.append(
        FieldInfo(
            name="seed",
            type="integer",
            minimum=0,
            maximum=SEED_MAX,
            description="Empty: a random seed, reported back",
        )
    )
    if info.takes_image:
        fields.append(
            FieldInfo(
                name="input_reference",
                type="image",
                required="image" in info.required_params,
                maximum=limits.max_side,
                description="The input image (PNG, JPEG or WebP)",
            )
        )
    if info.takes_mask:
        fields.append(
            FieldInfo(
                name="mask",
                type="image",
                required="mask_image" in info.required_params,
                maximum=limits.max_side,
                description="Inpainting mask: white = repaint (PNG, JPEG or WebP, the input image's size)",
            )
        )
    fields.append(
        FieldInfo(name="lora", type="adapters", description="LoRA adapters served here, each with a scale")
    )
    return ModelParameters(job_route=job_route, fields=fields, limits=listed)
