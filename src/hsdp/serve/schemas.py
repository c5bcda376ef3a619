"""Request and response bodies of the HTTP API (pydantic), shaped like OpenAI's, vLLM-Omni's and SGLang's.

Field bounds here are absolute (they appear in ``/openapi.json``); the server's own, tighter limits
(:class:`hsdp.serve.settings.ServeLimits`) are checked by :func:`check_limits` and the model's shape rules
(multiples of 16, ``4k + 1`` frames) by the engine's own validation, before a job is queued.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from hsdp.serve.settings import ServeLimits
from hsdp.suggest import closest

__all__ = [
    "ApiError",
    "DiffusionFields",
    "VideoRequest",
    "VideoJob",
    "JobObject",
    "JobRequest",
    "ModelParameters",
    "ImageRequest",
    "ImageEditRequest",
    "ChatImageParams",
    "SpeechRequest",
    "AUDIO_MEDIA_TYPES",
    "CompletionRequest",
    "ChatMessage",
    "ChatCompletionRequest",
    "check_limits",
    "parse_size",
    "closest_fields",
    "unknown_fields_problem",
    "DEFAULT_MODEL_ALIAS",
]

MAX_TEXT = 100_000
"""Absolute cap on any text field; the server's --max-prompt-chars is usually far lower."""
SEED_MAX = 2**32 - 1
DEFAULT_FPS = 16
DEFAULT_MODEL_ALIAS = "default"
"""A ``model`` value always taken to mean the served model: vLLM-Omni's benchmark client sends it."""
JobStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]


class ApiError(Exception):
    """A client-visible error: HTTP status plus an OpenAI-style ``{"error": {...}}`` body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


UNKNOWN_FIELD = "unknown_field"
"""The pydantic error type of a field a body does not declare; its ``ctx`` holds each such field's closest known
name (:func:`closest_fields`) and the hint (:func:`unknown_fields_problem` words it)."""
EXTRA_ARGS_HINT = "other arguments of the pipeline's __call__ go in extra_args"


def closest_fields(names: Iterable[str], known: Iterable[str]) -> dict[str, str | None]:
    """Each unknown name's closest known one (difflib), or None."""
    known = sorted(known)
    return {name: closest(name, known) for name in names}


def unknown_fields_problem(closest: dict[str, str | None], hint: str = "", prefix: str = "") -> str:
    """``num_inference_step: unknown field; did you mean num_inference_steps?``, as OpenAI refuses unknown
    arguments (a typo is never silently ignored); ``prefix`` is the enclosing field's path (``lora.``)."""
    parts = [f"{prefix}{name}: unknown field" + (f"; did you mean {c}?" if c else "") for name, c in closest.items()]
    return "; ".join(parts) + (f" ({hint})" if hint else "")


class _Strict(BaseModel):
    """A request body whose fields are all declared: an unknown one is a 400 naming it and the closest known
    one; pipeline-specific arguments have their own field (``extra_args``).

    ``other_api_fields`` are the names OpenAI's or vLLM-Omni's documented schema for the same route has and this
    one does not declare (issue 33 item 10: vLLM-Omni's own clients send ``bot_task``): they are accepted and kept
    apart (:attr:`other_fields`), the server applies those the pipeline takes and reports the rest as unused
    (``X-Hsdp-Unused-Fields``); only names neither API knows are refused."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="null")
    other_api_fields: ClassVar[frozenset[str]] = frozenset()
    _other: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _known_fields(cls, data: Any, handler: Any) -> Any:
        other = {}
        if isinstance(data, dict) and cls.model_config.get("extra") == "forbid":
            other = {k: v for k, v in data.items() if k not in cls.model_fields and k in cls.other_api_fields}
            data = {k: v for k, v in data.items() if k not in other}
            unknown = [str(k) for k in data if k not in cls.model_fields]
            if unknown:
                closest = closest_fields(unknown, set(cls.model_fields) | cls.other_api_fields)
                hint = EXTRA_ARGS_HINT if "extra_args" in cls.model_fields else ""
                raise PydanticCustomError(
                    UNKNOWN_FIELD,
                    "{problem}",
                    {"closest": closest, "hint": hint, "problem": unknown_fields_problem(closest, hint)},
                )
        model = handler(data)
        if isinstance(model, _Strict):
            model._other = other
        return model

    @property
    def other_fields(self) -> dict[str, Any]:
        """The fields of the other API's schema that were given (name -> value as sent)."""
        return dict(self._other)


