"""``--report-to tensorboard|wandb|none`` (HF Trainer's flag): per-step figures to an experiment tracker.

Rank 0 reports, under HF Trainer's names: ``train/loss``, ``train/learning_rate``, ``train/grad_norm`` (when
clipping), ``train/tokens_per_second``, and at evaluations ``eval/loss`` and ``eval/perplexity``. TensorBoard
writes event files to ``--logging-dir`` (default ``<output-dir>/runs``). wandb runs only when installed; it
follows its own environment (``WANDB_MODE=offline`` writes the run locally for a later ``wandb sync``,
``WANDB_PROJECT`` names the project, default ``hsdp``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Protocol

from hsdp.suggest import did_you_mean

__all__ = ["REPORTERS", "Reporter", "report_problems", "make_reporter", "step_metrics", "write_summary"]

REPORTERS = ("none", "tensorboard", "wandb")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


class Reporter(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def report_problems(report_to: str, output_dir: str | None, logging_dir: str | None) -> list[str]:
    if report_to not in REPORTERS:
        return [f"--report-to={report_to!r}: use one of {', '.join(REPORTERS)}{did_you_mean(report_to, REPORTERS)}"]
    if report_to == "none":
        return []
    package = _PACKAGES[report_to]
    if importlib.util.find_spec(package) is None:
        return [f"--report-to {report_to}: the {package} package is not installed; pip install {package}"]
    if report_to == "tensorboard" and not (output_dir or logging_dir):
        return [
            "--report-to tensorboard needs a folder for its event files: set --output-dir or --logging-dir"
        ]
    return []


def step_metrics(step) -> dict[str, float]:
    """The figures of one :class:`~hsdp.train.trainer.StepResult`, under HF Trainer's names."""
    out = {
        "train/loss": step.loss,
        "train/learning_rate": step.lr,
        "train/tokens_per_second": step.tokens_per_s,
    }
    if step.grad_norm is not None:
        out["train/grad_norm"] = step.grad_norm
    if step.eval_loss is not None:
        out["eval/loss"] = step.eval_loss
    if step.eval_perplexity is not None:
        out["eval/perplexity"] = step.eval_perplexity
    return out


def write_summary(path: str | Path, steps: list) -> None:
    """``--summary-json``: every :class:`~hsdp.train.trainer.StepResult` so far, written to a temporary sibling and
    renamed, so a reader (or a run killed mid-write) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps([dataclasses.asdict(s) for s in steps], indent=1))
    os.replace(tmp, path)


class _TensorBoard:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a crashed run keeps what it reported

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, config: dict, folder: Path | None) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "hsdp"),
            config=config,
            dir=str(folder) if folder else None,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def make_reporter(cfg) -> Reporter | None:
    """The reporter of a :class:`~hsdp.train.config.TrainConfig` (call on rank 0 only); None for ``none``."""
    folder = (
        Path(cfg.logging_dir)
        if cfg.logging_dir
        else Path(cfg.output_dir) / "runs"
        if cfg.output_dir
        else None
    )
    if cfg.report_to == "tensorboard":
        return _TensorBoard(folder)
    if cfg.report_to == "wandb":
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "parallel"}
        return _Wandb({**config, "layout": cfg.effective_parallel().describe()}, folder)
    return None
