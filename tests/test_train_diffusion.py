"""Diffusion fine-tuning (hsdp.train.diffusion) against one process running diffusers + peft.

Same media rows, noise and sigmas; fp32. Sharded runs sum gradients in another order, so losses are compared
within 1e-5, and so are trained weights wherever the gradient is above rounding level; AdamW may step a weight
whose gradient is at rounding level either way, so those are held to AdamW's bound (``assert_trained_like``:
a full fine-tuning run on another CPU reached 3.6e-5 on such a weight)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hsdp.config import ParallelConfig
from hsdp.models.builtin import resolve_model
from hsdp.train import TrainConfig, TrainConfigError
from hsdp.train.diffusion.trainer import check_diffusion_run
from tests.diffusion_train_fns import assert_trained_like, reference_run, sharded_encoders, train_diffusion

pytestmark = pytest.mark.slow
TOL = 1e-5


def _cfg(media, **kw) -> TrainConfig:
    base = dict(model="tiny-wan", data=str(media), resolution=32, steps=3, batch_size=2, lr=1e-3, seed=3,
                progress=False)
    return TrainConfig(**(base | kw))


def _close(run: dict, ref: dict) -> None:
    assert_trained_like(run, ref, TOL)


HSDP2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
STRAIGHT = dict(lora_r=4, steps=4, parallel=HSDP2)
"""The 4-step LoRA run at HSDP 2 that the parity, resume and stop-signal tests each compare with (:func:`straight`)."""


@pytest.fixture(scope="module")
def straight(dist_run, media) -> dict:
    """:data:`STRAIGHT` trained once for the module: one process's equal, and the uninterrupted run that a resumed
    or stopped run continues."""
    return dist_run(2, train_diffusion, [_cfg(media, **STRAIGHT)])[0][0]


@pytest.mark.parametrize("lora_r", [4, 0], ids=["lora", "full"])
def test_hsdp2_equals_diffusers_peft_one_process(dist_run, media, lora_r, request):
    """LoRA (:data:`STRAIGHT`, 4 steps at lr 1e-3) and full fine-tuning (3 steps at lr 1e-4)."""
    if lora_r:
        cfg, run = _cfg(media, **STRAIGHT), request.getfixturevalue("straight")
    else:
        cfg = _cfg(media, lora_r=0, lr=1e-4, parallel=HSDP2)
        run = dist_run(2, train_diffusion, [cfg])[0][0]
    ref = reference_run(cfg, resolve_model("tiny-wan"))
    _close(run, ref)
    assert run["losses"][0] != run["losses"][-1]  # it trained


def test_frozen_base_kept_whole_equals_one_process(dist_run, media):
    """NO_SHARD LoRA, and --frozen-whole under FULL_SHARD: the frozen base stays out of FSDP (plain tensors, whole on every rank: FSDP2's replicate would
    copy it into a second whole buffer at every step), only the adapters' gradients are all-reduced; equal to one
    process. Under bf16 mixed precision the base computes in bf16 as FSDP would gather it: the same losses as
    FULL_SHARD bf16 (same weights and casts; only the gradient reduction differs, in fp32)."""
    no_shard = ParallelConfig(use_hsdp=True, hsdp_shard_size=1, hsdp_replicate_size=2, sharding_strategy="NO_SHARD")
    cfg = _cfg(media, lora_r=4, parallel=no_shard)
    bf16 = [cfg.replace(mixed_precision="bf16"),
            cfg.replace(mixed_precision="bf16", parallel=ParallelConfig(use_hsdp=True, hsdp_shard_size=2))]
    # --frozen-whole under FULL_SHARD: the base as under NO_SHARD, the adapters (and their optimizer state) sharded.
    whole_base = cfg.replace(parallel=ParallelConfig(use_hsdp=True, hsdp_shard_size=2, frozen_whole=True))
    run, low, low_sharded, sharded_adapters = dist_run(2, train_diffusion, [cfg, *bf16, whole_base])[0]
    reference = reference_run(cfg, resolve_model("tiny-wan"))
    _close(run, reference)
    _close(sharded_adapters, reference)
    assert sharded_adapters["frozen_sharded"] == 0 and sharded_adapters["trained_share"] == 0.5
    assert run["trained_share"] == 1.0
    assert run["frozen_sharded"] == 0 and low["frozen_sharded"] == 0
    assert low_sharded["frozen_sharded"] > 0  # FULL_SHARD shards the base
    assert low["frozen_dtypes"] == {"torch.bfloat16"}
    assert np.allclose(low["losses"], low_sharded["losses"], atol=1e-5, rtol=0), (low["losses"], low_sharded["losses"])
    assert low["losses"] != run["losses"]  # bf16 computed


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-sdxl"])
def test_family_lora_hsdp2_equals_diffusers_peft_one_process(dist_run, media, model, tmp_path):
    """FLUX (packed latents, ids, pooled embedding, guidance) and SDXL (epsilon, added conditioning), with
    --cache-latents: the first run fills the cache (each rank its share) and stops at step 2; the resumed run reads
    the cache without loading the encoders and trains step 3. Together they equal three steps of one process. A
    fresh run of the first's settings on the full cache (another output folder, the same cache) loads no encoder
    either and equals the first bit for bit. lr 1e-4: at 1e-3 AdamW takes FLUX's adapters to 7.8e-6 of the
    reference (6.1e-7 here), too near the tolerance."""
    layout = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    first = _cfg(media, model=model, lora_r=4, lr=1e-4, steps=2, parallel=layout, cache_latents=True,
                 output_dir=str(tmp_path))
    second = first.replace(steps=3, resume="auto")
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "latent-cache").symlink_to(tmp_path / "latent-cache", target_is_directory=True)
    again = first.replace(output_dir=str(tmp_path / "again"))
    filled, resumed, repeated = dist_run(2, train_diffusion, [first, second, again])[0]
    _close({"losses": filled["losses"] + resumed["losses"], "state": resumed["state"]},
           reference_run(second, resolve_model(model)))
    assert [filled["encoder_loads"], resumed["encoder_loads"], repeated["encoder_loads"]] == [1, 0, 0]
    assert repeated["losses"] == filled["losses"]
    assert all(torch.equal(repeated["state"][k], filled["state"][k]) for k in filled["state"])
    files = sorted((tmp_path / "latent-cache").rglob("*.safetensors"))
    assert len(files) == 4
    assert all(f.stat().st_mtime_ns < resumed["started"] for f in files)  # the resumed run wrote none
    # latents and what encode_prompt returns per caption: FLUX's T5 and pooled CLIP embeddings, SDXL's embeddings
    # and pooled embedding (positions 0 and 2; its negatives are None without guidance)
    assert {"latents", "prompt.0.0", "prompt.0.1" if model == "tiny-flux" else "prompt.0.2"} <= load_file(files[0]).keys()


def test_family_full_fine_tuning_hsdp2_equals_one_process(dist_run, media):
    """Full fine-tuning of FLUX's transformer and SDXL's UNet (every weight trained, fp32 masters sharded). lr 3e-5
    (3 steps move weights ~9e-5): AdamW scales rounding differences of near-zero gradients with lr, to 6.4e-6 of the
    reference for SDXL here (FLUX 5.9e-7); at lr 1e-4 SDXL's reached 2.2e-5."""
    layout = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    cfgs = [_cfg(media, model=m, lora_r=0, lr=3e-5, steps=3, parallel=layout) for m in ("tiny-flux", "tiny-sdxl")]
    runs = dist_run(2, train_diffusion, cfgs)[0]
    for cfg, run in zip(cfgs, runs, strict=True):
        _close(run, reference_run(cfg, resolve_model(cfg.model)))
        assert run["losses"][0] != run["losses"][-1]  # it trained


