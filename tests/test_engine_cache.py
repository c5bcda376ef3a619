"""Step caches (diffusers' hooks) under every layout: they complete, skip work, and equal one process.

Each layout runs every cache in one engine (the cache is per call) on tiny-wan, and compares with the unchanged
``WanPipeline`` in this process with the same cache config and seed: exact. A hang would be a collective timeout
(the engine's ``call_timeout_s`` and the group's 120 s collective timeout turn it into a failure). The
disagreement test makes one Ulysses rank's first-block statistic wildly different and shows that both ranks
still take the same decision at every step.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hsdp import ParallelConfig
from hsdp.engine import Engine, SamplingParams
from hsdp.engine.cache import available_caches, build_cache_config, cache_problems
from hsdp.engine.model_info import inspect_model
from hsdp.launch import worker_state
from tests.engine_refs import _pipeline, builtin, one_thread

STEPS = 6
CACHES = {
    "first-block": {"threshold": 0.2},
    "taylorseer": {
        "cache_interval": 2,
        "disable_cache_before_step": 2,
        "cache_identifiers": [r"blocks\.\d+\.attn\d"],
    },
    "magcache": {"mag_ratios": [1.0] * STEPS, "max_skip_steps": 2},
    "pab": {},
}
"""Configs that skip within a 6-step run of the tiny model (each cache's own defaults assume 28-50 steps)."""
WAN = {
    "height": 32,
    "width": 32,
    "num_frames": 5,
    "num_inference_steps": STEPS,
    "guidance_scale": 4.0,
    "max_sequence_length": 32,
}
LAYOUTS = {
    "hsdp2": ParallelConfig(use_hsdp=True, hsdp_shard_size=2),
    "ulysses2": ParallelConfig(use_hsdp=True, ulysses_degree=2),
    "cfg2": ParallelConfig(use_hsdp=True, cfg_parallel_size=2),
    "request-parallel": ParallelConfig(use_hsdp=True, hsdp_shard_size=2, request_parallel=True),
}
PROMPTS = ["A cat playing piano", "A red fox in the snow"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "hsdp-cache"


@pytest.fixture(scope="module")
def wan(models) -> Path:
    return builtin("tiny-wan", models)


def reference(path: Path, prompt: str, seed: int, cache: str | None) -> np.ndarray:
    """WanPipeline in this process with the same diffusers cache config (or none)."""
    pipe = _pipeline(path)
    if cache is not None:
        config = build_cache_config(
            cache, CACHES[cache], timestep=lambda: pipe.current_timestep, num_inference_steps=STEPS
        )
        pipe.transformer.enable_cache(config)
    try:
        with one_thread(), torch.no_grad():
            out = pipe(
                prompt,
                negative_prompt="blurry",
                generator=torch.Generator().manual_seed(seed),
                output_type="np",
                **WAN,
            )
        return out.frames[0]
    finally:
        if cache is not None:
            pipe.transformer.disable_cache()


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_cache_under_layout_equals_one_process(layout, wan, dist_run):
    config = LAYOUTS[layout].resolved()
    prompts = PROMPTS if config.request_parallel else PROMPTS[:1]
    results = {}
    caches = {k: v for k, v in CACHES.items() if not (k == "pab" and config.cfg_parallel_size == 2)}
    with Engine(wan, config, workers=dist_run.group(2), call_timeout_s=120) as engine:
        for cache, fields in caches.items():
            params = SamplingParams(seed=3, negative_prompt="blurry", cache=cache, cache_config=fields, **WAN)
            results[cache] = engine.generate(prompts, params)
    for cache, outputs in results.items():
        for out in outputs:
            stats = out.cache
            assert stats is not None and stats["name"] == cache and stats["skipped"] > 0, (cache, stats)
            expected = reference(wan, out.prompt, out.seed, cache)
            np.testing.assert_array_equal(out.frames, expected, err_msg=f"{cache} under {layout}")
    # the caches changed the result: the comparison above is not trivially the uncached video
    plain = reference(wan, PROMPTS[0], 3, None)
    assert not np.array_equal(results["first-block"][0].frames, plain)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, layout, threshold, fields",
    [
        ("tiny-wan", "ulysses2", 0.2, {"negative_prompt": "blurry", **WAN}),
        ("tiny-flux", "hsdp2", 0.4, {"num_inference_steps": STEPS, "height": 32, "width": 32}),
    ],
    ids=["wan-ulysses2", "flux-hsdp2"],
)
def test_first_block_cache_batched_equals_each_alone(name, layout, threshold, fields, models, dist_run):
    """The first-block decision is each request's own: two requests that skip different steps alone give the
    same output batched (within 1e-5, as batching without a cache: CPU GEMMs round differently for another
    batch size; one statistic over the batch was 3e-2 off). Wan's blocks return a tensor, Flux's a tuple."""
    path = builtin(name, models)
    config = LAYOUTS[layout].resolved()
    params = SamplingParams(seed=3, cache="first-block", cache_config={"threshold": threshold}, **fields)
    with Engine(path, config, workers=dist_run.group(2), call_timeout_s=120) as engine:
        alone = engine.generate(PROMPTS, params)
        batched = engine.generate(PROMPTS, params, batch_size=2)
    # alone the requests skip different numbers of steps, so the batch holds a computing and a skipping request
    assert alone[0].cache["skipped"] != alone[1].cache["skipped"], [a.cache for a in alone]
    for together, single in zip(batched, alone, strict=True):
        got = together.frames if together.frames is not None else together.images
        want = single.frames if single.frames is not None else single.images
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def _perturb_first_block(scale_on_rank_1: float) -> None:
    """Rank side: scale this rank's first-block residual (rank 1 only) before the agreed decision, and record
    every decision taken."""
    import torch.distributed as dist

    runner = worker_state()["hsdp.engine.runner"][0]
    cache = runner.step_cache
    original = type(cache)._agreed_decision
    decisions: list[bool] = []
    scale = scale_on_rank_1 if dist.get_rank() == 1 else 1.0

    def patched(self, hook):
        agreed = original(self, hook)

        def decide(residual):
            decision = agreed(residual * scale)
            decisions.append(decision)
            return decision

        return decide

    cache._agreed_decision = patched.__get__(cache)
    cache._key = None  # re-instrument on the next call
    worker_state()["test.decisions"] = decisions


def _decisions() -> tuple[list[bool], int]:
    runner = worker_state()["hsdp.engine.runner"][0]
    return worker_state()["test.decisions"], runner.step_cache.stats.overruled


@pytest.mark.slow
def test_ranks_with_different_statistics_take_the_same_decision(wan, dist_run):
    config = LAYOUTS["ulysses2"].resolved()
    group = dist_run.group(2)
    params = SamplingParams(
        seed=3, negative_prompt="blurry", cache="first-block", cache_config={"threshold": 0.2}, **WAN
    )
    with Engine(wan, config, workers=group, call_timeout_s=120) as engine:
        group.run(_perturb_first_block, 1.2)
        [out] = engine.generate(PROMPTS[0], params)
        (decisions_0, overruled_0), (decisions_1, overruled_1) = group.run(_decisions)
    assert out.frames is not None and np.isfinite(out.frames).all()
    assert decisions_0 == decisions_1 and len(decisions_0) > 0
    # rank 1's own (scaled) statistic would have computed every step; rank 0's would have skipped some
    assert overruled_0 + overruled_1 > 0
    assert False in decisions_0 and True in decisions_0


def test_available_caches_are_the_installed_diffusers_configs():
    assert {"first-block", "taylorseer", "magcache", "pab"} <= set(available_caches())


@pytest.mark.parametrize(
    "name, fields, needle",
    [
        ("teacache", None, "unknown cache; available: first-block, taylorseer"),
        ("first-block", {"treshold": 0.1}, "FirstBlockCacheConfig takes no treshold; it takes threshold"),
        ("pab", {"current_timestep_callback": 1}, "current_timestep_callback is set by the engine"),
        ("magcache", None, "`mag_ratios` must be provided"),
        ("taylorseer", {"taylor_factors_dtype": "bfloat17"}, "'bfloat17' is not a torch dtype"),
        ("fastercache", None, "runs guidance as a separate unconditional denoiser call"),
        ("taylorseer", None, "its layer-name patterns match no module of the transformer"),
        ("pab", None, "with --cfg-parallel-size 2: that cache keeps one state for both guidance branches"),
        (None, {"threshold": 0.1}, "--cache-config is given without --cache"),
    ],
)
def test_bad_cache_input_named_before_start(name, fields, needle, wan):
    layout = LAYOUTS["cfg2"] if name == "pab" else ParallelConfig()
    problems = cache_problems(name, fields, inspect_model(wan), layout.resolved())
    assert any(needle in p for p in problems), problems
    with pytest.raises(ValueError, match=re.escape(needle)):  # raised before any process starts
        Engine(wan, layout, cache=name, cache_config=fields)


def test_denoiser_without_cache_support_refused(tmp_path_factory):
    sdxl = inspect_model(builtin("tiny-sdxl", tmp_path_factory.getbasetemp() / "hsdp-cache"))
    [problem] = cache_problems("first-block", None, sdxl)
    assert "UNet2DConditionModel) has no diffusers step-cache support" in problem


class _Features(torch.nn.Module):
    """Stands in for an attention layer: returns the features it is given (TaylorSeer predicts on skipped steps)."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features


def _taylorseer_predictions(fields: dict, features: list[torch.Tensor]) -> list[torch.Tensor]:
    """What diffusers' TaylorSeer hook returns at each step, under the engine's config, for these features."""
    from diffusers.models.cache_utils import CacheMixin

    class Denoiser(torch.nn.Module, CacheMixin):
        _cache_config = None

    block = torch.nn.Module()
    block.attn1 = _Features()
    model = Denoiser()
    model.blocks = torch.nn.ModuleList([block])
    model.enable_cache(build_cache_config("taylorseer", fields))
    with model.cache_context("cond"):
        return [block.attn1(f) for f in features]


@pytest.mark.parametrize("order", [1, 2])
def test_taylorseer_moves_a_one_ulp_feature_difference_by_the_derived_bound(order):
    """A request batched beside another gets features a float32 ulp or so away from its own alone (CPU GEMMs round
    differently for another batch size). The engine's TaylorSeer keeps its factors in the features' dtype, so the
    extrapolation of order N at offset s from gaps of at least D moves that ulp by at most sum_k (2s/D)^k/k!
    (each divided difference at most doubles the difference and divides by the gap), plus the prediction's own
    rounding (a few ulps of its value). diffusers' default, bfloat16 factors, moved it by a whole bfloat16 ulp
    where a feature sits next to a rounding midpoint: 2^16 times more (tiny-wan: 1.4e-3 on pixels batched)."""
    fields = {**CACHES["taylorseer"], "max_order": order}
    generator = torch.Generator().manual_seed(0)
    start, slope = torch.randn(4096, generator=generator), torch.randn(4096, generator=generator)
    steps = [start + 0.1 * t * slope for t in range(STEPS)]
    towards = torch.where(torch.rand(4096, generator=generator) < 0.5, -torch.inf, torch.inf)
    moved = [torch.nextafter(f, towards) for f in steps]  # each feature 1 ulp away, up or down
    ulp = torch.stack([(m - f).abs() for m, f in zip(moved, steps, strict=True)]).max(0).values
    alone, batched = _taylorseer_predictions(fields, steps), _taylorseer_predictions(fields, moved)
    # the schedule of CACHES' config: computed at steps 0, 1, 3, 5 (gaps D >= 1), predicted at 2 and 4 (s = 1)
    predicted = [t for t in range(STEPS) if not torch.equal(alone[t], steps[t])]
    assert predicted == [2, 4], predicted
    growth = sum(2.0**k / math.factorial(k) for k in range(order + 1))  # s = 1, D = 1
    for t in predicted:
        rounding = 4 * torch.finfo(torch.float32).eps * alone[t].abs()
        diff = (batched[t] - alone[t]).abs()
        assert bool((diff <= growth * ulp + rounding).all()), (t, float((diff / ulp).max()))
