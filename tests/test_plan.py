"""``hsdp plan``: sizes, the model profile, the per-rank memory model, the recommendation and bad input."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

from hsdp.config import ParallelConfig
from hsdp.memory import training_memory
from hsdp.planning import (
    Hardware,
    Layout,
    PlanError,
    Workload,
    estimate,
    format_size,
    parse_size,
    profile_module,
    residency_for_budget,
)
from hsdp.planning.cli import add_arguments, run


class Block(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.proj = nn.Linear(8, rows)  # weight (rows, 8), bias (rows,)


class Toy(nn.Module):
    """Three blocks of 5 rows (so every shard size > 1 pads), an embedding on the root, a 0-d scale."""

    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 8)
        self.blocks = nn.ModuleList(Block(5) for _ in range(blocks))
        self.scale = nn.Parameter(torch.ones(()))
        self._hsdp_shard_conditions = [lambda name, module: isinstance(module, Block)]


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(list(argv)))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20), ("1e9", 10**9)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["24XB", "-1GiB", "0", "lots", ""])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(PlanError, match="--device-memory"):
        parse_size(text)


def test_profile_follows_the_shard_plan_and_fsdp2_padding():
    profile = profile_module(Toy())
    assert [u.name for u in profile.blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert profile.root.params == ((7, 8, 4),)  # the embedding; the 0-d scale stays whole
    assert profile.replicated_bytes == 4
    # One block over 2 ranks: weight rows 5 -> 3 per rank (padded to 6), bias 5 -> 3.
    assert profile.blocks[0].shard_bytes(2) == (3 * 8 + 3) * 4
    assert profile.blocks[0].gathered_bytes(2) == (6 * 8 + 6) * 4
    assert profile.blocks[0].unsharded_bytes(2) == (5 * 8 + 5) * 2
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2).resolved()
    planned = estimate([profile], Layout(config), Workload(), Hardware(2**30))
    assert planned.weights == 3 * (3 * 8 + 3) * 4 + 4 * 8 * 4 + 4


def test_keep_gathered_inference_moves_nothing_after_the_first_step():
    profile = profile_module(Toy())
    kept = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, reshard_after_forward=False).resolved()
    default = ParallelConfig(use_hsdp=True, hsdp_shard_size=2).resolved()
    work, hw = Workload(seq_len=4), Hardware(2**30)
    assert estimate([profile], Layout(kept), work, hw).allgather_bytes == 0
    assert (
        estimate([profile], Layout(default), work, hw).allgather_bytes == (8 * 8 + 3 * (6 * 8 + 6)) * 4 // 2
    )
    assert (
        estimate([profile], Layout(kept), work, hw).gather
        == estimate([profile], Layout(default, 0, 3), work, hw).gather
    )


def test_int8_counts_the_weights_quantize_stores():
    """``--weight-dtype int8``: the Linear weights :mod:`hsdp.quantize` stores in 8 bits (rows dividing by the
    shard size, not tied) count 1 byte per value plus an fp32 scale per row, per rank and gathered."""
    from hsdp.quantize import quantize_linear_weights

    class Even(Toy):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(6) for _ in range(3))

    odd, even = profile_module(Toy()), profile_module(Even())
    assert odd.blocks[0].linear == even.blocks[0].linear == (True, False)  # the weight, not the bias
    assert odd.root.linear == (False,)  # an embedding
    # 5 rows do not split over 2 ranks: quantize.py keeps such a weight in its dtype.
    assert odd.blocks[0].shard_bytes(2, weight_dtype="int8") == odd.blocks[0].shard_bytes(2)
    block = even.blocks[0]
    assert block.shard_bytes(2, weight_dtype="int8") == 3 * 8 + 3 * 4 + 3 * 4  # int8 rows, fp32 scales, bias
    assert block.gathered_bytes(2, weight_dtype="int8") == 6 * 8 + 6 * 4 + 6 * 4
    replaced = quantize_linear_weights(Even(), "int8", shard_size=2)
    assert replaced == [f"{b.name}.proj.weight" for b in even.blocks]
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2).resolved()
    work, hw = Workload(seq_len=4), Hardware(2**30)
    full, int8 = (estimate([even], Layout(config, weight_dtype=w), work, hw) for w in (None, "int8"))
    assert full.weights - int8.weights == 3 * (3 * 8 * 4 - (3 * 8 + 3 * 4))
    assert full.allgather_bytes - int8.allgather_bytes == 3 * (6 * 8 * 4 - (6 * 8 + 6 * 4)) // 2
    assert int8.layout.label == "hsdp 1x2 int8"


def test_plan_command_int8(capsys):
    argv = ("tiny-llama", "--devices", "2", "--device-memory", "16MiB", "--seq-len", "64")
    assert _run(*argv, "--weight-dtype", "int8") == 0
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if x.startswith("run it: ")]
    assert "--weight-dtype int8" in line and "recommended: hsdp 1x2 int8" in out
    assert _run(*argv, "--weight-dtype", "int8", "--train") == 2
    assert "training needs full-precision weights: drop --weight-dtype" in capsys.readouterr().err
    assert _run(*argv, "--weight-dtype", "int4") == 2
    assert "--weight-dtype 'int4' is not one of int8, fp8" in capsys.readouterr().err


@pytest.mark.parametrize("tied", [True, False])
def test_profile_counts_what_loading_builds(tied, tmp_path):
    """``hsdp plan``'s meta build of a saved folder counts the real model's parameters and bytes (tied weights
    once; the meta build used to untie them: tiny-llama 221,760 planned against 197,184 real)."""
    from hsdp.models.tiny import build_tiny_llama
    from hsdp.planning import profile_model

    real = build_tiny_llama(tie_word_embeddings=tied)
    real.save_pretrained(tmp_path)
    (profile,) = profile_model(str(tmp_path))
    unique = list(real.parameters())  # each tied parameter once
    assert profile.num_params == sum(p.numel() for p in unique) == (197_184 if tied else 221_760)
    sharded = sum(u.nbytes for u in profile.units)
    whole_params = profile.replicated_bytes - sum(b.numel() * b.element_size() for b in real.buffers())
    assert sharded + whole_params == sum(p.numel() * p.element_size() for p in unique)
    assert profile.kind == "causal_lm" and profile.layers == 4 and profile.vocab == 384
    assert len(profile.blocks) == 4


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_training_state_agrees_with_the_zero_accounting(shards):
    """Per-rank params + grads + AdamW state equal hsdp.memory's fp32 ZeRO figures, up to FSDP2's padding."""
    from hsdp.models.tiny import build_tiny_llama

    with torch.device("meta"):
        profile = profile_module(build_tiny_llama())
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=shards, hsdp_replicate_size=4 // shards).resolved()
    planned = estimate([profile], Layout(config), Workload(training=True), Hardware(2**30))
    zero = training_memory(profile.num_params, shards, "FULL_SHARD", 4, 4, 8)
    ours = planned.weights + planned.grads + planned.optimizer
    assert zero.total <= ours <= zero.total * 1.02 + 16 * 2**10


def test_residency_fills_the_budget():
    profile = profile_module(Toy())
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    work = Workload(seq_len=4)
    none = residency_for_budget(profile, config, 10**9, work)
    assert none.resident_modules == ("blocks.0", "blocks.1", "blocks.2") and none.prefetch == 0
    sharded = estimate([profile], Layout(config.resolved(), 1, 0), work, Hardware(1)).total
    assert residency_for_budget(profile, config, sharded, work).resident_modules == ()
    one = estimate([profile], Layout(config.resolved(), 1, 1), work, Hardware(1)).total
    policy = residency_for_budget(profile, config, one, work)
    assert policy.resident_modules == ("blocks.0",) and policy.prefetch == 1
    assert (
        policy.estimate.allgather_bytes
        < estimate([profile], Layout(config.resolved()), work, Hardware(1)).allgather_bytes
    )
    with pytest.raises(PlanError, match="per device even fully sharded"):
        residency_for_budget(profile, config, 100, work)


def test_candidates_are_valid_layouts_over_all_devices():
    from diffusers import WanTransformer3DModel

    from hsdp.models.tiny import tiny_wan_transformer_config
    from hsdp.planning import candidate_layouts

    with torch.device("meta"):
        profile = profile_module(WanTransformer3DModel(**tiny_wan_transformer_config()))
    layouts = candidate_layouts([profile], 4, Workload(seq_len=64), Hardware(2**30))
    labels = {layout.label for layout in layouts}
    assert {"hsdp 4x1", "hsdp 2x2", "hsdp 1x4", "replicated cfg2 usp2", "hsdp 1x4 cfg2 usp2"} <= labels
    assert all(layout.config.world_size == 4 for layout in layouts)
    assert not any(
        "usp4" in label for label in labels
    )  # the model has 2 heads: Ulysses degree 4 cannot split


def test_model_without_a_plan_is_refused():
    from hsdp.planning import plan

    profile = profile_module(nn.Sequential(nn.Linear(4, 4)))
    assert profile.replicated_bytes == (16 + 4) * 4 and not profile.blocks
    with pytest.raises(PlanError, match="matches no module of Sequential"):
        plan([profile], 2, Workload(), Hardware(2**30))


def test_plan_command_training_json(capsys):
    assert (
        _run(
            "tiny-llama", "--devices", "4", "--device-memory", "64MiB", "--train", "--seq-len", "64", "--json"
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["recommended"]
    layouts = {row["layout"]: row for row in result["layouts"]}
    best = layouts[result["recommended"]]
    assert best["fits"] and best["total"] <= 64 * 2**20
    assert {"hsdp 4x1", "hsdp 1x4", "hsdp 2x2", "hsdp 1x4 grad-op"} <= set(layouts)
    assert layouts["hsdp 1x4"]["weights"] < layouts["hsdp 4x1"]["weights"]


def test_plan_command_lm_lora_plans_lora(capsys):
    """``--lora-r`` on a causal LM plans LoRA (issue 27 item 19: it planned full fine-tuning and dropped the flag):
    only the adapters carry gradients and AdamW state, the frozen-whole layouts are candidates, and the command
    that runs the plan trains LoRA."""
    common = ("tiny-llama", "--devices", "2", "--device-memory", "64MiB", "--train", "--seq-len", "64")
    assert _run(*common, "--json") == 0
    full = {row["layout"]: row for row in json.loads(capsys.readouterr().out)["layouts"]}
    assert _run(*common, "--lora-r", "8", "--json") == 0
    lora = {row["layout"]: row for row in json.loads(capsys.readouterr().out)["layouts"]}
    assert "hsdp 1x2 frozen-whole" in lora and "hsdp 1x2 frozen-whole" not in full
    # r 8 adapters on every projection of every layer (peft's all-linear): 8 x (in + out) each, fp32 grads + AdamW
    from hsdp.models.builtin import resolve_model

    c = json.loads((resolve_model("tiny-llama") / "config.json").read_text())
    h, kv, mlp = c["hidden_size"], c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"]
    adapters = c["num_hidden_layers"] * 8 * (2 * (h + h) + 2 * (h + kv) + 3 * (h + mlp))
    assert lora["hsdp 2x1"]["grads"] + lora["hsdp 2x1"]["optimizer"] == adapters * (4 + 8)
    assert _run(*common, "--lora-r", "8") == 0
    out = capsys.readouterr().out
    assert "training (LoRA r=8" in out and "tensor bytes" in out
    assert out.strip().splitlines()[-1].startswith("run it: hsdp train") and "--lora-r 8" in out.splitlines()[-1]
    assert _run(*common[:-3], "--lora-r", "8") == 2  # without --train
    assert "--lora-r 8 plans LoRA training: add --train" in capsys.readouterr().err


def test_plan_command_pipeline_table(capsys):
    assert (
        _run("tiny-wan", "--devices", "4", "--device-memory", "8MiB", "--seq-len", "64", "--reserve", "2MiB")
        == 0
    )
    out = capsys.readouterr().out
    assert "devices of 8.00 MiB (6.00 MiB usable, --reserve 2MiB)" in out
    assert "transformer: WanTransformer3DModel" in out and "text_encoder: UMT5EncoderModel" in out
    assert "cfg2 usp2" in out and "recommended:" in out


def test_plan_without_device_memory_plans_for_this_machine(capsys):
    from hsdp.measure.memory import device_capacity

    assert _run("tiny-wan", "--devices", "4", "--seq-len", "64") == 0
    captured = capsys.readouterr()
    memory, source = device_capacity(4)
    assert f"--device-memory not given: {format_size(memory)} per device, {source}" in captured.err
    assert f"inference on 4 devices of {format_size(memory)} (" in captured.out


def test_plan_command_nothing_fits_names_the_smallest(capsys):
    assert _run("tiny-llama", "--devices", "2", "--device-memory", "1KiB", "--reserve", "0%") == 1
    err = capsys.readouterr().err
    assert "nothing fits in 1.00 KiB per device; the smallest layout" in err and "needs" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "-2", "--device-memory", "24GiB"], "--devices=-2 must be >= 1"),
        (["--devices", "2", "--device-memory", "24XB"], "--device-memory='24XB'"),
        (["--devices", "2", "--device-memory", "24GiB", "--seq-len", "0"], "--seq-len=0"),
        (["--devices", "2", "--device-memory", "24GiB", "--param-dtype", "fp7"], "--param-dtype='fp7'"),
        (["--devices", "2", "--device-memory", "24GiB", "--reserve", "150%"], "--reserve='150%'"),
        (["--devices", "2", "--device-memory", "24GiB", "--reserve", "30GiB"], "leaves nothing"),
    ],
)
def test_plan_command_rejects_nonsense(argv, message, capsys):
    assert _run("tiny-llama", *argv) == 2
    assert message in capsys.readouterr().err


def test_config_only_component_folder(tmp_path, capsys):
    """A diffusers component folder with no weights plans at the --dtype given (fp32-kept modules stay fp32)."""
    from diffusers import WanTransformer3DModel

    from hsdp.models.tiny import tiny_wan_transformer_config
    from hsdp.planning import profile_model

    with torch.device("meta"):
        WanTransformer3DModel(**tiny_wan_transformer_config()).save_config(tmp_path)
    (profile,) = profile_model(str(tmp_path), torch.bfloat16)
    elems = [b for u in profile.units for _, _, b in u.params]
    assert profile.kind == "diffusion" and len(profile.blocks) == 3
    # bf16 weights; the modules diffusers keeps in fp32 (norms, time embedder) are left whole, as sharding does.
    assert set(elems) == {2} and profile.replicated_bytes > 0
    assert _run(str(tmp_path), "--devices", "2", "--device-memory", "1GiB", "--dtype", "bf16") == 0
    assert "recommended:" in capsys.readouterr().out


def test_plan_command_unreadable_folder(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert _run(str(tmp_path), "--devices", "2", "--device-memory", "24GiB") == 2
    assert f"cannot read model folder {tmp_path}" in capsys.readouterr().err
    assert _run(str(tmp_path / "missing"), "--devices", "2", "--device-memory", "24GiB") == 2
    assert "neither an existing path nor a built-in model" in capsys.readouterr().err


def test_train_takes_the_planned_layout_of_its_mesh(capsys):
    """What ``hsdp train`` runs when its command names no layout (issue 26 item 6): the fastest layout of ``hsdp plan
    --train`` that fits and keeps the command's mesh; for LoRA one that keeps the frozen base whole."""
    from hsdp.planning.training import planned_layout
    from hsdp.train import TrainConfig

    hsdp2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    lora = TrainConfig(model="tiny-llama", data="x", parallel=hsdp2, batch_size=2, seq_len=64, lora_r=8)
    planned = planned_layout(lora, device_memory=64 * 2**20)
    assert planned.cfg.parallel.frozen_whole and planned.chosen.layout.config.frozen_whole
    assert (planned.cfg.parallel.hsdp_shard_size, planned.cfg.parallel.world_size) == (2, 2)
    assert planned.cfg.parallel.sharding_strategy is planned.chosen.layout.config.sharding_strategy
    assert planned.cfg.replace(parallel=hsdp2) == lora  # nothing else changed
    assert "64.00 MiB" in planned.reason
    # the plan command's own estimates (it also offers the other mesh, 2x1): the fastest 1x2 row that fits
    assert _run("tiny-llama", "--devices", "2", "--device-memory", "64MiB", "--train", "--seq-len", "64",
                "--lora-r", "8", "--json") == 0  # fmt: skip
    rows = [r for r in json.loads(capsys.readouterr().out)["layouts"] if r["fits"] and " 1x2" in r["layout"]]
    assert planned.chosen.layout.label == max(rows, key=lambda r: (r["samples_per_s"], -r["total"]))["layout"]
    full = planned_layout(lora.replace(lora_r=0), device_memory=64 * 2**20)
    assert not full.cfg.parallel.frozen_whole
    assert planned_layout(lora.replace(parallel=ParallelConfig())) is None  # one process: nothing to choose


