"""Inference benchmark: seconds per denoising step and per-rank memory, replicated vs FSDP2 defaults vs ours.

Variants, each at world 2 and 4, on a Wan-architecture pipeline with a wide transformer (default width 768,
4 blocks; the text encoder and VAE stay tiny) at two video sizes (sequence lengths):

* ``replicated``: every rank holds all weights (``NO_SHARD``), no communication; the speed reference.
* ``fsdp2-default``: the vLLM-Omni configuration: blocks + root sharded, reshard after forward, no prefetch.
* ``prefetch``: ours, explicit forward prefetch of the next block's all-gather.
* ``keep-gathered``: ours, prefetch and ``reshard_after_forward=False``: blocks stay gathered across steps.

``s/step`` is the fastest denoising step after the first (the first includes the first all-gathers; the
fastest is the least disturbed by other work on a shared host; the median is in the JSON). Memory is per rank:
the weights a rank holds between steps (its shards, or the full weights when kept gathered), and the peak during ``generate`` (peak RSS on CPU, with the part above
the process's pre-load baseline of runtime and libraries). The variants of one world size load in turn into
the same worker processes. Then requests per minute at world 2: the same 4 requests with standalone HSDP
(every rank runs every request) vs request-parallel HSDP (each rank takes its own). All variants run in one
invocation, so ratios are side by side. Writes JSON and prints a table::

    python benchmarks/inference.py                 # ~3-4 min on a 2-core CPU
    python benchmarks/inference.py --worlds 2 --steps 2 --json /tmp/inference.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from hsdp import ParallelConfig
from hsdp.engine import Engine, SamplingParams
from hsdp.launch import WorkerGroup
from hsdp.models.tiny_wan import build_tiny_wan_pipeline, write_generation_defaults

MIB = 2**20


def build_model(folder: Path, width: int, layers: int) -> Path:
    heads = width // 64
    pipe = build_tiny_wan_pipeline(
        num_attention_heads=heads, attention_head_dim=64, ffn_dim=4 * width, num_layers=layers
    )
    pipe.save_pretrained(folder)
    write_generation_defaults(folder, {"guidance_scale": 1.0, "max_sequence_length": 32})
    return folder


def variants(world: int) -> dict[str, tuple[ParallelConfig, bool]]:
    """name -> (layout, forward prefetch)."""
    shard = ParallelConfig(use_hsdp=True, hsdp_shard_size=world)
    return {
        "replicated": (ParallelConfig(use_hsdp=True, hsdp_shard_size=1, hsdp_replicate_size=world), False),
        "fsdp2-default": (shard, False),
        "prefetch": (shard, True),
        "keep-gathered": (
            ParallelConfig(use_hsdp=True, hsdp_shard_size=world, reshard_after_forward=False),
            True,
        ),
    }


def tokens(shape: tuple[int, int, int]) -> int:
    height, width, frames = shape
    return ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)


def step_rows(group: WorkerGroup, model: Path, shapes: list[tuple[int, int, int]], steps: int) -> list[dict]:
    world = group.world_size
    rows = []
    for name, (config, prefetch) in variants(world).items():
        with Engine(model, config, forward_prefetch=prefetch, workers=group) as engine:
            shard_mib = [r["param_bytes"] / MIB for r in engine.load_report]
            baseline = [r["baseline_memory_bytes"] for r in engine.load_report]
            for shape in shapes:
                height, width, frames = shape
                params = SamplingParams(
                    seed=0, num_inference_steps=steps, height=height, width=width, num_frames=frames
                )
                [out] = engine.generate("A cat playing piano", params)
                held_mib = [r["param_bytes"] / MIB for r in engine.memory_report()]
                rows.append(
                    {
                        "world": world,
                        "variant": name,
                        "tokens": tokens(shape),
                        "shape": f"{height}x{width}x{frames}",
                        # The first step includes the first all-gathers and allocator warm-up; the fastest of the
                        # others is the one least disturbed by other load on a shared host.
                        "s_per_step": min(out.timings.step_s[1:] or out.timings.step_s),
                        "s_per_step_median": statistics.median(out.timings.step_s[1:] or out.timings.step_s),
                        "param_mib_per_rank_loaded": shard_mib,
                        "param_mib_per_rank_between_steps": held_mib,
                        "peak_mib_per_rank": [b / MIB for b in out.peak_memory_bytes],
                        "peak_above_baseline_mib_per_rank": [
                            (p - b) / MIB for p, b in zip(out.peak_memory_bytes, baseline, strict=True)
                        ],
                        "memory_kind": out.memory_kind,
                    }
                )
                print(
                    f"  world {world} {name:14s} {tokens(shape):5d} tokens: {rows[-1]['s_per_step']:.3f} s/step",
                    flush=True,
                )
    return rows


def throughput_rows(
    group: WorkerGroup, model: Path, shape: tuple[int, int, int], steps: int, requests: int
) -> list[dict]:
    world = group.world_size
    height, width, frames = shape
    params = SamplingParams(seed=0, num_inference_steps=steps, height=height, width=width, num_frames=frames)
    prompts = [f"request {i}" for i in range(requests)]
    rows = []
    for name, request_parallel in [("same-request HSDP", False), ("request-parallel HSDP", True)]:
        config = ParallelConfig(use_hsdp=True, hsdp_shard_size=world, request_parallel=request_parallel)
        with Engine(model, config, workers=group) as engine:
            engine.generate(prompts[:world], params)  # warm-up
            elapsed = float("inf")
            for _ in range(2):  # the faster of two batches: the less disturbed by other work on the host
                started = time.perf_counter()
                outputs = engine.generate(prompts, params)
                elapsed = min(elapsed, time.perf_counter() - started)
        rows.append(
            {
                "world": world,
                "mode": name,
                "requests": len(outputs),
                "seconds": elapsed,
                "requests_per_minute": 60 * len(outputs) / elapsed,
                "s_per_step": statistics.median(s for o in outputs for s in o.timings.step_s),
                "decode_s": statistics.median(o.timings.decode_s for o in outputs),
                "peak_mib_per_rank": [b / MIB for b in outputs[0].peak_memory_bytes],
            }
        )
        print(f"  {name}: {rows[-1]['requests_per_minute']:.1f} requests/min", flush=True)
    return rows


def table(step: list[dict], throughput: list[dict]) -> str:
    """Markdown tables; memory columns show rank 0 (which also decodes the video) / the last rank."""
    base = {(r["world"], r["tokens"]): r["s_per_step"] for r in step if r["variant"] == "replicated"}
    fsdp = {(r["world"], r["tokens"]): r["s_per_step"] for r in step if r["variant"] == "fsdp2-default"}
    lines = [
        "| world | tokens | variant | s/step | vs replicated | vs fsdp2-default | weights held MiB/rank | "
        "peak above baseline MiB (rank 0 / last) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in step:
        key = (r["world"], r["tokens"])
        above = r["peak_above_baseline_mib_per_rank"]
        lines.append(
            f"| {r['world']} | {r['tokens']} | {r['variant']} | {r['s_per_step']:.3f} | "
            f"{r['s_per_step'] / base[key]:.2f}x | {r['s_per_step'] / fsdp[key]:.2f}x | "
            f"{max(r['param_mib_per_rank_between_steps']):.0f} | {above[0]:.0f} / {above[-1]:.0f} |"
        )
    lines += [
        "",
        "| world | mode | requests | seconds | requests/min | s/step (median) | VAE decode s | peak MiB (rank 0 / last) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in throughput:
        peak = r["peak_mib_per_rank"]
        lines.append(
            f"| {r['world']} | {r['mode']} | {r['requests']} | {r['seconds']:.1f} | {r['requests_per_minute']:.1f} | "
            f"{r['s_per_step']:.3f} | {r['decode_s']:.3f} | {peak[0]:.0f} / {peak[-1]:.0f} |"
        )
    return "\n".join(lines)


def parse_shape(text: str) -> tuple[int, int, int]:
    height, width, frames = (int(v) for v in text.split("x"))
    return height, width, frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--shapes", type=parse_shape, nargs="+", default=[(64, 64, 13), (128, 128, 13)], help="HxWxF"
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=768, help="transformer width (64 per head)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/inference.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "wide-wan", args.width, args.layers)
        step, throughput = [], []
        for world in args.worlds:  # one set of processes per world size, every variant loaded into it in turn
            with WorkerGroup(world) as group:
                # A throwaway load first, so lazy imports do not count against the first variant's memory.
                Engine(model, variants(world)["replicated"][0], workers=group).close()
                step += step_rows(group, model, args.shapes, args.steps)
                if world == 2:
                    throughput = throughput_rows(
                        group, model, args.shapes[-1], max(2, args.steps - 1), args.requests
                    )
    report = {
        "command": "python benchmarks/inference.py " + " ".join(f"{k}={v}" for k, v in vars(args).items()),
        "model": {"width": args.width, "layers": args.layers},
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "seconds": time.perf_counter() - started,
        "step": step,
        "throughput": throughput,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(table(step, throughput))
    print(f"wrote {args.json} ({report['seconds']:.0f}s)")


if __name__ == "__main__":
    main()
