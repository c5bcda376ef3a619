"""``hsdp train`` on an audio pipeline (tiny-stable-audio: diffusers' StableAudioPipeline), issue 35 item 4: audio
pipelines train like image and video ones. Nothing here is Stable Audio code in hsdp: the clips are resampled,
mixed and cut to what the pipeline's VAE takes (:mod:`hsdp.train.diffusion.media`), the seconds conditioning comes
from the pipeline's own ``encode_duration`` recorded beside ``encode_prompt`` (:mod:`.pipeline_call`), and the
objective from its scheduler's EDM preconditioning (:mod:`.objective`).

LoRA at HSDP 2 equals one process running diffusers' pipeline to encode, peft for the adapters and AdamW, with the
denoiser's call and the v-objective written as stable-audio-tools and the pipeline write them
(:func:`tests.diffusion_train_fns.stable_audio_forward`): losses and adapters within 1e-5 in fp32 (the sharded run
reduces gradients in another order; :func:`assert_trained_like`). The export, applied by ``hsdp generate --lora``
at HSDP 2, equals peft applying it to diffusers' pipeline in one process (StableAudioPipeline has no
``load_lora_weights``), and the run's last validation sample is that same audio."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from hsdp.config import ParallelConfig
from hsdp.models.builtin import resolve_model
from hsdp.train import TrainConfig, TrainConfigError
from tests.diffusion_train_fns import assert_trained_like, reference_run, train_diffusion

pytestmark = pytest.mark.slow
TOL = 1e-5
PROMPT = "rain on a tin roof"
CLIPS = [(8000, 2, 2048), (16000, 1, 3000), (8000, 2, 4000), (11025, 2, 1500)]
"""(rate, channels, frames) of the test's clips: the VAE's own rate and length; mono at twice the rate, shorter
(resampled, repeated to stereo, padded); longer (cut); another rate, shorter."""


def write_audio(folder: Path) -> None:
    rng = np.random.default_rng(0)
    for i, (rate, channels, frames) in enumerate(CLIPS):
        soundfile.write(folder / f"clip{i}.wav", rng.uniform(-0.5, 0.5, (frames, channels)).astype("float32"), rate)
        (folder / f"clip{i}.txt").write_text(f"a sound number {i}")


@pytest.fixture(scope="module")
def audio(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("audio")
    write_audio(folder)
    return folder


def _cfg(audio: Path, **kw) -> TrainConfig:
    base = dict(model="tiny-stable-audio", data=str(audio), steps=2, batch_size=2, lr=1e-3, seed=3, lora_r=4,
                progress=False)  # fmt: skip
    return TrainConfig(**(base | kw))


HSDP2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)


@pytest.fixture(scope="module")
def runs(audio, dist_run, tmp_path_factory) -> dict[str, dict]:
    """At HSDP 2 for 2 steps, in one process group: LoRA exported (diffusers' format) with a validation sample
    before and after; full fine-tuning (lr 1e-4) exported as a pipeline folder."""
    out = tmp_path_factory.mktemp("audio-run")
    lora = _cfg(audio, parallel=HSDP2, output_dir=str(out / "run"), export=str(out / "lora"),
                validation_prompts=(PROMPT,))  # fmt: skip
    full = _cfg(audio, parallel=HSDP2, lora_r=0, lr=1e-4, export=str(out / "full"))
    trained = dist_run(2, train_diffusion, [lora, full])[0]
    return {"lora": trained[0] | {"cfg": lora}, "full": trained[1] | {"cfg": full}}


@pytest.fixture(scope="module")
def sharded(runs) -> dict:
    return runs["lora"]


def test_stable_audio_lora_hsdp2_equals_diffusers_peft_one_process(audio, sharded):
    run, ref = sharded, reference_run(_cfg(audio), resolve_model("tiny-stable-audio"))
    assert any("lora_" in k for k in ref["state"])
    assert_trained_like(run, ref, TOL)
    assert run["losses"][0] != run["losses"][1]  # two batches, trained weights: not a constant


def test_stable_audio_full_fine_tuning_equals_one_process_and_exports_a_pipeline(audio, runs):
    """Full fine-tuning at HSDP 2 equals one process (AdamW's bound on rounding-level gradients at lr 1e-4), and
    its export is a pipeline folder diffusers' ``StableAudioPipeline.from_pretrained`` loads with the trained DiT."""
    import diffusers

    run = runs["full"]
    assert_trained_like(run, reference_run(_cfg(audio, lora_r=0, lr=1e-4), resolve_model("tiny-stable-audio")), TOL)
    exported = diffusers.StableAudioPipeline.from_pretrained(run["cfg"].export).transformer.state_dict()
    assert all(torch.equal(exported[k], v.cpu()) for k, v in run["state"].items())


def test_caption_dropout_keeps_the_clips_length():
    """``--caption-dropout`` replaces a dropped clip's caption encodings (``encode_prompt``'s) with the empty
    caption's and keeps its seconds conditioning (``encode_duration``'s: its own length, not the pipeline's longest,
    which the empty caption is encoded at)."""
    from types import SimpleNamespace

    from hsdp.train.diffusion.frozen import frozen_pipeline
    from hsdp.train.diffusion.pipeline_call import encode_captions, prompt_layout
    from hsdp.train.diffusion.trainer import DiffusionTrainer

    model = resolve_model("tiny-stable-audio")
    pipe = frozen_pipeline(model)
    layout = prompt_layout(pipe, model, (1, 2048), 1)
    assert layout.methods == ("encode_prompt", "encode_duration")
    [empty] = encode_captions(pipe, model, layout, [""], (1, 2048), 1)
    [item] = encode_captions(pipe, model, layout, ["a short hum"], (1, 2048), 1, seconds=0.1)
    trainer = SimpleNamespace(data=SimpleNamespace(empty_prompt=empty), layout=layout)
    dropped = DiffusionTrainer._dropped(trainer, item)
    assert dropped.keys() == item.keys() == {"prompt.0.0", "prompt.1.0", "prompt.1.1"}
    assert torch.equal(dropped["prompt.0.0"], empty["prompt.0.0"])
    assert not torch.equal(item["prompt.1.1"], empty["prompt.1.1"])  # 0.1 s, where the empty caption has 0.256 s
    assert all(torch.equal(dropped[k], item[k]) for k in ("prompt.1.0", "prompt.1.1"))


def test_generate_lora_equals_peft_on_diffusers_and_the_validation_sample(sharded, dist_run):
    """``hsdp generate --lora EXPORT`` at HSDP 2 (the engine) equals diffusers' StableAudioPipeline with peft
    applying the export's adapters (the config from the file's metadata, as diffusers' loaders read it) in one
    process, within 1e-5 (the sharded engine's other summation order). The run's last validation sample (a 16-bit
    wav) is that audio, and the run page plays it."""
    import diffusers
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors import safe_open
    from safetensors.torch import load_file

    from hsdp.engine import Engine, SamplingParams
    from hsdp.lora_formats import DIFFUSERS_WEIGHTS
    from tests.engine_refs import one_thread

    cfg, model = sharded["cfg"], resolve_model("tiny-stable-audio")
    with Engine(model, HSDP2, workers=dist_run.group(2), lora=cfg.export) as engine:
        [out] = engine.generate(PROMPT, SamplingParams(seed=cfg.seed))
        defaults = dict(engine.info.defaults)

    pipe = diffusers.StableAudioPipeline.from_pretrained(model, torch_dtype=torch.float32)
    assert not hasattr(pipe, "load_lora_weights")  # diffusers has no LoRA loader for it: peft applies the file
    weights = Path(cfg.export) / DIFFUSERS_WEIGHTS
    with safe_open(str(weights), framework="pt") as handle:
        meta = json.loads(handle.metadata()[LORA_ADAPTER_METADATA_KEY])
    config = LoraConfig(**{k.removeprefix("transformer."): v for k, v in meta.items()})
    inject_adapter_in_model(config, pipe.transformer)
    state = {k.removeprefix("transformer."): v for k, v in load_file(weights).items()}
    assert not set_peft_model_state_dict(pipe.transformer, state).unexpected_keys
    pipe.set_progress_bar_config(disable=True)
    with one_thread(), torch.no_grad():
        expected = pipe(PROMPT, generator=torch.Generator().manual_seed(cfg.seed), output_type="np", **defaults).audios
    assert out.audios.shape == expected.shape and np.abs(expected).max() > 0
    np.testing.assert_allclose(out.audios, expected, rtol=0, atol=TOL)

    run = Path(cfg.output_dir)
    sample, rate = soundfile.read(run / "samples" / "step-2" / "0-rain-on-a-tin-roof.wav", dtype="float32")
    assert rate == 8000 and sample.shape == expected[0].T.shape
    np.testing.assert_allclose(sample.T, np.round(np.clip(expected[0], -1, 1) * 32767) / 32767, atol=1.5 / 32767)
    assert '<audio src="samples/step-2/0-rain-on-a-tin-roof.wav" controls' in (run / "report.html").read_text()


def test_audio_data_checked_cut_and_planned(audio, tmp_path, capsys):
    """Each clip at the VAE's rate and channels, cut or zero-padded to the pipeline's longest (0.256 s), conditioned
    on its own kept seconds; a file that cannot be read is refused before ranks start, naming it; a non-audio file
    is left out with why; a ``metadata.jsonl`` names files and captions as for images. ``hsdp plan --train`` plans the run (no item size to give). The objective is the
    scheduler's: the target is the output that its ``precondition_outputs`` turns back into the clean latents."""
    from scipy.signal import resample_poly

    from hsdp.cli import main
    from hsdp.train.diffusion.frozen import media_spec
    from hsdp.train.diffusion.media import MediaDataset
    from hsdp.train.diffusion.objective import objective_for
    from hsdp.train.diffusion.trainer import check_diffusion_run

    model = resolve_model("tiny-stable-audio")
    data = MediaDataset.from_source(audio, media_spec(model, "transformer"), resolution=512)
    assert [item.seconds for item in data.items] == [0.256, 3000 / 16000, 0.256, 1500 / 11025]
    waves = [data.waveform(i) for i in range(len(data))]
    assert all(w.shape == (2, 2048) for w in waves)
    source, _ = soundfile.read(audio / "clip1.wav", dtype="float64")
    np.testing.assert_allclose(waves[1][0, :1500], resample_poly(source, 1, 2)[:1500], atol=1e-6)
    assert torch.equal(waves[1][0], waves[1][1]) and not waves[1][:, 1500:].any()  # mono repeated, padded
    assert torch.equal(waves[2], torch.from_numpy(soundfile.read(audio / "clip2.wav", dtype="float32")[0][:2048].T))

    broken = tmp_path / "broken"
    broken.mkdir()
    write_audio(broken)
    (broken / "clip1.wav").write_bytes(b"RIFF not a wave file")
    (broken / "notes.png").write_bytes(b"x")
    with pytest.raises(TrainConfigError, match=f"cannot read {broken / 'clip1.wav'}: .*replace or remove it"):
        check_diffusion_run(_cfg(broken))
    (broken / "clip1.wav").unlink()
    (broken / "clip1.txt").unlink()
    skipped = MediaDataset.from_source(broken, media_spec(model, "transformer"), resolution=512).skipped
    assert skipped == [(broken / "notes.png", "not an audio file (.flac, .wav)")]
    (broken / "metadata.jsonl").write_text(json.dumps({"file_name": "clip3.wav", "text": "a hum"}) + "\n")
    listed = MediaDataset.from_source(broken, media_spec(model, "transformer"), resolution=512)
    assert [(i.caption, i.seconds) for i in listed.items] == [("a hum", 1500 / 11025)]

    assert main(["plan", "tiny-stable-audio", "--devices", "2", "--device-memory", "64MiB", "--train", "--lora-r", "4"]) == 0
    assert "run it: hsdp train --model tiny-stable-audio" in capsys.readouterr().out

    objective = objective_for(model)
    x0, noise = torch.randn(3, 4, 256, dtype=torch.float64), torch.randn(3, 4, 256, dtype=torch.float64)
    noised = objective.at(x0.float(), noise.float(), torch.tensor([0.0, 0.5, 1.0]))
    scheduler = objective._edm_scheduler
    sigma = torch.tan(noised.timesteps.double() * torch.pi / 2).view(-1, 1, 1)  # CosineDPM: t = atan(sigma) 2 / pi
    assert objective.kind == "edm"
    assert torch.allclose(sigma.flatten()[[0, 2]], torch.tensor([0.3, 500.0], dtype=torch.float64), rtol=1e-3)
    denoised = scheduler.precondition_outputs(x0 + sigma * noise, noised.target.double(), sigma)
    assert torch.allclose(denoised, x0, atol=1e-4)