def test_offload_layers_moves_the_blocks_after_k_to_the_host_and_is_recommended_when_nothing_else_fits():
    """--offload-layers K: the device holds the root's and K blocks' shards, the host the rest, which are copied in
    once per inference step (twice per training step, their gradient shards out); the plan recommends the largest K
    that fits when no layout fits without offload, before whole CPU offload."""
    from hsdp.planning import plan

    profile = profile_module(Toy())
    work = Workload(seq_len=4)
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2).resolved()
    block = profile.blocks[0].shard_bytes(2)
    for k in range(4):
        layered = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, offload_layers=k).resolved()
        got = estimate([profile], Layout(layered, 1), work, Hardware(2**30))
        want = estimate([profile], Layout(config, 1), work, Hardware(2**30))
        offloaded = max(0, 3 - k) * block
        assert (got.weights, got.host, got.host_copy_bytes) == (want.weights - offloaded, offloaded, offloaded)
        assert got.allgather_bytes == want.allgather_bytes
        assert got.layout.label == f"hsdp 1x2 offload-layers {k} prefetch 1"
        trained = estimate([profile], Layout(layered), Workload(training=True, seq_len=4), Hardware(2**30))
        assert trained.host_copy_bytes == 2 * offloaded + offloaded  # in for forward and backward, gradients out
        assert trained.host == 4 * offloaded  # the shards, their gradients and two AdamW states
    # One device, 40 blocks: the whole model does not fit, 30 on the device (the rest streamed) do, 31 do not.
    profile = profile_module(Toy(40))
    one = ParallelConfig(use_hsdp=True, hsdp_shard_size=1, offload_layers=30).resolved()
    budget = estimate([profile], Layout(one, 1), work, Hardware(1)).total
    result = plan([profile], 1, work, Hardware(budget))
    labels = [e.layout.label for e in result.estimates]
    assert labels == ["hsdp 1x1", "hsdp 1x1 offload-layers 30 prefetch 1", "hsdp 1x1 offload"]
    assert not result.estimates[0].fits and result.recommended is result.estimates[1]


