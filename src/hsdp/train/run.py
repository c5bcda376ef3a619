"""Run a :class:`~hsdp.train.config.TrainConfig` on the ranks its layout needs.

Under ``torchrun`` (or any launcher that sets ``RANK``/``WORLD_SIZE``) every process trains in place; otherwise
the layout's ranks are spawned here with :class:`~hsdp.launch.WorkerGroup` (a one-rank layout trains in this
process). Inputs are checked by :func:`~hsdp.train.config.preflight` before anything is spawned.
"""

from __future__ import annotations

import logging

from hsdp.distributed import init_distributed, launched_by_torchrun, rank
from hsdp.launch import WorkerError, WorkerGroup
from hsdp.logging_utils import configure_logging
from hsdp.train.config import TrainConfig, preflight
from hsdp.train.stop import signal_name, stop_requests
from hsdp.train.trainer import Trainer, TrainResult, load_data

logger = logging.getLogger("hsdp")

__all__ = ["run_training", "train_on_rank"]


def trainer_class(cfg: TrainConfig) -> type[Trainer]:
    """The LM trainer, or the diffusion one for a diffusers pipeline folder."""
    from hsdp.models.builtin import resolve_model
    from hsdp.train.diffusion.trainer import DiffusionTrainer, is_pipeline

    try:
        model_dir = resolve_model(cfg.model)
    except FileNotFoundError:
        return Trainer  # its preflight names the --model problem
    return DiffusionTrainer if is_pipeline(model_dir) else Trainer


def train_on_rank(cfg: TrainConfig) -> TrainResult:
    """Rank-side entry point: build a trainer, train to the end (or to the step boundary after a stop signal
    received from now on: :mod:`hsdp.train.stop`), release what it owns."""
    with stop_requests(), trainer_class(cfg)(cfg) as trainer:
        return trainer.fit()


def run_training(cfg: TrainConfig, *, collective_timeout_s: float | None = None) -> TrainResult:
    """Train ``cfg`` to the end and return rank 0's result."""
    if trainer_class(cfg) is not Trainer:
        from hsdp.train.diffusion.trainer import check_diffusion_run

        check_diffusion_run(cfg)
        return _launch(cfg, collective_timeout_s)
    checks = preflight(cfg)
    if not launched_by_torchrun() and cfg.effective_parallel().world_size > 1:
        load_data(cfg, checks.model_dir)  # a short or malformed file fails here, before ranks start
    return _launch(cfg, collective_timeout_s)


def _launch(cfg: TrainConfig, collective_timeout_s: float | None) -> TrainResult:
    """Train in place under torchrun or in one process, else spawn the layout's ranks."""
    if launched_by_torchrun():
        init_distributed()
        configure_logging(rank())
        return train_on_rank(cfg)
    parallel = cfg.effective_parallel()
    if parallel.world_size == 1 and not parallel.use_hsdp:
        return train_on_rank(cfg)
    # FSDP2 on one rank (e.g. for --offload-layers) needs a process group, which a spawned rank has. The library
    # the ranks build with is imported once for all (before their fork, or by their forkserver). A stop signal to
    # this process alone (Kubernetes, kill PID) is passed on to the ranks.
    package = "transformers" if trainer_class(cfg) is Trainer else "diffusers"
    with stop_requests() as stop:
        try:
            with WorkerGroup(
                parallel.world_size, collective_timeout_s=collective_timeout_s, packages=[package]
            ) as group:
                stop.forward_to(group.pids)
                return group.run(train_on_rank, cfg)[0]
        except WorkerError as exc:
            if stop.signum is None:
                raise
            # the signal reached a rank before its trainer recorded such signals (starting, loading)
            logger.warning("a rank ended on %s before training: %s", signal_name(stop.signum), exc)
            return TrainResult(stopped_by=signal_name(stop.signum))
