"""``--vae-parallel``: the VAE's tiled decode and encode split over the ranks (:mod:`hsdp.vae_parallel`) equal
diffusers' own tiled decode and encode in one process: for every diffusers autoencoder class that tiles (or it is
refused), and through the engine for an image VAE (``AutoencoderKL``) under HSDP 2 and CFG 2, a video VAE
(``AutoencoderKLWan``) under HSDP 2 and Ulysses 2 (there the denoiser's own rounding bounds the comparison, see
``ULYSSES``) and a held-out family's (CogVideoX) under HSDP 2.

Each tile is computed by the same diffusers code on the same input in another process, and blended by diffusers'
own code from the gathered tiles, so the outputs are expected to be identical; ``TILED`` allows float32 rounding of
a convolution computed by another rank's kernels (a few ulp of values within [-1, 1] or latents of order 1)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from diffusers import AutoencoderKLAllegro

from hsdp import ParallelConfig
from hsdp.engine import Engine, SamplingParams
from hsdp.engine.checks import vae_parallel_default, vae_problems
from hsdp.engine.model_info import inspect_model
from hsdp.models.builtin import resolve_model
from hsdp.vae_parallel import split_refusal
from tests.engine_refs import reference_pipeline
from tests.vae_fns import (
    TILED_VAES,
    TINY_VAES,
    UNTILED_ENCODE,
    class_exact_and_whole,
    class_split_and_alone,
    exact_splits,
    small_tile_cogvideox,
    split_and_alone,
    vae_split,
)

TILED = 1e-6
ULYSSES = 1e-5
"""Ulysses' split denoiser rounds differently from one process at these sizes (measured 1.6e-6 on the frames of a
288 x 288 tiny-wan, whose 162 tokens per rank take other matrix-product blockings): the bound the engine's
layout tests use for such layouts (``NOT_BITWISE`` in ``tests/test_engine_families.py``)."""
HSDP2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("kind, size, frames", [("image", 128, 1), ("video", 64, 9)])
def test_split_tiles_equal_diffusers_tiled(kind, size, frames, dist_run):
    ranks = dist_run(2, split_and_alone, kind, size, frames)
    for result in ranks:
        assert result["encode_diff"] <= TILED and result["decode_diff"] <= TILED, result
        assert result["tiling_changes"] > 0.1  # the tiled path ran (its blending changes the output)
    for method in ranks[0]["replaced"]:
        tiles = ranks[0]["split"][method].tiles
        assert tiles >= 9, method
        # round-robin: rank 0 the even tiles, rank 1 the odd ones
        assert [r["split"][method].computed for r in ranks] == [(tiles + 1) // 2, tiles // 2], method
        if kind == "video":
            # 3 x 3 tiles, the last row and column narrower: rank 0 computes the first tile of each shape, so it
            # sizes rank 1's from its own calls; rank 1 runs the first of each shape on meta
            first = [r["first_decode_split"] if method == "tiled_decode" else r["split"][method] for r in ranks]
            assert first[0].meta_runs == 0 < first[1].meta_runs, method
    for result in ranks:  # a second decode of the same shape runs nothing on meta and gives the same video
        assert result["split"]["tiled_decode"].meta_runs == 0 and result["again_diff"] == 0, result


@pytest.mark.slow
@pytest.mark.parametrize("name", TILED_VAES)
def test_every_tiled_vae_class_splits_or_is_refused(name, dist_run):
    """Every diffusers autoencoder with a ``tiled_decode`` (enumerated from diffusers), at its test suite's dummy
    size with small tiles: the split encode and decode equal its own tiled ones in one process, or
    ``enable_vae_parallel`` refuses the class naming why."""
    assert name in TINY_VAES, f"{name}: a tiled diffusers VAE without a tiny config in tests/vae_fns.py"
    ranks = dist_run(2, class_split_and_alone, name)
    if "refused" in ranks[0]:
        assert name == "AutoencoderKLAllegro" and "blends its tiles itself" in ranks[0]["refused"], ranks[0]
        return
    for result in ranks:
        assert result["encode_diff"] <= TILED and result["decode_diff"] <= TILED, result
    for method in ranks[0]["replaced"]:
        if method != "tiled_decode" and name in UNTILED_ENCODE:
            continue
        tiles = ranks[0]["split"][method].tiles
        assert tiles >= 4, (name, method)
        assert [r["split"][method].computed for r in ranks] == [(tiles + 1) // 2, tiles // 2], (name, method)


CASES = {
    # tiny-flux's AutoencoderKL tiles at 64 pixels: 128 x 128 is 3 x 3 tiles
    "image-hsdp2": ("tiny-flux", HSDP2, {"height": 128, "width": 128, "num_inference_steps": 2}),
    "image-cfg2": ("tiny-flux", ParallelConfig(use_hsdp=True, cfg_parallel_size=2),
                   {"height": 128, "width": 128, "num_inference_steps": 2, "true_cfg_scale": 4.0,
                    "negative_prompt": "blurry"}),
    # AutoencoderKLWan tiles at 256 pixels: 288 x 288 is 2 x 2 tiles
    "video-hsdp2": ("tiny-wan", HSDP2, {"height": 288, "width": 288, "num_frames": 1, "num_inference_steps": 2}),
    "video-ulysses2": ("tiny-wan", ParallelConfig(use_hsdp=True, ulysses_degree=2),
                       {"height": 288, "width": 288, "num_frames": 1, "num_inference_steps": 2}),
    # a held-out family: CogVideoX's VAE (conv_cache handed from one frame batch to the next), 3 x 3 tiles
    "cogvideox-hsdp2": ("cogvideox", HSDP2, {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 2}),
}  # fmt: skip
BATCHED = {"image-hsdp2": ["A cat", "A red fox in the snow"]}
"""Cases that decode two requests' latents in one batch (the tiles carry both samples)."""
FOLDERS = {"cogvideox": small_tile_cogvideox}
"""Cases whose model is a folder built here rather than a built-in tiny model."""


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_engine_decode_split_equals_one_process_tiled(case, dist_run, tmp_path_factory):
    model, config, call = CASES[case]
    path = FOLDERS[model](tmp_path_factory.mktemp(model)) if model in FOLDERS else resolve_model(model)
    group = dist_run.group(2)
    prompts = BATCHED.get(case, ["A cat"])
    with Engine(path, config, workers=group, vae_parallel=True, vae_tiling=True) as engine:
        assert engine.vae_parallel
        outputs = engine.generate(prompts, SamplingParams(seed=3, **call))
        splits = group.run(vae_split)
    assert [s.computed for s in splits] == [(splits[0].tiles + 1) // 2, splits[0].tiles // 2] and splits[0].tiles >= 4
    defaults = {k: v for k, v in engine.info.defaults.items() if k in engine.info.call_params}
    for out in outputs:
        expected = reference_pipeline(path, out.prompt, out.seed, vae_tiling=True, **{**defaults, **call})
        got = out.frames if engine.info.output == "video" else out.images
        assert got.shape == expected.shape and expected.std() > 0
        np.testing.assert_allclose(got, expected, atol=ULYSSES if config.ulysses_degree > 1 else TILED, rtol=0)


DEFAULTS = {
    # sizes the tiled split would tile (tiny-flux: 3 x 3 tiles; tiny-wan: 2 x 2), so a tiled default would show
    "tiny-flux": {"height": 128, "width": 128, "num_inference_steps": 2},
    "tiny-wan": {"height": 288, "width": 288, "num_frames": 1, "num_inference_steps": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(DEFAULTS))
def test_default_decode_equals_plain_diffusers_one_process(model, dist_run):
    """Issue 33 item 1: with no VAE flag, HSDP 2 gives plain diffusers' output in one process (whole, untiled
    decode) bit for bit, as the HSDP 2 layout tests of ``tests/test_engine_families.py`` assert; the tiled split
    that was the default differed by up to 127 levels on tiny-flux."""
    path, call = resolve_model(model), DEFAULTS[model]
    with Engine(path, HSDP2, workers=dist_run.group(2)) as engine:
        [out] = engine.generate("A cat", SamplingParams(seed=3, **call))
    defaults = {k: v for k, v in engine.info.defaults.items() if k in engine.info.call_params}
    expected = reference_pipeline(path, out.prompt, out.seed, **{**defaults, **call})
    got = out.frames if engine.info.output == "video" else out.images
    assert got.shape == expected.shape and expected.std() > 0
    np.testing.assert_array_equal(got, expected)
    assert not engine.vae_parallel


EXACT = 1e-5
"""The row split against the whole decode, relative to the output's largest value: the derivation is in
:func:`hsdp.vae_parallel.enable_exact_split` (measured at most 2.6e-6 over the classes)."""
WHOLE = {
    "AutoencoderDC": "rows",  # its linear attention sums over the frame's tokens by matmul (the probe sees it)
    "AutoencoderKLAllegro": "Decoding without tiling has not been implemented",  # diffusers' own whole decode
    "AutoencoderKLHunyuanVideo": "attention with a mask",  # frame-causal mask over the frame's tokens
    "AutoencoderKLHunyuanVideo15": "attention with a mask",
}
"""Classes the row split leaves whole, and a word of the reason it gives."""


@pytest.mark.slow
@pytest.mark.parametrize("name", TILED_VAES)
def test_every_tiled_vae_class_exact_split_or_whole(name, dist_run):
    """``--vae-parallel`` without tiling: every diffusers autoencoder with a ``tiled_decode`` decodes split by rows
    over 2 ranks within ``EXACT`` of its own whole decode in one process (its encoded sample, 4 latent rows a
    rank, and a 9-row latent split 5 / 4), or decodes whole saying why."""
    ranks = dist_run(2, class_exact_and_whole, name)
    if name in WHOLE:
        assert all(WHOLE[name] in r.get("whole", "") for r in ranks), ranks
        return
    for result in ranks:
        assert "whole" not in result, result
        assert result["splits"] > 0 and result["rel"] <= EXACT and result["uneven_rel"] <= EXACT, result


EXACT_CASES = {
    "image-hsdp2": ("tiny-flux", {"height": 128, "width": 128, "num_inference_steps": 2}),
    "video-hsdp2": ("tiny-wan", {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_engine_exact_split_equals_plain_diffusers(case, dist_run):
    """``Engine(vae_parallel=True)`` at HSDP 2 (``--vae-parallel``) against plain diffusers in one process, untiled:
    the denoiser is bit-exact at HSDP 2, so the difference is the row split's, within ``EXACT`` of the range."""
    model, call = EXACT_CASES[case]
    path, group = resolve_model(model), dist_run.group(2)
    with Engine(path, HSDP2, workers=group, vae_parallel=True) as engine:
        [out] = engine.generate("A cat", SamplingParams(seed=3, **call))
        splits = group.run(exact_splits)
    assert all(s > 0 for s in splits), splits
    defaults = {k: v for k, v in engine.info.defaults.items() if k in engine.info.call_params}
    expected = reference_pipeline(path, out.prompt, out.seed, **{**defaults, **call})
    got = out.frames if engine.info.output == "video" else out.images
    assert got.shape == expected.shape and expected.std() > 0
    np.testing.assert_allclose(got, expected, atol=EXACT, rtol=0)


@pytest.mark.unit
def test_default_and_refusals():
    wan = inspect_model(resolve_model("tiny-wan"))
    assert not vae_parallel_default(wan, HSDP2.resolved(), None)  # off: the one-process output by default
    assert vae_parallel_default(wan, HSDP2.resolved(), True)
    assert not vae_parallel_default(wan, ParallelConfig().resolved(), None)
    request_parallel = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, request_parallel=True).resolved()
    assert not vae_parallel_default(wan, request_parallel, None)
    assert not vae_parallel_default(wan, HSDP2.resolved(), False)
    assert vae_problems(wan, HSDP2.resolved(), True, True, True) == []
    [one_rank] = vae_problems(wan, ParallelConfig().resolved(), True, False, False)
    assert one_rank.startswith("--vae-parallel") and "this layout has one rank" in one_rank
    [own_requests] = vae_problems(wan, request_parallel, True, False, False)
    assert "--request-parallel ranks each decode their own request" in own_requests
    # a VAE class that tiles but cannot be split (Allegro: no blend_v / blend_h): off by default, refused if asked
    allegro_like = dataclasses.replace(wan, vae_unsplittable={"vae": split_refusal(AutoencoderKLAllegro)})
    assert vae_problems(allegro_like, HSDP2.resolved(), True, False, False) == []  # the row split: no tiles
    [unsplittable] = vae_problems(allegro_like, HSDP2.resolved(), True, True, False)
    assert unsplittable.startswith("--vae-parallel --vae-tiling: AutoencoderKLAllegro's tiled decode blends its")
    assert vae_problems(allegro_like, HSDP2.resolved(), None, True, False) == []
    llama = inspect_model(resolve_model("tiny-llama"))
    [no_vae] = vae_problems(llama, HSDP2.resolved(), None, True, False)
    assert no_vae.startswith("--vae-tiling: ") and "has no VAE" in no_vae


@pytest.mark.slow
def test_generate_refuses_before_loading(tmp_path):
    from tests.forked_cli import run_hsdp

    done = run_hsdp(["generate", "--model", "tiny-wan", "--prompt", "x", "--vae-parallel", "--output", tmp_path / "x.mp4"])
    assert done.returncode == 2, done.stderr
    assert "--vae-parallel splits the VAE's decode over the ranks that share a request" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "x.mp4").exists()
