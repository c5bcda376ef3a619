"""Resume continues the uninterrupted run, or refuses: ``--resume auto`` (one command for the first start and every
restart), the settings a checkpoint must be resumed with, and the documented pair of commands in docs/training.md."""

from __future__ import annotations

import argparse
import logging

import pytest

from hsdp.config import ParallelConfig
from hsdp.train import TrainConfig, TrainConfigError, Trainer, preflight
from hsdp.train.cli import add_arguments, config_from_args
from tests.test_docs_commands import ROOT, commands_in
from tests.train_fns import train_configs

pytestmark = pytest.mark.slow  # trains the built-in model

TEXT = "resumed runs must see the same rows and the same settings as the uninterrupted one. " * 40


def _losses(cfg: TrainConfig) -> list[float]:
    with Trainer(cfg) as trainer:
        return trainer.fit().losses


@pytest.fixture(scope="module")
def auto_runs(tmp_path_factory):
    """One process: ``--resume auto`` twice in one folder (step 0 -> 2, then 2 -> 4), and 4 steps uninterrupted."""
    root = tmp_path_factory.mktemp("resume")
    data = root / "data.txt"
    data.write_text(TEXT)
    cfg = TrainConfig(
        model="tiny-llama", data=str(data), steps=2, batch_size=2, seq_len=16, lr=1e-3, max_grad_norm=1.0,
        lr_scheduler="constant", warmup_steps=1, output_dir=str(root / "run"), save_every=1, resume="auto",
        progress=False,
    )  # fmt: skip
    first = _losses(cfg)
    second = _losses(cfg.replace(steps=4))
    whole = _losses(cfg.replace(steps=4, output_dir=str(root / "whole"), resume=None))
    return {"cfg": cfg.replace(steps=4), "root": root, "first": first, "second": second, "whole": whole}


def test_resume_auto_starts_at_zero_then_continues_exactly(auto_runs):
    assert len(auto_runs["first"]) == 2 and len(auto_runs["second"]) == 2
    assert auto_runs["first"] + auto_runs["second"] == auto_runs["whole"]  # bit for bit


def test_resume_auto_after_the_last_step_trains_nothing(auto_runs):
    """A restart after the final checkpoint (killed while exporting): nothing left to train, no error."""
    cfg = auto_runs["cfg"]
    assert preflight(cfg).resume_from.name == "step-00000004"
    assert _losses(cfg) == []
    with pytest.raises(TrainConfigError, match="already at step 4"):
        preflight(cfg.replace(resume="latest"))


def test_bare_resume_needs_a_checkpoint_and_names_auto(auto_runs, tmp_path):
    cfg = auto_runs["cfg"].replace(output_dir=str(tmp_path / "empty"))
    with pytest.raises(TrainConfigError, match="--resume auto"):
        preflight(cfg.replace(resume="latest"))
    assert preflight(cfg).resume_from is None  # auto: step 0
    with pytest.raises(TrainConfigError, match="--resume auto"):  # checkpoints there, no --resume
        preflight(auto_runs["cfg"].replace(resume=None, steps=6))


def _refusal(cfg: TrainConfig) -> str:
    with pytest.raises(TrainConfigError) as info:
        preflight(cfg.replace(resume="latest", steps=6))
    return str(info.value)


@pytest.mark.parametrize(
    ("change", "flag", "saved", "now"),
    [
        ({"lr": 2e-3}, "--lr", "0.001", "0.002"),
        ({"max_grad_norm": None}, "--max-grad-norm", "1.0", "unset"),
        ({"weight_decay": 0.1}, "--weight-decay", "0.0", "0.1"),
        ({"warmup_steps": 0}, "--warmup-steps", "1", "0"),
        ({"batch_size": 4}, "--batch-size", "2", "4"),
        ({"grad_accum": 2}, "--grad-accum", "1", "2"),
        ({"seq_len": 32}, "--seq-len", "16", "32"),
        ({"seed": 1}, "--seed", "0", "1"),
        ({"mixed_precision": "bf16"}, "--mixed-precision", "unset", "bf16"),
        ({"packing": False}, "--packing", "True", "False"),
        ({"freeze": ("embed",)}, "--freeze", "none", "embed"),
        ({"lora_r": 4}, "--lora-r", "0", "4"),
    ],
)
def test_resume_refuses_a_setting_that_changes_the_math(auto_runs, change, flag, saved, now):
    message = _refusal(auto_runs["cfg"].replace(**change))
    assert f"{flag}: the checkpoint has {saved}, this run {now}" in message
    assert "new --output-dir" in message


