"""The playground at ``/`` of ``hsdp serve``, driven in a real headless Chromium (Debian's ``chromium`` package,
through Playwright's Python package; no browser is downloaded), and the public routes it runs on: ``/v1/jobs``
(asynchronous jobs of any output, with step ``k`` of ``n``) and the ``parameters`` of ``/v1/models``.

One tiny-flux server at HSDP 2 for the module. What the page shows is checked against the API: the image's bytes
equal ``/v1/images/generations``' answer for the same seed (with and without an adapter picked in the page, as the
``lora`` field does). The video and audio players are tested beside those models' servers: ``tests/test_serve.py``
(tiny-wan, and the text page on tiny-llama) and ``tests/test_serve_audio.py``. A screenshot of each page goes to
``outputs/test-artifacts/playground/`` (``HSDP_TEST_ARTIFACTS`` to move it; ignored by git).
Without chromium or playwright the browser tests skip naming what is missing (``.ci/run`` installs both).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import pytest

from hsdp.serve.local import LocalServer
from tests.browser import assert_accessible, open_playground, run_job, screenshot, shown_bytes
from tests.engine_refs import builtin
from tests.lora_refs import save_adapter

pytestmark = pytest.mark.slow

HSDP2 = ["--use-hsdp", "--hsdp-shard-size", "2"]
KEY = "page-key"
LONG_STEPS = 400
"""A job long enough to watch its steps advance and to cancel it while it runs."""


# -- servers -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flux(tmp_path_factory) -> Path:
    return builtin("tiny-flux", tmp_path_factory.getbasetemp() / "hsdp-cache")


@pytest.fixture(scope="module")
def flux_server(flux, tmp_path_factory):
    """tiny-flux at HSDP 2 serving the LoRA adapter ``x`` (random, so it changes the image), behind an API key."""
    from diffusers import FluxTransformer2DModel

    folder = tmp_path_factory.mktemp("flux-page")
    transformer = FluxTransformer2DModel.from_pretrained(str(flux / "transformer"))
    save_adapter(transformer, folder / "x", ["to_q", "to_k", "to_v"], seed=3)
    args = [*HSDP2, "--lora", f"x={folder / 'x'}", "--max-steps", str(LONG_STEPS)]
    args += ["--served-model-name", "tiny-flux", "--output-dir", str(folder / "out")]
    with LocalServer(str(flux), args, log=folder / "log", api_key=KEY) as server:
        yield server


def _pixels(data: bytes) -> np.ndarray:
    from PIL import Image  # noqa: I001

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _api_image(server: LocalServer, **body) -> np.ndarray:
    response = httpx.post(
        server.url + "/v1/images/generations", json=body, headers=server.headers, timeout=300
    )
    assert response.status_code == 200, response.text
    return _pixels(base64.b64decode(response.json()["data"][0]["b64_json"]))


# -- the public routes the page runs on ----------------------------------------------------------------------
def test_image_jobs_report_steps_and_equal_the_images_route(flux_server):
    """``POST /v1/jobs`` on an image pipeline: queued, polled (step k of n), its file equal to
    ``/v1/images/generations``' answer; ``/v1/videos`` neither lists nor serves it; ``/v1/models`` tells the
    fields with the server's limits."""
    with httpx.Client(base_url=flux_server.url, timeout=300, headers=flux_server.headers) as client:
        card = client.get("/v1/models").json()["data"][0]
        job = client.post(
            "/v1/jobs", json={"prompt": "a red fox", "seed": 5, "num_inference_steps": 3}
        ).json()
        assert job["object"] == "job" and job["output"] == "image" and job["steps"] == 3, job
        while job["status"] not in ("completed", "failed", "cancelled"):
            job = client.get(f"/v1/jobs/{job['id']}").json()
        content = client.get(f"/v1/jobs/{job['id']}/content")
        videos = client.get("/v1/videos").json()["data"]
        video_get = client.get(f"/v1/videos/{job['id']}")
        wrong = client.post("/v1/jobs", json={"prompt": "x", "num_frames": 5})
        over = client.post("/v1/jobs", json={"prompt": "x", "num_inference_steps": LONG_STEPS + 1})
    assert job["status"] == "completed" and job["step"] == job["steps"] == 3, job
    assert content.headers["content-type"] == "image/png"
    np.testing.assert_array_equal(
        _pixels(content.content), _api_image(flux_server, prompt="a red fox", seed=5, num_inference_steps=3)
    )
    assert videos == [] and video_get.status_code == 404
    assert wrong.status_code == 400 and "num_frames" in wrong.json()["error"]["message"]
    assert over.status_code == 400 and "--max-steps" in over.json()["error"]["message"]
    fields = {f["name"]: f for f in card["parameters"]["fields"]}
    assert card["parameters"]["job_route"] == "/v1/jobs"
    assert (
        fields["num_inference_steps"]["maximum"] == LONG_STEPS
        and fields["num_inference_steps"]["default"] == 4
    )
    assert fields["size"]["default"] == "64x64" and fields["size"]["multiple_of"] == 16
    assert "num_frames" not in fields and "guidance_scale" in fields and "input_reference" not in fields


