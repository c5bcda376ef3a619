"""``--eval-data`` and validation samples for diffusion training.

Eval: loss at fixed timesteps, deterministic, equal to one process.

The reference is one process running diffusers on the trained weights: the pipeline's own VAE and
``encode_prompt``, the documented noise (one generator per item, seeded from the run's seed) and sigmas (the
fractions of :data:`EVAL_FRACTIONS`, shifted by the scheduler's flow shift). fp32; HSDP 2 sums in another order,
so within 1e-5 as the training parity tests.

Validation samples: written under ``<output_dir>/samples/step-N`` at step 0, every ``--validation-every`` steps and
at the end; the step-0 sample (LoRA adapters start at zero) equals the base diffusers pipeline's on the same seed
within 1e-5 (pixels in [0, 1]; HSDP 2 sums in another order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hsdp.config import ParallelConfig
from hsdp.models.builtin import resolve_model
from hsdp.train import TrainConfig, TrainConfigError
from hsdp.train.diffusion.evaluation import EVAL_FRACTIONS, eval_noise
from hsdp.train.diffusion.trainer import check_diffusion_run

TOL = 1e-5


def train_with_eval(configs: list[TrainConfig]) -> list[dict]:
    """Train each config; the eval losses per step and the trained weights (whole)."""
    from hsdp.train.diffusion import DiffusionTrainer

    out = []
    for cfg in configs:
        with DiffusionTrainer(cfg) as trainer:
            result = trainer.fit()
            out.append({"eval": [s.eval_loss for s in result.steps], "state": trainer.full_state()})
    return out


def reference_eval(cfg: TrainConfig, state: dict[str, torch.Tensor]) -> float:
    """One process: diffusers' pipeline with ``state`` loaded into its transformer, scored as the docs say."""
    import diffusers

    from hsdp.train.diffusion.media import MediaDataset
    from hsdp.train.diffusion.trainer import media_spec

    folder = resolve_model(cfg.model)
    pipe = diffusers.WanPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    pipe.transformer.load_state_dict(state)
    data = MediaDataset.from_source(cfg.eval_data, media_spec(folder, "transformer"),
                                    resolution=cfg.resolution, frames=cfg.frames)  # fmt: skip
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    shift = pipe.scheduler.config.flow_shift
    u = torch.tensor(EVAL_FRACTIONS)
    sigma = (shift * u / (1 + (shift - 1) * u)).view(-1, 1, 1, 1, 1)
    losses = []
    with torch.no_grad():
        for i, item in enumerate(data.items):
            x0 = (vae.encode(data.pixels(i)[None]).latent_dist.mode() - mean) / std
            prompt = pipe.encode_prompt([item.caption], do_classifier_free_guidance=False, max_sequence_length=512,
                                        device=torch.device("cpu"))[0]  # 512 tokens as WanPipeline.__call__  # fmt: skip
            noise = eval_noise(cfg.seed, i, x0[0])
            pred = pipe.transformer(hidden_states=(1 - sigma) * x0 + sigma * noise, timestep=sigma.flatten() * 1000,
                                    encoder_hidden_states=prompt.expand(len(u), -1, -1), return_dict=False)[0]  # fmt: skip
            losses.append(((pred - (noise - x0)) ** 2).flatten(1).mean(1))
    return torch.cat(losses).mean().item()


@pytest.mark.slow
def test_eval_loss_is_deterministic_and_equals_one_process(dist_run, media):  # noqa: F811
    cfg = TrainConfig(model="tiny-wan", data=str(media), eval_data=str(media), eval_every=1, resolution=32,
                      steps=2, batch_size=2, lr=1e-4, seed=3, progress=False,
                      parallel=ParallelConfig(use_hsdp=True, hsdp_shard_size=2))  # fmt: skip
    first, second = dist_run(2, train_with_eval, [cfg, cfg])[0]
    assert first["eval"] == second["eval"]  # two runs: the same figures, bit for bit
    assert first["eval"][0] != first["eval"][1]  # it scores the model being trained
    reference = reference_eval(cfg, first["state"])
    assert abs(first["eval"][-1] - reference) < TOL, (first["eval"], reference)


def test_eval_media_are_checked_before_training(media, tmp_path):  # noqa: F811
    base = TrainConfig(model="tiny-wan", data=str(media), resolution=32, progress=False)
    with pytest.raises(TrainConfigError, match="--eval-data .*missing: no such file or folder"):
        check_diffusion_run(base.replace(eval_data=str(tmp_path / "missing")))
    with pytest.raises(TrainConfigError, match="--eval-split: not available for diffusion"):
        check_diffusion_run(base.replace(eval_split=0.5))