def test_resume_refuses_other_data_and_a_moved_horizon(auto_runs, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text(TEXT.upper())
    assert "--data: the checkpoint has sha256:" in _refusal(auto_runs["cfg"].replace(data=str(other)))
    same = tmp_path / "copy.txt"
    same.write_text(TEXT)  # the same records under another path
    assert preflight(auto_runs["cfg"].replace(data=str(same), resume="latest", steps=6)).resume_from
    # A decaying schedule's lr depends on --steps (its horizon): only a constant one may be extended.
    message = _refusal(auto_runs["cfg"].replace(lr_scheduler="cosine"))
    assert "--lr-scheduler: the checkpoint has constant, this run cosine" in message
    assert "--steps: the checkpoint has 4, this run 6" in message


def test_resume_allows_settings_that_keep_the_math(auto_runs, tmp_path, caplog):
    cfg = auto_runs["cfg"].replace(
        resume="latest", steps=6, log_every=3, save_every=2, keep_last=1, async_save=True,
        export=str(tmp_path / "export"), activation_checkpointing=True, report_to="none",
    )  # fmt: skip
    assert preflight(cfg).resume_from.name == "step-00000004"
    layout = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, sharding_strategy="FULL_SHARD")
    with caplog.at_level(logging.WARNING, logger="hsdp"):
        assert preflight(cfg.replace(parallel=layout)).resume_from
    assert "DCP reshards it" in caplog.text and "not bit for bit" in caplog.text


def _doc_pair() -> tuple[list[str], list[str]]:
    """The first documented command with ``--resume`` in docs/training.md and the command written before it."""
    commands = commands_in((ROOT / "docs" / "training.md").read_text(), "docs/training.md")
    second = next(c for c in commands if "--resume" in c.argv and "..." not in c.argv)
    first = commands[commands.index(second) - 1]
    return list(first.argv), list(second.argv)


def _config(argv: list[str], replace: dict[str, str]) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert argv[0] == "train", argv
    args = parser.parse_args([replace.get(a, a) for a in argv[1:]])
    return config_from_args(args).replace(progress=False)


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_documented_resume_pair_gives_the_uninterrupted_curve(dist_run, tmp_path):
    """docs/training.md's two commands (train, then continue with --resume) at the world size they name: the
    losses of the pair equal one uninterrupted run to the second command's --steps, bit for bit."""
    first, second = _doc_pair()
    data = tmp_path / "sample.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 400)  # as the doc's printf writes it
    paths = {_flag(first, "--data"): str(data), _flag(first, "--output-dir"): str(tmp_path / "run")}
    if "--export" in first:
        paths[_flag(first, "--export")] = str(tmp_path / "model")
    start, resume = _config(first, paths), _config(second, paths)
    assert resume.resume and resume.steps > start.steps
    whole = start.replace(steps=resume.steps, output_dir=str(tmp_path / "whole"), export=None)
    world = start.effective_parallel().world_size
    assert resume.effective_parallel().world_size == world
    runs = [dist_run(world, train_configs, [cfg])[0][0] for cfg in (start, resume, whole)]
    assert runs[0]["losses"] + runs[1]["losses"] == runs[2]["losses"]


def test_a_stop_signal_to_one_rank_stops_every_rank_at_the_same_step(dist_run, tmp_path):
    """SIGTERM reaching one rank only (a node's torchrun agent, one task signalled): the ranks agree at the next step
    boundary (the step's loss all-reduce carries the request), so both stop after the same step with its
    checkpoint saved, where a rank stopping alone would leave the other waiting in its next collective."""
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    parallel = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    cfg = TrainConfig(model="tiny-llama", data=str(data), parallel=parallel, steps=50, batch_size=2, seq_len=16,
                      output_dir=str(tmp_path / "run"), save_every=100, progress=False)  # fmt: skip
    from tests.train_fns import train_signalled

    ranks = dist_run(2, train_signalled, cfg, 1, 2)
    assert [r["steps"] for r in ranks] == [[1, 2, 3]] * 2  # recorded after step 2, agreed in step 3's all-reduce
    assert [r["stopped_by"] for r in ranks] == ["a stop signal to another rank", "SIGTERM"]
    assert ranks[0]["checkpoint"] == str(tmp_path / "run" / "step-00000003")