class LoraRequest(_Strict):
    """vLLM-Omni's per-request ``lora``: an adapter served by name, or loaded from ``local_path`` (under the
    server's ``--lora-root``) under that name on first use; ``scale`` multiplies its ``lora_alpha / r``."""

    name: str = Field(..., min_length=1, max_length=256)
    local_path: str | None = Field(None, max_length=4096)
    scale: float = Field(1.0, ge=-100.0, le=100.0, allow_inf_nan=False)


MAX_COMPOSED_LORAS = 16
"""The most adapters one request may compose (each needs an adapter slot; ``--max-loras`` bounds them too)."""


def _names_once(value: list[LoraRequest]) -> list[LoraRequest]:
    names = [item.name for item in value]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"names the adapter {', '.join(map(repr, twice))} twice; give each once")
    return value


UNION_TAGS = ("one", "list")
"""The tags of :data:`LoraField`'s branches, which pydantic puts in an error's location (error messages drop
them: ``lora.0.scale``, not ``lora.list.0.scale``)."""

LoraField = (
    Annotated[
        Annotated[LoraRequest, Tag("one")]
        | Annotated[
            list[LoraRequest],
            Field(min_length=1, max_length=MAX_COMPOSED_LORAS),
            AfterValidator(_names_once),
            Tag("list"),  # outermost: the tag names the branch as validated
        ],
        Discriminator(lambda value: "list" if isinstance(value, list) else "one"),
    ]
    | None
)
"""``lora``: one adapter, or a list of them composed with their scales (diffusers' ``set_adapters``)."""
LORA_DESCRIPTION = (
    "vLLM-Omni: the LoRA adapter (and scale) for this request; a list composes several, each with its scale (a "
    "JSON string in multipart forms)"
)


