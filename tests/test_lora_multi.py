"""Several LoRA adapters on one sharded base (:mod:`hsdp.engine.adapters`), chosen per ``generate`` call.

Every output is compared with one process holding the base and that adapter alone (peft), or the base alone: the
adapters of rank 4 (the slots' rank) exactly, the rank-2 adapter in a rank-4 slot within float rounding (its
zero-padded matmul groups the sum differently; measured max |logit difference| ~1e-6). The adapters are random,
so each changes the outputs, and the sequences mix adapters, scales and the base on one engine.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hsdp import ParallelConfig
from hsdp.engine import Engine, SamplingParams
from hsdp.engine.adapters import AdapterCache, UnknownAdapter, describe_adapter, slot_spec
from hsdp.launch import worker_state
from hsdp.models.tiny import build_tiny_llama
from tests.engine_refs import builtin
from tests.lora_refs import (
    WAN_BLOCK_LINEARS,
    diffusers_folder,
    diffusers_video_reference,
    kohya_files,
    lm_reference,
    save_adapter,
    video_reference,
)

pytestmark = pytest.mark.slow

HSDP2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
PROMPT = "Adapters change"
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
IDS = tuple(
    tuple(row) for row in torch.randint(4, 250, (2, 12), generator=torch.Generator().manual_seed(3)).tolist()
)
VIDEO = SamplingParams(seed=1, num_inference_steps=2)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return builtin("tiny-llama", tmp_path_factory.getbasetemp() / "hsdp-cache")


@pytest.fixture(scope="module")
def lm_adapters(base, tmp_path_factory) -> dict[str, Path]:
    """``a``: rank 4 on every linear layer; ``b``: rank 2 on the attention projections only."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("lora")
    model = AutoModelForCausalLM.from_pretrained(base)
    return {
        "a": save_adapter(model, folder / "a", seed=1),
        "b": save_adapter(model, folder / "b", ["q_proj", "v_proj"], r=2, alpha=4, seed=2),
    }


def loaded_logits(ids: tuple) -> torch.Tensor:
    """Rank side: logits of the loaded model with the adapter the last call activated."""
    runner = worker_state()["hsdp.engine.runner"][0]
    with torch.no_grad():
        return runner.model(torch.tensor(ids)).logits


