"""One-process references for LoRA adapters: peft adapters saved by peft itself, and outputs of the base with one
adapter alone (``PeftModel.from_pretrained``), weights in fresh memory and one thread as :mod:`tests.engine_refs`."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import torch

from hsdp.engine import SamplingParams
from tests.engine_refs import _fresh_copies, one_thread


def save_adapter(
    model: torch.nn.Module,
    folder: Path,
    targets: str | list[str] = "all-linear",
    *,
    r: int = 4,
    alpha: int = 8,
    seed: int = 0,
) -> Path:
    """A peft adapter with random ``lora_A`` and ``lora_B`` (so it changes outputs), saved by peft."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    peft_model.save_pretrained(folder)
    peft_model.unload()  # leave ``model`` as it was for the next adapter
    return folder


def _with_adapter(model: torch.nn.Module, adapter: Path | None, scale: float) -> torch.nn.Module:
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if adapter is None:
        return model
    adapted = PeftModel.from_pretrained(model, adapter).base_model.model.eval()
    for layer in adapted.modules():
        if isinstance(layer, LoraLayer):
            layer.set_scale("default", scale)
    return adapted


@cache
def lm_reference(
    base: Path, adapter: Path | None, scale: float, prompt: str, max_new_tokens: int, ids: tuple
) -> tuple[list[int], torch.Tensor]:
    """Greedy new tokens for ``prompt`` and logits for ``ids`` of the base with ``adapter`` alone (or none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base)
    _fresh_copies(model)
    model = _with_adapter(model, adapter, scale)
    tokenizer = AutoTokenizer.from_pretrained(base)
    inputs = tokenizer(prompt, return_tensors="pt")
    with one_thread(), torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        logits = model(torch.tensor(ids)).logits
    return out[0, inputs["input_ids"].shape[1] :].tolist(), logits


@cache
def _pipeline_with(path: Path, adapter: Path | None, scale: float):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path)
    _fresh_copies(*(m for m in pipe.components.values() if isinstance(m, torch.nn.Module)))
    pipe.transformer = _with_adapter(pipe.transformer, adapter, scale)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def video_reference(
    path: Path, adapter: Path | None, scale: float, prompt: str, params: SamplingParams, defaults: dict
) -> np.ndarray:
    """Frames of the one-process pipeline whose transformer carries ``adapter`` alone (or none)."""
    call = {k: getattr(params, k) if getattr(params, k) is not None else v for k, v in defaults.items()}
    with one_thread(), torch.no_grad():
        generator = torch.Generator().manual_seed(params.seed)
        pipe = _pipeline_with(path, adapter, scale)
        return pipe(prompt, generator=generator, output_type="np", **call).frames[0]


def diffusers_folder(adapter: Path) -> Path:
    """The peft adapter folder ``adapter`` as diffusers' own LoRA file (``save_lora_weights``' format, its config in
    the metadata, :func:`hsdp.lora_formats.diffusers_lora`), in a sibling folder: what ``load_lora_weights`` reads."""
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file

    from hsdp.lora_formats import DIFFUSERS_WEIGHTS, diffusers_lora

    out = adapter.with_name(adapter.name + "-diffusers")
    if not (out / DIFFUSERS_WEIGHTS).is_file():
        tensors, meta = diffusers_lora(
            load_file(adapter / "adapter_model.safetensors"), LoraConfig.from_pretrained(adapter), "transformer"
        )
        out.mkdir(exist_ok=True)
        save_file(tensors, out / DIFFUSERS_WEIGHTS, metadata=meta)
    return out


def diffusers_video_reference(
    path: Path,
    loras: list[tuple[str | Path, float]],
    prompt: str,
    params: SamplingParams,
    defaults: dict,
) -> np.ndarray:
    """Frames of the one-process pipeline with each LoRA of ``loras`` loaded by diffusers itself
    (``load_lora_weights``: a diffusers LoRA folder, or a kohya / ComfyUI file its converters read) and composed
    with ``set_adapters(names, adapter_weights=scales)``."""
    from diffusers import DiffusionPipeline

    call = {k: getattr(params, k) if getattr(params, k) is not None else v for k, v in defaults.items()}
    pipe = DiffusionPipeline.from_pretrained(path)
    _fresh_copies(*(m for m in pipe.components.values() if isinstance(m, torch.nn.Module)))
    pipe.set_progress_bar_config(disable=True)
    names = [f"lora{i}" for i in range(len(loras))]
    for name, (lora, _) in zip(names, loras, strict=True):
        pipe.load_lora_weights(str(lora), adapter_name=name)
    pipe.set_adapters(names, adapter_weights=[scale for _, scale in loras])
    with one_thread(), torch.no_grad():
        generator = torch.Generator().manual_seed(params.seed)
        return pipe(prompt, generator=generator, output_type="np", **call).frames[0]


WAN_BLOCK_LINEARS = r".*blocks\.\d+\.(attn1\.to_(q|k|v|out\.0)|attn2\.to_(q|k|v|out\.0)|ffn\.net\.(0\.proj|2))"
"""peft targets: every linear layer of Wan's blocks (what musubi-tuner's LoRA files adapt, and its converter
requires)."""


def kohya_files(adapter: Path, transformer: torch.nn.Module, out: Path) -> dict[str, Path]:
    """The peft adapter folder ``adapter`` of a Wan ``transformer`` as LoRA files of other tools: ComfyUI's
    (``diffusion_model.<original name>.lora_down`` / ``lora_up`` / ``alpha``, :func:`hsdp.lora_formats.comfyui_lora`)
    and musubi-tuner's kohya keys (``lora_unet_<original_name_with_underscores>``, the same tensors)."""
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file

    from hsdp.lora_formats import comfyui_lora

    comfy = comfyui_lora(load_file(adapter / "adapter_model.safetensors"), LoraConfig.from_pretrained(adapter), transformer)
    kohya = {}
    for key, tensor in comfy.items():
        module, part = key.removeprefix("diffusion_model.").rsplit(".", 1)
        if part == "weight":  # lora_down.weight / lora_up.weight
            module, part = module.rsplit(".", 1)[0], module.rsplit(".", 1)[1] + ".weight"
        kohya[f"lora_unet_{module.replace('.', '_')}.{part}"] = tensor
    out.mkdir(parents=True, exist_ok=True)
    paths = {"comfyui": out / "comfyui.safetensors", "kohya": out / "kohya.safetensors"}
    save_file(comfy, paths["comfyui"])
    save_file(kohya, paths["kohya"])
    return paths