def test_plan_plot_draws_one_bar_per_layout_equal_to_the_table(tmp_path, capsys):
    """``--plot FILE.svg`` / ``.png`` and the terminal chart: one bar per layout of the table, each the table's total
    per rank (the SVG's ``data-bytes``, the PNG's ``hsdp-plan`` text chunk), drawn to scale; a bar per layout in the
    PNG's pixels; another suffix is refused before planning."""
    import xml.etree.ElementTree as ET

    from PIL import Image

    from hsdp.planning.profile import format_size

    common = ("tiny-llama", "--devices", "4", "--device-memory", "64MiB", "--train", "--seq-len", "64")
    svg, png = tmp_path / "plan.svg", tmp_path / "plan.png"
    assert _run(*common, "--json", "--plot", str(svg)) == 0
    table = {row["layout"]: row["total"] for row in json.loads(capsys.readouterr().out)["layouts"]}
    bars = [r for r in ET.parse(svg).getroot().iter("{http://www.w3.org/2000/svg}rect") if r.get("class") == "bar"]
    assert {r.get("data-layout"): int(r.get("data-bytes")) for r in bars} == table and len(bars) == len(table)
    widths = {r.get("data-layout"): float(r.get("width")) for r in bars}
    big = max(table, key=table.get)
    for layout, total in table.items():  # to scale
        assert widths[layout] / widths[big] == pytest.approx(total / table[big], abs=1e-3)

    assert _run(*common, "--plot", str(png)) == 0
    out = capsys.readouterr().out
    chart = out[out.index("memory per rank (") :].splitlines()[1 : len(table) + 1]
    assert [line.split()[0:2] for line in chart] == [layout.split()[:2] for layout in table]
    assert [line.rsplit(" ", 2)[-2:] for line in chart] == [format_size(t).split() for t in table.values()]
    image = Image.open(png)
    assert image.format == "PNG"
    assert {b["layout"]: b["bytes"] for b in json.loads(image.text["hsdp-plan"])} == table
    column = [image.getpixel((231, y)) for y in range(40, image.height)]  # inside every bar, below the title
    runs = sum(1 for y in range(1, len(column)) if column[y] != (255, 255, 255) and column[y - 1] == (255, 255, 255))
    assert runs == len(table)

    assert _run(*common, "--plot", str(tmp_path / "plan.pdf")) == 2
    assert "--plot" in capsys.readouterr().err and not (tmp_path / "plan.pdf").exists()


