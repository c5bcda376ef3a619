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


def _drawn(page) -> dict:
    """Every chart's points as the page holds them: metric -> [[step, value]] (memory: [[rank, step, bytes]])."""
    return page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll("svg[data-metric]")].map(svg => [svg.dataset.metric,
             [...svg.querySelectorAll("circle")].map(c => c.dataset.series === undefined
               ? [Number(c.dataset.step), Number(c.dataset.value)]
               : [Number(c.dataset.series.split(" ")[1]), Number(c.dataset.step), Number(c.dataset.value)])]))"""
    )


def _served_page_with_steps(process, url: str, steps: int) -> str:
    """The page ``--serve-report`` answers once it holds ``steps`` records (the run holds before the next)."""
    import json
    import re
    import time

    import httpx

    while process.poll() is None:
        time.sleep(0.2)  # a poll interval, not a wait for something to happen
        text = httpx.get(url, timeout=30).text
        records = re.search(r'<script type="application/json" id="records">(.*?)</script>', text, re.S)
        if records and len(json.loads(records.group(1))) == steps:
            return text
    raise AssertionError(f"the run ended (exit {process.returncode}) before its page held {steps} steps")


def test_run_page_of_a_flux_lora_run_updates_while_it_goes_and_is_served(media, tmp_path, page):
    """``hsdp train --serve-report 0`` on tiny-flux (LoRA, HSDP 2, validation samples), held before its second
    step (tests/fault_injection): the served page says it is running, with step 1's points only, the step-0 samples
    and the data table (items, buckets, the PDF left out with why), and serves samples but no checkpoint. Opened from
    the file in a headless Chromium, the page reloads itself until the run ends; then it has the points of
    ``--summary-json`` (every curve and each rank's memory), a grid row per validation step with each image loaded,
    no reload script, and the server is gone."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    import threading
    from pathlib import Path

    import httpx

    from hsdp.models.builtin import resolve_model
    from tests.browser import assert_accessible, screenshot

    resolve_model("tiny-flux")  # built here, not by the ranks
    data, run, summary, gate = tmp_path / "data", tmp_path / "run", tmp_path / "summary.json", tmp_path / "go"
    shutil.copytree(media, data)
    (data / "notes.pdf").write_bytes(b"%PDF-1.4")
    argv = [sys.executable, "-m", "hsdp.cli", "train", "--model", "tiny-flux", "--data", str(data),
            "--resolution", "32", "--steps", "2", "--batch-size", "2", "--lr", "1e-3", "--lora-r", "4",
            "--use-hsdp", "--hsdp-shard-size", "2", "--output-dir", str(run), "--validation-prompt", "a red fox",
            "--validation-every", "2", "--summary-json", str(summary), "--serve-report", "0"]  # fmt: skip
    faults = str(Path(__file__).parent / "fault_injection")
    env = {**os.environ, "HSDP_TEST_HOLD_FILE": f"{gate}:2"}
    env["PYTHONPATH"] = os.pathsep.join([faults, env.get("PYTHONPATH", "")])
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    served_at = threading.Event()

    def drain() -> None:  # the run's output, read as it comes (a full pipe would stop the run)
        for line in process.stdout:
            lines.append(line)
            if line.startswith("run page served at "):
                served_at.set()
        served_at.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        served_at.wait(timeout=300)
        url = next((line.split()[4] for line in lines if line.startswith("run page served at ")), None)
        assert url, "".join(lines)
        served = _served_page_with_steps(process, url, 1)
        assert '<body data-state="running"' in served and 'id="auto-refresh"' in served
        sample = next((run / "samples" / "step-0").glob("*.png")).relative_to(run).as_posix()
        answer = httpx.get(url + sample, timeout=30)
        assert answer.status_code == 200 and answer.headers["content-type"] == "image/png"
        assert answer.content == (run / sample).read_bytes()
        assert httpx.get(url + "summary.json", timeout=30).status_code == 404

        page.goto((run / "report.html").as_uri())  # the file, as the run writes it
        # Its reload box off while the running page is read: axe-core took longer than the reload interval on a
        # loaded host ("Execution context was destroyed"); on again and reloaded once, the page reloads itself.
        page.uncheck("#auto-refresh")
        assert page.get_attribute("body", "data-state") == "running"
        middle = _drawn(page)
        assert [s for s, _ in middle["loss"]] == [1] and [r for r, _, _ in middle["peak_memory"]] == [0, 1]
        assert page.eval_on_selector_all(".grid tr[data-step]", "rs => rs.map(r => Number(r.dataset.step))") == [0]
        assert page.inner_text('#data td[data-field="items"]').startswith("4 ")
        assert len(page.query_selector_all('#data th:text-matches("^bucket ")')) == 2
        left_out = page.inner_text('#left-out tr[data-kind="skipped"]')
        assert "notes.pdf" in left_out and "not an image or video" in left_out
        screenshot(page, "train-run-page-running")
        assert_accessible(page, "the run page while the run goes")
        page.check("#auto-refresh")
        page.reload()
        assert page.get_attribute("body", "data-state") == "running"  # the run holds before step 2

        gate.touch()
        page.wait_for_function("document.body.dataset.state === 'finished'", timeout=300_000)  # reloaded itself
        process.wait(timeout=300)
        reader.join(timeout=60)
    finally:
        gate.touch()
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, "".join(lines)
    records = json.loads(summary.read_text())
    assert [r["step"] for r in records] == [1, 2]
    drawn = _drawn(page)
    for name in ("loss", "lr", "tokens_per_s"):
        assert drawn[name] == [[r["step"], r[name]] for r in records], name
    assert middle["loss"] == drawn["loss"][:1]  # the points so far, then more
    memory = sorted([rank, r["step"], peak] for r in records for rank, peak in enumerate(r["peak_memory"]))
    assert sorted(drawn["peak_memory"]) == memory
    rows = page.eval_on_selector_all(".grid tr[data-step]", "rows => rows.map(r => Number(r.dataset.step))")
    assert rows == [0, 2]  # before the first step and at the end
    loaded = page.eval_on_selector_all(".grid img", "imgs => imgs.map(i => i.complete && i.naturalWidth)")
    assert loaded == [64, 64], loaded
    assert page.query_selector("#auto-refresh") is None and page.query_selector("main script:not([type])") is None
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=30)
    screenshot(page, "train-run-page")
    assert_accessible(page, "the run page")
