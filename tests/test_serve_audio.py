"""``hsdp serve`` on an audio pipeline (tiny-stable-audio, request-parallel HSDP 2), driven by the official ``openai``
client: ``audio.speech.create`` and chat completions with ``modalities: ["audio"]`` answer the waveform of the
single-process diffusers pipeline for the same seed, as 16-bit PCM holds it; the routes the model cannot serve and a
length past the model's limit are 400s naming what to use instead. The playground at ``/`` plays the same waveform
(in a headless Chromium, :mod:`tests.browser`)."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import soundfile

from hsdp.models.builtin import resolve_model
from hsdp.serve.local import LocalServer
from tests.browser import assert_accessible, media_duration, open_playground, run_job, screenshot, shown_bytes
from tests.engine_refs import reference_pipeline

pytestmark = pytest.mark.slow

PROMPT = "Rain on a tin roof"
GENERATION = {"seed": 5, "num_inference_steps": 3, "guidance_scale": 7.0, "audio_seconds": 0.25}
PCM16 = 1.5 / 32768  # libsndfile writes x * 32767 and reads back / 32768, rounded


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-audio")
    args = ["--use-hsdp", "--hsdp-shard-size", "2", "--request-parallel", "--output-dir", str(folder / "out")]
    with LocalServer("tiny-stable-audio", args, log=folder / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def expected():
    waveforms = reference_pipeline(
        resolve_model("tiny-stable-audio"), PROMPT, 5, num_inference_steps=3, guidance_scale=7.0, audio_end_in_s=0.25
    )
    return waveforms[0]


def _waveform(data: bytes) -> np.ndarray:
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    assert rate == 8000
    return samples.T


def test_openai_speech_and_chat_audio_equal_one_process(server, expected):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    speech = client.audio.speech.create(
        model="tiny-stable-audio", input=PROMPT, voice="alloy", response_format="wav", extra_body=GENERATION
    )
    np.testing.assert_allclose(_waveform(speech.content), expected, atol=PCM16, rtol=0)
    flac = client.audio.speech.create(
        model="tiny-stable-audio", input=PROMPT, voice="alloy", response_format="flac", extra_body=GENERATION
    )
    np.testing.assert_allclose(_waveform(flac.content), expected, atol=PCM16, rtol=0)
    chat = client.chat.completions.create(
        model="tiny-stable-audio",
        messages=[{"role": "user", "content": PROMPT}],
        modalities=["audio"],
        audio={"voice": "alloy", "format": "wav"},
        extra_body=GENERATION,
    )
    message = chat.choices[0].message
    assert message.content is None and chat.model == "tiny-stable-audio"
    np.testing.assert_allclose(_waveform(base64.b64decode(message.audio.data)), expected, atol=PCM16, rtol=0)


def test_routes_the_audio_model_cannot_serve_name_the_ones_it_can(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        [card] = client.get("/v1/models").json()["data"]
        assert card["outputs"] == ["audio"]
        assert card["routes"] == ["/v1/audio/speech", "/v1/jobs", "/v1/chat/completions"]
        for path, body in [
            ("/v1/images/generations", {"prompt": PROMPT}),
            ("/v1/videos/sync", {"prompt": PROMPT}),
        ]:
            answer = client.post(path, json=body)
            assert answer.status_code == 400, answer.text
            assert "use POST /v1/audio/speech, /v1/jobs or /v1/chat/completions" in answer.json()["error"]["message"]
        too_long = client.post("/v1/audio/speech", json={"input": PROMPT, "audio_seconds": 0.6})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "audio_seconds", too_long.text
        assert "exceeds the 0.256 s" in too_long.json()["error"]["message"]
        fast = client.post("/v1/audio/speech", json={"input": PROMPT, "speed": 2.0})
        assert fast.status_code == 400 and fast.json()["error"]["param"] == "speed"


def test_playground_plays_the_audio_of_the_api(server, expected, page):
    """A job started in the page: its <audio> player reads the file (duration > 0) and the file is the waveform of
    the single-process pipeline, as the speech route's."""
    open_playground(page, server.url)
    fields = page.eval_on_selector_all("#fields input, #fields textarea", "els => els.map(e => e.name)")
    assert "audio_seconds" in fields and "size" not in fields, fields
    run_job(page, PROMPT, seed=5, num_inference_steps=3, guidance_scale=7.0, audio_seconds=0.25)
    assert media_duration(page) == pytest.approx(0.25, abs=0.01)
    np.testing.assert_allclose(_waveform(shown_bytes(page)), expected, atol=PCM16, rtol=0)
    screenshot(page, "stable-audio")
    assert_accessible(page, "the playground on tiny-stable-audio")
