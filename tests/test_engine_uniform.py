"""Requests that differ in their own inputs (negative prompt, input image) in request-parallel and batched calls.

Request-parallel ranks share the FSDP shard group, so each round they must run the same sharded forwards; a
negative prompt (true CFG: a text encoding and an unconditional pass per step) or an input image (a VAE encoding)
changes them. The engine groups requests by those inputs and pads short ranks with fillers
(:func:`hsdp.engine.params.lockstep_rounds`); each output must still equal one process running that request alone.
Before, the mixed call below died with gloo's "collective mismatch".
"""

from __future__ import annotations

import numpy as np
import pytest

from hsdp import ParallelConfig
from hsdp.engine import Engine, SamplingParams
from hsdp.engine.params import Request, input_signature, lockstep_rounds
from tests.engine_refs import builtin, input_image, reference_pipeline

REQUEST_PARALLEL = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, request_parallel=True)
HSDP2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "hsdp-cache"


def _ids(groups: list[list[Request]]) -> list[list[tuple[int, bool]]]:
    return [[(r.request_id, r.filler) for r in group] for group in groups]


def test_rounds_share_inputs_and_sizes_and_run_every_request_once():
    image = input_image(32)
    negatives = ["n", None, None, "n", "n", None, "n"]
    requests = [
        Request(i, "p", i, negative_prompt=n, image=image if i == 6 else None) for i, n in enumerate(negatives)
    ]
    rounds = lockstep_rounds(requests, 2, 2)
    assert [_ids(r) for r in rounds] == [
        [[(0, False), (4, False)], [(3, False), (0, True)]],  # negative prompt: 0, 3, 4 (slot 1 padded)
        [[(1, False), (5, False)], [(2, False), (1, True)]],  # none: 1, 2, 5
        [[(6, False)], [(6, True)]],  # negative prompt and a 32 x 32 image
    ]
    for groups in rounds:
        assert len({input_signature(r) for g in groups for r in g}) == 1
        assert len({len(g) for g in groups}) == 1
    real = sorted(r.request_id for groups in rounds for g in groups for r in g if not r.filler)
    assert real == list(range(7))
    # Alike inputs: rank d takes d, d + 2, ... in runs of batch_size, as before the grouping.
    alike = [Request(i, "p", i) for i in range(8)]
    assert [_ids(r) for r in lockstep_rounds(alike, 2, 2)] == [
        [[(0, False), (2, False)], [(1, False), (3, False)]],
        [[(4, False), (6, False)], [(5, False), (7, False)]],
    ]
    # Images of other sizes are encoded in other tiles: another round.
    sized = [Request(0, "p", 0, image=input_image(32)), Request(1, "p", 1, image=input_image(64))]
    assert len(lockstep_rounds(sized, 2, 1)) == 2


def _reference(engine: Engine, prompt: str, seed: int, **call_kwargs) -> np.ndarray:
    return reference_pipeline(engine.info.path, prompt, seed, **{**engine.info.defaults, **call_kwargs})


@pytest.mark.slow
def test_request_parallel_mixed_negative_prompts_equal_each_alone(model_cache, dist_run):
    """The issue's reproduction, then six requests batched two at a time on each rank, mixed the same way."""
    path = builtin("tiny-flux", model_cache)
    cfg = {"true_cfg_scale": 4.0, "num_inference_steps": 2}
    with Engine(path, REQUEST_PARALLEL, workers=dist_run.group(2)) as engine:
        negatives = ["blurry", None]
        progress: list[tuple[int, int, int]] = []
        params = SamplingParams(seed=[1, 2], negative_prompt=negatives, **cfg)
        pair = engine.generate(["a fox", "a cat"], params, on_progress=lambda *e: progress.append(e))
        for out, negative in zip(pair, negatives, strict=True):
            want = _reference(engine, out.prompt, out.seed, negative_prompt=negative, **cfg)
            np.testing.assert_array_equal(out.images, want)
        assert sorted(progress) == [(r, s, 2) for r in range(2) for s in (1, 2)]  # fillers report nothing

        negatives = ["blurry", None, "dark", None, "grainy", "flat"]
        prompts = [f"a fox {i}" for i in range(6)]
        params = SamplingParams(seed=30, negative_prompt=negatives, **cfg)
        batched = engine.generate(prompts, params, batch_size=2)
    assert [o.request_id for o in batched] == list(range(6))
    for out, negative in zip(batched, negatives, strict=True):
        want = _reference(engine, out.prompt, out.seed, negative_prompt=negative, **cfg)
        # Batches of two round differently from one request alone (CPU GEMM kernels): 1e-5 on pixels in [0, 1].
        np.testing.assert_allclose(out.images, want, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [REQUEST_PARALLEL, HSDP2], ids=["request-parallel", "same-request"])
def test_mixed_input_images_and_negative_prompts_equal_each_alone(layout, model_cache, dist_run):
    """FLUX.1 Kontext: an edit with a 64 x 64 image, one with a 32 x 32 image, and text-to-image, with and
    without negative prompts, batched two at a time."""
    path = builtin("tiny-flux-kontext", model_cache)
    images = [input_image(64, seed=1), None, input_image(32, seed=2), None]
    negatives = ["blurry", None, None, "dark"]
    cfg = {"true_cfg_scale": 2.0, "num_inference_steps": 2}
    params = SamplingParams(seed=40, negative_prompt=negatives, image=images, **cfg)
    with Engine(path, layout, workers=dist_run.group(2)) as engine:
        outputs = engine.generate(["make it red", "a bird", "make it blue", "a tree"], params, batch_size=2)
    assert [o.request_id for o in outputs] == [0, 1, 2, 3]
    for out, image, negative in zip(outputs, images, negatives, strict=True):
        want = _reference(engine, out.prompt, out.seed, image=image, negative_prompt=negative, **cfg)
        np.testing.assert_array_equal(out.images, want)