def test_hybrid_2x2_lora_with_grad_accum_equals_one_process(dist_run, media):
    layout = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2)
    cfg = _cfg(media, lora_r=4, grad_accum=2, batch_size=4, parallel=layout)
    run = dist_run(4, train_diffusion, [cfg])[0][0]
    _close(run, reference_run(cfg, resolve_model("tiny-wan")))


def test_resume_is_bit_exact(dist_run, media, tmp_path, straight):
    first = _cfg(media, **STRAIGHT, output_dir=str(tmp_path / "ck")).replace(steps=2)
    second = first.replace(steps=4, resume="auto")
    _, resumed = dist_run(2, train_diffusion, [first, second])[0]
    assert resumed["losses"] == straight["losses"][2:]
    assert all(torch.equal(resumed["state"][k], straight["state"][k]) for k in straight["state"])


def test_a_stop_signal_saves_and_resume_auto_continues_bit_exact(dist_run, media, tmp_path, straight):
    """SIGTERM to one rank of a LoRA run on a pipeline (issue 37 item 2): both ranks stop after the same step with its
    checkpoint (between --save-every steps), and --resume auto continues with the uninterrupted run's losses."""
    from tests.train_fns import train_signalled

    stopped = _cfg(media, **STRAIGHT, output_dir=str(tmp_path / "ck"), save_every=100)
    ranks = dist_run(2, train_signalled, stopped, 0, 1)  # recorded after step 1, agreed in step 2
    assert [r["steps"] for r in ranks] == [[1, 2]] * 2 and ranks[0]["stopped_by"] == "SIGTERM"
    assert ranks[0]["checkpoint"] == str(tmp_path / "ck" / "step-00000002")
    resumed = dist_run(2, train_diffusion, [stopped.replace(resume="auto")])[0][0]
    assert ranks[0]["losses"] + resumed["losses"] == straight["losses"]