def train_with_samples(cfg: TrainConfig) -> dict:
    """The samples before training and after it (fit writes every due step's files)."""
    from hsdp.train.diffusion import DiffusionTrainer

    with DiffusionTrainer(cfg) as trainer:
        first = trainer.sample()
        trainer.fit()
        return {"first": first, "last": trainer.sample()}


@pytest.mark.slow
def test_validation_samples_at_their_steps_start_from_the_base_pipeline(dist_run, media, tmp_path):  # noqa: F811
    import diffusers

    from hsdp.train.diffusion.validation import sample_paths, validation_calls

    prompts = ("a cat playing piano", "a dog")
    cfg = TrainConfig(model="tiny-wan", data=str(media), resolution=32, steps=3, batch_size=2, lr=1e-2, seed=3,
                      lora_r=4, progress=False, output_dir=str(tmp_path / "run"), validation_prompts=prompts,
                      validation_every=2, parallel=ParallelConfig(use_hsdp=True, hsdp_shard_size=2))  # fmt: skip
    run = dist_run(2, train_with_samples, cfg)[0]
    written = sorted(p.relative_to(tmp_path / "run" / "samples").as_posix()
                     for p in (tmp_path / "run" / "samples").rglob("*.mp4"))  # fmt: skip
    expected = [p.relative_to(tmp_path / "run" / "samples").as_posix()
                for step in (0, 2, 3) for p in sample_paths(cfg.output_dir, step, prompts, video=True)]  # fmt: skip
    assert written == sorted(expected) and "step-0/0-a-cat-playing-piano.mp4" in written

    folder = resolve_model("tiny-wan")
    pipe = diffusers.WanPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for call, sample in zip(validation_calls(cfg, folder), run["first"], strict=True):
        kwargs = {k: v for k, v in call.items() if k != "seed"}
        base = pipe(generator=torch.Generator().manual_seed(cfg.seed), **kwargs)
        assert call["prompt"] in prompts and abs(sample - base.frames[0]).max() < TOL
    assert abs(run["last"][0] - run["first"][0]).max() > 1e-3  # the samples show the training


@pytest.mark.slow
def test_validation_sample_equals_engine_generate_with_true_cfg(dist_run, media, tmp_path):  # noqa: F811
    """FLUX with a negative prompt and true_cfg_scale (two encode_prompt calls per sample): the sample after one
    step of full fine-tuning equals the engine generating from the exported weights, prompt and seed on the same
    layout (within 1e-5; measured 0), and differs from the step-0 sample and from one without the negative prompt."""
    from hsdp.engine import Engine
    from hsdp.engine.params import SamplingParams

    layout = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    resolve_model("tiny-flux")  # written here: ranks writing the built-in could lose its text encoders' weights
    cfg = TrainConfig(model="tiny-flux", data=str(media), resolution=32, steps=1, batch_size=2, lr=1e-2, seed=3,
                      progress=False, output_dir=str(tmp_path / "run"), validation_prompts=("a red fox",),
                      validation_negative_prompt="blurry", validation_cfg_scale=4.0, export=str(tmp_path / "out"),
                      parallel=layout)  # fmt: skip
    run = dist_run(2, train_with_samples, cfg)[0]
    plain = cfg.replace(validation_negative_prompt=None, validation_cfg_scale=None, export=None,
                        output_dir=str(tmp_path / "plain"))  # fmt: skip
    unguided = dist_run(2, train_with_samples, plain)[0]
    with Engine(tmp_path / "out", layout, workers=dist_run.group(2)) as engine:
        [out] = engine.generate("a red fox", SamplingParams(seed=3, negative_prompt="blurry", true_cfg_scale=4.0))
    [sample], generated = run["last"], np.stack(out.images)
    assert sample.shape == generated.shape == (1, 64, 64, 3)
    assert abs(sample - generated).max() < TOL
    assert abs(sample - run["first"][0]).max() > 1e-3  # trained
    assert abs(sample - unguided["last"][0]).max() > 1e-3  # the negative prompt's pass counts


def test_validation_flags_are_checked():
    base = TrainConfig(model="tiny-wan", data="media", progress=False)
    assert "--validation-every needs prompts" in " ".join(base.replace(validation_every=2).problems())
    assert "--validation-prompt writes samples under --output-dir" in " ".join(
        base.replace(validation_prompts=("a cat",)).problems()
    )
    assert "--validation-cfg-scale sets the validation samples'" in " ".join(
        base.replace(validation_cfg_scale=4.0).problems()
    )
