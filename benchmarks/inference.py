"""Inference benchmark against the plain model: FSDP2 defaults, prefetch, budgeted residency and int8 shards.

A Wan-architecture ``diffusers`` transformer (Wan 2.1 1.3B's block: width 1536, 12 heads of 128, FFN 8960;
``--layers`` blocks, bf16 with diffusers' fp32 norms and time embedder) runs one denoising forward per step under
``torch.no_grad()`` on every rank, at 256, 1,024 and 2,304 tokens. Variants, side by side in one process per rank:

* ``plain``: the model with no FSDP wrapper at all, every rank holding all weights: what a user runs when it fits.
  The reference for time.
* ``fsdp2``: FSDP2's defaults as vLLM-Omni configures them (blocks + root, reshard after forward, no prefetch).
* ``prefetch``: the same with one block of explicit forward prefetch.
* ``budget-0.5x`` / ``budget-0.75x``: :func:`hsdp.planning.residency_for_budget` when the weights a rank may hold
  between steps (its shards plus the blocks it keeps gathered) are 0.5x / 0.75x of the full weights; the gather
  window and activations every sharded variant needs come on top (the planner's estimate of them).
* ``int8``: ``weight_dtype="int8"`` shards (:mod:`hsdp.quantize`) with one block of prefetch.

``--throughput`` adds requests per minute of same-request vs request-parallel HSDP through the engine
(docs/layouts/request-parallel.md).

Timing: each round times every variant once, round-robin (rotating the order), so background load on a shared
host hits them alike; a round's time is the slowest rank's. The table shows each variant's fastest round (the one
least disturbed by other work on the host) and its ratio to ``plain``'s fastest; the JSON also has every round
and the median of the per-round ratios. Memory per rank is torch's ``MemTracker`` peak over the first forward
(every live tensor storage: weights held, gathered weights, activations; resident blocks are gathered in that
call), which is what ``max_memory_allocated`` counts on a GPU (where one is present, the models and inputs are
on it: the device comes from :func:`hsdp.distributed.local_device`, as in the engine); beside it, the planner's prediction
(:func:`hsdp.planning.estimate` for the variant's layout at that length). Gathered bytes are counted by
:class:`hsdp.measure.comm.CommCounter` in the last timed round (steady state) against :func:`hsdp.measure.comm.minimum_bytes`,
the unpadded compute-dtype weights every resharded unit must gather.

    .venv/bin/python benchmarks/inference.py                   # world 2, 4 blocks: about 12 minutes on 2 cores
    .venv/bin/python benchmarks/inference.py --worlds 2 4 --layers 4 --output /tmp/inference.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

MIB = 2**20
VARIANTS = ("plain", "fsdp2", "prefetch", "budget-0.5x", "budget-0.75x", "int8")
BUDGETS = {"budget-0.5x": 0.5, "budget-0.75x": 0.75}
TEXT_TOKENS = 64


def wan_config(width: int, layers: int, ffn: int) -> dict:
    return dict(num_attention_heads=width // 128, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=256, freq_dim=256, ffn_dim=ffn, num_layers=layers, rope_max_seq_len=1024)  # fmt: skip


def build(width: int, layers: int, ffn: int) -> torch.nn.Module:
    """The transformer in bf16, diffusers' fp32 modules kept fp32 (as ``load_pretrained(dtype="bf16")``)."""
    from hsdp.models.tiny import build_tiny_wan_transformer

    model = build_tiny_wan_transformer(**wan_config(width, layers, ffn))
    keep = set(model._keep_in_fp32_modules or ())
    for name, param in model.named_parameters():
        if not keep.intersection(name.split(".")):
            param.data = param.data.bfloat16()
    return model


def inputs(tokens: int) -> tuple[torch.Tensor, ...]:
    """One frame of latents with ``tokens`` 2x2 patches."""
    side = 2 * math.isqrt(tokens)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 1, side, side, generator=g).bfloat16()
    return latents, torch.tensor([500]), torch.randn(1, TEXT_TOKENS, 256, generator=g).bfloat16()


