"""``--attention-backend``: the libraries' own attention dispatchers, for inference and training, under HSDP 2 and
Ulysses 2, against one process with diffusers' default (``native``) or transformers' (``sdpa``) kernels.

Another kernel sums the softmax in another order, so outputs agree within rounding (pixels in [0, 1]: 1e-5; losses
1e-5), not bit for bit; the same kernel with Ulysses equals the plain run exactly, as Ulysses alone does. Backends
this machine cannot run are refused before any rank starts, naming the flag."""

from __future__ import annotations

import numpy as np
import pytest

from hsdp import ParallelConfig
from hsdp.attention import attention_backend_problems
from hsdp.engine import Engine, SamplingParams
from hsdp.models.builtin import resolve_model
from hsdp.train import TrainConfig
from tests.diffusion_train_fns import train_diffusion
from tests.engine_refs import reference_pipeline
from tests.forked_cli import run_hsdp

WAN = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 4.0, "max_sequence_length": 32}
PIXELS = 1e-5  # another softmax order: rounding only


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, kind, context_parallel, needle",
    [
        ("nope", "diffusion", False, "diffusers has no such backend; it has"),
        ("sage", "diffusion", False, "sage"),  # its package, or its CUDA kernels
        ("_native_cudnn", "diffusion", False, "its kernels run on cuda devices"),
        ("_native_math", "diffusion", True, "with --ulysses-degree / --ring-degree: diffusers' _native_math backend"),
        ("flash_attention_2", "causal_lm", False, "FlashAttention runs on CUDA devices"),
        ("native", "causal_lm", False, "transformers has no such attention implementation"),
    ],
)
def test_backends_this_machine_cannot_run_are_refused(name, kind, context_parallel, needle):
    problems = attention_backend_problems(name, kind, "cpu", context_parallel)
    assert problems and all(p.startswith(f"--attention-backend {name}") for p in problems)
    assert any(needle in p for p in problems), problems


@pytest.mark.unit
def test_backends_this_machine_runs_pass():
    assert attention_backend_problems("native", "diffusion", "cpu", True) == []
    assert attention_backend_problems("_native_math", "diffusion", "cpu", False) == []
    assert attention_backend_problems("eager", "causal_lm", "cpu", False) == []


@pytest.mark.slow
def test_generate_refuses_before_loading(tmp_path):
    done = run_hsdp(
        ["generate", "--model", "tiny-wan", "--prompt", "x", "--attention-backend", "_native_cudnn",
         "--output", tmp_path / "x.mp4"],
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--attention-backend _native_cudnn: its kernels run on cuda devices" in done.stderr
    assert not (tmp_path / "x.mp4").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, backend",
    [("hsdp2", "_native_math"), ("hsdp2", "flex"), ("ulysses2", "native")],
)
def test_denoiser_backends_equal_one_process(layout, backend, dist_run):
    config = (
        ParallelConfig(use_hsdp=True, ulysses_degree=2)
        if layout == "ulysses2"
        else ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    )
    path = resolve_model("tiny-wan")
    with Engine(path, config, workers=dist_run.group(2), attention_backend=backend) as engine:
        [out] = engine.generate("A cat", SamplingParams(seed=3, **WAN))
    expected = reference_pipeline(path, "A cat", 3, **WAN)
    if backend == "native":  # the default kernel, split by Ulysses: exact, as without the flag
        np.testing.assert_array_equal(out.frames, expected)
    else:
        np.testing.assert_allclose(out.frames, expected, atol=PIXELS, rtol=0)


@pytest.mark.slow
def test_a_backend_stays_with_its_model(dist_run):
    """diffusers makes a backend the process-wide default too: the next engine on the same ranks, which names
    none, must run the default kernel (found by the combination tier after this file's engines: 1e-6 off)."""
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    path = resolve_model("tiny-wan")
    with Engine(path, config, workers=dist_run.group(2), attention_backend="_native_math"):
        pass
    with Engine(path, config, workers=dist_run.group(2)) as engine:
        [out] = engine.generate("A cat", SamplingParams(seed=3, **WAN))
    np.testing.assert_array_equal(out.frames, reference_pipeline(path, "A cat", 3, **WAN))


@pytest.mark.slow
def test_causal_lm_eager_equals_sdpa(dist_run):
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    tokens = {}
    for backend in ("eager", "sdpa"):
        with Engine("tiny-llama", config, workers=dist_run.group(2), attention_backend=backend) as engine:
            [out] = engine.generate("the quick brown fox", SamplingParams(seed=0, max_new_tokens=12))
        tokens[backend] = out.token_ids
    assert tokens["eager"] == tokens["sdpa"] and len(tokens["sdpa"]) == 12


@pytest.mark.slow
def test_training_with_a_backend_equals_the_default(dist_run, media):
    """LoRA training of tiny-wan at HSDP 2 with ``_native_math``: the same losses as the default kernel, within
    rounding."""
    base = TrainConfig(model="tiny-wan", data=str(media), resolution=32, steps=2, batch_size=2, lr=1e-3, seed=3,
                       lora_r=4, progress=False, parallel=ParallelConfig(use_hsdp=True, hsdp_shard_size=2))  # fmt: skip
    default, math = dist_run(2, train_diffusion, [base, base.replace(attention_backend="_native_math")])[0]
    np.testing.assert_allclose(math["losses"], default["losses"], atol=1e-5, rtol=0)
    assert math["losses"][0] != math["losses"][-1]
