"""Sharded training of causal LMs on FSDP2 + DCP: :class:`Trainer`, :class:`TrainConfig`, :func:`run_training`."""

from hsdp.train.config import TrainConfig, TrainConfigError, preflight
from hsdp.train.run import run_training
from hsdp.train.trainer import StepResult, Trainer, TrainResult

__all__ = [
    "TrainConfig",
    "TrainConfigError",
    "Trainer",
    "TrainResult",
    "StepResult",
    "preflight",
    "run_training",
]
