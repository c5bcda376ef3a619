"""Ulysses sequence-parallel diffusion training against one process running diffusers + peft.

The two ranks of the sequence group train on the same rows with the same noise; diffusers' ``_cp_plan`` splits the
denoiser's tokens between them and all-to-all attention sees the whole sequence, so the math is the one-process
math with sums in another order (within 1e-5, fp32)."""

from __future__ import annotations

import numpy as np
import pytest

from hsdp.config import ParallelConfig
from hsdp.models.builtin import resolve_model
from hsdp.train import TrainConfig, TrainConfigError
from hsdp.train.diffusion.trainer import check_diffusion_run
from tests.diffusion_train_fns import assert_trained_like, reference_run, train_diffusion

TOL = 1e-5
ULYSSES2 = ParallelConfig(use_hsdp=True, ulysses_degree=2)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """Three captioned images (64x48 at resolution 32: 4x4 latents, 4 tokens, which split over 2 ranks)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("media-ulysses")
    rng = np.random.default_rng(1)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (48, 48, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"a dog number {i}")
    return folder


def _cfg(media, **kw) -> TrainConfig:
    base = dict(
        model="tiny-wan",
        data=str(media),
        resolution=32,
        steps=3,
        batch_size=2,
        lr=1e-3,
        seed=5,
        progress=False,
        lora_r=4,
        parallel=ULYSSES2,
    )
    return TrainConfig(**(base | kw))


def grad_norms(configs: list[TrainConfig]) -> list[list[float]]:
    """The gradient norm of each step of each config (clipping far above it, so only measured)."""
    from hsdp.train.diffusion import DiffusionTrainer

    out = []
    for cfg in configs:
        with DiffusionTrainer(cfg.replace(max_grad_norm=1e6)) as trainer:
            out.append([step.grad_norm for step in trainer.fit().steps])
    return out


@pytest.mark.slow
def test_ulysses2_lora_equals_diffusers_peft_one_process(dist_run, media):
    cfg = _cfg(media)
    run = dist_run(2, train_diffusion, [cfg])[0][0]
    ref = reference_run(cfg, resolve_model("tiny-wan"))
    assert_trained_like(run, ref, TOL)
    assert run["losses"][0] != run["losses"][-1]
    # Adam would hide a gradient off by a constant factor (each rank's share of the sequence, averaged instead of
    # summed): the gradient norms of Ulysses 2 equal those of HSDP 2 on the same rows.
    sharded_layout = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    ulysses, sharded = dist_run(2, grad_norms, [cfg, cfg.replace(parallel=sharded_layout)])[0]
    assert np.allclose(ulysses, sharded, rtol=1e-5, atol=0), (ulysses, sharded)


def test_layouts_training_cannot_use_are_refused(media):
    for layout, flag in (
        (ParallelConfig(use_hsdp=True, cfg_parallel_size=2), "--cfg-parallel-size"),
        (ParallelConfig(use_hsdp=True, ring_degree=2), "--ring-degree"),
        (ParallelConfig(use_hsdp=True, hsdp_shard_size=2, request_parallel=True), "--request-parallel"),
    ):
        with pytest.raises(TrainConfigError, match=flag):
            check_diffusion_run(_cfg(media, parallel=layout))
    with pytest.raises(TrainConfigError, match="has no _cp_plan"):  # SDXL's UNet: diffusers cannot split it
        check_diffusion_run(_cfg(media, model="tiny-sdxl", train_component="unet"))


def test_ulysses_refused_for_a_causal_lm(tmp_path):
    from hsdp.train.config import preflight

    data = tmp_path / "d.txt"
    data.write_text("hello world " * 50)
    with pytest.raises(TrainConfigError, match="--ulysses-degree=2: sequence-parallel training"):
        preflight(TrainConfig(model="tiny-llama", data=str(data), parallel=ULYSSES2))
