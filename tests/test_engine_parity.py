"""Every layout of the engine against the single-process diffusers / transformers pipeline: exactly equal.

Each layout loads one Engine into the session's reused worker group (``dist_run``), and generates 2 denoising steps of the tiny Wan
at 32 x 32 x 5 frames with classifier-free guidance on. Equality is exact: the sharded forward does the same
arithmetic as the unsharded one, Ulysses and CFG parallel only move whole tensors, and the reference copies
its weights into fresh memory (see ``tests/engine_refs.py``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch

from hsdp import ParallelConfig
from hsdp.engine import Engine, SamplingParams
from hsdp.models.tiny_wan import TINY_WAN_DEFAULTS
from tests.engine_refs import builtin, reference_tokens, reference_video

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(seed=11, num_inference_steps=2, negative_prompt="blurry")
PROMPTS = ["A cat playing piano", "A red fox in the snow"]

LAYOUTS = {
    "hsdp2": ParallelConfig(use_hsdp=True, hsdp_shard_size=2),
    "hsdp2+ulysses2": ParallelConfig(use_hsdp=True, ulysses_degree=2),
    "hsdp2+cfg2": ParallelConfig(use_hsdp=True, cfg_parallel_size=2),
    "hsdp2x2": ParallelConfig(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2),
    # --offload-layers with the sequence split and with the CFG branches split (plain HSDP 2: tests/test_loading.py)
    "hsdp2+ulysses2+offload-layers1": ParallelConfig(use_hsdp=True, ulysses_degree=2, offload_layers=1),
    "hsdp2+cfg2+offload-layers1": ParallelConfig(use_hsdp=True, cfg_parallel_size=2, offload_layers=1),
}


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "hsdp-cache"


def test_wan22_second_transformer_sharded_and_cfg_parallel(tmp_path, dist_run):
    from hsdp.models.tiny_wan import build_tiny_wan_pipeline, write_generation_defaults

    path = tmp_path / "tiny-wan2.2"
    build_tiny_wan_pipeline(boundary_ratio=0.9).save_pretrained(path)
    write_generation_defaults(path, TINY_WAN_DEFAULTS)
    params = SamplingParams(seed=2, num_inference_steps=3, guidance_scale_2=2.0)
    config = ParallelConfig(use_hsdp=True, cfg_parallel_size=2)
    with Engine(path, config, workers=dist_run.group(2)) as engine:
        [out] = engine.generate(PROMPTS[0], params)
        assert sorted(engine.load_report[0]["sharded"]) == ["text_encoder", "transformer", "transformer_2"]
    defaults = {**engine.info.defaults, "guidance_scale_2": None}
    expected = reference_video(path, PROMPTS[0], 2, params, defaults)
    np.testing.assert_array_equal(out.frames, expected)


def test_torchrun_ranks_run_the_engine_in_process(model_cache, tmp_path):
    import os
    import subprocess

    from tests import engine_fns
    from tests.forked_cli import preloaded_python

    path = builtin("tiny-wan", model_cache)
    out = tmp_path / "frames.npz"
    command = [preloaded_python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "tests.engine_fns", str(path), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    saved = np.load(out)
    assert list(saved["ranks"]) == [0, 1] and list(saved["seeds"]) == [21, 22]
    for i, prompt in enumerate(engine_fns.PROMPTS):
        expected = reference_video(path, prompt, 21 + i, engine_fns.PARAMS, TINY_WAN_DEFAULTS)
        np.testing.assert_array_equal(saved[f"frames_{i}"], expected)


def test_call_timeout_under_torchrun_is_refused(monkeypatch):
    """Under torchrun each rank runs ``generate`` itself and nothing watches the call: ``call_timeout_s`` was
    accepted and ignored; it is refused, by name, before the ranks load anything."""
    from hsdp import distributed

    monkeypatch.setattr(distributed, "launched_by_torchrun", lambda: True)
    with pytest.raises(ValueError, match=r"call_timeout_s=30: under torchrun .* HSDP_COLLECTIVE_TIMEOUT"):
        Engine("tiny-llama", ParallelConfig(use_hsdp=True, hsdp_shard_size=2), call_timeout_s=30)


def test_request_parallel_each_request_equals_its_single_process_output(model_cache, dist_run):
    path = builtin("tiny-wan", model_cache)
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, request_parallel=True)
    with Engine(path, config, workers=dist_run.group(2)) as engine:
        assert engine.request_slots == 2
        outputs = engine.generate(PROMPTS * 2, PARAMS)  # two rounds of two requests
    assert [o.request_id for o in outputs] == [0, 1, 2, 3]
    assert [o.rank for o in outputs] == [0, 1, 0, 1]
    assert [o.seed for o in outputs] == [11, 12, 13, 14]
    for out in outputs:
        expected = reference_video(path, out.prompt, out.seed, PARAMS, engine.info.defaults)
        np.testing.assert_array_equal(out.frames, expected)
    assert not np.array_equal(outputs[0].frames, outputs[1].frames)


@pytest.mark.parametrize("request_parallel", [False, True], ids=["same-request", "request-parallel"])
def test_causal_lm_tokens_equal_single_process(request_parallel, model_cache, dist_run):
    path = builtin("tiny-llama", model_cache)
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, request_parallel=request_parallel)
    greedy = SamplingParams(seed=5, max_new_tokens=12)
    sampled = SamplingParams(seed=5, max_new_tokens=12, temperature=0.8, top_p=0.9)
    with Engine(path, config, workers=dist_run.group(2)) as engine:
        runs = [(p, engine.generate(PROMPTS, p)) for p in (greedy, sampled)]
        # Request-parallel lockstep when the ranks' sequences end at different lengths: stop request 0 early on
        # a token that greedy request 1 never produces, so request 1 runs on alone to max_new_tokens.
        first, second = (out.token_ids for out in runs[0][1])
        only_first = [token for token in first[:6] if token not in second]
        assert only_first and len(second) == 12, (first, second)
        stop = SamplingParams(seed=5, max_new_tokens=12, stop_token_ids=[only_first[0]])
        runs.append((stop, engine.generate(PROMPTS, stop)))
    for params, outputs in runs:
        for out in outputs:
            assert out.token_ids == reference_tokens(path, out.prompt, out.seed, params)
            assert out.text is not None
    stopped = runs[-1][1]
    assert len(stopped[0].token_ids) <= 6 < len(stopped[1].token_ids) == 12


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_video_layout_equals_single_process(layout, model_cache, dist_run):
    path = builtin("tiny-wan", model_cache)
    config = LAYOUTS[layout].resolved()
    with Engine(path, config, workers=dist_run.group(config.world_size)) as engine:
        [out] = engine.generate(PROMPTS[0], PARAMS)
    assert out.frames.shape == (5, 32, 32, 3) and out.seed == 11
    assert len(out.timings.step_s) == 2 and out.timings.seconds_per_step > 0
    assert len(out.peak_memory_bytes) == engine.config.world_size
    expected = reference_video(path, PROMPTS[0], 11, PARAMS, engine.info.defaults)
    np.testing.assert_array_equal(out.frames, expected)
    if config.offload_layers is not None:  # the denoiser's blocks 1 and 2 of 3 on the host, the text encoder's none
        for report in engine.load_report:
            assert report["offloaded"] == {
                "WanTransformer3DModel": ["blocks.1", "blocks.2"], "UMT5EncoderModel": [],
            }



OFFLOADED_WITH = {
    "lora": {},  # the adapter folder is made by the test
    "first-block-cache": dict(cache="first-block", cache_config={"threshold": 0.2}),
    "int8": dict(weight_dtype="int8"),
}


@pytest.mark.parametrize("feature", list(OFFLOADED_WITH))
def test_offload_layers_composes_with(feature, model_cache, dist_run, tmp_path):
    """--offload-layers changes where shards live, nothing else: with an adapter (its lora_A / lora_B sharded beside
    offloaded blocks), a step cache (which reads the first block's output) or int8 shards, the video equals the same
    engine's without it, which the feature's own tests hold to one process."""
    path = builtin("tiny-wan", model_cache)
    options = dict(OFFLOADED_WITH[feature])
    if feature == "lora":
        from diffusers import WanTransformer3DModel

        from tests.lora_refs import save_adapter

        options["lora"] = str(save_adapter(WanTransformer3DModel.from_pretrained(path / "transformer"), tmp_path / "x"))
    frames = {}
    for offload in (None, 1):
        config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, offload_layers=offload)
        with Engine(path, config, workers=dist_run.group(2), **options) as engine:
            [out] = engine.generate(PROMPTS[0], PARAMS)
            frames[offload] = out.frames
            if offload:
                assert engine.load_report[0]["offloaded"]["WanTransformer3DModel"] == ["blocks.1", "blocks.2"]
    np.testing.assert_array_equal(frames[1], frames[None])
    if feature == "lora":  # the adapter reached the output
        assert not np.array_equal(frames[1], reference_video(path, PROMPTS[0], 11, PARAMS, engine.info.defaults))

# -- CFG parallel: the wrapper's risks (issue 21 item 9) ---------------------------------------------------------
class _Denoiser(torch.nn.Module):
    """A stand-in denoiser whose output depends on every argument it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    @contextlib.contextmanager
    def cache_context(self, name: str):
        yield

    def forward(self, hidden_states, context, scale=None, bias=None, return_dict=True):
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        out = self.proj(hidden_states) + context.sum()
        out = out * (1.0 if scale is None else scale) + (0.0 if bias is None else bias)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)