class LoadLoraAdapterRequest(_Strict):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str = Field(..., min_length=1, max_length=256)
    lora_path: str = Field(..., min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(_Strict):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: str = Field(..., min_length=1, max_length=256)


_VLLM_OMNI_GENERATION = frozenset(
    {"bot_task", "system_prompt", "use_system_prompt", "flow_shift", "extra_params", "infer_align_image_size",
     "generator_device", "vae_use_slicing", "vae_use_tiling", "layers", "resolution", "return_stage_metrics"}
)  # fmt: skip
"""vLLM-Omni's generation fields hsdp declares no field for (its ``ImageGenerationRequest``, chat ``extra_body``)."""
_OPENAI_IMAGES = frozenset({"moderation", "output_compression", "partial_images", "stream", "input_fidelity"})
"""OpenAI's images fields hsdp declares no field for (generations and edits)."""
_VLLM_OMNI_EDITS = frozenset({"sys_type", "reference_image", "url", "url[]"})
"""vLLM-Omni's ``/v1/images/edits`` form fields beyond its generation ones."""
_VLLM_OMNI_VIDEOS = frozenset(
    {"image_reference", "video_params", "boundary_ratio", "flow_shift", "generate_sound", "sound_duration",
     "enable_frame_interpolation", "frame_interpolation_exp", "frame_interpolation_scale",
     "frame_interpolation_model_path", "extra_params"}
)  # fmt: skip
"""vLLM-Omni's ``VideoGenerationRequest`` fields hsdp declares no field for."""
EXTRA_PARAMS = "extra_params"
"""vLLM-Omni's name for ``extra_args``: merged into them."""


class DiffusionFields(_Strict):
    """Generation fields every diffusion endpoint takes. A field the pipeline's ``__call__`` does not take
    (``true_cfg_scale`` for Wan, ``guidance_scale_2`` for FLUX, ...) is a 400 naming it when set."""

    model: str | None = Field(
        None, max_length=512, description="Served model name or 'default'; omit for this server's model"
    )
    prompt: str = Field(..., min_length=1, max_length=MAX_TEXT)
    negative_prompt: str | None = Field(None, max_length=MAX_TEXT)
    size: str | None = Field(
        None,
        pattern=r"^(auto|\d{1,5}x\d{1,5})$",
        description="'WIDTHxHEIGHT', or 'auto': the input image's size (edits), else the model's default",
    )
    width: int | None = Field(None, ge=1, le=16384)
    height: int | None = Field(None, ge=1, le=16384)
    num_inference_steps: int | None = Field(None, ge=1, le=1000, description="None: the model's default")
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0, allow_inf_nan=False)
    guidance_scale_2: float | None = Field(
        None, ge=0.0, le=100.0, allow_inf_nan=False, description="Wan2.2: the low-noise transformer's"
    )
    true_cfg_scale: float | None = Field(
        None, ge=0.0, le=100.0, allow_inf_nan=False, description="FLUX / Qwen-Image true CFG"
    )
    audio_seconds: float | None = Field(
        None, gt=0.0, le=3600.0, allow_inf_nan=False, description="Audio pipelines: seconds of audio"
    )
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="None: a random seed, reported back")
    lora: LoraField = Field(None, description=LORA_DESCRIPTION)
    extra_args: dict[str, Any] | None = Field(
        None,
        description="Other arguments of the pipeline's __call__ by name, e.g. {\"strength\": 0.6} (checked "
        "against its signature); a JSON string in multipart forms",
    )

    @field_validator("extra_args", "lora", mode="before")
    @classmethod
    def _form_json(cls, value: Any) -> Any:
        """Multipart forms carry ``extra_args`` and ``lora`` as JSON text."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError as exc:
                raise ValueError(f"not valid JSON ({exc}); give a JSON object (lora: or a list of them)") from exc
        return value


class VideoRequest(DiffusionFields):
    """``POST /v1/videos`` and ``/v1/videos/sync``, as JSON or multipart form fields (the input image is the
    ``input_reference`` file part, or a data URL in JSON)."""

    other_api_fields: ClassVar[frozenset[str]] = _VLLM_OMNI_VIDEOS

    num_frames: int | None = Field(
        None, ge=1, le=4096, description="4k+1 for Wan; None: from seconds, else the model's default"
    )
    fps: int | None = Field(
        None,
        ge=1,
        le=240,
        description="Frames per second of the mp4 (and of the pipeline's frame_rate, LTX-2's sound); None: the "
        f"pipeline's frame_rate default, else {DEFAULT_FPS}",
    )
    seconds: int | None = Field(
        None,
        ge=1,
        le=3600,
        description="OpenAI: the length; num_frames = seconds x fps rounded down to the model's rule (t*k+1)",
    )
    user: str | None = Field(None, max_length=512)

    def frames(self, temporal_factor: int, fps: int) -> int | None:
        """``num_frames``, or the frames of ``seconds`` at ``fps`` rounded down to ``temporal_factor * k + 1``
        (the VAE's temporal compression, :meth:`hsdp.models.description.ModelDescription.size_rule`)."""
        if self.num_frames is not None or self.seconds is None:
            return self.num_frames
        frames = self.seconds * fps
        return frames // temporal_factor * temporal_factor + 1 if temporal_factor > 1 else frames


class VideoError(BaseModel):
    code: str
    message: str


class VideoJob(BaseModel):
    """A video job as ``GET /v1/videos/{id}`` reports it (OpenAI's video object plus the generation fields)."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: JobStatus
    progress: int = Field(..., ge=0, le=100)
    created_at: int
    completed_at: int | None = None
    prompt: str
    size: str
    seconds: str
    num_frames: int
    fps: int
    seed: int
    attempts: int = Field(
        0, description="Engine runs started; a run interrupted by a worker failure is repeated"
    )
    error: VideoError | None = None
    step: int = Field(0, ge=0, description="Denoising steps done (of steps) in the current run")
    steps: int | None = Field(None, description="The run's denoising steps, as the pipeline counts them")
    eta_seconds: float | None = Field(
        None, description="While it runs: the denoising steps left at the pace of those done (decoding follows)"
    )


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoJob]


class JobObject(VideoJob):
    """An asynchronous job of any output (``/v1/jobs``): the video job's fields, ``output`` saying what it makes
    and ``content_type`` what ``/content`` answers with; the video fields are null for images and audio."""

    object: Literal["job"] = "job"
    output: Literal["video", "image", "audio"]
    content_type: str
    size: str | None = None
    seconds: str | None = None
    num_frames: int | None = None
    fps: int | None = None


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobObject]


class DeletedJob(BaseModel):
    id: str
    object: Literal["job.deleted"] = "job.deleted"
    deleted: bool


class JobRequest(VideoRequest):
    """``POST /v1/jobs``: the video request's fields (``num_frames``, ``fps`` and ``seconds`` for video
    pipelines), plus the file format of images and audio."""

    output_format: Literal["png", "jpeg", "webp", "wav", "flac", "mp3"] | None = Field(
        None, description="Images: png (default), jpeg or webp; audio: wav (default), flac or mp3"
    )


class DeletedVideo(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool


OutputFormat = Literal["png", "jpeg", "jpg", "webp"]


class ImageRequest(DiffusionFields):
    """OpenAI ``POST /v1/images/generations`` (``n`` images, seeds ``seed + i``) plus vLLM-Omni's fields."""

    other_api_fields: ClassVar[frozenset[str]] = _OPENAI_IMAGES | _VLLM_OMNI_GENERATION

    n: int = Field(1, ge=1, le=64)
    response_format: Literal["b64_json", "url"] | None = Field(None, description="Only b64_json is served")
    output_format: OutputFormat = Field("png", description="Encoding of b64_json")
    quality: str | None = Field(None, max_length=64, description="Accepted and ignored")
    style: str | None = Field(None, max_length=64, description="Accepted and ignored")
    background: str | None = Field(None, max_length=64, description="Accepted and ignored")
    user: str | None = Field(None, max_length=512)