def test_the_planner_tracker_keeps_torchs_global_peak_without_walking_every_module():
    """The planner's MemTracker (hsdp.planning.trace.memory_tracker) keeps the global peak and current snapshot as
    torch's does, but not torch's per-module peaks, which walk every tracked module after every operation: that
    walk was most of a planner trace (tiny-sdxl 11.6 -> 2.6 CPU s, tiny-wan LoRA 3.8 -> 1.2 s, same plans); on
    2a202a7 every operation walked them."""
    from torch import nn
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.weak import WeakIdKeyDictionary

    from hsdp.planning.trace import memory_tracker

    def peak(tracker) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
        tracker.track_external(model)
        with tracker:
            model(torch.randn(8, 16, requires_grad=True)).square().sum().backward()
        return tracker.get_tracker_snapshot("peak")

    class Torchs(MemTracker):  # torch's own update, gradients counted as memory_tracker counts them
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    walks, updates = [], []

    class Counted(WeakIdKeyDictionary):  # torch's per-module update walks memory_tracking.values()
        def values(self):
            walks.append(1)
            return super().values()

    ours = memory_tracker(updates.append)
    ours.memory_tracking = Counted()
    assert peak(ours) == peak(Torchs()) and updates
    assert len(walks) < len(updates), "every operation walked the tracked modules"