def test_bad_input_is_refused_before_training(media, tmp_path):
    uncaptioned = tmp_path / "uncaptioned"
    uncaptioned.mkdir()
    (uncaptioned / "a.png").write_bytes((media / "img0.png").read_bytes())
    with pytest.raises(TrainConfigError, match="a.png has no caption file"):
        check_diffusion_run(_cfg(uncaptioned))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "v.mp4").write_bytes(b"")
    (broken / "v.txt").write_text("x")
    with pytest.raises(TrainConfigError, match="v.mp4"):
        check_diffusion_run(_cfg(broken))
    with pytest.raises(TrainConfigError, match="--resolution 8"):
        check_diffusion_run(_cfg(media, resolution=8))
    with pytest.raises(TrainConfigError, match="--lora-target-modules"):
        check_diffusion_run(_cfg(media, lora_r=4, lora_target_modules=("qkv_proj",)))
    with pytest.raises(TrainConfigError, match="--train-component unet"):
        check_diffusion_run(_cfg(media, train_component="unet"))
    refiner = tmp_path / "refiner"  # SDXL's UNet under a pipeline no family trains (aesthetic-score time ids)
    shutil.copytree(resolve_model("tiny-sdxl"), refiner)
    index = json.loads((refiner / "model_index.json").read_text())
    (refiner / "model_index.json").write_text(json.dumps(index | {"_class_name": "StableDiffusionXLImg2ImgPipeline"}))
    for conditioned in ("tiny-wan-i2v", "tiny-flux-kontext", str(refiner)):  # inputs the trainer does not build
        with pytest.raises(TrainConfigError, match="does not build yet"):
            check_diffusion_run(_cfg(media, model=conditioned))


