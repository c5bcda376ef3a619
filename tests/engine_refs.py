"""Single-process references for the engine parity tests: plain diffusers / transformers on the same folder.

The reference copies every weight into fresh memory after ``from_pretrained``: safetensors maps the file, and an
unaligned mapped weight changes CPU BLAS rounding (~2e-7 on the tiny Wan), while the sharded path holds its
weights in freshly allocated buffers. With that, the sharded layouts are compared for exact equality. One thread,
as in the worker ranks.
"""

from __future__ import annotations

import contextlib
from functools import cache
from pathlib import Path

import numpy as np
import torch

from hsdp.engine import SamplingParams
from hsdp.engine.causal_lm import generation_kwargs
from hsdp.models.builtin import resolve_model


@contextlib.contextmanager
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _fresh_copies(*modules: torch.nn.Module) -> None:
    for module in modules:
        for param in module.parameters():
            param.data = param.data.clone()


@cache
def _pipeline(path: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path)
    _fresh_copies(*(m for m in pipe.components.values() if isinstance(m, torch.nn.Module)))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_video(path: Path, prompt: str, seed: int, params: SamplingParams, defaults: dict) -> np.ndarray:
    """Frames from ``WanPipeline.__call__`` in this process, with the engine's defaults filled in."""
    value = {k: getattr(params, k) if getattr(params, k) is not None else defaults[k] for k in defaults}
    with one_thread(), torch.no_grad():
        return _pipeline(path)(
            prompt,
            negative_prompt=params.negative_prompt,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
            **value,
        ).frames[0]


def reference_param_bytes(path: Path) -> int:
    """Bytes of every parameter of the single-process pipeline (all components, unsharded)."""
    modules = [m for m in _pipeline(path).components.values() if isinstance(m, torch.nn.Module)]
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


@cache
def _causal_lm(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    _fresh_copies(model)
    return model, AutoTokenizer.from_pretrained(path)


def reference_tokens(path: Path, prompt: str, seed: int, params: SamplingParams) -> list[int]:
    """New token ids from ``model.generate`` in this process."""
    model, tokenizer = _causal_lm(path)
    inputs = tokenizer(prompt, return_tensors="pt")
    with one_thread(), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(**inputs, **generation_kwargs(params), pad_token_id=tokenizer.pad_token_id)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def builtin(name: str, cache_dir: Path) -> Path:
    return resolve_model(name, cache_dir=cache_dir)


def reference_pipeline(path: Path, prompt: str, seed: int, *, vae_tiling: bool = False, **call_kwargs) -> np.ndarray:
    """Frames (video pipelines), images or waveforms (audio pipelines) of the pipeline's own ``__call__`` in this
    process, given every argument explicitly; ``vae_tiling``: with diffusers' ``vae.enable_tiling()``."""
    pipe = _pipeline(path)
    if vae_tiling:
        pipe.vae.enable_tiling()
    try:
        with one_thread(), torch.no_grad():
            result = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **call_kwargs)
    finally:
        if vae_tiling:
            pipe.vae.disable_tiling()
    if hasattr(result, "frames"):
        return result.frames[0]
    return result.audios if hasattr(result, "audios") else result.images


def input_image(size: int, seed: int = 0):
    """A deterministic RGB input image (noise, so every pixel matters)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
