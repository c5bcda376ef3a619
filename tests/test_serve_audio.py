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


def test_pcm_is_what_openai_clients_play(server, expected):
    """Issue 33 item 6: ``response_format: "pcm"`` was the pipeline's 8 kHz stereo samples; the ``openai`` SDK's
    own player reads pcm as 24 kHz mono int16. Read that way, the answer is the one-process waveform's channel mean
    at 24 kHz (resampled as :func:`hsdp.engine.outputs.openai_pcm` documents), within 16-bit rounding."""
    import asyncio

    import openai
    from openai.helpers.local_audio_player import SAMPLE_RATE, LocalAudioPlayer
    from scipy.signal import resample_poly

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    speech = client.audio.speech.create(
        model="tiny-stable-audio", input=PROMPT, voice="alloy", response_format="pcm", extra_body=GENERATION
    )
    played = asyncio.run(LocalAudioPlayer()._tts_response_to_buffer(speech))  # (samples, 1) float32
    assert SAMPLE_RATE == 24000 and played.shape == (expected.shape[1] * 3, 1)  # 0.25 s at 24 kHz, mono
    reference = np.clip(resample_poly(expected.astype(np.float64).mean(axis=0), 3, 1), -1, 1)
    np.testing.assert_allclose(played[:, 0], reference, atol=PCM16 + 1e-6, rtol=0)


def test_chat_audio_makes_n_choices(server, expected):
    """Issue 33 item 8: chat completions with audio output made one output whatever ``n`` asked (n > 1 was
    refused outright, ``num_outputs_per_prompt`` ignored). Now ``n`` choices, seeds ``seed + i``: the first is
    the one-process waveform of seed 5, the second another one (seed 6)."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny-stable-audio",
        messages=[{"role": "user", "content": PROMPT}],
        modalities=["audio"],
        audio={"voice": "alloy", "format": "wav"},
        n=2,
        extra_body=GENERATION,
    )
    assert [c.index for c in chat.choices] == [0, 1]
    first, second = (_waveform(base64.b64decode(c.message.audio.data)) for c in chat.choices)
    np.testing.assert_allclose(first, expected, atol=PCM16, rtol=0)
    assert np.abs(second - first).max() > 0.01  # another seed, not the same output twice
    with httpx.Client(base_url=server.url, timeout=120) as http:
        body = {"messages": [{"role": "user", "content": PROMPT}], "n": 2, "num_outputs_per_prompt": 2, **GENERATION}
        answer = http.post("/v1/chat/completions", json=body)  # vLLM-Omni's shape: audio_url parts per choice
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        assert [len(c["message"]["content"]) for c in choices] == [2, 2]
        urls = [part["audio_url"]["url"] for c in choices for part in c["message"]["content"]]
        assert len(set(urls)) == 4  # seeds 5..8
        too_many = http.post("/v1/chat/completions", json={**body, "n": 3})
        assert too_many.status_code == 400 and "--max-images" in too_many.json()["error"]["message"]

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