class ImageEditRequest(ImageRequest):
    """OpenAI ``POST /v1/images/edits`` form fields (the ``image`` / ``image[]`` and ``mask`` / ``mask_image``
    files are read beside them)."""

    other_api_fields: ClassVar[frozenset[str]] = _OPENAI_IMAGES | _VLLM_OMNI_GENERATION | _VLLM_OMNI_EDITS
    size: str | None = Field(
        "auto", pattern=r"^(auto|\d{1,5}x\d{1,5})$", description="'WIDTHxHEIGHT' or 'auto' (the image's size)"
    )
    strength: float | None = Field(
        None, ge=0.0, le=1.0, allow_inf_nan=False, description="Pipelines that take it (img2img, inpainting)"
    )


class ChatAudioOutput(_Strict):
    """OpenAI's chat ``audio`` parameter: the format of ``message.audio.data`` (the voice is accepted and
    ignored, as on ``/v1/audio/speech``)."""

    format: Literal["wav", "flac", "mp3", "pcm16"] = "wav"
    voice: str | dict | None = None


class ChatImageParams(DiffusionFields):
    """Generation parameters of a chat completion on a diffusion model, as vLLM-Omni reads them from
    ``extra_body`` (nested in the JSON, or flattened to the top level by the ``openai`` client)."""

    other_api_fields: ClassVar[frozenset[str]] = _VLLM_OMNI_GENERATION

    num_outputs_per_prompt: int = Field(1, ge=1, le=64, description="Images to generate")
    num_frames: int | None = Field(None, ge=1, le=4096, description="Video pipelines")
    fps: int | None = Field(
        None, ge=1, le=240, description="Video pipelines: frames per second of the mp4 (as /v1/videos' fps)"
    )
    output_format: OutputFormat = "png"
    modalities: list[Literal["text", "image", "video", "audio"]] | None = Field(
        None, description="OpenAI: ['audio'] answers in message.audio (audio pipelines)"
    )
    audio: ChatAudioOutput | None = Field(None, description="OpenAI: the answer's audio format (audio pipelines)")


AudioFormat = Literal["wav", "flac", "mp3", "pcm"]
AUDIO_MEDIA_TYPES = {"wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg", "pcm": "audio/pcm"}


