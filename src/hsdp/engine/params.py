"""Sampling parameters, and their validation against the model and the parallel layout (caller side).

Every check here runs before any rank does work, so bad input is a ``ValueError`` that names the parameter, the
value and the fix. Each prompt becomes one :class:`Request` with its own seed (``seed + i`` for the i-th prompt
unless a list of seeds is given); a request is always generated alone, so its output does not depend on the
layout or on which other requests ran beside it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from hsdp.config import ParallelConfig
from hsdp.engine.images import load_image
from hsdp.engine.model_info import ModelInfo
from hsdp.models.description import INDEX_FILE

__all__ = [
    "SamplingParams",
    "Request",
    "build_requests",
    "request_slots",
    "lockstep_rounds",
    "batch_size_problem",
    "PIPELINE_ARGS",
    "video_fps",
    "frame_rate_args",
]


def video_fps(info: ModelInfo, fps: int | None, default: int = 8) -> int:
    """A written video's frame rate: ``fps`` as asked, else the rate the pipeline generates at (its ``frame_rate``
    default: LTX-2's sound track is made for it), else ``default`` (``hsdp generate`` 8, ``hsdp serve`` 16)."""
    return fps or int(info.defaults.get("frame_rate") or default)


def frame_rate_args(info: ModelInfo, fps: int | None) -> dict:
    """The asked ``fps`` for a pipeline that generates for a frame rate (``frame_rate``), so that the video and its
    sound match (issue 33 item 2): what ``hsdp generate --fps`` and the server's ``fps`` both pass."""
    return {"frame_rate": float(fps)} if fps and "frame_rate" in info.call_params else {}


PER_REQUEST_INPUTS = ("negative_prompt", "image", "mask_image")
"""Inputs given once for all prompts or as one per prompt (a list)."""

PIPELINE_ARGS = (
    "num_inference_steps",
    "height",
    "width",
    "num_frames",
    "guidance_scale",
    "guidance_scale_2",
    "true_cfg_scale",
    "max_sequence_length",
)
"""Fields passed to the pipeline's ``__call__`` under their own name, when it accepts them."""

RESERVED_ARGS = frozenset(
    {"prompt", "negative_prompt", "image", "mask_image", "generator", "output_type", "return_dict", "callback"}
    | {"callback_steps"}
    | {"callback_on_step_end", "callback_on_step_end_tensor_inputs", *PIPELINE_ARGS}
)
"""``__call__`` arguments the engine sets itself; ``pipeline_kwargs`` may not name them."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to generate. ``None`` means the model's default (``hsdp_defaults.json`` or the pipeline's own).

    Diffusion fields are passed to the pipeline's ``__call__`` when it takes them; a field that is set but that
    the pipeline does not take is an error, not silently dropped.
    """

    seed: int | list[int] | None = None
    """Seed of the first request (the i-th prompt gets ``seed + i``), or one seed per prompt; None = random."""
    # -- diffusion -------------------------------------------------------------------------------------------
    num_inference_steps: int | None = None
    height: int | None = None
    """Pixels; a multiple of the model's ``spatial_multiple`` (16 for Wan and FLUX, 8 for SDXL)."""
    width: int | None = None
    num_frames: int | None = None
    """Video pipelines: ``4k + 1`` for Wan (the VAE compresses time 4x after the first frame)."""
    guidance_scale: float | None = None
    """Classifier-free guidance weight (a distilled guidance embedding for FLUX)."""
    guidance_scale_2: float | None = None
    """Wan2.2: guidance of the low-noise transformer (``transformer_2``); None = ``guidance_scale``."""
    true_cfg_scale: float | None = None
    """FLUX / Qwen-Image: > 1 with a negative prompt runs a separate unconditional pass (true CFG)."""
    negative_prompt: str | list[str] | None = None
    """For the unconditional branch: one for all prompts, or one per prompt."""
    max_sequence_length: int | None = None
    """Text-encoder tokens (prompts are padded or truncated to it)."""
    audio_seconds: float | None = None
    """Audio pipelines: the length of the audio to make, passed as the pipeline's own argument for it
    (``audio_end_in_s``, ``audio_length_in_s``, ...: :data:`hsdp.engine.model_info.AUDIO_LENGTH_PARAMS`)."""
    image: Any = None
    """Input image of image-to-video / editing pipelines: a PIL image, a path or bytes; or one per prompt."""
    mask_image: Any = None
    """Inpainting mask (white = repaint), for pipelines that take ``mask_image``; or one per prompt."""
    pipeline_kwargs: dict[str, Any] = field(default_factory=dict)
    """Any other argument of the pipeline's ``__call__`` (checked against its signature), e.g. ``strength``."""
    cache: str | None = None
    """A diffusers step cache on the denoiser (:mod:`hsdp.engine.cache`: ``first-block``, ``taylorseer``,
    ``magcache``, ``pab``, ``fastercache``); None = the engine's (``Engine(cache=...)``), ``"none"`` = off."""
    cache_config: dict[str, Any] | None = None
    """Fields of the cache's diffusers config class, e.g. ``{"threshold": 0.1}``."""
    # -- causal LM -------------------------------------------------------------------------------------------
    max_new_tokens: int = 32
    temperature: float = 0.0
    """0 = greedy decoding; > 0 samples (with ``top_p`` / ``top_k``)."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k filtering."""
    stop_token_ids: list[int] | None = None
    """Token ids that end a sequence; None = the model's end-of-sequence token."""