def budget_policy(model: torch.nn.Module, world: int, tokens: int, fraction: float):
    """Residency for a rank that may hold ``fraction`` of the full weights between steps."""
    from hsdp.config import ParallelConfig
    from hsdp.planning import Hardware, Layout, Workload, estimate, profile_module, residency_for_budget

    profile, work = profile_module(model), Workload(seq_len=tokens, guidance=False)
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=world).resolved()
    sharded = estimate([profile], Layout(config, 1, 0), work, Hardware(1))
    # The root's gathered weights, the gather window and the activations of the fully sharded layout come on
    # top of what the rank holds between steps; the planner adds resident blocks while shards + resident fit.
    budget = int(fraction * profile.param_bytes) + sharded.total - sharded.weights
    return residency_for_budget(profile, config, budget, work), budget


def build_variant(variant: str, width: int, layers: int, ffn: int, tokens: int) -> tuple:
    import torch.distributed as dist

    from hsdp.config import ParallelConfig
    from hsdp.distributed import local_device
    from hsdp.sharding import apply_hsdp_to_model

    model = build(width, layers, ffn)
    info = dict(variant=variant, resident=0, prefetch=0, budget_bytes=None)
    if variant == "plain":
        return model.to(local_device()), info
    world = dist.get_world_size()
    resident: tuple[str, ...] = ()
    prefetch = 0 if variant == "fsdp2" else 1
    if variant in BUDGETS:
        from hsdp.planning import PlanError

        try:
            policy, budget = budget_policy(model, world, tokens, BUDGETS[variant])
        except PlanError as exc:  # e.g. 0.5x at world 2: the shards alone are half the weights
            return None, dict(info, refused=str(exc))
        resident, prefetch = policy.resident_modules, policy.prefetch
        info.update(budget_bytes=budget, planned_peak=policy.estimate.total)
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=world)
    apply_hsdp_to_model(
        model,
        config,
        resident_modules=resident,
        forward_prefetch=prefetch,
        weight_dtype="int8" if variant == "int8" else None,
    )
    return model, dict(info, resident=len(resident), prefetch=prefetch)


def predicted_peak(profile, world: int, tokens: int, info: dict) -> int | None:
    """The planner's per-rank peak for a sharded variant's layout (resident blocks, prefetch, 8-bit shards)."""
    from hsdp.config import ParallelConfig
    from hsdp.planning import Hardware, Layout, Workload, estimate

    if info["variant"] == "plain":
        return None
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=world).resolved()
    weight_dtype = "int8" if info["variant"] == "int8" else None
    layout = Layout(config, info["prefetch"], info["resident"], weight_dtype)
    return estimate([profile], layout, Workload(seq_len=tokens, guidance=False), Hardware(2**40)).total


def _timed(model: torch.nn.Module, x: tuple) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    model(*x)
    if x[0].device.type != "cpu":
        torch.accelerator.synchronize()  # the kernels, not just their launch
    dist.barrier()
    return time.perf_counter() - start


def _tracked_peak(model: torch.nn.Module, x: tuple) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    class InferenceMemTracker(MemTracker):
        """MemTracker hooks every parameter's gradient, which a frozen one (an 8-bit shard) refuses; inference
        makes no gradients, so no hooks are needed."""

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    tracker = InferenceMemTracker()
    tracker.track_external(model)
    with tracker:
        model(*x)
    return int(tracker.get_tracker_snapshot("peak")[x[0].device]["Total"])


