"""Quantized single files kept quantized (issue 35 item 3): a GGUF transformer (Q8_0 and Q4_K, written with ``gguf``'s
own writer in the original Wan key layout) and an ``fp8_scaled`` one (ComfyUI's: ``float8_e4m3fn`` weights, a
``scale_weight`` per layer), as Wan 2.2's two experts. ``hsdp generate`` at HSDP 2 keeps their Linear weights in the
stored bytes, sharded, gathered and dequantized per layer, and equals diffusers in one process: the GGUF expert from
``from_single_file(..., quantization_config=GGUFQuantizationConfig(compute_dtype=float32))``, the fp8 expert from
``from_single_file`` of the dequantized weights (``weight.to(dtype) * scale_weight.to(dtype)``). The arithmetic is the
same (the same dequantization functions on the same bytes, the same fp32 matmuls), so the frames are equal."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hsdp.models.builtin import resolve_model
from hsdp.models.single_file import SingleFileError, with_single_files
from tests.forked_cli import run_hsdp
from tests.test_single_file import _to_original

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]
SEED, PROMPT, STEPS = 5, "a red fox", 2
WIDE = dict(num_attention_heads=2, attention_head_dim=128, ffn_dim=256, num_layers=2)
"""Width 256: the rows of GGUF's K-quants are 256 values per block (Q8_0: 32)."""


def _wide_transformer(seed: int):
    from diffusers import WanTransformer3DModel

    config = WanTransformer3DModel.load_config(resolve_model("tiny-wan") / "transformer")
    torch.manual_seed(seed)
    model = WanTransformer3DModel.from_config({**config, **WIDE})
    with torch.no_grad():  # init's zeros (biases, tables) made visible: every tensor matters to the output
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def wan22(tmp_path_factory) -> Path:
    """Tiny Wan 2.2: the tiny Wan's text encoder and VAE, two experts of width 256, boundary 0.875 (of 2 steps at
    t = 999 and 750, the first runs ``transformer``, the second ``transformer_2``)."""
    base = tmp_path_factory.mktemp("wan22") / "base"
    shutil.copytree(resolve_model("tiny-wan"), base, ignore=shutil.ignore_patterns("transformer"))
    for seed, component in enumerate(("transformer", "transformer_2")):
        _wide_transformer(seed).save_pretrained(base / component)
    index = json.loads((base / "model_index.json").read_text())
    index |= {"transformer_2": index["transformer"], "boundary_ratio": 0.875}
    (base / "model_index.json").write_text(json.dumps(index))
    return base


def _original(folder: Path) -> dict[str, torch.Tensor]:
    """A component's weights in the original (ComfyUI) Wan key layout."""
    weights = load_file(folder / "diffusion_pytorch_model.safetensors")
    return {f"model.diffusion_model.{_to_original(k)}": v for k, v in weights.items()}


