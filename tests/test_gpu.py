"""GPU tier: the NCCL path of the multi-rank checks, on CUDA devices (``bash scripts/test.sh -m gpu``).

Each test is skipped, not failed, on a machine with fewer CUDA devices than it needs. The ranks are spawned by
:class:`hsdp.launch.WorkerGroup`, which joins them over NCCL on CUDA (one device per rank). The comparisons
allow float noise (1e-5) instead of the CPU tests' exact equality: on a GPU the one-process reference and the
sharded ranks may get different kernel choices (cuBLAS / cuDNN pick algorithms per call site and buffer).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hsdp import ParallelConfig
from hsdp.engine import Engine, SamplingParams
from tests.engine_refs import builtin

pytestmark = pytest.mark.gpu

ATOL = 1e-5
PROMPT = "A cat playing piano"
PARAMS = SamplingParams(seed=11, num_inference_steps=2, negative_prompt="blurry")


def needs_cuda_devices(count: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        torch.cuda.device_count() < count,
        reason=f"needs {count} CUDA device(s), found {torch.cuda.device_count()}",
    )


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hsdp-cache")


def llama_ids() -> torch.Tensor:
    return torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(1))


def rank_llama_logits(model_dir: str, config: ParallelConfig) -> dict:
    """On each rank: load tiny-llama sharded from its checkpoint and run one forward on this rank's device."""
    import torch.distributed as dist

    from hsdp.distributed import local_device
    from hsdp.loading import load_pretrained
    from hsdp.mesh import build_meshes

    model = load_pretrained(model_dir, config, meshes=build_meshes(config), dtype=torch.float32)
    with torch.no_grad():
        logits = model(llama_ids().to(local_device())).logits
    return {"backend": dist.get_backend(), "device": logits.device.type, "logits": logits.cpu()}


@needs_cuda_devices(2)
def test_two_rank_hsdp_load_over_nccl_equals_one_process(model_cache: Path):
    from transformers import AutoModelForCausalLM

    from hsdp.launch import WorkerGroup

    path = builtin("tiny-llama", model_cache)
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2).resolved()
    with WorkerGroup(config.world_size) as group:
        results = group.run(rank_llama_logits, str(path), config)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    with torch.no_grad():
        want = reference(llama_ids().to("cuda")).logits.cpu()
    for out in results:
        assert (out["backend"], out["device"]) == ("nccl", "cuda")
        torch.testing.assert_close(out["logits"], want, atol=ATOL, rtol=0)