@dataclass(frozen=True)
class Request:
    """One prompt to generate, as sent to the ranks (images already decoded)."""

    request_id: int
    prompt: str
    seed: int
    negative_prompt: str | None = None
    image: Any = None
    mask_image: Any = None
    filler: bool = False
    """A copy of another request of its round, run only so that this rank does the same sharded forwards as the
    ranks beside it (see :func:`lockstep_rounds`); its output is dropped and it reports no progress."""


def batch_size_problem(kind: str, batch_size: int, flag: str = "batch_size") -> str | None:
    """Why ``batch_size`` cannot be used for a model of ``kind`` (None when it can); ``flag`` names it as the
    caller takes it (``--batch-size``, ``--max-batch-size`` or the API's ``batch_size``)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        return f"{flag} {batch_size}: must be an integer >= 1"
    if batch_size > 1 and kind != "diffusion":
        return (
            f"{flag} {batch_size}: causal LMs generate one request at a time per rank (per-request sampling "
            "seeds); use --request-parallel to run several side by side"
        )
    return None


def input_signature(request: Request) -> tuple:
    """What of a request's own inputs decides which sharded forwards the pipeline runs for it: whether it has a
    negative prompt (one more text encoding, and for true-CFG pipelines an unconditional pass per step) and each
    input image or mask, with its size (one more VAE encoding, whose tiles and slices follow the size). Everything
    else that changes the forwards (steps, sizes, guidance) is one value per call. Requests of one signature can
    also be batched: a pipeline takes a list of such inputs for every prompt or none."""
    return tuple(
        None if value is None else getattr(value, "size", True)
        for value in (getattr(request, name) for name in PER_REQUEST_INPUTS)
    )


def lockstep_rounds(
    requests: list[Request], slots: int, batch_size: int, single_inputs: frozenset[str] = frozenset()
) -> list[list[list[Request]]]:
    """The groups each rank runs, round by round: ``rounds[k][d]`` is the batch that the rank with data-parallel
    index ``d`` generates in round ``k`` (one group per round when ``slots`` is 1).

    Request-parallel ranks run different requests but share the FSDP shard group, so in every round they must run
    the same sequence of sharded forwards: every request of a round has the same :func:`input_signature`, and
    every rank's batch the same size. Requests are grouped by signature (in order of first appearance) and dealt
    ``d, d + slots, ...`` within each run of ``slots * batch_size``, as when the inputs are uniform; a rank that a
    round leaves short runs *fillers* (copies of the round's first request, output dropped). Padding costs the
    filler's compute, but every real output is that of one process running the request alone, and no input is
    changed or refused (encoding an empty negative prompt instead of none would change the images). Every rank
    computes the same rounds from the same requests, so they agree without a collective. Requests that give one
    of ``single_inputs`` (inputs the pipeline takes one of per call: :attr:`ModelInfo.single_inputs`) run one
    per rank per round whatever ``batch_size`` says.
    """
    by_signature: dict[tuple, list[Request]] = {}
    for request in requests:
        by_signature.setdefault(input_signature(request), []).append(request)
    rounds = []
    for signature, members in by_signature.items():
        given = {name for name, value in zip(PER_REQUEST_INPUTS, signature, strict=True) if value is not None}
        per_round = slots * (1 if given & single_inputs else batch_size)
        for start in range(0, len(members), per_round):
            chunk = members[start : start + per_round]
            size = -(-len(chunk) // slots)
            filler = replace(chunk[0], filler=True)
            rounds.append([chunk[d::slots] + [filler] * (size - len(chunk[d::slots])) for d in range(slots)])
    return rounds


def request_slots(config: ParallelConfig) -> int:
    """How many requests run side by side: every HSDP rank in request-parallel mode, else one."""
    return config.data_parallel_size if config.request_parallel else 1


def _as_list(value, n: int, name: str, problems: list[str]) -> list:
    if not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        problems.append(
            f"{name} has {len(value)} entries but there are {n} prompts; give one per prompt or a single value"
        )
        return [None] * n
    return list(value)


def cli_flag(name: str) -> str:
    """How ``hsdp generate`` names a field (``true_cfg_scale`` -> ``--true-cfg-scale``): the default naming of
    :func:`build_requests`' messages. ``hsdp serve`` passes its request fields' names instead."""
    return "--" + name.replace("_", "-")


Naming = Callable[[str], str]


def _not_taken(info: ModelInfo, name: str, name_of: Naming) -> str:
    """Why the pipeline refuses the argument ``name``: it has no such argument, or this folder's config turns it
    off (``guidance_scale_2`` without ``boundary_ratio``: Wan 2.1, not Wan 2.2's two experts)."""
    key = info.config_gated.get(name)
    if key is None:
        return f"{name}: {info.class_name} takes no {name} (drop {name_of(name)})"
    return (
        f"{name}: this {info.class_name} takes no {name}: its pipeline config ({INDEX_FILE}) leaves {key} unset, which "
        f"{name} needs (drop {name_of(name)})"
    )


def _argument_problems(info: ModelInfo, p: SamplingParams, name_of: Naming) -> list[str]:
    """Arguments set that the pipeline does not take, and required ones that are missing."""
    problems = []
    for name in (*PIPELINE_ARGS, "negative_prompt", "image", "mask_image"):
        if getattr(p, name) is not None and name not in info.call_params:
            problems.append(
                f"{_not_taken(info, name, name_of)}; it takes "
                f"{', '.join(sorted(a for a in info.call_params if a in (*PIPELINE_ARGS, *PER_REQUEST_INPUTS)))}"
            )
    for name in sorted(info.required_params - {"prompt"}):
        if name in PER_REQUEST_INPUTS and getattr(p, name) is None:
            problems.append(
                f"{name}: {info.class_name} needs an input {name.replace('_', ' ')} ({name_of(name)})"
            )
    if p.audio_seconds is not None:
        if info.audio_length_param is None:
            problems.append(
                f"audio_seconds: {info.class_name} takes no audio length (drop {name_of('audio_seconds')})"
            )
        elif not isinstance(p.audio_seconds, (int, float)) or p.audio_seconds <= 0:
            problems.append(f"audio_seconds={p.audio_seconds} must be > 0 ({name_of('audio_seconds')})")
        elif info.max_audio_seconds is not None and p.audio_seconds > info.max_audio_seconds:
            problems.append(
                f"audio_seconds={p.audio_seconds} exceeds the {info.max_audio_seconds:g} s that {info.class_name} "
                f"makes at most ({name_of('audio_seconds')})"
            )
    unknown = sorted(set(p.pipeline_kwargs) - info.call_params)
    if unknown:
        problems.append(
            f"pipeline_kwargs: {info.class_name}.__call__ takes no {', '.join(unknown)}; it takes "
            f"{', '.join(sorted(info.call_params - RESERVED_ARGS))}"
        )
    reserved = sorted(set(p.pipeline_kwargs) & RESERVED_ARGS)
    if reserved:
        problems.append(f"pipeline_kwargs: {', '.join(reserved)} are set by the engine or by their own field")
    return problems


def _shape_problems(info: ModelInfo, config: ParallelConfig, p: SamplingParams, name_of: Naming) -> list[str]:
    problems = []
    m, k = info.spatial_multiple, info.temporal_factor
    for name in ("height", "width"):
        value = getattr(p, name)
        if value is not None and (not isinstance(value, int) or value <= 0 or value % m):
            problems.append(
                f"{name}={value} must be a positive multiple of {m} for {info.family} ({name_of(name)}); "
                f"e.g. {max(m, (value if isinstance(value, int) else m) // m * m)}"
            )
    frames = p.num_frames
    if frames is not None and (not isinstance(frames, int) or frames < 1 or (frames - 1) % k):
        below = max(1, ((frames if isinstance(frames, int) else 1) - 1) // k * k + 1)
        near = f"{below} or {below + k}" if isinstance(frames, int) and frames > 1 else f"{below}"
        problems.append(
            f"num_frames={frames} must be {k}k+1 (1, {k + 1}, {2 * k + 1}, ...: the VAE compresses {k} frames into "
            f"one after the first) ({name_of('num_frames')}); the nearest are {near}"
        )
    steps = p.num_inference_steps
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        problems.append(f"num_inference_steps={steps} must be >= 1 ({name_of('num_inference_steps')})")
    sp = config.sequence_parallel_size
    if sp > 1 and not problems and p.height and p.width:
        latent_frames = (p.num_frames - 1) // k + 1 if p.num_frames else 1
        tokens = latent_frames * (p.height // m) * (p.width // m)
        if tokens % sp:
            problems.append(
                f"--ulysses-degree {sp} splits the {tokens} latent tokens ({latent_frames} latent frames x "
                f"{p.height // m} x {p.width // m}), which is not divisible by {sp}; change --height/--width"
                f"{'/--num-frames' if info.output == 'video' else ''}"
            )
    return problems


def _cfg_problems(info: ModelInfo, config: ParallelConfig, p: SamplingParams, name_of: Naming) -> list[str]:
    if config.cfg_parallel_size != 2:
        return []
    scale_name = info.cfg_scale_param
    scale = getattr(p, scale_name)
    if not (scale or 0) > 1:
        return [
            f"--cfg-parallel-size 2 splits the two guidance branches, but {scale_name}={scale} runs only one; "
            f"set {name_of(scale_name)} > 1 or --cfg-parallel-size 1"
        ]
    negatives = p.negative_prompt if isinstance(p.negative_prompt, (list, tuple)) else [p.negative_prompt]
    if scale_name == "true_cfg_scale" and any(n is None for n in negatives):
        return [
            f"--cfg-parallel-size 2: {info.class_name} runs its unconditional pass only with a negative prompt; "
            f"give {name_of('negative_prompt')} (for every prompt) or use --cfg-parallel-size 1"
        ]
    return []


def _diffusion_problems(
    info: ModelInfo, config: ParallelConfig, p: SamplingParams, name_of: Naming
) -> list[str]:
    from hsdp.engine.cache import cache_problems

    return (
        _argument_problems(info, p, name_of)
        + _shape_problems(info, config, p, name_of)
        + _cfg_problems(info, config, p, name_of)
        + cache_problems(None if p.cache == "none" else p.cache, p.cache_config, info, config)
    )


def _fill_defaults(info: ModelInfo, params: SamplingParams) -> SamplingParams:
    """The model's defaults for what ``params`` leaves unset; defaults for other ``__call__`` arguments (e.g.
    Kontext's ``max_area``) go to ``pipeline_kwargs`` unless the caller set them there."""
    names = {f.name for f in fields(params)}
    usable = {k: v for k, v in info.defaults.items() if k in info.call_params}
    filled = {k: v for k, v in usable.items() if k in names and getattr(params, k) is None}
    extra = {k: v for k, v in usable.items() if k not in names and k not in RESERVED_ARGS}
    return replace(params, **filled, pipeline_kwargs={**extra, **params.pipeline_kwargs})


def _images(values: list, field_name: str, problems: list[str]) -> list:
    """The input images, read; ``field_name`` names the input in messages as the caller takes it."""
    images = []
    for i, value in enumerate(values):
        try:
            images.append(None if value is None else load_image(value, field_name))
        except ValueError as exc:
            problems.append(f"{exc}" if len(values) == 1 else f"{field_name}[{i}]: {exc}")
            images.append(None)
    return images


DIFFUSION_ONLY = (*PIPELINE_ARGS, "negative_prompt", "image", "mask_image", "audio_seconds", "cache_config")
"""Fields that only a diffusion pipeline takes: set for a causal LM, they are refused, never ignored."""


def _lm_problems(p: SamplingParams, name_of: Naming) -> list[str]:
    diffusion = [name for name in DIFFUSION_ONLY if getattr(p, name) is not None]
    diffusion += ["pipeline_kwargs"] * bool(p.pipeline_kwargs) + ["cache"] * (p.cache not in (None, "none"))
    problems = [
        f"{name}: a causal LM takes no {name} (it is for diffusion pipelines); drop {name_of(name)}"
        for name in diffusion
    ]
    if not isinstance(p.max_new_tokens, int) or p.max_new_tokens < 1:
        problems.append(f"max_new_tokens={p.max_new_tokens} must be >= 1 ({name_of('max_new_tokens')})")
    if p.temperature < 0:
        problems.append(f"temperature={p.temperature} must be >= 0 (0 = greedy)")
    if not 0 < p.top_p <= 1:
        problems.append(f"top_p={p.top_p} must be in (0, 1]")
    return problems


def build_requests(
    info: ModelInfo,
    config: ParallelConfig,
    prompts: list[str],
    params: SamplingParams,
    name_of: Naming = cli_flag,
) -> tuple[list[Request], SamplingParams]:
    """Validate everything and fill defaults; returns the requests and the concrete parameters (images are
    read and converted here, so the returned parameters hold no image: the requests do). ``name_of`` names a
    field in the messages as the caller sets it: a CLI flag (default) or a request field."""
    problems: list[str] = []
    if not prompts:
        problems.append(f"no prompt given ({name_of('prompt')}); pass at least one")
    problems += [
        f"prompt {i} is not a non-empty string: {p!r}"
        for i, p in enumerate(prompts)
        if not (isinstance(p, str) and p)
    ]
    slots = request_slots(config)
    if prompts and len(prompts) % slots:
        problems.append(
            f"request-parallel HSDP runs {slots} requests side by side (one per rank, in lockstep), but "
            f"{len(prompts)} prompt(s) were given; pass a multiple of {slots} prompts, or drop --request-parallel"
        )
    not_mappings = [
        f"{name}={value!r} must be a dict (a JSON object for {name_of(name)})"
        for name in ("pipeline_kwargs", "cache_config")
        if (value := getattr(params, name)) is not None and not isinstance(value, dict)
    ]
    problems += not_mappings
    if info.kind == "diffusion" and not not_mappings:
        params = _fill_defaults(info, params)
        problems += _diffusion_problems(info, config, params, name_of)
    else:
        problems += _lm_problems(params, name_of)
    n = len(prompts)
    per_request = {name: _as_list(getattr(params, name), n, name, problems) for name in PER_REQUEST_INPUTS}
    for name in ("image", "mask_image"):
        per_request[name] = _images(per_request[name], name_of(name), problems)
    seed = params.seed if params.seed is not None else random.randrange(2**31)
    seeds = [seed + i for i in range(n)] if isinstance(seed, int) else _as_list(seed, n, "seed", problems)
    if problems:
        raise ValueError("invalid generation request:\n" + "\n".join(f"  - {p}" for p in problems))
    requests = [
        Request(i, prompts[i], int(seeds[i]), **{name: per_request[name][i] for name in PER_REQUEST_INPUTS})
        for i in range(n)
    ]
    return requests, replace(params, seed=seed, image=None, mask_image=None)
