"""``--device-memory SIZE``: residency and prefetch planned from a per-rank budget, with the planner of ``hsdp plan``.

* The predicted per-rank peak is within 10 % of the measured one (torch's ``MemTracker``: every live tensor
  storage) for budgets that keep 0, 2, 3 and all 4 blocks of a Wan transformer gathered, at world 2, with full
  precision and with 8-bit (``--weight-dtype int8``) shards.
* Through the engine, for a Wan pipeline and a causal LM: the planned blocks stay gathered (each rank then holds
  exactly their full weights instead of their shards) and the output is the same as without a budget.
* A budget below the smallest layout is refused before any process starts, naming the flag, the need and the
  smallest layout that fits; ``hsdp plan`` prints the command that runs its recommendation.
"""

from __future__ import annotations

import shlex

import numpy as np
import pytest

from hsdp import ParallelConfig
from hsdp.engine import Engine, SamplingParams
from hsdp.engine.device_memory import engine_profiles, plan_device_memory
from hsdp.engine.model_info import inspect_model
from hsdp.planning import Hardware, Layout, Workload, estimate
from tests import quantize_fns
from tests.engine_refs import builtin

HSDP2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "hsdp-cache"


def _need(
    profiles,
    resident: int,
    prefetch: int = 1,
    tokens: int = 1024,
    shard: int = 2,
    weight_dtype: str | None = None,
) -> int:
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=shard).resolved()
    layout = Layout(config, prefetch, resident, weight_dtype)
    return estimate(profiles, layout, Workload(seq_len=tokens, guidance=False), Hardware(1)).total


