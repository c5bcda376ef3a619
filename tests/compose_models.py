"""The models of the combination tier (tests/test_compose.py) and their adapters: ``tiny-wan`` for most cases, and
the models that some axis values imply (:data:`tests.compose_axes.IMPLIED_MODELS`): a Wan 2.2 A14B-shaped pipeline
(tiny-wan with a second expert), ``tiny-stable-audio`` and a tiny LTX-2 (video with its sound track).

Each model's ``--lora-root`` holds the adapters its cases name: peft adapters ``x`` and ``y`` of its denoiser (served
from the start), Wan 2.2's ``w`` (one adapter per expert, as ``hsdp train --train-component
transformer,transformer_2`` exports it), and the LoRA files of other tools added while running
(:data:`tests.compose_hosts.FILE_ADAPTERS`): ComfyUI's and musubi-tuner's kohya keys for Wan; for LTX-2 the
``diffusion_model.``-keyed file of LTX-2's own trainer (the non-diffusers format diffusers' LTX-2 loader converts; it
reads no kohya keys for LTX-2), under both names; for Stable Audio the same keys, which hsdp refuses (diffusers'
StableAudioPipeline has no LoRA loader to read a file with).
"""

from __future__ import annotations

from pathlib import Path

from tests.lora_refs import WAN_BLOCK_LINEARS, kohya_files, save_adapter

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
LTX2_BLOCK_LINEARS = r".*transformer_blocks\.\d+\.(attn\d|audio_attn\d)\.to_(q|k|v|out\.0)"
"""peft targets of the LTX-2 files: the video and audio self- and cross-attention of every block."""
SPEECH_SECONDS = 0.25
"""Seconds of audio a speech case asks for (tiny-stable-audio: 2,000 samples at 8 kHz)."""


def build_model(name: str, base: Path) -> Path:
    """The folder of model ``name`` under ``base`` (built once)."""
    from tests.engine_refs import builtin

    if name in ("tiny-wan", "tiny-stable-audio"):
        return builtin(name, base / "hsdp-cache")
    folder = base / "compose-models" / name
    if (folder / "model_index.json").is_file():
        return folder
    if name == "wan2.2-a14b":
        # tiny-wan with a second expert below boundary_ratio (tests/test_lora_formats.py's): unlike
        # tests/heldout_pipelines.py's wan2.2-a14b, its VAE spreads an adapter's effect over many 8-bit levels
        from hsdp.models.tiny_wan import build_tiny_wan_pipeline

        build_tiny_wan_pipeline(boundary_ratio=0.875).save_pretrained(folder)
        return folder
    from tests.audio_pipelines import build_tiny_ltx2

    return build_tiny_ltx2(folder)


def build_root(name: str, model: Path, folder: Path) -> Path:
    """``--lora-root`` of model ``name``: rank-4 adapters with random weights (so that they change the output)."""
    from diffusers import DiffusionPipeline

    folder.mkdir(parents=True, exist_ok=True)
    if name == "wan2.2-a14b":
        _two_expert_export(model, folder / "w")
        return folder
    pipe = DiffusionPipeline.from_pretrained(model)
    transformer = pipe.transformer
    targets = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"] if name == "tiny-wan" else ATTENTION
    for seed, adapter in enumerate(("x", "y"), start=3):
        save_adapter(transformer, folder / adapter, targets, seed=seed)
    if name == "tiny-wan":
        kohya_files(save_adapter(transformer, folder / "k", WAN_BLOCK_LINEARS, seed=5), transformer, folder)
    elif name == "tiny-ltx2":
        _diffusion_model_files(save_adapter(transformer, folder / "k", LTX2_BLOCK_LINEARS, seed=5), folder)
    else:  # files no diffusers converter reads for Stable Audio (its pipeline has no LoRA loader): refused
        _diffusion_model_files(folder / "x", folder)
    return folder


def _two_expert_export(model: Path, out: Path) -> None:
    """One adapter per expert in diffusers' format (``pytorch_lora_weights.safetensors`` keyed ``transformer.``, the
    config in its metadata), in ``out/transformer`` and ``out/transformer_2``: what ``hsdp train --train-component
    transformer,transformer_2 --export-format diffusers`` writes and ``hsdp serve --lora w=out`` reads."""
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file

    from hsdp.lora_formats import DIFFUSERS_WEIGHTS, diffusers_lora

    for seed, expert in enumerate(("transformer", "transformer_2"), start=7):
        peft = save_adapter(WanTransformer3DModel.from_pretrained(model / expert), out.with_name(f"{expert}-peft"),
                            ATTENTION, seed=seed)  # fmt: skip
        tensors, meta = diffusers_lora(
            load_file(peft / "adapter_model.safetensors"), LoraConfig.from_pretrained(peft), "transformer"
        )
        (out / expert).mkdir(parents=True, exist_ok=True)
        save_file(tensors, out / expert / DIFFUSERS_WEIGHTS, metadata=meta)


def _diffusion_model_files(adapter: Path, out: Path) -> None:
    """The peft adapter ``adapter`` of a transformer keyed as LTX-2's trainer and ComfyUI write it
    (``diffusion_model.<module>.lora_A.weight``), as ``comfyui.safetensors`` and ``kohya.safetensors``."""
    from safetensors.torch import load_file, save_file

    tensors = {
        "diffusion_model." + key.removeprefix("base_model.model."): value
        for key, value in load_file(adapter / "adapter_model.safetensors").items()
    }
    for file in ("comfyui.safetensors", "kohya.safetensors"):
        save_file(tensors, out / file)


def load_adapters(pipe, model: str, root: Path, loads: list[tuple[str, Path | str, float]]) -> None:
    """The request's adapters in plain diffusers, as a diffusers user loads them: ``load_lora_weights`` (for Wan
    2.2's export, each expert's half, the low-noise one with ``load_into_transformer_2=True``) and ``set_adapters`` at
    the scales; for Stable Audio, whose pipeline has no LoRA loader in diffusers, peft itself (``PeftModel`` on the
    DiT at the scale: one adapter per request there). ``loads``: (name, folder or file, scale)."""
    from tests.lora_refs import _with_adapter

    if model == "tiny-stable-audio":
        [(_, path, scale)] = loads
        pipe.transformer = _with_adapter(pipe.transformer, Path(path), scale)
        return
    for i, (_, path, _) in enumerate(loads):
        if model == "wan2.2-a14b":
            pipe.load_lora_weights(str(Path(path) / "transformer"), adapter_name=f"a{i}")
            pipe.load_lora_weights(str(Path(path) / "transformer_2"), adapter_name=f"a{i}", load_into_transformer_2=True)
        else:
            pipe.load_lora_weights(str(path), adapter_name=f"a{i}")
    pipe.set_adapters([f"a{i}" for i in range(len(loads))], adapter_weights=[scale for *_, scale in loads])

