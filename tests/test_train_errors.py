"""Bad input to training gets a clear error before heavy work, and nothing on disk is overwritten."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hsdp.checkpoint import CheckpointError, latest_checkpoint
from hsdp.config import ParallelConfig
from hsdp.launch import WorkerDiedError
from hsdp.models.tiny import build_byte_tokenizer, build_tiny_llama
from hsdp.train import TrainConfig, TrainConfigError, Trainer, preflight
from hsdp.train.data import DatasetError
from tests.train_fns import train_and_die

pytestmark = pytest.mark.slow  # builds and trains models, spawns ranks


def _model(folder: Path, **overrides) -> Path:
    build_tiny_llama(**overrides).save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder


def _snapshot(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-process run with two checkpoints, the config that made it, and a model of another shape."""
    root = tmp_path_factory.mktemp("errors")
    data = root / "data.txt"
    data.write_text("sharded training needs enough text for a few batches of tokens. " * 20)
    cfg = TrainConfig(
        model=str(_model(root / "model")), data=str(data), steps=2, batch_size=2, seq_len=16, lr=1e-3,
        output_dir=str(root / "run"), save_every=1, progress=False,
    )  # fmt: skip
    Trainer(cfg).fit()
    return {"cfg": cfg, "root": root, "other": _model(root / "other", num_hidden_layers=2)}


def _error(cfg: TrainConfig, kind: type[Exception] = TrainConfigError) -> str:
    with pytest.raises(kind) as info:
        Trainer(cfg)
    return str(info.value)


def test_unknown_strategy_and_strategy_mesh_mismatch(trained):
    cfg = trained["cfg"].replace(output_dir=None, save_every=0)
    bad = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, sharding_strategy="ZERO_SHARD")
    message = _error(cfg.replace(parallel=bad))
    assert "ZERO_SHARD" in message and "FULL_SHARD" in message
    mismatch = ParallelConfig(
        use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2, sharding_strategy="FULL_SHARD"
    )
    assert "HYBRID_SHARD" in _error(cfg.replace(parallel=mismatch))
    odd_batch = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    assert "--batch-size=3" in _error(cfg.replace(parallel=odd_batch, batch_size=3))


def test_existing_checkpoints_are_not_overwritten(trained):
    before = _snapshot(trained["root"] / "run")
    assert "--resume" in _error(trained["cfg"])
    export = trained["root"] / "run"  # a non-empty folder
    assert "--export" in _error(trained["cfg"].replace(resume="latest", steps=5, export=str(export)))
    assert _snapshot(trained["root"] / "run") == before


def test_resume_from_another_model_is_refused(trained):
    before = _snapshot(trained["root"] / "run")
    message = _error(trained["cfg"].replace(model=str(trained["other"]), resume="latest", steps=5))
    assert "another model" in message and "num_hidden_layers" in message
    assert "already at step 2" in _error(trained["cfg"].replace(resume="latest", steps=2))
    assert _snapshot(trained["root"] / "run") == before


def test_partial_and_corrupt_checkpoints(trained, tmp_path):
    good = latest_checkpoint(trained["root"] / "run")
    partial = tmp_path / "step-00000009"
    shutil.copytree(good, partial)
    (partial / "COMPLETE").unlink()
    assert latest_checkpoint(tmp_path) is None  # an interrupted save is never the latest
    assert "incomplete" in _error(trained["cfg"].replace(resume=str(partial), steps=5), CheckpointError)
    corrupt = tmp_path / "step-00000002"
    shutil.copytree(good, corrupt)
    shard = next(corrupt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    message = _error(trained["cfg"].replace(resume=str(corrupt), steps=5), CheckpointError)
    assert str(corrupt) in message and "could not be loaded" in message


def test_dataset_too_short_for_one_batch(trained, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    message = _error(trained["cfg"].replace(data=str(short), output_dir=None, save_every=0), DatasetError)
    assert "--seq-len" in message and "--batch-size" in message
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"text": "ok"}\n{"content": "no text field"}\n')
    assert ":2:" in _error(
        trained["cfg"].replace(data=str(jsonl), output_dir=None, save_every=0), DatasetError
    )
    with pytest.raises(TrainConfigError, match="--data"):
        preflight(trained["cfg"].replace(data=str(tmp_path / "missing.txt")))


def test_killed_rank_fails_fast_and_last_checkpoint_loads(dist_run, trained, tmp_path):
    """Rank 1 dies after step 3: the group reports it, step 2 (the last complete save) resumes at one rank."""
    cfg = trained["cfg"].replace(
        parallel=ParallelConfig(use_hsdp=True, hsdp_shard_size=2),
        steps=5,
        save_every=2,
        output_dir=str(tmp_path),
    )
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        dist_run(2, train_and_die, cfg, 1, 3, timeout_s=120)
    assert latest_checkpoint(tmp_path).name == "step-00000002"
    resumed = Trainer(cfg.replace(parallel=ParallelConfig(), resume="latest", steps=3))
    assert resumed.step == 2
    assert torch.isfinite(torch.tensor(resumed.fit().losses)).all()
