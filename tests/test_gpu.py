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
