"""Issue 33's silent differences between ``hsdp serve`` and plain diffusers in one process, on a tiny LTX-2 (video and
its sound) and LTX: the served video's sound is made for the mp4's frame rate (item 2), and frame counts follow the
pipeline's own rule (item 3); vLLM-Omni's own edit fields are accepted (item 10, on tiny-wan-i2v).

The server here is the real app, service and runner in this process (FastAPI's test client) over an engine
stand-in that runs the diffusers pipeline in this process, through the engine's own request building
(:func:`hsdp.engine.params.build_requests`) and pipeline arguments (:func:`hsdp.engine.diffusion.call_kwargs`): what
these items are about is what the server asks of the pipeline, and the sharded engine equals one process already
(tests/test_audio.py), so no ranks are started."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
from PIL import Image

from hsdp.engine import GenerationOutput, Timings
from hsdp.engine.diffusion import _numpy, call_kwargs, sample_rate
from hsdp.engine.model_info import inspect_model
from hsdp.engine.params import build_requests
from hsdp.serve.settings import ServeSettings

pytestmark = pytest.mark.slow

PROMPT = "A cat walks by"
SMALL = {"size": "32x32", "num_inference_steps": 1, "guidance_scale": 1.0, "seed": 3, "negative_prompt": ""}


@pytest.fixture(scope="module")
def ltx2(tmp_path_factory):
    from tests.audio_pipelines import build_tiny_ltx2

    return build_tiny_ltx2(tmp_path_factory.mktemp("ltx2") / "tiny-ltx2")


@pytest.fixture(scope="module")
def ltx2_pipe(ltx2):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(ltx2)


class OneProcessEngine:
    """The runner's engine contract over the diffusers pipeline in this process (one request slot, no workers)."""

    kind = "diffusion"
    request_slots = 1
    pids: list[int] = []
    closed = False
    last_heard = None
    adapter_slots = None
    adapter_stats = {"adapters": [], "loads": 0, "switches": 0, "evictions": 0}

    def __init__(self, folder, pipe, settings: ServeSettings):
        self.info, self.pipe = inspect_model(folder), pipe
        self.config = settings.parallel_config.resolved()
        self.calls: list[dict] = []

    def generate(self, prompts, params, on_progress=None, on_start=None, **ignored):
        requests, resolved = build_requests(self.info, self.config, prompts, params)
        outputs = []
        for request in requests:
            kwargs = call_kwargs(self.info, [request], resolved)
            self.calls.append(kwargs)
            result = self.pipe(
                prompt=request.prompt,
                generator=torch.Generator("cpu").manual_seed(request.seed),
                output_type="np",
                **kwargs,
            )
            sound = getattr(result, "audio", None)
            made = {"frames": result.frames[0]} if hasattr(result, "frames") else {"images": result.images}
            if sound is not None:
                made |= {"audio": _numpy(sound)[0], "sample_rate": sample_rate(self.pipe)}
            outputs.append(
                GenerationOutput(
                    request.request_id, request.prompt, request.seed, Timings(total_s=0.0), [0], "cpu", **made
                )
            )
        return outputs

    def ping(self, timeout_s):
        pass

    def cancel(self, request_id, call_id=None):
        pass

    def kill_workers(self):
        pass

    def close(self):
        self.closed = True


@contextlib.contextmanager
def served(folder, pipe, tmp_path):
    """The app over :class:`OneProcessEngine`, and that engine."""
    from fastapi.testclient import TestClient

    from hsdp.serve.app import create_app
    from hsdp.serve.service import Server

    settings = ServeSettings(model=str(folder), output_dir=tmp_path / "out")
    engines = []

    class OneProcessServer(Server):
        def _make_engine(self):
            engines.append(OneProcessEngine(folder, pipe, settings))
            return engines[-1]

    server = OneProcessServer(settings)
    server.start()
    with TestClient(create_app(server)) as client:
        yield client, engines[0]


def test_served_sound_is_made_for_the_mp4_frame_rate(ltx2, ltx2_pipe, tmp_path, monkeypatch):
    """Issue 33 item 2: ``/v1/videos/sync`` wrote the mp4 at the request's ``fps`` (default 16) while the pipeline
    made the sound for its own ``frame_rate`` (24), so the sound ran short of the picture. Now the request's ``fps``
    is the pipeline's ``frame_rate``, as ``hsdp generate --fps`` passes it (one rule,
    :func:`hsdp.engine.params.frame_rate_args`), and without ``fps`` the mp4 takes the pipeline's 24: what the server
    writes into the mp4 is the one-process pipeline's picture and sound for that rate, exactly."""
    from hsdp.serve import runner

    written = []

    def save_frames(frames, path, fps, audio=None):
        written.append((frames, fps, audio))
        return runner_save_frames(frames, path, fps=fps, audio=audio)

    runner_save_frames = runner.save_frames
    monkeypatch.setattr(runner, "save_frames", save_frames)
    with served(ltx2, ltx2_pipe, tmp_path) as (client, engine):
        for fps, frame_rate in ((16, 16.0), (None, 24.0)):
            body = {"prompt": PROMPT, "num_frames": 9, **SMALL, **({"fps": fps} if fps else {})}
            answer = client.post("/v1/videos/sync", json=body)
            assert answer.status_code == 200, answer.text
            reference = ltx2_pipe(
                PROMPT, height=32, width=32, num_frames=9, num_inference_steps=1, guidance_scale=1.0,
                negative_prompt="", frame_rate=frame_rate, output_type="np",
                generator=torch.Generator("cpu").manual_seed(3),
            )  # fmt: skip
            frames, mp4_fps, (sound, rate) = written[-1]
            assert mp4_fps == int(frame_rate) and rate == sample_rate(ltx2_pipe)
            np.testing.assert_array_equal(frames, reference.frames[0])
            np.testing.assert_array_equal(sound, _numpy(reference.audio)[0])
        # The two rates make sounds of different lengths for the same 9 frames: the check above can tell them apart.
        assert written[0][2][0].shape[-1] != written[1][2][0].shape[-1]