def cfg_wrapper_steps(steps: int, requests: int) -> tuple[list, list, list]:
    """On each cfg rank: ``requests`` runs of ``steps`` guided steps through the wrapper, a pipeline's way (a
    labelled conditional call with ``bias``, then an unconditional one without it and with its own context),
    and the same calls to the bare denoiser; ``reset()`` between runs, as the engine does per request."""
    from hsdp.engine.parallel import CFGParallelTransformer
    from hsdp.mesh import build_meshes

    torch.manual_seed(0)
    model = _Denoiser()
    wrapper = CFGParallelTransformer(model, build_meshes(CFG2.resolved()).axis("cfg"))
    got, want, split = [], [], []
    for request in range(requests):
        wrapper.reset()
        context = {"cond": torch.full((2,), 1.0 + request), "uncond": torch.full((2,), -2.0 - request)}
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(request))
        for step in range(steps):
            calls = {"cond": {"bias": 0.5 * step, "scale": 2.0}, "uncond": {"scale": 2.0}}
            outs = {}
            for branch, extra in calls.items():
                with torch.no_grad(), wrapper.cache_context(branch):
                    outs[branch] = wrapper(x, context[branch], **extra).sample
                    want.append(model(x, context[branch], **extra).sample)
                got.append(outs[branch])
            x = outs["cond"] + 0.5 * (outs["cond"] - outs["uncond"])  # the next step's latents
        split.append(wrapper.parallel_steps)
    return got, want, split