class SpeechRequest(DiffusionFields):
    """OpenAI ``POST /v1/audio/speech`` (what the ``openai`` client's ``audio.speech.create`` sends) on an audio
    pipeline: ``input`` is the prompt; the generation fields come beside it (``extra_body``)."""

    prompt: str | None = Field(None, max_length=MAX_TEXT, description="Ignored: the prompt is input")
    input: str = Field(..., min_length=1, max_length=MAX_TEXT, description="What to make, as text")
    voice: str | dict | None = Field(
        None, description="Accepted and ignored: a text-to-audio pipeline has no voices (the client needs one)"
    )
    instructions: str | None = Field(None, max_length=MAX_TEXT, description="Accepted and ignored")
    response_format: AudioFormat = Field(
        "mp3", description="OpenAI's default mp3; pcm as OpenAI's: 24 kHz mono 16-bit little-endian"
    )
    speed: float = Field(1.0, ge=0.25, le=4.0, allow_inf_nan=False, description="Only 1.0 is served")
    stream_format: Literal["audio"] | None = Field(None, description="Only the whole file ('audio') is served")


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str = "png"
    size: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = Field(None, max_length=512)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=100_000, description="0: no top-k filtering")
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="Up to 4 strings; the text ends before the first")
    n: int = Field(1, ge=1, le=1, description="One choice per prompt")
    user: str | None = Field(None, max_length=512)
    lora: LoraField = Field(None, description=LORA_DESCRIPTION)


class CompletionRequest(_SamplingFields):
    """OpenAI ``POST /v1/completions``."""

    prompt: str | list[str] = Field(..., description="A prompt or a list of prompts (one choice each)")
    max_tokens: int = Field(16, ge=1, le=1_000_000)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str = Field(..., max_length=MAX_TEXT)


class ImageUrl(BaseModel):
    url: str = Field(..., description="A data URL (data:image/png;base64,...); nothing is fetched")
    detail: str | None = Field(None, max_length=64)


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] = Field(
        ..., description="Text, or a list of text and (diffusion models) image_url parts"
    )
    name: str | None = Field(None, max_length=256)

    def text(self, sep: str = "") -> str:
        if isinstance(self.content, str):
            return self.content
        return sep.join(p.text for p in self.content if isinstance(p, TextPart))

    def images(self) -> list[ImagePart]:
        return [] if isinstance(self.content, str) else [p for p in self.content if isinstance(p, ImagePart)]


class ChatCompletionRequest(_SamplingFields):
    """OpenAI ``POST /v1/chat/completions``. Other fields are kept here and checked by the route: on a diffusion
    model they are the generation parameters (:class:`ChatImageParams`), also when nested under ``extra_body``;
    on a causal LM each is a 400 (:meth:`unknown_problem`)."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="null")

    messages: list[ChatMessage] = Field(..., min_length=1, max_length=256)
    n: int = Field(
        1, ge=1, le=64, description="Choices: a diffusion model makes n (seeds seed + i); a causal LM answers one"
    )
    max_tokens: int | None = Field(
        None, ge=1, le=1_000_000, description="Deprecated name of max_completion_tokens"
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)

    def token_budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16

    def unknown_problem(self) -> str | None:
        """The fields a text chat does not take (all it kept), named with the closest known ones."""
        extra = list(self.model_extra or {})
        return unknown_fields_problem(closest_fields(extra, type(self).model_fields)) if extra else None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every 4xx: OpenAI's error shape."""

    error: ErrorDetail


class Health(BaseModel):
    status: str
    model: str
    engine: str


class FieldInfo(BaseModel):
    """One request field the served model takes, for forms and clients (the playground at ``/`` reads these)."""

    name: str
    type: Literal["text", "integer", "number", "size", "image", "adapters"]
    default: Any = Field(None, description="The model's default (null: none, or random for seed)")
    minimum: int | float | None = None
    maximum: int | float | None = Field(
        None, description="This server's limit where it has one (hsdp serve --max-*)"
    )
    multiple_of: int | None = Field(None, description="Sizes: each side a multiple of this")
    required: bool = False
    description: str = ""


