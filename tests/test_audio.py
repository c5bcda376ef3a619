"""Audio pipelines (tiny-stable-audio: diffusers' StableAudioPipeline) through the engine, against the same pipeline
in one process: exact under HSDP 2 and request-parallel HSDP 2; written as wav / flac exactly as 16-bit PCM holds
the waveform, as mp3 within the codec's error; the layouts the pipeline cannot use are refused before loading."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile

from hsdp import ParallelConfig
from hsdp.engine import Engine, SamplingParams
from hsdp.engine.checks import layout_problems
from hsdp.engine.model_info import inspect_model
from hsdp.engine.outputs import encode_audio, output_suffix_problem, save_audio
from hsdp.engine.params import build_requests
from tests.engine_refs import builtin, reference_pipeline

pytestmark = pytest.mark.slow

PROMPT = "A hammer hitting a wooden surface"
STEPS = {"num_inference_steps": 3, "guidance_scale": 7.0}
SAMPLES_PER_SECOND = 8000  # tiny-stable-audio's VAE


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return builtin("tiny-stable-audio", tmp_path_factory.getbasetemp() / "hsdp-cache")


def test_audio_pipeline_read_from_its_output_class(model):
    info = inspect_model(model)
    assert (info.output, info.audio_track, info.audio_length_param) == ("audio", False, "audio_end_in_s")
    # The DiT names no _no_split_modules: it is sharded by its repeated blocks, not left whole.
    assert "transformer" in info.shardable


@pytest.mark.parametrize("layout", ["hsdp2", "request-parallel2"])
def test_audio_layouts_equal_one_process(layout, model, dist_run):
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, request_parallel=layout == "request-parallel2")
    prompts = [PROMPT, "Rain on a tin roof"] if config.request_parallel else [PROMPT]
    with Engine(model, config, workers=dist_run.group(2)) as engine:
        progress: list[tuple] = []
        outputs = engine.generate(
            prompts, SamplingParams(seed=5, audio_seconds=0.25, **STEPS), on_progress=lambda *e: progress.append(e)
        )
    assert progress and progress[-1][1:] == (3, 3)  # live steps through the pipeline's older callback
    for out in outputs:
        expected = reference_pipeline(model, out.prompt, out.seed, audio_end_in_s=0.25, **STEPS)
        assert out.sample_rate == SAMPLES_PER_SECOND and out.audios.shape == (1, 2, 2000) == expected.shape
        assert np.isfinite(expected).all() and expected.std() > 0
        np.testing.assert_array_equal(out.audios, expected)


def test_audio_files_hold_the_waveform(tmp_path):
    rng = np.random.default_rng(0)
    waveform = np.clip(rng.normal(0, 0.3, (2, 4000)), -1, 1).astype(np.float32)
    pcm16 = np.round(waveform * 32767) / 32767  # what 16-bit PCM can hold
    for suffix in (".wav", ".flac"):
        [path] = save_audio(waveform[None], 16000, tmp_path / f"sound{suffix}")
        read, rate = soundfile.read(path, dtype="float32", always_2d=True)
        assert rate == 16000 and read.shape == (4000, 2)
        np.testing.assert_allclose(read.T, pcm16, atol=1.5 / 32768, rtol=0)
    paths = save_audio(np.stack([waveform, -waveform]), 16000, tmp_path / "two.mp3")
    assert [p.name for p in paths] == ["two_0.mp3", "two_1.mp3"]
    read, rate = soundfile.read(paths[0], dtype="float32", always_2d=True)
    assert rate == 16000 and abs(read.shape[0] - 4000) < 1200  # mp3 pads to whole frames


@pytest.mark.parametrize("rate", [8000, 16000, 44100])
def test_pcm_is_openai_pcm_24khz_mono(rate):
    """Issue 33 item 6: ``pcm`` was the pipeline's raw samples (8 kHz stereo for tiny-stable-audio), which OpenAI's
    clients play as 24 kHz mono: 3x too fast, channels interleaved into one. Now a 440 Hz tone in two channels comes
    back as the 24 kHz mono tone of their mean; away from the ends (the resampler's FIR has no samples beyond
    them) it is within 1e-3 (the Kaiser filter's passband ripple plus 16-bit rounding, measured 6e-4 at 8 kHz)."""
    t = np.arange(rate // 2) / rate
    tone = np.sin(2 * np.pi * 440 * t)
    pcm = np.frombuffer(encode_audio(np.stack([0.5 * tone, 0.3 * tone]), rate, ".pcm"), dtype="<i2") / 32767
    assert len(pcm) == 12000  # half a second at 24 kHz, one channel
    expected = 0.4 * np.sin(2 * np.pi * 440 * np.arange(12000) / 24000)
    np.testing.assert_allclose(pcm[200:-200], expected[200:-200], atol=1e-3, rtol=0)


def test_bad_audio_input_refused_before_loading(model):
    info = inspect_model(model)
    assert "makes audio, not images" in output_suffix_problem(Path("a.png"), info.output)
    assert output_suffix_problem(Path("a.flac"), info.output) is None
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2).resolved()
    for params, needle in [
        (SamplingParams(audio_seconds=-1.0), "audio_seconds=-1.0 must be > 0 (--audio-seconds)"),
        (SamplingParams(audio_seconds=0.6), "audio_seconds=0.6 exceeds the 0.256 s that StableAudioPipeline"),
        (SamplingParams(num_frames=5), "num_frames: StableAudioPipeline takes no num_frames"),
    ]:
        with pytest.raises(ValueError, match=params and needle.replace("(", r"\(").replace(")", r"\)")):
            build_requests(info, config, [PROMPT], params)
    flux = inspect_model(builtin("tiny-flux", model.parent))
    with pytest.raises(ValueError, match="audio_seconds: FluxPipeline takes no audio length"):
        build_requests(flux, config, [PROMPT], SamplingParams(audio_seconds=1.0))
    # Stable Audio runs guidance as one batched call and has no context-parallel plan.
    for layout, needle in [
        (ParallelConfig(use_hsdp=True, cfg_parallel_size=2), "does not run guidance as a separate"),
        (ParallelConfig(use_hsdp=True, ulysses_degree=2), "has no diffusers context-parallel plan"),
    ]:
        assert any(needle in p for p in layout_problems(info, layout.resolved()))


def _decoded_track(path: Path, rate: int) -> np.ndarray | None:
    """The mp4's audio stream decoded to float32 ``(channels=2, samples)``, or None when it has none."""
    import subprocess

    import imageio_ffmpeg

    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(path), "-map", "0:a:0", "-f", "f32le",
               "-ac", "2", "-ar", str(rate), "-"]  # fmt: skip
    done = subprocess.run(command, capture_output=True)
    if done.returncode:
        return None
    return np.frombuffer(done.stdout, dtype="<f4").reshape(-1, 2).T