CFG2 = ParallelConfig(use_hsdp=True, cfg_parallel_size=2)


def test_cfg_wrapper_many_split_steps_reset_and_an_argument_only_the_conditional_call_passes(dist_run):
    """Six steps (five split across the two ranks), two requests (``reset()`` between) whose unconditional
    contexts differ, and a ``bias`` the unconditional call leaves out: every output equals the bare denoiser's.
    Before, the split unconditional branch ran with the conditional call's ``bias`` and the check then refused."""
    for got, want, split in dist_run(2, cfg_wrapper_steps, 6, 2):
        assert split == [5, 5]
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def test_cfg_parallel_second_request_many_steps_and_batches_equal_single_process(model_cache, dist_run):
    """Through the engine on the tiny Wan: a second request with another negative prompt (the wrapper's
    ``reset()``), six denoising steps, and two requests batched (1e-5: a batch of two rounds differently)."""
    path = builtin("tiny-wan", model_cache)
    first = SamplingParams(seed=3, num_inference_steps=6, negative_prompt="blurry")
    second = SamplingParams(seed=4, num_inference_steps=6, negative_prompt="dark, low quality")
    batched = SamplingParams(seed=5, num_inference_steps=2, negative_prompt=["blurry", "grainy"])
    with Engine(path, CFG2, workers=dist_run.group(2)) as engine:
        [one] = engine.generate(PROMPTS[0], first)
        [two] = engine.generate(PROMPTS[1], second)
        pair = engine.generate(PROMPTS, batched, batch_size=2)
    np.testing.assert_array_equal(one.frames, reference_video(path, PROMPTS[0], 3, first, engine.info.defaults))
    np.testing.assert_array_equal(two.frames, reference_video(path, PROMPTS[1], 4, second, engine.info.defaults))
    for out, negative in zip(pair, ["blurry", "grainy"], strict=True):
        params = SamplingParams(seed=out.seed, num_inference_steps=2, negative_prompt=negative)
        want = reference_video(path, out.prompt, out.seed, params, engine.info.defaults)
        np.testing.assert_allclose(out.frames, want, rtol=0, atol=1e-5)
