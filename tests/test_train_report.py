"""``--report-to``: TensorBoard event files and an offline wandb run hold the per-step and eval figures; the run
page ``<output-dir>/report.html`` draws the ``--summary-json`` records (checked in a headless Chromium)."""

from __future__ import annotations

import pytest

from hsdp.models.tiny import build_byte_tokenizer, build_tiny_llama
from hsdp.train import TrainConfig, Trainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> TrainConfig:
    root = tmp_path_factory.mktemp("report")
    build_tiny_llama().save_pretrained(root / "model")
    build_byte_tokenizer().save_pretrained(root / "model")
    data = root / "data.jsonl"
    data.write_text("\n".join(f'{{"text": "record {i} for the tracker to see."}}' for i in range(40)))
    return TrainConfig(
        model=str(root / "model"), data=str(data), steps=3, batch_size=2, seq_len=32, lr=1e-3, progress=False,
        max_grad_norm=1.0, eval_split=0.1, eval_every=2, lr_scheduler="linear", warmup_steps=1,
    )  # fmt: skip


def test_tensorboard_event_files_hold_train_and_eval_figures(base, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = Trainer(base.replace(report_to="tensorboard", logging_dir=str(tmp_path / "tb"))).fit().steps
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["train/loss"] == [(s.step, pytest.approx(s.loss)) for s in steps]
    assert [v for _, v in scalars["train/learning_rate"]] == pytest.approx([0.0, 1e-3, 5e-4])
    assert len(scalars["train/grad_norm"]) == 3 and len(scalars["train/tokens_per_second"]) == 3
    assert [s for s, _ in scalars["eval/loss"]] == [2, 3] and len(scalars["eval/perplexity"]) == 2


def test_wandb_offline_run_is_written(base, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    Trainer(base.replace(report_to="wandb", logging_dir=str(tmp_path / "wb"))).fit()
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_report_to_problems_name_the_flag():
    cfg = TrainConfig(model="tiny-llama", data="x.txt", report_to="tensorboard")
    assert any("--output-dir or --logging-dir" in p for p in cfg.problems())
    assert any("--report-to='mlflow'" in p for p in cfg.replace(report_to="mlflow").problems())


def test_run_page_of_a_flux_lora_run_shows_the_summary_json_curves_and_each_validation_step(media, tmp_path, page):
    """``hsdp train`` on tiny-flux (LoRA, HSDP 2, validation samples) writes ``<output-dir>/report.html``; opened
    in a headless Chromium from the file (no server), its curves' points are ``--summary-json``'s records and its
    sample grid has a row per validation step, each image loaded."""
    import json

    from hsdp.cli import main as cli_main
    from hsdp.models.builtin import resolve_model
    from tests.browser import assert_accessible, screenshot

    resolve_model("tiny-flux")  # built here, not by the ranks
    run, summary = tmp_path / "run", tmp_path / "summary.json"
    argv = ["train", "--model", "tiny-flux", "--data", str(media), "--resolution", "32", "--steps", "2",
            "--batch-size", "2", "--lr", "1e-3", "--lora-r", "4", "--use-hsdp", "--hsdp-shard-size", "2",
            "--output-dir", str(run), "--validation-prompt", "a red fox", "--validation-every", "2",
            "--summary-json", str(summary)]  # fmt: skip
    assert cli_main(argv) == 0
    records = json.loads(summary.read_text())
    page.goto((run / "report.html").as_uri())
    drawn = page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll("svg[data-metric]")].map(svg => [svg.dataset.metric,
             [...svg.querySelectorAll("circle")].map(c => [Number(c.dataset.step), Number(c.dataset.value)])]))"""
    )
    for name in ("loss", "lr", "tokens_per_s"):
        assert drawn[name] == [[r["step"], r[name]] for r in records], name
    assert [r["step"] for r in records] == [1, 2]
    rows = page.eval_on_selector_all(".grid tr[data-step]", "rows => rows.map(r => Number(r.dataset.step))")
    assert rows == [0, 2]  # before the first step and at the end
    loaded = page.eval_on_selector_all(".grid img", "imgs => imgs.map(i => i.complete && i.naturalWidth)")
    assert loaded == [64, 64], loaded
    screenshot(page, "train-run-page")
    assert_accessible(page, "the run page")