# -- the page ------------------------------------------------------------------------------------------------
def test_flux_page_image_equals_the_api_adapter_progress_cancel_download(flux_server, page):
    open_playground(page, flux_server.url, api_key=KEY)  # asked once: the tab keeps it, a reload asks no more
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.is_hidden("#key-section")
    assert page.inner_text("#model-name") == "tiny-flux"
    assert page.get_attribute("#f-num_inference_steps", "max") == str(LONG_STEPS)
    # The image the page shows is the API's for the same request and seed.
    run_job(page, "a red fox", seed=1, num_inference_steps=2)
    assert page.eval_on_selector("#result-media", "img => img.complete && img.naturalWidth") == 64
    base = _pixels(shown_bytes(page))
    np.testing.assert_array_equal(
        base, _api_image(flux_server, prompt="a red fox", seed=1, num_inference_steps=2)
    )
    # An adapter picked in the page changes the image as the API's lora field does.
    page.check("[data-adapter=x]")
    adapted_id = run_job(page, "a red fox", seed=1, num_inference_steps=2)
    adapted = _pixels(shown_bytes(page))
    expected = _api_image(flux_server, prompt="a red fox", seed=1, num_inference_steps=2, lora={"name": "x"})
    np.testing.assert_array_equal(adapted, expected)
    assert not np.array_equal(adapted, base)
    page.uncheck("[data-adapter=x]")
    # The job list's Download saves the job's file.
    with page.expect_download() as download:
        page.click(f"button[aria-label='Download {adapted_id}']")
    np.testing.assert_array_equal(_pixels(Path(download.value.path()).read_bytes()), expected)
    screenshot(page, "flux")
    assert_accessible(page, "the playground on tiny-flux")
    # A long job: its steps advance in the page (step k of n, an ETA), then the job list's Cancel stops it.
    page.fill("#f-num_inference_steps", str(LONG_STEPS))
    page.click("#start")
    running = """min => { const s = document.getElementById("current-status");
        return s.dataset.status === "in_progress" && Number(s.dataset.step) >= min; }"""
    page.wait_for_function(running, arg=1, timeout=120_000)
    first = int(page.get_attribute("#current-status", "data-step"))
    page.wait_for_function(running, arg=first + 1, timeout=120_000)
    text = page.inner_text("#current-status")
    assert f"of {LONG_STEPS}" in text and "s left" in text, text
    job_id = page.get_attribute("#current-status", "data-job-id")
    screenshot(page, "flux-running")
    page.click(f"button[aria-label='Cancel {job_id}']")
    page.wait_for_function(
        """() => document.getElementById("current-status").dataset.status === "cancelled" """
    )
    job = httpx.get(f"{flux_server.url}/v1/jobs/{job_id}", headers=flux_server.headers).json()
    assert job["status"] == "cancelled" and job["step"] < LONG_STEPS, job
    page.wait_for_selector(f"tr[data-job-id='{job_id}'][data-status=cancelled]")
    assert page.is_hidden("#key-section")
