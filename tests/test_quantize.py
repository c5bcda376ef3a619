"""8-bit weight shards (``--weight-dtype int8``): bytes, quality and exactness.

* Bytes: a Wan block of Wan 2.1 1.3B's shape (width 1536) at world 2 gathers 0.50-0.53x the bytes of bf16 and
  holds 0.50-0.52x the sharded bytes per rank.
* Exactness: the int8 output at world 2 equals, bit for bit, a single-process run of the plain model whose
  weights went through the same quantize-dequantize (sharding adds no error beyond quantization), for the Wan
  block, a causal LM loaded from a checkpoint (each rank quantizing its rows as read) and a Wan pipeline through
  the engine.
* Quality, int8 against full precision: decoded frames of a Wan-architecture pipeline (width 256) PSNR >= 40 dB;
  the LM's logits within 0.03 (its largest logit is about 1), greedy tokens the same.
* Refusals name the flag: fp8 on a machine without fp8 kernels, training, an unsharded layout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hsdp import ParallelConfig
from hsdp.engine import Engine, SamplingParams
from hsdp.quantize import QuantizedWeight, dequantize_rows, fake_quantize, quantize_rows, weight_dtype_problem
from tests import quantize_fns

PSNR_MIN_DB = 40.0
LOGIT_DIFF_MAX = 0.03
GREEDY_SHARE_MIN = 0.9


def test_a_shard_quantizes_to_the_rows_of_the_whole_weight():
    weight = torch.randn(12, 40, generator=torch.Generator().manual_seed(0)).bfloat16()
    q, scale = quantize_rows(weight, torch.int8)
    for rows in (slice(0, 6), slice(6, 12)):
        q_part, scale_part = quantize_rows(weight[rows], torch.int8)
        assert torch.equal(q_part, q[rows]) and torch.equal(scale_part, scale[rows])
    error = (dequantize_rows(q, scale, torch.float32) - weight.float()).abs()
    assert (error <= scale / 2 + 1e-6).all()  # round to nearest: half a step per output channel
    assert fake_quantize(torch.zeros(3, 4), torch.int8).abs().max() == 0  # zero rows survive (scale 1, not 0)


def test_fp8_storage_round_trip():
    # The storage path of --weight-dtype fp8 (refused on this CPU machine: no fp8 kernels for the flag's use).
    weight = torch.randn(6, 32, generator=torch.Generator().manual_seed(2))
    q, scale = quantize_rows(weight, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max() <= 448
    relative = (dequantize_rows(q, scale, torch.float32) - weight).abs() / weight.abs().amax(-1, keepdim=True)
    assert relative.max() <= 2**-4  # e4m3 keeps 3 mantissa bits: half an ulp is at most 1/16 of the row's max


def test_copy_into_a_quantized_shard_quantizes_and_split_keeps_rows():
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    shard = QuantizedWeight(*quantize_rows(torch.zeros(8, 16), torch.int8), torch.float32)
    shard.copy_(weight)
    assert torch.equal(shard.dequantize(), fake_quantize(weight, torch.int8))
    top, bottom = torch.chunk(shard, 2)
    assert torch.equal(bottom.dequantize(), fake_quantize(weight[4:], torch.int8))
    assert shard.stored_bytes == 8 * 16 + 8 * 4  # one byte per weight, one fp32 scale per row


def test_fp8_on_cpu_and_training_are_refused_naming_the_flag():
    problem = weight_dtype_problem("fp8", "cpu")
    assert "--weight-dtype fp8" in problem and "fp8 kernels" in problem and "--weight-dtype int8" in problem
    problem = weight_dtype_problem("int8", "cpu", training=True)
    assert "--weight-dtype int8" in problem and "training" in problem
    with pytest.raises(ValueError, match="--weight-dtype fp8 needs a device with fp8 kernels"):
        Engine("tiny-llama", ParallelConfig(use_hsdp=True, hsdp_shard_size=2), weight_dtype="fp8")
    with pytest.raises(ValueError, match="--weight-dtype int8 stores FSDP shards in 8 bits: add --use-hsdp"):
        Engine("tiny-llama", ParallelConfig(), weight_dtype="int8")


def test_generate_cli_refuses_fp8_on_cpu(capsys):
    from hsdp.cli import main

    code = main(
        [
            "generate",
            "--model",
            "tiny-llama",
            "--prompt",
            "hi",
            "--use-hsdp",
            "--hsdp-shard-size",
            "2",
            "--weight-dtype",
            "fp8",
        ]
    )
    assert code == 2
    assert "--weight-dtype fp8 needs a device with fp8 kernels" in capsys.readouterr().err


@pytest.mark.slow
def test_wan_block_gathers_half_the_bytes_and_equals_the_fake_quantized_model(dist_run):
    full, int8 = (dist_run(2, quantize_fns.wan_gathered_bytes, w) for w in (None, "int8"))
    gathered = int8[0]["all_gather"] / full[0]["all_gather"]
    sharded = [q["sharded_bytes"] / f["sharded_bytes"] for f, q in zip(full, int8, strict=True)]
    print(f"Wan block int8: gathered {gathered:.4f}x of bf16, sharded bytes per rank {sharded}")
    assert 0.50 <= gathered <= 0.53, gathered
    assert all(0.50 <= ratio <= 0.52 for ratio in sharded), sharded
    # 4 attention projections x 2 + 2 FFN in the block, 3 in the condition embedder, the output projection
    assert len(int8[0]["quantized"]) == 14
    reference = quantize_fns.fake_quantized(quantize_fns.wide_wan(), int8[0]["quantized"])
    from tests.engine_refs import one_thread

    with one_thread(), torch.no_grad():
        [expected] = reference(*quantize_fns.wan_inputs(), return_dict=False)
    assert torch.equal(int8[0]["out"], expected)
    assert not torch.equal(full[0]["out"], expected)  # quantization did change the weights


@pytest.mark.slow
def test_causal_lm_int8_logits_and_greedy_tokens(dist_run, tiny_checkpoints):
    path = tiny_checkpoints["llama-bf16"]
    full, int8 = (dist_run(2, quantize_fns.lm_logits_and_tokens, path, w, 24) for w in (None, "int8"))
    # bf16 checkpoint of width 64: the tied embedding stays bf16 and a scale per 64-wide row costs 3 %
    assert int8[0]["local_bytes"] <= 0.6 * full[0]["local_bytes"]
    logit_diff = (full[0]["logits"] - int8[0]["logits"]).abs().max().item()
    assert logit_diff <= LOGIT_DIFF_MAX, logit_diff
    argmax_equal = (full[0]["logits"].argmax(-1) == int8[0]["logits"].argmax(-1)).float().mean().item()
    greedy_equal = np.mean(np.array(full[0]["tokens"]) == np.array(int8[0]["tokens"]))
    print(
        f"LM int8: max logit diff {logit_diff:.4f}, argmax equal {argmax_equal:.3f}, greedy equal {greedy_equal:.3f}"
    )
    assert argmax_equal >= GREEDY_SHARE_MIN and greedy_equal >= GREEDY_SHARE_MIN, (argmax_equal, greedy_equal)
    expected = quantize_fns.reference_lm(path, int8[0]["quantized"], 24)
    assert torch.equal(int8[0]["logits"], expected["logits"]) and int8[0]["tokens"] == expected["tokens"]


@pytest.mark.slow
def test_wan_pipeline_int8_psnr_and_exact_against_fake_quantized(tmp_path, dist_run):
    from hsdp.models.tiny_wan import build_tiny_wan_pipeline, write_generation_defaults

    path = tmp_path / "wan-256"
    build_tiny_wan_pipeline(
        num_attention_heads=4, attention_head_dim=64, ffn_dim=1024, num_layers=2
    ).save_pretrained(path)
    call = dict(num_inference_steps=2, height=32, width=32, num_frames=5, guidance_scale=1.0)
    write_generation_defaults(path, {"max_sequence_length": 16})
    params = SamplingParams(seed=5, **call)
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    frames = {}
    for weight_dtype in (None, "int8"):
        with Engine(path, config, workers=dist_run.group(2), weight_dtype=weight_dtype) as engine:
            [out] = engine.generate("A cat playing piano", params)
            frames[weight_dtype] = out.frames
            shardable = engine.load_report[0]["sharded"]
    mse = float(np.mean((frames["int8"] - frames[None]) ** 2))
    psnr = 10 * np.log10(1.0 / mse)
    print(f"Wan pipeline int8 vs fp32: PSNR {psnr:.1f} dB")
    assert psnr >= PSNR_MIN_DB, psnr
    expected = quantize_fns.reference_frames_fake_quantized(
        path, shardable, "A cat playing piano", 5, {**call, "max_sequence_length": 16}
    )
    np.testing.assert_array_equal(frames["int8"], expected)


def test_serve_flags_reach_the_engine_settings():
    from hsdp.cli import build_parser
    from hsdp.serve.cli import settings_from_args

    argv = ["serve", "tiny-wan", "--use-hsdp", "--hsdp-shard-size", "2", "--weight-dtype", "int8"]
    settings = settings_from_args(build_parser().parse_args([*argv, "--device-memory", "2GiB"]))
    assert (settings.weight_dtype, settings.device_memory) == ("int8", "2GiB")


def test_engine_reports_the_8_bit_share_of_its_linear_weights(tmp_path, dist_run):
    """Weights whose rows do not divide by the shard size keep the compute dtype (with a warning in the log);
    ``Engine.quantized`` says how much was stored in 8 bits, for the server's ``/metrics`` too."""
    import shutil

    import transformers as tf

    from hsdp.models.builtin import resolve_model
    from hsdp.quantize import quantizable_linears, rows_split_evenly

    source = resolve_model("tiny-llama")
    config = tf.AutoConfig.from_pretrained(source)
    config.intermediate_size = 33  # gate_proj / up_proj rows: odd, so they do not split over 2 ranks
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    for file in source.iterdir():
        if file.is_file() and not (tmp_path / file.name).exists():
            shutil.copy(file, tmp_path)
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    eight_bit = [m.weight for _, m in quantizable_linears(model) if rows_split_evenly(m.weight.shape[0], 2)]
    expected = sum(w.numel() for w in eight_bit) / sum(w.numel() for w in linears)
    assert 0 < expected < 1
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    with Engine(tmp_path, config, workers=dist_run.group(2), weight_dtype="int8") as engine:
        share = engine.quantized
    assert share["linear_weights"] == len(linears) and share["quantized_weights"] == len(eight_bit)
    assert share["quantized_fraction"] == pytest.approx(expected, rel=1e-12)
