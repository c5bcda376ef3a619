"""Run a :class:`~hsdp.train.config.TrainConfig` on the ranks its layout needs.

Under ``torchrun`` (or any launcher that sets ``RANK``/``WORLD_SIZE``) every process trains in place; otherwise
the layout's ranks are spawned here with :class:`~hsdp.launch.WorkerGroup` (a one-rank layout trains in this
process). Inputs are checked by :func:`~hsdp.train.config.preflight` before anything is spawned.
"""

from __future__ import annotations

from hsdp.distributed import init_distributed, launched_by_torchrun, rank
from hsdp.launch import WorkerGroup
from hsdp.logging_utils import configure_logging
from hsdp.train.config import TrainConfig, preflight
from hsdp.train.trainer import Trainer, TrainResult, load_data

__all__ = ["run_training", "train_on_rank"]


def train_on_rank(cfg: TrainConfig) -> TrainResult:
    """Rank-side entry point: build a trainer, train to the end, release what it owns."""
    with Trainer(cfg) as trainer:
        return trainer.fit()


def run_training(cfg: TrainConfig, *, collective_timeout_s: float | None = None) -> TrainResult:
    """Train ``cfg`` to the end and return rank 0's result."""
    checks = preflight(cfg)
    world = cfg.effective_parallel().world_size
    if launched_by_torchrun():
        init_distributed()
        configure_logging(rank())
        return train_on_rank(cfg)
    if world == 1:
        return train_on_rank(cfg)
    load_data(cfg, checks.model_dir)  # a short or malformed file fails here, before ranks start
    with WorkerGroup(world, collective_timeout_s=collective_timeout_s) as group:
        return group.run(train_on_rank, cfg)[0]
