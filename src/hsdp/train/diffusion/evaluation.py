"""``--eval-data`` for diffusion training: the denoiser's loss on held-out media at fixed timesteps.

A diffusion loss drawn at random timesteps and noise is too noisy to compare two evaluations, so the eval set is
scored at fixed points: every item at each of :data:`EVAL_FRACTIONS` of the trained timestep range (for flow
matching, shifted to sigmas as training shifts them), with noise drawn from a CPU generator seeded by the run's
seed and the item's index. The same model therefore scores the same on every run, world size and layout. The
figure is the plain mean squared error of the prediction against the objective's target over all items and
points (no timestep weighting), reported as ``eval/loss`` at ``--eval-every`` and the last step, as LM training
reports its eval loss.

The eval media are encoded with the training data, by the same frozen encoders, before these are freed (and, with
``--cache-latents``, kept in the same latent cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hsdp.train.config import TrainConfig, TrainConfigError
from hsdp.train.data import DatasetError
from hsdp.train.diffusion.media import Bucket, MediaDataset, MediaSpec

__all__ = ["EVAL_FRACTIONS", "EvalData", "open_eval_media", "encoded", "eval_noise", "evaluate"]

EVAL_FRACTIONS = (0.125, 0.375, 0.625, 0.875)
"""Where in the trained timestep range each eval item is scored: the middles of four equal parts."""


@dataclass
class EvalData:
    """The eval items, encoded: latents, caption encodings and size buckets."""

    latents: list[torch.Tensor]
    prompts: list[dict[str, torch.Tensor]]
    buckets: list[Bucket]


def open_eval_media(cfg: TrainConfig, spec: MediaSpec) -> MediaDataset:
    """The ``--eval-data`` media, checked as the training media are (refusals name ``--eval-data``)."""
    try:
        return MediaDataset.from_source(
            cfg.eval_data, spec, resolution=cfg.resolution, frames=cfg.frames, flag="--eval-data"
        )
    except DatasetError as exc:
        raise TrainConfigError(str(exc)) from exc


def encoded(dataset: MediaDataset, items: list[dict[str, torch.Tensor]]) -> EvalData:
    """The eval data of ``dataset`` from its items' encodings
    (:func:`hsdp.train.diffusion.frozen.encode_items`'s, or the latent cache's)."""
    return EvalData([item.pop("latents") for item in items], items, list(dataset.buckets))


def eval_noise(seed: int, index: int, latents: torch.Tensor) -> torch.Tensor:
    """The fixed noise of eval item ``index``: one draw per point of :data:`EVAL_FRACTIONS`, ``[K, *latents]``."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + 2**40 + index)
    return torch.randn((len(EVAL_FRACTIONS), *latents.shape), generator=generator, dtype=torch.float32)


@torch.no_grad()
def evaluate(trainer) -> float:
    """Mean eval loss of ``trainer``'s model (a :class:`hsdp.train.diffusion.DiffusionTrainer`); collective.

    Items are dealt round-robin over the data-parallel ranks, each scored at every point in one forward. Every
    rank runs the same number of forwards (FSDP gathers collectively): a rank past the last item scores item 0
    again and adds nothing."""
    data: EvalData = trainer.eval_data
    rows = range(trainer.dp_rank, len(data.latents), trainer.dp_size)
    forwards = -(-len(data.latents) // trainer.dp_size)
    fractions = torch.tensor(EVAL_FRACTIONS)
    sums = torch.zeros(2, device=trainer.device)  # summed per-point losses, points
    trainer.model.eval()
    for i in range(forwards):
        index = rows[i] if i < len(rows) else 0
        latents = data.latents[index]
        noise = eval_noise(trainer.cfg.seed, index, latents)
        noised = trainer.objective.at(latents.expand_as(noise), noise, fractions)
        prompts = trainer.batch_prompts([data.prompts[index]] * len(fractions))
        bucket = data.buckets[index]
        size = (bucket.height, bucket.width)
        prediction = trainer.denoise(noised.noisy, noised.timesteps, prompts, size, bucket.frames)
        loss = F.mse_loss(prediction.float(), noised.target.to(trainer.device), reduction="none").flatten(1).mean(1)
        if i < len(rows):
            sums += torch.stack([loss.sum(), torch.tensor(float(len(loss)), device=trainer.device)])
    trainer.model.train()
    if dist.is_initialized():
        dist.all_reduce(sums)  # sequence-parallel peers add equal copies to both sums: the ratio holds
    return (sums[0] / sums[1]).item()