def _check_lm(engine, dist_run, base: Path, adapter: Path | None, name: str | None, scale: float) -> None:
    [out] = engine.generate(PROMPT, GREEDY, adapter=name, adapter_scale=scale)
    tokens, logits = lm_reference(base, adapter, scale, PROMPT, GREEDY.max_new_tokens, IDS)
    assert out.token_ids == tokens, (name, scale)
    for rank_logits in dist_run(2, loaded_logits, IDS):
        if name == "b":  # rank 2 zero-padded into the rank-4 slot
            torch.testing.assert_close(rank_logits, logits, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(rank_logits, logits), (name, (rank_logits - logits).abs().max().item())


def test_two_adapters_and_the_base_on_one_engine(base, lm_adapters, dist_run):
    sequence = [("a", 1.0), (None, 1.0), ("b", 1.0), ("a", 0.5), ("b", 1.0), (None, 1.0), ("a", 1.0)]
    with Engine(base, HSDP2, workers=dist_run.group(2), lora=lm_adapters) as engine:
        assert engine.default_adapter is None
        for name, scale in sequence:
            _check_lm(engine, dist_run, base, lm_adapters.get(name), name, scale)
        stats = engine.adapter_stats
    # Both fit their slots at start: loaded once each, never again; every change of adapter is a switch.
    assert (stats["loads"], stats["evictions"], stats["switches"]) == (2, 0, 7)
    a, b = (lm_reference(base, lm_adapters[n], 1.0, PROMPT, 8, IDS)[0] for n in "ab")
    assert len({tuple(a), tuple(b), tuple(lm_reference(base, None, 1.0, PROMPT, 8, IDS)[0])}) == 3


def test_one_slot_evicts_the_least_recently_used(base, lm_adapters, dist_run):
    with Engine(base, HSDP2, workers=dist_run.group(2), lora=lm_adapters, max_loras=1) as engine:
        for name in ("a", "b", "a", "a"):
            _check_lm(engine, dist_run, base, lm_adapters[name], name, 1.0)
        with pytest.raises(ValueError, match=r"2 adapters composed, and this engine holds 1 adapter slot.*max_loras=2"):
            engine.generate(PROMPT, GREEDY, adapter=["a", "b"])
        stats = engine.adapter_stats
    assert (stats["loads"], stats["evictions"], stats["resident"]) == (3, 2, ["a"])


def test_adapters_added_at_run_time_and_removed(base, lm_adapters, dist_run):
    with Engine(base, HSDP2, workers=dist_run.group(2), max_loras=2, max_lora_rank=4) as engine:
        assert engine.adapter_stats["adapters"] == []
        engine.add_adapter("late", lm_adapters["a"])
        _check_lm(engine, dist_run, base, lm_adapters["a"], "late", 1.0)
        engine.remove_adapter("late")
        with pytest.raises(UnknownAdapter, match="no adapter named 'late'; the adapters served are: none"):
            engine.generate(PROMPT, GREEDY, adapter="late")
        _check_lm(engine, dist_run, base, None, None, 1.0)


def test_an_adapter_added_at_run_time_may_adapt_layers_no_start_up_adapter_does(base, lm_adapters, dist_run):
    """Issue 33 item 9: slots for adapters added later (``max_loras``) cover every linear layer, not only the start-up
    adapters' (b: q_proj and v_proj), so ``a`` (every linear layer, rank 4) loads and equals peft exactly; b, the base
    and a keep their outputs on the wider slots. Before: "adapts 20 layer(s) the adapter slots do not cover"."""
    with Engine(base, HSDP2, workers=dist_run.group(2), lora={"b": lm_adapters["b"]}, max_loras=2, max_lora_rank=4) as engine:
        engine.add_adapter("a", lm_adapters["a"], "load_lora_adapter")
        for name in ("a", None, "b", "a"):
            _check_lm(engine, dist_run, base, lm_adapters.get(name), name, 1.0)


@pytest.mark.unit
def test_unknown_adapter_and_adapter_for_another_base(base, lm_adapters, tmp_path):
    other = save_adapter(build_tiny_llama(hidden_size=32), tmp_path / "other")
    with pytest.raises(ValueError) as info:
        Engine(base, HSDP2, lora={"a": lm_adapters["a"], "other": other})
    message = str(info.value)
    assert (
        "--lora" in message and "does not fit" in message and "adapter [" in message and "model [" in message
    )
    b, a = (describe_adapter(n, lm_adapters[n], base, "--lora") for n in "ba")
    cache = AdapterCache(slot_spec([b], base, count=1, rank=None), [b])
    with pytest.raises(ValueError, match="rank 4 exceeds the adapter slots' rank 2; .*--max-lora-rank 4"):
        cache.add(a, "load_lora_adapter")
    cache = AdapterCache(slot_spec([b], base, count=1, rank=4), [b])  # b's layers only (hsdp generate --lora)
    with pytest.raises(ValueError, match=r"adapts 20 layer.* do not cover \(model.layers.0.mlp.down_proj"):
        cache.add(a, "load_lora_adapter")
    # Slots narrowed to named layers (--lora-target-modules) refuse an adapter of others, naming the flag.
    narrow = slot_spec([b], base, count=1, rank=4, modules=["q_proj", "k_proj"])
    assert {m.rsplit(".", 1)[1] for m in narrow.targets} == {"q_proj", "k_proj", "v_proj"}
    with pytest.raises(ValueError, match=r"adapts 16 layer.* do not cover .*--lora-target-modules naming"):
        AdapterCache(narrow, [b]).add(a, "load_lora_adapter")
    with pytest.raises(ValueError, match=r"--lora-target-modules nope: .*all-linear"):
        slot_spec([b], base, count=1, rank=4, modules=["nope"])


@pytest.mark.unit
def test_a_composed_call_keeps_its_own_adapters(base, lm_adapters):
    """Loading the second adapter of a composed call evicts the least recently used adapter that the call does not
    use; scales and names are checked before any rank runs."""
    a, b = (describe_adapter(n, lm_adapters[n], base, "--lora") for n in "ab")
    cache = AdapterCache(slot_spec([a, b], base, count=2, rank=None), [a, b])
    cache.loaded("a", 0)
    cache.loaded("b", 1)
    assert cache.free_slot(keep=["a"]) == 1  # b goes, though a is the least recently used
    cache.loaded("b", 1)
    assert cache.free_slot() == 0 and cache.stats()["resident"] == ["b"]
    [first, second] = cache.use([("b", 1, 0.5), ("a", 0, 2.0)])
    assert (first.slot, second.slot) == (1, 0)
    assert first.scaling == {m: s * 0.5 for m, (_, s) in b.layers.items()}
    assert second.scaling == {m: s * 2.0 for m, (_, s) in a.layers.items()}


# -- a diffusion denoiser ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> Path:
    return builtin("tiny-wan", tmp_path_factory.getbasetemp() / "hsdp-cache")


@pytest.fixture(scope="module")
def wan_adapters(wan, tmp_path_factory) -> dict[str, Path]:
    from diffusers import WanTransformer3DModel

    folder = tmp_path_factory.mktemp("wan-lora")
    # A str path: peft writes the base's _name_or_path into the adapter's model card, and a Path breaks its YAML.
    transformer = WanTransformer3DModel.from_pretrained(str(wan / "transformer"))
    # ``comfyui`` and ``kohya``: LoRA files of other tools (ComfyUI's keys, musubi-tuner's kohya keys) holding one
    # adapter of every block's linear layers, as users have them (issue 26 item 4).
    files = kohya_files(save_adapter(transformer, folder / "k", WAN_BLOCK_LINEARS, seed=5), transformer, folder)
    return {
        "x": save_adapter(
            transformer, folder / "x", ["to_q", "to_k", "to_v", "to_out.0", "proj_out"], seed=3
        ),
        "y": save_adapter(transformer, folder / "y", ["to_q", "to_v", "proj_out"], seed=4),
        **files,
    }


def test_denoiser_adapters_mixed_with_the_base(wan, wan_adapters, dist_run):
    """Single adapters equal peft's. Issue 26 item 4: two composed equal diffusers' ``load_lora_weights`` of each
    and ``set_adapters([x, y], adapter_weights=[1, 0.5])`` in one process, in either order; LoRA files of ComfyUI
    and musubi-tuner (kohya keys) equal diffusers' ``load_lora_weights(file)``, alone and composed."""
    composed = [(["x", "y"], [1.0, 0.5]), (["y", "x"], [0.5, 1.0]), ("comfyui", 1.0), (["x", "kohya"], [1.0, 0.5])]
    with Engine(wan, HSDP2, workers=dist_run.group(2), lora=wan_adapters) as engine:
        defaults = engine.info.defaults
        outputs = {}
        for name, scale in (("x", 1.0), (None, 1.0), ("y", 0.5), *composed, ("x", 1.0)):
            [out] = engine.generate("a red fox", VIDEO, adapter=name, adapter_scale=scale)
            if isinstance(name, list) or name in ("comfyui", "kohya"):
                names, scales = (name, scale) if isinstance(name, list) else ([name], [scale])
                loras = [
                    (wan_adapters[n] if wan_adapters[n].is_file() else diffusers_folder(wan_adapters[n]), s)
                    for n, s in zip(names, scales, strict=True)
                ]
                expected = diffusers_video_reference(wan, loras, "a red fox", VIDEO, defaults)
            else:
                expected = video_reference(wan, wan_adapters.get(name), scale, "a red fox", VIDEO, defaults)
            np.testing.assert_array_equal(out.frames, expected, err_msg=f"adapter {name} scale {scale}")
            outputs[str(name)] = expected
        stats = engine.adapter_stats
    assert (stats["loads"], stats["evictions"]) == (4, 0)
    base = outputs["None"]
    assert np.abs(outputs["x"] - base).max() > 0.05 and np.abs(outputs["y"] - base).max() > 0.05
    both = outputs[str(["x", "y"])]
    assert np.abs(both - outputs["x"]).max() > 0.05 and np.abs(both - outputs["y"]).max() > 0.05
    assert np.abs(outputs["comfyui"] - base).max() > 0.05