class ModelParameters(BaseModel):
    """What a request to this model may set, with the server's limits and the model's defaults."""

    job_route: str | None = Field(None, description="The asynchronous job route (poll, download, cancel)")
    fields: list[FieldInfo]
    limits: dict[str, int] = Field(default_factory=dict, description="This server's limits (hsdp serve --max-*)")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hsdp"
    kind: Literal["diffusion", "causal_lm"]
    outputs: list[str] = Field(default_factory=list, description="What the model makes: video, image, audio, text")
    routes: list[str] = Field(default_factory=list, description="The generation routes that serve it")
    root: str | None = None
    """With ``--lora``: the adapter folder (vLLM's card for a LoRA module)."""
    parent: str | None = None
    """With ``--lora``: the base model the adapter is applied to."""
    parameters: ModelParameters | None = Field(
        None, description="The base model's card only: the fields its requests take, with limits and defaults"
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def parse_size(size: str | None, width: int | None, height: int | None) -> tuple[int | None, int | None]:
    """``size='WxH'`` or ``width``/``height`` (not both, unless they agree); None means the model's default."""
    if size is None or size == "auto":
        return width, height
    w, h = (int(v) for v in size.split("x"))
    if (width is not None and width != w) or (height is not None and height != h):
        raise ApiError(
            400,
            f"size={size!r} disagrees with width={width}/height={height}; give one or the other",
            param="size",
        )
    return w, h


def _too_long(name: str, text: str | None, limit: int) -> str | None:
    if text is not None and len(text) > limit:
        return (
            f"{name} has {len(text)} characters; this server allows {limit} (hsdp serve --max-prompt-chars)"
        )
    return None


def check_limits(
    request: BaseModel, limits: ServeLimits, width: int | None = None, height: int | None = None
) -> None:
    """Raise a 400 naming every field over this server's limits (and the flag that raises each limit)."""
    problems: list[tuple[str, str]] = []

    def check(param: str, message: str | None) -> None:
        if message:
            problems.append((param, message))

    for name in ("prompt", "negative_prompt"):
        value = getattr(request, name, None)
        for i, text in enumerate([value] if isinstance(value, str) or value is None else value):
            check(
                name,
                _too_long(name if isinstance(value, str) else f"{name}[{i}]", text, limits.max_prompt_chars),
            )
    for i, message in enumerate(getattr(request, "messages", None) or []):
        check("messages", _too_long(f"messages[{i}].content", message.text(), limits.max_prompt_chars))
    for name, value in (("width", width), ("height", height)):
        if value is not None and value > limits.max_side:
            check(
                name, f"{name}={value} exceeds this server's {limits.max_side} pixels (hsdp serve --max-side)"
            )
    frames = getattr(request, "num_frames", None)
    if frames is not None and frames > limits.max_frames:
        check(
            "num_frames",
            f"num_frames={frames} exceeds this server's {limits.max_frames} (hsdp serve --max-frames)",
        )
    steps = getattr(request, "num_inference_steps", None)
    if steps is not None and steps > limits.max_steps:
        check(
            "num_inference_steps",
            f"num_inference_steps={steps} exceeds {limits.max_steps} (hsdp serve --max-steps)",
        )
    for name in ("n", "num_outputs_per_prompt"):
        count = getattr(request, name, None)
        if count is not None and count > limits.max_images:
            check(
                name,
                f"{name}={count} exceeds this server's {limits.max_images} images per request "
                "(hsdp serve --max-images)",
            )
    if isinstance(request, (CompletionRequest, ChatCompletionRequest)):
        budget = request.max_tokens if isinstance(request, CompletionRequest) else request.token_budget()
        if budget > limits.max_new_tokens:
            check(
                "max_tokens",
                f"max_tokens={budget} exceeds {limits.max_new_tokens} (hsdp serve --max-new-tokens)",
            )
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stops) > 4 or any(not s for s in stops):
            check("stop", "stop takes up to 4 non-empty strings")
    if isinstance(request, CompletionRequest):
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if not prompts or len(prompts) > limits.max_prompts:
            check("prompt", f"prompt must be a string or a list of 1 to {limits.max_prompts} strings")
        if any(not p for p in prompts):
            check("prompt", "every prompt must be a non-empty string")
    if problems:
        raise ApiError(400, "; ".join(m for _, m in problems), param=problems[0][0], code="limit_exceeded")


_ID = re.compile(r"^[a-z]+_[0-9a-f]{32}$")


def valid_job_id(job_id: str) -> bool:
    return bool(_ID.match(job_id))