@pytest.fixture(scope="module")
def ltx(tmp_path_factory):
    from tests.heldout_pipelines import build

    return build("ltx", tmp_path_factory.mktemp("heldout"))


@pytest.mark.parametrize("name", ["ltx2", "ltx"])
def test_the_frame_rule_is_the_pipeline_s_as_the_trainer_reads_it(name, request):
    """Issue 33 item 3: the engine read the temporal compression from ``vae/config.json``, where the LTX and LTX-2
    VAEs leave it null (their class derives it), and took 1 where the pipeline's is 2 (LTX-2 here) or 4 (LTX here).
    Now the engine, the server and the trainer read it from the pipeline by one rule
    (:mod:`hsdp.models.description`): the model's info equals the loaded pipeline's attribute and the trainer's spec."""
    from diffusers import DiffusionPipeline

    from hsdp.train.diffusion.frozen import media_spec

    folder = request.getfixturevalue(name)
    info = inspect_model(folder)
    loaded = DiffusionPipeline.from_pretrained(folder)
    assert info.temporal_factor == loaded.vae_temporal_compression_ratio == {"ltx2": 2, "ltx": 4}[name]
    spec = media_spec(folder, "transformer")
    assert (info.spatial_multiple, info.temporal_factor) == (spec.spatial_multiple, spec.temporal_multiple)


def test_a_frame_count_off_the_rule_is_refused_with_the_nearest(ltx2, ltx2_pipe, tmp_path, capsys, monkeypatch):
    """Issue 33 item 3: ``--num-frames 6`` on LTX-2 silently wrote 5 frames, and ``/v1/videos``' ``seconds`` was not
    rounded to the model's rule. Now ``hsdp generate`` refuses it before any rank starts, naming the flag, the rule
    and the nearest valid counts; the HTTP routes refuse ``num_frames`` alike, and round ``seconds x fps`` down to
    the rule (1 s at 8 fps: 8 frames, so 9 = 2 x 4 + 1)."""
    from hsdp.cli import main

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks started before the refusal")

    monkeypatch.setattr("hsdp.engine.engine.WorkerGroup", no_ranks)
    argv = ["generate", "--model", str(ltx2), "--prompt", PROMPT, "--num-frames", "6", "--output", str(tmp_path / "x.mp4")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "num_frames=6 must be 2k+1" in err and "(--num-frames)" in err and "the nearest are 5 or 7" in err, err
    with served(ltx2, ltx2_pipe, tmp_path) as (client, engine):
        answer = client.post("/v1/videos/sync", json={"prompt": PROMPT, "num_frames": 6, **SMALL})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "num_frames", answer.text
        assert "the nearest are 5 or 7" in answer.json()["error"]["message"]
        job = client.post("/v1/videos", json={"prompt": PROMPT, "seconds": 1, "fps": 8, **SMALL}).json()
        assert job["num_frames"] == 9 and job["fps"] == 8, job
        client.delete(f"/v1/videos/{job['id']}")


def test_vllm_omni_edit_fields_are_accepted_applied_or_named_unused(tmp_path):
    """Issue 33 item 10: vLLM-Omni's benchmark client sends ``bot_task=think`` on ``/v1/images/edits`` (a field of
    its edits API, with ``sys_type`` and ``system_prompt``), and hsdp answered 400 "bot_task: unknown field". Now
    every field of OpenAI's or vLLM-Omni's schema for the route is accepted: those the pipeline takes are applied
    (vLLM-Omni's ``extra_params``, its ``extra_args``, here ``attention_kwargs``), the others are named in
    ``X-Hsdp-Unused-Fields``; a name neither API knows is still a 400 with the closest known one."""
    from diffusers import DiffusionPipeline

    from hsdp.models.builtin import resolve_model

    folder = resolve_model("tiny-wan-i2v")
    pipe = DiffusionPipeline.from_pretrained(folder)
    image = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(image, format="PNG")
    files = {"image": ("in.png", image.getvalue(), "application/octet-stream")}
    form = {"prompt": PROMPT, "size": "32x32", "num_inference_steps": "1", "seed": "3"}
    vllm_omni = {"bot_task": "think", "sys_type": "en_unified", "system_prompt": "be brief",
                 "extra_params": '{"attention_kwargs": {"scale": 1.0}}', "output_compression": "90"}  # fmt: skip
    with served(folder, pipe, tmp_path) as (client, engine):
        answer = client.post("/v1/images/edits", data={**form, **vllm_omni}, files=files)
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-Hsdp-Unused-Fields"] == "bot_task, output_compression, sys_type, system_prompt"
        assert engine.calls[-1]["attention_kwargs"] == {"scale": 1.0} and len(answer.json()["data"]) == 1
        plain = client.post("/v1/images/edits", data=form, files=files)
        assert plain.status_code == 200 and "X-Hsdp-Unused-Fields" not in plain.headers
        assert "attention_kwargs" not in engine.calls[-1]
        typo = client.post("/v1/images/edits", data={**form, "bot_tsk": "think"}, files=files)
        assert typo.status_code == 400 and typo.json()["error"]["param"] == "bot_tsk", typo.text
        assert "bot_tsk: unknown field; did you mean bot_task?" in typo.json()["error"]["message"]