def budgeted_peak(budget: int, weight_dtype: str | None) -> dict:
    """Plan residency for ``budget`` bytes per rank (with ``weight_dtype`` shards), shard so, and measure the
    first forward's peak with torch's ``MemTracker`` (every live tensor storage: what ``max_memory_allocated``
    counts on a GPU; resident blocks are gathered in that call and kept)."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from hsdp.planning import profile_module
    from hsdp.sharding import apply_hsdp_to_model

    class InferenceMemTracker(MemTracker):
        """No gradient hooks: an 8-bit weight is frozen and refuses them; inference makes no gradients."""

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    torch.set_num_threads(1)
    model = quantize_fns.plan_wan()
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=dist.get_world_size()).resolved()
    work = Workload(seq_len=(quantize_fns.PLAN_SIDE // 2) ** 2, guidance=False)
    plan = plan_device_memory([profile_module(model)], config, budget, work, weight_dtype)
    apply_hsdp_to_model(
        model,
        config,
        resident_modules=plan.resident_modules,
        forward_prefetch=plan.prefetch,
        weight_dtype=weight_dtype,
    )
    g = torch.Generator().manual_seed(0)
    side = quantize_fns.PLAN_SIDE
    inputs = (torch.randn(1, 16, 1, side, side, generator=g), torch.tensor([500]), torch.randn(1, 16, 256))
    tracker = InferenceMemTracker()
    tracker.track_external(model)
    with tracker, torch.no_grad():
        model(*inputs)
    measured = int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    return dict(predicted=plan.estimate.total, measured=measured, resident=len(plan.resident_modules))


def test_a_budget_below_the_smallest_layout_is_refused_naming_the_flag(model_cache):
    path = builtin("tiny-wan", model_cache)
    profiles = engine_profiles(path, None, inspect_model(path).shardable)
    budget = (_need(profiles, 0, shard=2) + _need(profiles, 0, shard=4)) // 2  # fits 4 ranks, not 2
    with pytest.raises(ValueError, match="--device-memory .* is below what world_size=2") as refused:
        Engine(path, HSDP2, device_memory=budget)
    message = str(refused.value)
    assert (
        "per rank (weights" in message and "The smallest layout that fits is --hsdp-shard-size 4" in message
    )
    with pytest.raises(ValueError, match="no wider --hsdp-shard-size fits: give --device-memory"):
        Engine(path, HSDP2, device_memory="64KiB")  # less than the activations of one request
    with pytest.raises(ValueError, match="--device-memory plans which sharded blocks stay gathered"):
        Engine(path, ParallelConfig(), device_memory="1GiB")
    with pytest.raises(ValueError, match="--device-memory='lots' is not a positive size"):
        Engine(path, HSDP2, device_memory="lots")


def test_generate_cli_refuses_a_budget_below_the_smallest_layout(model_cache, capsys):
    from hsdp.cli import main

    path = builtin("tiny-wan", model_cache)
    argv = ["generate", "--model", str(path), "--prompt", "a cat", "--use-hsdp", "--hsdp-shard-size", "2"]
    assert main([*argv, "--device-memory", "64KiB"]) == 2
    assert "hsdp generate: --device-memory 64.00 KiB is below what" in capsys.readouterr().err


def test_generate_cli_refuses_device_memory_with_offload_layers(model_cache, capsys):
    from hsdp.cli import main

    path = builtin("tiny-wan", model_cache)
    argv = ["generate", "--model", str(path), "--prompt", "a cat", "--use-hsdp", "--hsdp-shard-size", "2"]
    assert main([*argv, "--device-memory", "1GiB", "--offload-layers", "1"]) == 2
    err = capsys.readouterr().err
    assert "--device-memory keeps blocks gathered on the device, --offload-layers 1 streams" in err
    assert "drop one" in err and "Traceback" not in err


def test_offload_layers_at_or_above_the_block_count_offloads_nothing_and_says_so(caplog):
    from hsdp.sharding import offloaded_blocks

    targets = [(f"blocks.{i}", None) for i in reversed(range(3))]  # leaf-first, as fully_shard is applied
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, offload_layers=1)
    assert offloaded_blocks(targets, config) == ["blocks.1", "blocks.2"]
    assert offloaded_blocks(targets, ParallelConfig(use_hsdp=True, hsdp_shard_size=2)) == []
    with caplog.at_level("WARNING", logger="hsdp"):
        assert offloaded_blocks(targets, ParallelConfig(use_hsdp=True, hsdp_shard_size=2, offload_layers=3)) == []
    assert "--offload-layers 3: the model has 3 blocks, so all of them stay on the device" in caplog.text
    assert "use --offload-layers 2 or less to offload" in caplog.text


def test_plan_prints_the_command_that_runs_its_recommendation(capsys):
    from hsdp.cli import build_parser, main
    from hsdp.planning import command_line, profile_module, residency_for_budget

    assert main(["plan", "tiny-llama", "--devices", "2", "--device-memory", "16MiB", "--seq-len", "64"]) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("run it: ")]
    command = shlex.split(line.removeprefix("run it: "))
    assert command[:4] == ["hsdp", "generate", "--model", "tiny-llama"]
    build_parser().parse_args(command[1:])  # a command the CLI accepts as written
    # A budgeted-residency recommendation is run with its budget, from which the engine plans residency.
    profiles = [profile_module(quantize_fns.plan_wan())]
    budget = _need(profiles, resident=2)
    chosen = residency_for_budget(profiles, HSDP2, budget, Workload(guidance=False)).estimate
    args = build_parser().parse_args(shlex.split(command_line("wan", chosen, training=False))[1:])
    assert (args.use_hsdp, args.hsdp_shard_size, args.device_memory) == (True, 2, str(budget))


@pytest.mark.slow
@pytest.mark.parametrize("weight_dtype", [None, "int8"])
def test_predicted_peak_within_10_percent_of_measured(dist_run, weight_dtype):
    """Allocation accounting, not timing: deterministic. A budget that fits ``k`` resident blocks keeps at least
    ``k`` (more when the next block costs nothing at the peak: its first gather is the peak either way)."""
    from hsdp.planning import profile_module

    profiles = [profile_module(quantize_fns.plan_wan())]
    tokens = (quantize_fns.PLAN_SIDE // 2) ** 2
    for resident in (0, 2, 3, 4):
        budget = _need(profiles, resident, tokens=tokens, weight_dtype=weight_dtype)
        ranks = dist_run(2, budgeted_peak, budget, weight_dtype)
        for r in ranks:
            assert r["resident"] >= resident
            error = r["predicted"] / r["measured"] - 1
            print(
                f"{weight_dtype} resident {r['resident']}: predicted {r['predicted']}, measured {r['measured']}"
            )
            assert abs(error) <= 0.10, (resident, r)


def test_int8_budget_counts_8_bit_shards():
    """``--weight-dtype int8`` budgets with 8-bit shards and gathers: the fully sharded need is lower, and the
    budget that keeps 1 block gathered in full precision keeps all 4 with 8-bit shards."""
    from hsdp.planning import profile_module

    profiles = [profile_module(quantize_fns.plan_wan())]
    work = Workload(guidance=False)
    assert _need(profiles, 0, weight_dtype="int8") < 0.6 * _need(profiles, 0)
    budget = _need(profiles, 1)
    full = plan_device_memory(profiles, HSDP2, budget, work)
    eight_bit = plan_device_memory(profiles, HSDP2, budget, work, "int8")
    assert len(full.resident_modules) == 1 and len(eight_bit.resident_modules) == 4
    assert (
        eight_bit.estimate.layout.weight_dtype == "int8" and "with int8 weight shards" in eight_bit.describe()
    )


def test_engine_budgets_with_its_weight_dtype(model_cache):
    """``Engine(weight_dtype="int8", device_memory=...)`` plans with 8-bit shards (before any worker starts):
    a budget sized for one gathered block in full precision keeps more blocks gathered with int8."""
    from hsdp.engine.checks import memory_plan

    path = builtin("tiny-wan", model_cache)
    info = inspect_model(path)
    budget = _need(engine_profiles(path, None, info.shardable), resident=1)
    full = memory_plan(info, HSDP2, budget, None, None)
    eight_bit = memory_plan(info, HSDP2, budget, None, "int8")
    assert eight_bit.estimate.layout.weight_dtype == "int8"
    assert len(eight_bit.resident_modules) > len(full.resident_modules)


def test_no_prefetch_is_kept_under_a_budget(model_cache):
    """``--no-prefetch --device-memory``: the plan keeps its residency but prefetches nothing (it planned with
    prefetch 1 regardless); the estimate, which counts one prefetched block, stays an upper bound."""
    from hsdp.engine.checks import memory_plan

    path = builtin("tiny-wan", model_cache)
    info = inspect_model(path)
    budget = _need(engine_profiles(path, None, info.shardable), resident=1)
    default = memory_plan(info, HSDP2, budget, None, None)
    plain = memory_plan(info, HSDP2, budget, None, None, forward_prefetch=False)
    assert default.prefetch == 1 and plain.prefetch == 0
    assert plain.resident_modules == default.resident_modules
    assert plain.load_options()[plain.component]["forward_prefetch"] == 0 and "prefetch 0" in plain.describe()


@pytest.mark.slow
def test_engine_keeps_the_planned_blocks_gathered_and_outputs_are_unchanged(model_cache, dist_run):
    path = builtin("tiny-wan", model_cache)
    info = inspect_model(path)
    profiles = engine_profiles(path, None, info.shardable)
    budget = _need(profiles, resident=2)
    plan = plan_device_memory(profiles, HSDP2, budget, Workload(guidance=False))
    assert len(plan.resident_modules) == 2 and plan.prefetch == 1
    params = SamplingParams(seed=3, num_inference_steps=2)
    held, frames = {}, {}
    for device_memory in (None, budget):
        with Engine(path, HSDP2, workers=dist_run.group(2), device_memory=device_memory) as engine:
            [out] = engine.generate("A cat playing piano", params)
            frames[device_memory] = out.frames
            held[device_memory] = [r["param_bytes"] for r in engine.memory_report()]
    assert engine.memory_plan.resident_modules == plan.resident_modules
    np.testing.assert_array_equal(frames[budget], frames[None])
    # A resident block holds its full weights between steps where it held its shard: rank 0 the first
    # ceil(rows / 2) rows of each parameter, rank 1 the rest.
    main = next(p for p in profiles if p.name == plan.component)
    blocks = [u for u in main.blocks if u.name in plan.resident_modules]
    full = sum(u.unsharded_bytes() for u in blocks)
    first = sum(u.shard_bytes(2) for u in blocks)
    assert [b - a for a, b in zip(held[None], held[budget], strict=True)] == [full - first, first]


@pytest.mark.slow
def test_causal_lm_budget_keeps_layers_gathered_and_tokens_unchanged(model_cache, dist_run):
    path = builtin("tiny-llama", model_cache)
    profiles = engine_profiles(path, None, ("model",))
    budget = _need(profiles, resident=2)
    params = SamplingParams(seed=0, max_new_tokens=8)
    tokens, held = {}, {}
    for device_memory in (None, budget):
        with Engine(path, HSDP2, workers=dist_run.group(2), device_memory=device_memory) as engine:
            [out] = engine.generate("hello", params)
            tokens[device_memory] = out.token_ids
            held[device_memory] = engine.memory_report()[0]["param_bytes"]
    # The budget for 2 layers keeps a third too: its first gather costs no more at the peak than the prefetched
    # buffer it replaces.
    plan = plan_device_memory(profiles, HSDP2, budget, Workload(guidance=False))
    assert engine.memory_plan.resident_modules == plan.resident_modules
    assert plan.resident_modules[:2] == ("model.layers.0", "model.layers.1")
    assert tokens[budget] == tokens[None]
    layers = [u for u in profiles[0].blocks if u.name in engine.memory_plan.resident_modules]
    assert held[budget] - held[None] == sum(u.unsharded_bytes() - u.shard_bytes(2) for u in layers)