def cuda_reference_video(path: Path, defaults: dict) -> np.ndarray:
    """``WanPipeline.__call__`` on one CUDA device, with the engine's defaults and its CPU-seeded noise."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    value = {k: getattr(PARAMS, k) if getattr(PARAMS, k) is not None else defaults[k] for k in defaults}
    with torch.no_grad():
        return pipe(
            PROMPT,
            negative_prompt=PARAMS.negative_prompt,
            generator=torch.Generator().manual_seed(PARAMS.seed),
            output_type="np",
            **value,
        ).frames[0]


@pytest.mark.parametrize(
    "shard", [pytest.param(1, marks=needs_cuda_devices(1)), pytest.param(2, marks=needs_cuda_devices(2))]
)
def test_wan_engine_on_cuda_equals_diffusers(shard: int, model_cache: Path):
    path = builtin("tiny-wan", model_cache)
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=shard).resolved()
    with Engine(path, config) as engine:
        [out] = engine.generate(PROMPT, PARAMS)
    assert out.memory_kind.startswith("cuda") and len(out.peak_memory_bytes) == shard
    np.testing.assert_allclose(
        out.frames, cuda_reference_video(path, engine.info.defaults), atol=ATOL, rtol=0
    )


# -- every layout, the caches and --compile on CUDA + NCCL (issue 18) ------------------------------------------

LAYOUTS = {
    "hsdp2": (2, ParallelConfig(use_hsdp=True, hsdp_shard_size=2)),
    "hsdp2x2": (4, ParallelConfig(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2)),
    "ulysses2": (2, ParallelConfig(use_hsdp=True, ulysses_degree=2)),
    "cfg2": (2, ParallelConfig(use_hsdp=True, cfg_parallel_size=2)),
    "request-parallel": (2, ParallelConfig(use_hsdp=True, hsdp_shard_size=2, request_parallel=True)),
}
CACHE_STEPS = 6
INT8_PSNR_DB = 40.0
"""int8 shards change the weights: bounded against full precision, as in tests/test_quantize.py on CPU."""


def _layout_params(layout: str):
    devices, _ = LAYOUTS[layout]
    return pytest.param(layout, marks=needs_cuda_devices(devices))


def cuda_cache_reference(path: Path, defaults: dict, cache: str | None, seed: int, prompt: str) -> np.ndarray:
    """Diffusers on one CUDA device with the cache config the engine builds (or none)."""
    from diffusers import DiffusionPipeline

    from hsdp.engine.cache import build_cache_config
    from tests.test_engine_cache import CACHES

    pipe = DiffusionPipeline.from_pretrained(path).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    if cache is not None:
        config = build_cache_config(
            cache, CACHES[cache], timestep=lambda: pipe.current_timestep, num_inference_steps=CACHE_STEPS
        )
        pipe.transformer.enable_cache(config)
    value = {**defaults, "num_inference_steps": CACHE_STEPS}
    with torch.no_grad():
        return pipe(
            prompt,
            negative_prompt=PARAMS.negative_prompt,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
            **value,
        ).frames[0]


@pytest.mark.parametrize("layout", [_layout_params(name) for name in LAYOUTS])
def test_every_layout_and_cache_on_cuda_equals_diffusers(layout: str, model_cache: Path):
    from tests.test_engine_cache import CACHES

    path = builtin("tiny-wan", model_cache)
    _, config = LAYOUTS[layout]
    config = config.resolved()
    prompts = [PROMPT, "A red fox"] if config.request_parallel else [PROMPT]
    caches = [None, *(c for c in CACHES if not (c == "pab" and config.cfg_parallel_size == 2))]
    with Engine(path, config) as engine:
        for cache in caches:
            params = SamplingParams(
                seed=PARAMS.seed,
                num_inference_steps=CACHE_STEPS,
                negative_prompt=PARAMS.negative_prompt,
                cache=cache,
                cache_config=CACHES.get(cache),
            )
            for out in engine.generate(prompts, params):
                want = cuda_cache_reference(path, engine.info.defaults, cache, out.seed, out.prompt)
                np.testing.assert_allclose(out.frames, want, atol=ATOL, rtol=0, err_msg=f"{layout} {cache}")
                if cache is not None:
                    assert out.cache["skipped"] > 0, out.cache


@needs_cuda_devices(2)
def test_int8_shards_on_cuda_close_to_full_precision(model_cache: Path):
    path = builtin("tiny-wan", model_cache)
    config = LAYOUTS["hsdp2"][1].resolved()
    with Engine(path, config, weight_dtype="int8") as engine:
        [out] = engine.generate(PROMPT, PARAMS)
    want = cuda_reference_video(path, engine.info.defaults)
    mse = float(np.mean((out.frames.astype(np.float64) - want) ** 2))
    assert mse == 0 or 10 * np.log10(1 / mse) >= INT8_PSNR_DB


@pytest.mark.parametrize("layout", [_layout_params(n) for n in ("hsdp2", "ulysses2", "cfg2")])
def test_compiled_blocks_on_cuda_equal_eager(layout: str, model_cache: Path):
    path = builtin("tiny-wan", model_cache)
    config = LAYOUTS[layout][1].resolved()
    with Engine(path, config) as engine:
        [eager] = engine.generate(PROMPT, PARAMS)
    with Engine(path, config, compile=True) as engine:
        [compiled] = engine.generate(PROMPT, PARAMS)
        [cached] = engine.generate(PROMPT, SamplingParams(**{**vars(PARAMS), "cache": "first-block"}))
    np.testing.assert_allclose(compiled.frames, eager.frames, atol=1e-3, rtol=0)
    assert cached.cache is not None


@needs_cuda_devices(2)
def test_cache_and_compile_benchmark_rows_on_cuda(tmp_path: Path):
    """The rows of docs/performance.md's cache and compile table, measured on this machine's GPUs; the JSON goes
    to ``$HSDP_GPU_BENCH_OUTPUT`` when set (e.g. benchmarks/results/inference_cache-gpu.json)."""
    import json
    import os
    import subprocess
    import sys

    output = Path(os.environ.get("HSDP_GPU_BENCH_OUTPUT", tmp_path / "inference_cache.json"))
    subprocess.run(
        [sys.executable, "benchmarks/inference_cache.py", "--compile-width", "1536", "--output", str(output)],
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    report = json.loads(output.read_text())
    assert report["caches"] and all(row["psnr_db"] > 0 for row in report["caches"])
    assert {row["variant"] for row in report["compile"]} == {"eager", "compiled"}


# -- diffusion fine-tuning on CUDA (issue 17) --------------------------------------------------------------------

TRAIN_TOL = 1e-4
"""CUDA against one CPU process: the same math in other kernels (TF32 off), so float noise of order 1e-6 per
step; AdamW's eps keeps near-zero gradients from turning it into whole-lr steps."""


def train_diffusion_without_tf32(configs: list) -> list[dict]:
    """On a rank: :func:`tests.diffusion_train_fns.train_diffusion` with cuDNN's TF32 off (on by default for
    convolutions: Wan's patch embedding and the VAE would compute in 10-bit mantissas)."""
    from tests.diffusion_train_fns import train_diffusion

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    return train_diffusion(configs)


@pytest.mark.parametrize(
    "shard", [pytest.param(1, marks=needs_cuda_devices(1)), pytest.param(2, marks=needs_cuda_devices(2))]
)
@pytest.mark.parametrize("lora_r", [4, 0], ids=["lora", "full"])
def test_diffusion_training_on_cuda_equals_one_cpu_process(shard: int, lora_r: int, model_cache: Path, media: Path):
    """``hsdp train``'s diffusion trainer on CUDA + NCCL (LoRA and full fine-tuning of tiny-wan): loss per step and
    trained weights against one CPU process running diffusers + peft on the same rows, noise and timesteps."""
    from hsdp.launch import WorkerGroup
    from hsdp.train import TrainConfig
    from tests.diffusion_train_fns import assert_trained_like, reference_run
    path = builtin("tiny-wan", model_cache)
    cfg = TrainConfig(
        model=str(path), data=str(media), resolution=32, steps=3, batch_size=2, lr=1e-3 if lora_r else 1e-4,
        seed=3, progress=False, lora_r=lora_r, parallel=ParallelConfig(use_hsdp=True, hsdp_shard_size=shard),
    )  # fmt: skip
    with WorkerGroup(shard) as group:
        [[run], *_] = group.run(train_diffusion_without_tf32, [cfg])
    ref = reference_run(cfg, path)
    assert_trained_like(run, ref, TRAIN_TOL)
    assert run["losses"][0] != run["losses"][-1]  # it trained
