"""Wan 2.x (text-, image-to-video): the ComfyUI LoRA key map, the inverse of diffusers'
``_convert_non_diffusers_wan_lora_to_diffusers``. The pipelines themselves need no facts beyond diffusers'
metadata, so the family claims no pipeline (the engine runs them with the generic rules).

ComfyUI (and musubi-tuner, ai-toolkit, DiffSynth) name Wan's layers as the original code does: ``self_attn.q``
for diffusers' ``attn1.to_q``, ``ffn.0`` for ``ffn.net.0.proj``, ``head.head`` for ``proj_out``... A LoRA there is
``diffusion_model.<name>.lora_down.weight`` (A), ``lora_up.weight`` (B) and, for the blocks, ``alpha``: the
converter scales the pair by ``alpha / rank`` (split between A and B in powers of two). It reads ``alpha`` only
inside ``blocks.N``; outside them the scale is multiplied into ``lora_up`` instead.
"""

from __future__ import annotations

import re

import torch

from hsdp.families.family import Family, register_family

# diffusers module path -> original one; \1 is the block index.
_RENAMES = [
    (r"blocks\.(\d+)\.attn1\.to_(q|k|v)", r"blocks.\1.self_attn.\2"),
    (r"blocks\.(\d+)\.attn1\.to_out\.0", r"blocks.\1.self_attn.o"),
    (r"blocks\.(\d+)\.attn2\.to_(q|k|v)", r"blocks.\1.cross_attn.\2"),
    (r"blocks\.(\d+)\.attn2\.to_out\.0", r"blocks.\1.cross_attn.o"),
    (r"blocks\.(\d+)\.attn2\.add_(k|v)_proj", r"blocks.\1.cross_attn.\2_img"),
    (r"blocks\.(\d+)\.ffn\.net\.0\.proj", r"blocks.\1.ffn.0"),
    (r"blocks\.(\d+)\.ffn\.net\.2", r"blocks.\1.ffn.2"),
    (r"condition_embedder\.time_proj", "time_projection.1"),
    (r"proj_out", "head.head"),
    (r"condition_embedder\.text_embedder\.linear_1", "text_embedding.0"),
    (r"condition_embedder\.text_embedder\.linear_2", "text_embedding.2"),
    (r"condition_embedder\.time_embedder\.linear_1", "time_embedding.0"),
    (r"condition_embedder\.time_embedder\.linear_2", "time_embedding.2"),
    (r"condition_embedder\.image_embedder\.ff\.net\.0\.proj", "img_emb.proj.1"),
    (r"condition_embedder\.image_embedder\.ff\.net\.2", "img_emb.proj.3"),
]


def _original(module: str) -> str:
    for pattern, replacement in _RENAMES:
        if re.fullmatch(pattern, module):
            return re.sub(pattern, replacement, module)
    raise ValueError(
        f"the LoRA adapts {module}, which diffusers' Wan converter does not map to an original layer name"
    )


def wan_to_comfyui(tensors: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """``<module>.lora_A.weight`` / ``lora_B.weight`` (diffusers names) -> the ``diffusion_model.`` LoRA."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        module, part = key.rsplit(".lora_", 1)
        name = "diffusion_model." + _original(module)
        in_block = name.startswith("diffusion_model.blocks.")
        if part == "A.weight":
            out[f"{name}.lora_down.weight"] = tensor
            if in_block:
                rank = tensor.shape[0]
                out[f"{name}.alpha"] = torch.tensor(scaling * rank, dtype=torch.float32)
        else:
            out[f"{name}.lora_up.weight"] = tensor if in_block else tensor * scaling
    return out


def wan_comfyui_problem(comfy: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> str | None:
    """Run diffusers' converter on ``comfy``: it must give back every module of ``tensors`` (by key)."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

    try:  # on copies: the converter scales some of its input tensors in place
        back = _convert_non_diffusers_wan_lora_to_diffusers({k: v.clone() for k, v in comfy.items()})
    except (ValueError, KeyError) as exc:
        return f"diffusers' Wan converter does not read the result back ({exc!r})"
    back = {k.removeprefix("transformer."): v for k, v in back.items()}
    if back.keys() != tensors.keys():
        lost = sorted(tensors.keys() ^ back.keys())[:4]
        return f"diffusers' Wan converter reads back other modules than the LoRA adapts (differs in {lost})"
    return None


WAN = register_family(
    Family(
        "Wan 2.x",
        denoisers=r"WanTransformer3DModel",
        comfyui_lora=wan_to_comfyui,
        comfyui_check=wan_comfyui_problem,
    )
)