def run_rank(width: int, layers: int, ffn: int, token_counts: list[int], repeats: int) -> list[dict]:
    """Every variant on this rank at every token count (see the module docstring for what is measured)."""
    import torch.distributed as dist

    from hsdp.distributed import local_device
    from hsdp.measure.comm import CommCounter, minimum_bytes
    from hsdp.planning import profile_module
    from hsdp.sharding import parameter_bytes

    torch.set_num_threads(1)  # one core per rank: ranks do not compete for each other's cores
    variants = [build_variant(v, width, layers, ffn, max(token_counts)) for v in VARIANTS]
    built = [(model, info) for model, info in variants if model is not None]
    profile = profile_module(variants[0][0])  # plain: the unsharded model
    rows = [dict(info, tokens=tokens) for _, info in variants if "refused" in info for tokens in token_counts]
    with torch.no_grad():
        for tokens in token_counts:
            x = tuple(t.to(local_device()) for t in inputs(tokens))
            peaks = {info["variant"]: _tracked_peak(model, x) for model, info in built}
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            comm: dict[str, int] = {}
            for r in range(repeats):
                for model, info in built[r % len(built) :] + built[: r % len(built)]:
                    # The last round counts bytes (steady state); the counter's cost is per op, not per byte.
                    counter = CommCounter() if r == repeats - 1 else contextlib.nullcontext()
                    with counter:
                        times[info["variant"]].append(_timed(model, x))
                    if isinstance(counter, CommCounter):
                        comm[info["variant"]] = counter.bytes.get("all_gather", 0)
            for model, info in built:
                rows.append(
                    dict(
                        info,
                        tokens=tokens,
                        times=times[info["variant"]],
                        peak_bytes=peaks[info["variant"]],
                        predicted_peak=predicted_peak(profile, dist.get_world_size(), tokens, info),
                        param_bytes=parameter_bytes(model)[0],
                        all_gather_bytes=comm[info["variant"]],
                        minimum_all_gather_bytes=minimum_bytes(model).get("all_gather", 0),
                    )
                )
    return rows


def summarize(per_rank: list[list[dict]], world: int, layers: int) -> list[dict]:
    rows = []
    by_tokens: dict[int, dict[str, list[list[dict]]]] = {}
    for rank_rows in per_rank:
        for row in rank_rows:
            by_tokens.setdefault(row["tokens"], {}).setdefault(row["variant"], []).append(row)
    for tokens, variants in by_tokens.items():
        slowest = {
            v: [max(t) for t in zip(*(r["times"] for r in rs), strict=True)]
            for v, rs in variants.items()
            if "refused" not in rs[0]
        }
        for variant, rs in variants.items():
            first = rs[0]
            if "refused" in first:
                rows.append(
                    dict(world=world, layers=layers, tokens=tokens, variant=variant, refused=first["refused"])
                )
                continue
            per_round = [t / b for t, b in zip(slowest[variant], slowest["plain"], strict=True)]
            minimum = first["minimum_all_gather_bytes"]
            rows.append(
                dict(
                    world=world,
                    layers=layers,
                    tokens=tokens,
                    variant=variant,
                    resident_blocks=first["resident"],
                    prefetch=first["prefetch"],
                    budget_bytes=first["budget_bytes"],
                    planned_peak_bytes=first.get("planned_peak"),
                    predicted_peak_bytes=first["predicted_peak"],
                    s_per_step=min(slowest[variant]),
                    s_per_step_rounds=slowest[variant],
                    vs_plain=min(slowest[variant]) / min(slowest["plain"]),
                    vs_plain_median_of_rounds=statistics.median(per_round),
                    peak_bytes_per_rank=[r["peak_bytes"] for r in rs],
                    param_bytes_per_rank=[r["param_bytes"] for r in rs],
                    all_gather_bytes=first["all_gather_bytes"],
                    minimum_all_gather_bytes=minimum,
                    gathered_vs_minimum=first["all_gather_bytes"] / minimum if minimum else None,
                )
            )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| world | tokens | variant | resident / prefetch | s/step | vs plain | peak MiB/rank | predicted MiB/rank "
        "| weights held MiB/rank | gathered MiB/step | vs minimum |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['world']} | {r['tokens']} | {r['variant']} | does not fit: {r['refused']} |")
            continue
        vs_min = f"{r['gathered_vs_minimum']:.2f}x" if r["gathered_vs_minimum"] is not None else "-"
        held = "-" if r["variant"] == "plain" else f"{r['resident_blocks']}/{r['layers']}, {r['prefetch']}"
        peak = max(r["peak_bytes_per_rank"])
        predicted = r["predicted_peak_bytes"]
        planned = "-" if predicted is None else f"{predicted / MIB:.0f} ({predicted / peak - 1:+.1%})"
        lines.append(
            f"| {r['world']} | {r['tokens']} | {r['variant']} | {held} | {r['s_per_step']:.3f} | "
            f"{r['vs_plain']:.2f}x | {peak / MIB:.0f} | {planned} | "
            f"{max(r['param_bytes_per_rank']) / MIB:.0f} | {r['all_gather_bytes'] / MIB:.1f} | {vs_min} |"
        )
    return "\n".join(lines)