def test_mp4_carries_the_sound_track_the_pipeline_made(tmp_path):
    """A video output with a sound track (what LTX-2 makes) is one mp4: H.264 and AAC at the pipeline's sample
    rate, as long as the frames; AAC is lossy, so the decoded track is compared by its error's energy (two tones
    at ffmpeg's default AAC bit rate keep it more than 30 dB down)."""
    from hsdp.engine.outputs import GenerationOutput, Timings

    rate, fps, frames = 16000, 8, np.random.default_rng(0).random((9, 32, 32, 3), dtype=np.float32)
    t = np.arange(int(len(frames) / fps * rate)) / rate
    track = np.stack([0.5 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)
    out = GenerationOutput(0, "p", 0, Timings(1.0), [0], "rss", frames=frames, audio=track, sample_rate=rate)
    [with_sound] = out.save(tmp_path / "with.mp4", fps=fps)
    [silent] = out.save(tmp_path / "without.mp4", fps=fps, with_audio=False)
    decoded = _decoded_track(with_sound, rate)
    assert decoded is not None and _decoded_track(silent, rate) is None
    assert decoded.shape == track.shape  # the mp4's edit list drops AAC's priming: aligned, as long as the frames
    error = decoded - track
    assert 10 * np.log10(np.mean(track**2) / np.mean(error**2)) > 30  # 39 dB measured


LTX2 = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 1.0,
        "max_sequence_length": 16}  # fmt: skip


def test_video_with_its_sound_equals_one_process(tmp_path, dist_run):
    """LTX-2 (one joint video + audio transformer, sharded): the frames and the waveform of HSDP 2 equal one
    process within rounding (1e-5; measured 0 to 1.3e-6 from run to run: the Gemma 3 encoder's and the
    connectors' CPU sums round by the thread count), the pipeline's vocoder gives the sample rate."""
    import torch

    from tests.audio_pipelines import build_tiny_ltx2

    folder = build_tiny_ltx2(tmp_path / "tiny-ltx2")
    info = inspect_model(folder)
    assert (info.output, info.audio_track) == ("video", True) and "transformer" in info.shardable
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    with Engine(folder, config, workers=dist_run.group(2)) as engine:
        [out] = engine.generate(PROMPT, SamplingParams(seed=5, negative_prompt="", **LTX2))
    from tests.engine_refs import _pipeline, one_thread

    with one_thread(), torch.no_grad():  # the pipeline as the reference of every family test holds it
        expected = _pipeline(folder)(prompt=PROMPT, negative_prompt="", generator=torch.Generator().manual_seed(5),
                                     output_type="np", frame_rate=24.0, **LTX2)  # fmt: skip
    assert out.sample_rate == 16000 and out.audio.shape == tuple(expected.audio[0].shape)
    np.testing.assert_allclose(out.frames, expected.frames[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.audio, expected.audio[0].numpy(), atol=1e-5, rtol=0)
    assert np.abs(out.audio).max() > 0