def test_the_planned_layout_reuses_the_profiles_of_the_same_model_and_arguments(monkeypatch, tmp_path, media):
    """The trace behind ``hsdp train``'s layout pick is cached: the same pipeline and arguments again (a restart, each
    rank under torchrun) take the cached profiles and pick the same layout; another resolution traces again."""
    from hsdp.models.builtin import resolve_model
    from hsdp.planning import diffusion
    from hsdp.planning.training import planned_layout
    from hsdp.train import TrainConfig

    cfg = TrainConfig(model=str(resolve_model("tiny-wan")), data=str(media), lora_r=4, resolution=32,
                      parallel=ParallelConfig(use_hsdp=True, hsdp_shard_size=2))  # fmt: skip
    monkeypatch.setenv("HSDP_CACHE", str(tmp_path / "cache"))
    traced = []
    trace = diffusion.diffusion_training
    monkeypatch.setattr(diffusion, "diffusion_training", lambda *a, **k: traced.append(k) or trace(*a, **k))
    first = planned_layout(cfg, device_memory=2**30)
    again = planned_layout(cfg, device_memory=2**30)
    assert len(traced) == 1 and len(list((tmp_path / "cache" / "train-profiles").iterdir())) == 1
    assert (again.cfg, again.reason, again.chosen) == (first.cfg, first.reason, first.chosen)
    planned_layout(cfg.replace(resolution=64), device_memory=2**30)
    assert len(traced) == 2