def throughput_rows(world: int, requests: int = 4, steps: int = 3) -> list[dict]:
    """Requests per minute, same-request vs request-parallel HSDP (docs/layouts/request-parallel.md): a Wan
    pipeline with a width-768, 4-block transformer, ``requests`` requests of 128 x 128 x 13 frames, no guidance;
    the faster of two batches after a warm-up."""
    import tempfile

    from hsdp import ParallelConfig
    from hsdp.engine import Engine, SamplingParams
    from hsdp.launch import WorkerGroup
    from hsdp.models.tiny_wan import build_tiny_wan_pipeline, write_generation_defaults

    params = SamplingParams(seed=0, num_inference_steps=steps, height=128, width=128, num_frames=13)
    prompts = [f"request {i}" for i in range(requests)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, WorkerGroup(world) as group:
        folder = Path(tmp) / "wan-768"
        build_tiny_wan_pipeline(
            num_attention_heads=12, attention_head_dim=64, ffn_dim=3072, num_layers=4
        ).save_pretrained(folder)
        write_generation_defaults(folder, {"guidance_scale": 1.0, "max_sequence_length": 32})
        for name, request_parallel in [("same-request HSDP", False), ("request-parallel HSDP", True)]:
            config = ParallelConfig(use_hsdp=True, hsdp_shard_size=world, request_parallel=request_parallel)
            with Engine(folder, config, workers=group) as engine:
                engine.generate(prompts[:world], params)  # warm-up
                elapsed = float("inf")
                for _ in range(2):
                    started = time.perf_counter()
                    outputs = engine.generate(prompts, params)
                    elapsed = min(elapsed, time.perf_counter() - started)
            rows.append(
                dict(
                    world=world,
                    mode=name,
                    requests=len(outputs),
                    seconds=elapsed,
                    requests_per_minute=60 * len(outputs) / elapsed,
                    s_per_step=statistics.median(s for o in outputs for s in o.timings.step_s),
                    peak_mib_per_rank=[b / MIB for b in outputs[0].peak_memory_bytes],
                )
            )
            print(f"  world {world} {name}: {rows[-1]['requests_per_minute']:.1f} requests/min", flush=True)
    return rows


def main() -> None:
    from hsdp.launch import WorkerGroup

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2304], help="square numbers")
    parser.add_argument("--width", type=int, default=1536, help="transformer width (128 per head)")
    parser.add_argument("--ffn", type=int, default=8960)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per token count")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/inference.json"))
    parser.add_argument(
        "--throughput",
        action="store_true",
        help="also requests per minute, same-request vs request-parallel HSDP, at world 2 (a Wan pipeline)",
    )
    args = parser.parse_args()
    if any(math.isqrt(t) ** 2 != t for t in args.tokens):
        parser.error(f"--tokens must be square numbers (a square latent of 2x2 patches), got {args.tokens}")
    started = time.perf_counter()
    rows = []
    for world in args.worlds:
        with WorkerGroup(world) as group:
            per_rank = group.run(
                run_rank, args.width, args.layers, args.ffn, args.tokens, args.repeats, timeout_s=3600
            )
        rows += summarize(per_rank, world, args.layers)
        print(table(rows), flush=True)
    report = {
        "command": "python benchmarks/inference.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "model": wan_config(args.width, args.layers, args.ffn),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "seconds": time.perf_counter() - started,
        "rows": rows,
        "throughput": throughput_rows(2) if args.throughput else [],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output} ({report['seconds']:.0f}s)")


if __name__ == "__main__":
    main()