def test_large_frozen_encoders_shard_as_inference_does(dist_run, media):
    """The engine's size rule decides which frozen components shard (tiny FLUX's T5 at the default fraction; its
    CLIP and VAE too at fraction 0): each rank holds half of their bytes as DTensor shards, and the latents,
    caption encodings and losses equal those of whole encoders (fraction inf) on the same layout (measured: equal
    bit for bit; bound 1e-6)."""
    from hsdp.train.diffusion.trainer import frozen_sharded

    assert frozen_sharded(resolve_model("tiny-flux")) == ["text_encoder_2"]  # written here: transformers 5 saves
    # text encoders only on rank 0 of a process group, so ranks writing the built-in could lose its weights
    layout = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    cfg = _cfg(media, model="tiny-flux", lora_r=4, lr=1e-4, steps=2, parallel=layout)
    whole, forced = (dist_run(2, sharded_encoders, cfg, f) for f in (float("inf"), 0.0))
    assert whole[0]["sharded"] == [] and sorted(forced[0]["sharded"]) == ["text_encoder", "text_encoder_2", "vae"]
    for name in forced[0]["sharded"]:
        assert all(rank["dtensor"][name] for rank in forced)
        total = forced[0]["bytes"][name][1]
        held = [rank["bytes"][name][0] for rank in forced]
        assert sum(held) == total and max(held) <= 0.55 * total, (name, held, total)
    for got, ref in zip(forced[0]["items"], whole[0]["items"], strict=True):
        assert got.keys() == ref.keys()
        worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
        assert worst <= 1e-6, worst
    assert np.allclose(forced[0]["losses"], whole[0]["losses"], atol=1e-6, rtol=0), (forced[0]["losses"], whole[0]["losses"])


def test_full_latent_cache_loads_no_encoder_one_process(media, tmp_path):
    """One process, with what else the encoders encode: --caption-dropout (the empty caption), --eval-data (its
    items cached with the training items) and --validation-prompt (the prompts' encode_prompt returns kept beside
    the cache). A run on a full cache loads neither VAE nor text encoders and equals the run that filled it bit for
    bit (losses, eval losses, adapters, samples). A cache missing an item, or with one damaged (another item's file
    in its place), loads the encoders and encodes it again, to the same run; a model folder with another text
    encoder reads nothing of the cache (its fingerprint differs)."""
    cache = tmp_path / "filled" / "latent-cache"
    first = _cfg(media, lora_r=4, steps=2, caption_dropout=0.5, cache_latents=True, output_dir=str(cache.parent),
                 eval_data=str(media), validation_prompts=("a cat",))

    def on_cache(name: str, **kw) -> TrainConfig:
        """``first`` in a fresh output folder whose latent cache is the first run's."""
        (tmp_path / name).mkdir()
        (tmp_path / name / "latent-cache").symlink_to(cache, target_is_directory=True)
        return first.replace(output_dir=str(tmp_path / name), **kw)

    def same(run: dict, ref: dict) -> bool:
        return run["losses"] == ref["losses"] and all(torch.equal(run["state"][k], ref["state"][k]) for k in ref["state"])

    def samples(name: str) -> list[bytes]:
        return [p.read_bytes() for p in sorted((tmp_path / name / "samples").rglob("*.mp4"))]

    filled, repeated = train_diffusion([first, on_cache("repeated")])
    assert [filled["encoder_loads"], repeated["encoder_loads"]] == [1, 0]
    assert same(repeated, filled) and repeated["eval"] == filled["eval"] and filled["eval"][-1] is not None
    assert len(samples("filled")) == 2 and samples("repeated") == samples("filled")  # steps 0 and 2
    items = sorted(cache.rglob("*.safetensors"))
    assert len(items) == 4  # the eval media are the training media here: the same files
    items[0].unlink()
    items[1].write_bytes(items[2].read_bytes())  # whole, but another item's tensors
    plain = {"eval_data": None, "validation_prompts": ()}  # from here on, only the training items matter
    mended = train_diffusion([on_cache("mended", **plain)])[0]
    assert mended["encoder_loads"] == 1 and same(mended, filled)
    assert mended["started"] < min(items[i].stat().st_mtime_ns for i in (0, 1))  # both written again
    other = tmp_path / "other-model"
    shutil.copytree(resolve_model("tiny-wan"), other)
    weights = load_file(other / "text_encoder" / "model.safetensors")
    name = next(iter(weights))
    save_file(weights | {name: weights[name] + 0.5}, other / "text_encoder" / "model.safetensors", {"format": "pt"})
    elsewhere = train_diffusion([on_cache("other", model=str(other), **plain)])[0]
    assert elsewhere["encoder_loads"] == 1 and elsewhere["losses"] != filled["losses"]
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2  # a folder per fingerprint
