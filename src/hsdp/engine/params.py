"""Sampling parameters, and their validation against the model and the parallel layout (caller side).

Every check here runs before any rank does work, so bad input is a ``ValueError`` that names the parameter, the
value and the fix. Each prompt becomes one :class:`Request` with its own seed (``seed + i`` for the i-th prompt
unless a list of seeds is given); a request is always generated alone, so its output does not depend on the
layout or on which other requests ran beside it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields, replace

from hsdp.config import ParallelConfig
from hsdp.engine.model_info import ModelInfo

__all__ = ["SamplingParams", "Request", "build_requests", "request_slots"]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to generate. ``None`` means the model's default (``hsdp_defaults.json`` or the pipeline's own)."""

    seed: int | list[int] | None = None
    """Seed of the first request (the i-th prompt gets ``seed + i``), or one seed per prompt; None = random."""
    # -- video diffusion -----------------------------------------------------------------------------------
    num_inference_steps: int | None = None
    height: int | None = None
    """Pixels; a multiple of 16 for Wan (VAE downsampling x patch size)."""
    width: int | None = None
    num_frames: int | None = None
    """``4k + 1`` for Wan (the VAE compresses time 4x after the first frame)."""
    guidance_scale: float | None = None
    """Classifier-free guidance weight; > 1 runs a second (unconditional) branch, which CFG parallel splits off."""
    guidance_scale_2: float | None = None
    """Wan2.2: guidance of the low-noise transformer (``transformer_2``); None = ``guidance_scale``."""
    negative_prompt: str | list[str] | None = None
    """For the unconditional branch: one for all prompts, or one per prompt."""
    max_sequence_length: int | None = None
    """Text-encoder tokens (prompts are padded or truncated to it)."""
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
    """One prompt to generate, as sent to the ranks."""

    request_id: int
    prompt: str
    seed: int
    negative_prompt: str | None = None


def request_slots(config: ParallelConfig) -> int:
    """How many requests run side by side: every HSDP rank in request-parallel mode, else one."""
    return config.data_parallel_size if config.request_parallel else 1


def _as_list(value, n: int, name: str, problems: list[str]) -> list:
    if value is None or isinstance(value, (str, int)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        problems.append(
            f"{name} has {len(value)} entries but there are {n} prompts; give one per prompt or a single value"
        )
        return [None] * n
    return value


def _diffusion_problems(info: ModelInfo, config: ParallelConfig, p: SamplingParams) -> list[str]:
    problems = []
    m, k = info.spatial_multiple, info.temporal_factor
    for name in ("height", "width"):
        value = getattr(p, name)
        if not isinstance(value, int) or value <= 0 or value % m:
            problems.append(
                f"{name}={value} must be a positive multiple of {m} (--{name}); e.g. {max(m, (value or m) // m * m)}"
            )
    if not isinstance(p.num_frames, int) or p.num_frames < 1 or (p.num_frames - 1) % k:
        near = max(1, ((p.num_frames or 1) - 1) // k * k + 1)
        problems.append(
            f"num_frames={p.num_frames} must be {k}k+1 (1, {k + 1}, {2 * k + 1}, ...) (--num-frames); e.g. {near}"
        )
    if not isinstance(p.num_inference_steps, int) or p.num_inference_steps < 1:
        problems.append(f"num_inference_steps={p.num_inference_steps} must be >= 1 (--num-inference-steps)")
    if config.cfg_parallel_size == 2 and not (p.guidance_scale or 0) > 1:
        problems.append(
            f"--cfg-parallel-size 2 splits the two guidance branches, but guidance_scale={p.guidance_scale} runs only "
            "one; set --guidance-scale > 1 or --cfg-parallel-size 1"
        )
    sp = config.sequence_parallel_size
    if sp > 1 and not problems:
        latent_frames = (p.num_frames - 1) // k + 1
        tokens = latent_frames * (p.height // m) * (p.width // m)
        if tokens % sp:
            problems.append(
                f"--ulysses-degree {sp} splits the {tokens} video tokens ({latent_frames} latent frames x "
                f"{p.height // m} x {p.width // m}), which is not divisible by {sp}; change --height/--width/--num-frames"
            )
    return problems


def _lm_problems(p: SamplingParams) -> list[str]:
    problems = []
    if not isinstance(p.max_new_tokens, int) or p.max_new_tokens < 1:
        problems.append(f"max_new_tokens={p.max_new_tokens} must be >= 1 (--max-new-tokens)")
    if p.temperature < 0:
        problems.append(f"temperature={p.temperature} must be >= 0 (0 = greedy)")
    if not 0 < p.top_p <= 1:
        problems.append(f"top_p={p.top_p} must be in (0, 1]")
    return problems


def build_requests(
    info: ModelInfo, config: ParallelConfig, prompts: list[str], params: SamplingParams
) -> tuple[list[Request], SamplingParams]:
    """Validate everything and fill defaults; returns the requests and the concrete parameters."""
    problems: list[str] = []
    if not prompts:
        problems.append("no prompt given (--prompt); pass at least one")
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
    if info.kind == "diffusion":
        filled = {
            f.name: info.defaults[f.name]
            for f in fields(params)
            if getattr(params, f.name) is None and f.name in info.defaults
        }
        params = replace(params, **filled)
        problems += _diffusion_problems(info, config, params)
    else:
        problems += _lm_problems(params)
    n = len(prompts)
    negatives = _as_list(params.negative_prompt, n, "negative_prompt", problems)
    seed = params.seed if params.seed is not None else random.randrange(2**31)
    seeds = [seed + i for i in range(n)] if isinstance(seed, int) else _as_list(seed, n, "seed", problems)
    if problems:
        raise ValueError("invalid generation request:\n" + "\n".join(f"  - {p}" for p in problems))
    requests = [Request(i, prompts[i], int(seeds[i]), negatives[i]) for i in range(n)]
    return requests, replace(params, seed=seed)
