"""The run page's states and its server, without training (the page of a real run, opened in a browser while the
run goes and after, is tests/test_train_report.py's): a live page reloads itself, an ended one does not; a run
whose ranks ended without their last page gets it from the records the page embeds; ``--serve-report`` serves
the page and the samples, nothing else, and stops with its ``with``."""

from __future__ import annotations

import json
import re
import sys
import threading
import time

import httpx
import pytest

from hsdp.cli import build_parser
from hsdp.train import TrainConfig
from hsdp.train.cli import _serve_problem
from hsdp.train.page_server import serve_run_page
from hsdp.train.run_page import PAGE_NAME, end_live_page, write_run_page
from hsdp.train.trainer import StepResult, TrainResult

CFG = TrainConfig(model="tiny-flux", data="media", steps=5, log_every=1)
DATA = {
    "source": "media",
    "items": 4,
    "unit": "(4 images, 0 clips)",
    "buckets": [["1 x 32 x 32 (frames x height x width)", 3]],
    "skipped": [["media/notes.pdf", "not an image or video"]],
    "upscaled": [],
}


def _result(steps: int) -> TrainResult:
    records = [
        StepResult(
            step=s, loss=1.0 / s, grad_norm=0.5, tokens_per_s=3.0, seconds=0.1, peak_memory=[2**20 * s, 2**21]
        )
        for s in range(1, steps + 1)
    ]
    return TrainResult(steps=records, unit="samples", memory_kind="cpu peak RSS", data=DATA)


def _embedded(text: str, key: str):
    return json.loads(
        re.search(rf'<script type="application/json" id="{key}">(.*?)</script>', text, re.S).group(1)
    )


def test_a_live_page_reloads_itself_and_an_ended_one_keeps_its_records_and_stays_still(tmp_path):
    text = write_run_page(tmp_path, _result(2), CFG, state="running").read_text()
    assert (
        '<body data-state="running"' in text and 'id="auto-refresh"' in text and "location.reload()" in text
    )
    assert 2 <= int(re.search(r'data-refresh="(\d+)"', text).group(1)) <= 30
    assert "Running: step 2 of 5." in text and "notes.pdf" in text and "1 x 32 x 32" in text
    assert len(re.findall(r'<circle [^>]*data-series="rank 1"', text)) == 2  # each rank's memory per step

    assert end_live_page(tmp_path, CFG, "failed: rank 1 exited with SIGKILL")
    ended = (tmp_path / PAGE_NAME).read_text()
    assert '<body data-state="failed"' in ended and "location.reload()" not in ended
    assert "Failed: rank 1 exited with SIGKILL (step 2 of 5)." in ended
    assert (
        _embedded(ended, "records") == _embedded(text, "records") and _embedded(ended, "run")["data"] == DATA
    )
    assert not end_live_page(tmp_path, CFG, "failed: again")  # ended pages are left alone
    write_run_page(tmp_path, _result(2), CFG, state="running")
    assert not end_live_page(tmp_path, CFG, "failed: refused", since=time.time() + 60)  # a previous run's page

    finished = write_run_page(tmp_path, _result(5), CFG).read_text()
    assert '<body data-state="finished"' in finished and "<script>" not in finished


def test_serve_report_serves_the_page_and_samples_only_and_stops(tmp_path):
    (tmp_path / "samples" / "step-0").mkdir(parents=True)
    (tmp_path / "samples" / "step-0" / "0-fox.png").write_bytes(b"\x89PNG fox")
    (tmp_path / "step-00000001").mkdir()
    (tmp_path / "step-00000001" / "model.safetensors").write_bytes(b"weights")
    threads = threading.active_count()
    with serve_run_page(tmp_path, 0) as url:
        assert url.startswith("http://127.0.0.1:")
        # No thread of the caller's (a forked child serves): the ranks the run starts next fork from it
        assert sys.platform != "linux" or threading.active_count() == threads
        waiting = httpx.get(url)
        assert waiting.status_code == 200 and "location.reload()" in waiting.text  # before the first page
        page = write_run_page(tmp_path, _result(1), CFG, state="running")
        assert httpx.get(url).content == httpx.get(url + PAGE_NAME).content == page.read_bytes()
        sample = httpx.get(url + "samples/step-0/0-fox.png")
        assert sample.content == b"\x89PNG fox" and sample.headers["content-type"] == "image/png"
        for path in ("step-00000001/model.safetensors", "samples/../step-00000001/model.safetensors", "x"):
            assert httpx.get(url + path).status_code == 404, path
    with pytest.raises(httpx.ConnectError):
        httpx.get(url)


def test_serve_report_flags_are_checked():
    parser = build_parser("train")
    parse = lambda *flags: parser.parse_args(["train", "--data", "x.txt", *flags])  # noqa: E731
    assert (
        _serve_problem(parse()) is None
        and _serve_problem(parse("--output-dir", "o", "--serve-report", "0")) is None
    )
    assert "set --output-dir" in _serve_problem(parse("--serve-report", "8000"))
    assert "0 (any free one) to 65535" in _serve_problem(
        parse("--output-dir", "o", "--serve-report", "70000")
    )
    assert parse("--output-dir", "o", "--serve-report", "1").serve_report_host == "127.0.0.1"