def _q4_k_blocks(rows: int, cols: int, generator: torch.Generator) -> np.ndarray:
    """Random Q4_K blocks (``gguf`` dequantizes K-quants but cannot quantize them): per 256 values, fp16 ``d`` and
    ``dmin``, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit values."""
    blocks = torch.randint(0, 256, (rows * cols // 256, 144), dtype=torch.uint8, generator=generator)
    scales = (0.001 + 0.002 * torch.rand(blocks.shape[0], 2, generator=generator)).half()
    blocks[:, :4] = scales.view(torch.uint8)
    return blocks.reshape(rows, cols // 256 * 144).numpy()


def write_gguf(weights: dict[str, torch.Tensor], path: Path, types: dict[str, str]) -> None:
    """``weights`` with ``gguf``'s writer: each key in ``types`` quantized to its type (Q8_0 by ``gguf.quants``, Q4_K
    as random blocks, another type as ``gguf.quants.quantize`` makes it), the rest F32."""
    writer = gguf.GGUFWriter(str(path), "wan")
    generator = torch.Generator().manual_seed(1)
    for key, value in weights.items():
        qtype = types.get(key)
        if qtype is None:
            writer.add_tensor(key, value.float().numpy())
        elif qtype == "Q4_K":
            writer.add_tensor(key, _q4_k_blocks(*value.shape, generator), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(key, gguf.quants.quantize(value.float().numpy(), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_types(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """Q4_K for the 2-D weights of 256 columns (attention, FFN, time projection, head), Q8_0 for the other 2-D
    weights (the text and time embedders: 32 columns; the time embedder is one diffusers keeps in fp32, so
    dequantizes at load), F32 for the rest (norms, biases, the patch embedding convolution, modulation tables)."""
    types = {}
    for key, value in weights.items():
        if value.ndim == 2 and key.endswith(".weight") and "modulation" not in key:
            types[key] = "Q4_K" if value.shape[1] % 256 == 0 else "Q8_0"
    return types


def write_fp8_scaled(weights: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """``weights`` as ComfyUI's fp8_scaled files hold them: every 2-D Linear weight in ``float8_e4m3fn`` with its
    ``scale_weight`` (amax / 448), the ``scaled_fp8`` marker; returns the dequantized weights in fp32."""
    out, dequantized = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, {}
    for key, value in weights.items():
        if value.ndim == 2 and key.endswith(".weight") and "modulation" not in key:
            scale = (value.abs().amax() / 448).float()
            q = (value / scale).to(torch.float8_e4m3fn)
            out[key], out[key.removesuffix(".weight") + ".scale_weight"] = q, scale.reshape(())
            dequantized[key] = q.to(torch.float32) * scale.to(torch.float32)
        else:
            out[key] = dequantized[key] = value
    save_file(out, path)
    return dequantized


@pytest.fixture(scope="module")
def quant_files(wan22, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the GGUF high-noise expert, the fp8_scaled low-noise expert, the fp8 expert dequantized as a .safetensors)."""
    folder = tmp_path_factory.mktemp("quant")
    high, low = _original(wan22 / "transformer"), _original(wan22 / "transformer_2")
    write_gguf(high, folder / "wan22_high_noise_tiny-Q4_K.gguf", _gguf_types(high))
    dequantized = write_fp8_scaled(low, folder / "wan22_low_noise_tiny_fp8_scaled.safetensors")
    save_file(dequantized, folder / "low_dequantized.safetensors")
    return (folder / "wan22_high_noise_tiny-Q4_K.gguf", folder / "wan22_low_noise_tiny_fp8_scaled.safetensors",
            folder / "low_dequantized.safetensors")  # fmt: skip


def _reference(base: Path, gguf_file: Path, fp8_dequantized: Path) -> np.ndarray:
    from diffusers import GGUFQuantizationConfig, WanPipeline, WanTransformer3DModel

    from tests.engine_refs import one_thread

    quant = GGUFQuantizationConfig(compute_dtype=torch.float32)
    high = WanTransformer3DModel.from_single_file(str(gguf_file), config=str(base / "transformer"), quantization_config=quant)
    low = WanTransformer3DModel.from_single_file(str(fp8_dequantized), config=str(base / "transformer_2"))
    assert type(high.blocks[0].attn1.to_q).__name__ == "GGUFLinear"  # diffusers keeps it quantized, as hsdp does
    pipe = WanPipeline.from_pretrained(base, transformer=high, transformer_2=low)
    pipe.set_progress_bar_config(disable=True)
    defaults = json.loads((base / "hsdp_defaults.json").read_text())
    call = {k: v for k, v in defaults.items() if k != "num_inference_steps"}
    with one_thread(), torch.no_grad():
        return pipe(PROMPT, generator=torch.Generator().manual_seed(SEED), output_type="np", num_inference_steps=STEPS,
                    **call).frames[0]  # fmt: skip


def test_generate_gguf_and_fp8_scaled_experts_at_hsdp2_equal_diffusers(wan22, quant_files, tmp_path):
    import imageio.v3 as iio

    from hsdp.engine.outputs import save_frames

    gguf_file, fp8_file, fp8_dequantized = quant_files
    env = {**os.environ, "HSDP_CACHE": str(tmp_path / "cache")}
    argv = ["generate", "--model", str(wan22), "--transformer", str(gguf_file), "--transformer-2", str(fp8_file),
            "--prompt", PROMPT, "--seed", str(SEED), "--num-inference-steps", str(STEPS), "--use-hsdp",
            "--hsdp-shard-size", "2", "--output", str(tmp_path / "o.gif"), "--log-level", "info"]  # fmt: skip
    done = run_hsdp(argv, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    # Both experts keep their Linear weights in the stored bytes (the time embedders, kept fp32 by diffusers, aside).
    kept = [int(n) for n in re.findall(r"(\d+) Linear weights kept in their stored bytes", done.stderr)]
    assert len(kept) >= 2 and min(kept) > 0, done.stderr[-3000:]  # each expert, on each rank
    reference = _reference(wan22, gguf_file, fp8_dequantized)
    save_frames(reference, tmp_path / "ref.gif")
    np.testing.assert_array_equal(iio.imread(tmp_path / "o.gif"), iio.imread(tmp_path / "ref.gif"))


def test_converted_gguf_keeps_the_stored_bytes(wan22, quant_files, tmp_path, monkeypatch):
    """The converted component holds each quantized tensor's GGUF bytes under diffusers' name, its type in the header;
    dequantized by diffusers' own function it is the tensor diffusers' from_single_file holds."""
    from diffusers import GGUFQuantizationConfig, WanTransformer3DModel

    from hsdp.loading import read_checkpoint_index, stored_view

    monkeypatch.setenv("HSDP_CACHE", str(tmp_path / "cache"))
    gguf_file, fp8_file, _ = quant_files
    folder = with_single_files(wan22, {"transformer": gguf_file, "transformer_2": fp8_file})
    index, layout = stored_view(read_checkpoint_index(folder / "transformer"))
    assert layout["blocks.0.attn1.to_q.weight"].quant_type == "Q4_K"
    assert layout["condition_embedder.text_embedder.linear_1.weight"].quant_type == "Q8_0"
    quant = GGUFQuantizationConfig(compute_dtype=torch.float32)
    diffusers_model = WanTransformer3DModel.from_single_file(str(gguf_file), config=str(wan22 / "transformer"), quantization_config=quant)
    stored = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    q = diffusers_model.blocks[0].attn1.to_q.weight
    assert stored["blocks.0.attn1.to_q.weight"].dtype == torch.uint8 and torch.equal(stored["blocks.0.attn1.to_q.weight"], q.as_tensor())
    _, fp8_layout = stored_view(read_checkpoint_index(folder / "transformer_2"))
    assert fp8_layout["blocks.1.ffn.net.2.weight"].format == "fp8_scaled"
    assert load_file(folder / "transformer_2" / "diffusion_pytorch_model.safetensors")["blocks.1.ffn.net.2.weight"].dtype == torch.float8_e4m3fn


def test_a_gguf_type_diffusers_cannot_dequantize_is_refused_before_ranks_start(wan22, tmp_path, monkeypatch):
    """TQ1_0 (ternary; ``gguf`` writes it, diffusers has no dequantization for it): refused while converting, which
    every command does before its ranks start (``hsdp.cli.resolve_model_argument``), naming the flag, the file, the
    tensor, its type and what to use."""
    high = _original(wan22 / "transformer")
    types = _gguf_types(high) | {"model.diffusion_model.blocks.0.ffn.0.weight": "TQ1_0"}
    bad = tmp_path / "tq1.gguf"
    write_gguf(high, bad, types)
    monkeypatch.setenv("HSDP_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SingleFileError, match=r"tensor model\.diffusion_model\.blocks\.0\.ffn\.0\.weight is GGUF TQ1_0"):
        with_single_files(wan22, {"transformer": bad})
    with pytest.raises(SingleFileError, match=r"--transformer .*tq1\.gguf: .* use a file quantized to one of .*Q8_0"):
        with_single_files(wan22, {"transformer": bad})


def test_gathered_bytes_of_a_gguf_transformer_against_bf16_measured_and_planned(wan22, quant_files, dist_run, tmp_path, monkeypatch):
    """All-gather bytes per forward at HSDP 2, measured (hsdp.measure.comm) for the Q4_K / Q8_0 GGUF transformer and
    for the same model in bf16, equal the planner's count for each (``hsdp plan`` counts the stored bytes)."""
    from hsdp.planning.profile import build_meta_model, profile_module
    from tests import quantize_fns

    monkeypatch.setenv("HSDP_CACHE", str(tmp_path / "cache"))
    gguf_file, _, _ = quant_files
    folder = with_single_files(wan22, {"transformer": gguf_file})
    measured, planned, sizes = {}, {}, {}
    for name, component in (("gguf", folder / "transformer"), ("bf16", wan22 / "transformer")):
        measured[name] = dist_run(2, quantize_fns.stored_gathered_bytes, component, "bf16")[0]
        profile = profile_module(*build_meta_model(component, torch.bfloat16)[:1], name)
        sizes[name] = profile.param_bytes  # the component's size hsdp plan prints
        # What a rank receives: (shard - 1) / shard of each gathered buffer (the estimate's "ag" fraction).
        planned[name] = sum(unit.gathered_bytes(2) for unit in (*profile.blocks, profile.root)) // 2
    ratio = measured["gguf"]["all_gather"] / measured["bf16"]["all_gather"]
    print(f"GGUF Q4_K/Q8_0 transformer (width 256): gathered {ratio:.4f}x of bf16 per forward; "
          f"measured {measured}, planned {planned}")
    assert {k: v["all_gather"] for k, v in measured.items()} == planned
    assert ratio < 0.4  # Q4_K: 4.5 bits per weight against 16
    assert sizes["gguf"] < 0.4 * sizes["bf16"], sizes


def test_lora_over_a_gguf_base_kept_quantized_has_the_gradients_of_the_dequantized_base(wan22, quant_files, dist_run, tmp_path, monkeypatch):
    """LoRA training over the GGUF transformer at HSDP 2 keeps the frozen base in its stored bytes (gathered and
    dequantized per layer in forward, and again in backward), and the adapters' gradients equal those over the same
    weights dequantized into a plain fp32 checkpoint (the same dequantization, the same fp32 matmuls: exact)."""
    from safetensors import safe_open

    from hsdp.stored_quant import dequantize, read_layout
    from tests import quantize_fns

    monkeypatch.setenv("HSDP_CACHE", str(tmp_path / "cache"))
    converted = with_single_files(wan22, {"transformer": quant_files[0]}) / "transformer"
    plain = tmp_path / "dequantized"
    plain.mkdir()
    shutil.copy(converted / "config.json", plain / "config.json")
    file = converted / "diffusion_pytorch_model.safetensors"
    with safe_open(file, framework="pt") as handle:
        layout = read_layout(handle.metadata())
    weights = {k: dequantize(v, layout[k], torch.float32) if k in layout else v for k, v in load_file(file).items()}
    save_file(weights, plain / "diffusion_pytorch_model.safetensors")
    kept, reference = (dist_run(2, quantize_fns.lora_grads_over, folder)[0] for folder in (converted, plain))
    assert kept["stored"] > 0 and reference["stored"] == 0
    assert kept["grads"].keys() == reference["grads"].keys() and len(kept["grads"]) == 2 * 2 * 4 * 2
    for name, grad in reference["grads"].items():
        assert grad.abs().sum() > 0 and torch.equal(kept["grads"][name], grad), name


def test_a_quantized_gguf_tensor_that_is_no_linear_weight_is_refused(wan22, tmp_path, monkeypatch):
    """A quantized bias: diffusers dequantizes GGUF only in Linear layers (its GGUFLinear), and a bias has no rows
    of blocks to shard; refused while converting, naming the tensor, its type and what to store instead."""
    monkeypatch.setenv("HSDP_CACHE", str(tmp_path / "cache"))
    high = _original(wan22 / "transformer")
    bad = tmp_path / "bias.gguf"
    write_gguf(high, bad, _gguf_types(high) | {"model.diffusion_model.blocks.0.ffn.0.bias": "Q8_0"})
    with pytest.raises(SingleFileError, match=r"--transformer .*bias\.gguf: tensor blocks\.0\.ffn\.net\.0\.proj\.bias is GGUF "
                                              r"Q8_0 but is no nn\.Linear weight.*F32 / F16 / BF16"):  # fmt: skip
        with_single_files(wan22, {"transformer": bad})
