"""Wan 2.x (text-, image-to-video): the original layer names of its single-file LoRAs, which diffusers'
``_convert_non_diffusers_wan_lora_to_diffusers`` (ComfyUI) and ``_convert_musubi_wan_lora_to_diffusers`` (kohya)
read; :mod:`hsdp.lora_layouts` derives and checks the layouts. The pipelines themselves need no facts beyond diffusers'
metadata, so the family claims no pipeline (the engine runs them with the generic rules).

ComfyUI (and musubi-tuner, ai-toolkit, DiffSynth) name Wan's layers as the original code does: ``self_attn.q``
for diffusers' ``attn1.to_q``, ``ffn.0`` for ``ffn.net.0.proj``, ``head.head`` for ``proj_out``... A LoRA there is
``diffusion_model.<name>.lora_down.weight`` (A), ``lora_up.weight`` (B) and ``alpha``.
"""

from __future__ import annotations

import re

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


WAN = register_family(
    Family(
        "Wan 2.x",
        denoisers=r"WanTransformer3DModel",
        original_names=_original,
        lora_pipeline="WanPipeline",
    )
)
