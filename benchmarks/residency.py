"""Sharded vs replicated forward time: FSDP2 defaults against prefetch and budgeted residency.

A Wan-architecture ``diffusers`` transformer (width 512, 6 blocks) runs one denoising forward per step under
``torch.no_grad()`` on every rank, at world 2 and 4 and two sequence lengths. Per row, relative to the
replicated model (every rank holds all weights, no communication):

* ``fsdp2``: vLLM-Omni's configuration (blocks + root, reshard after forward, no prefetch);
* ``prefetch``: the same with one block of explicit forward prefetch;
* ``ours``: :func:`hsdp.planning.residency_for_budget` for a budget halfway between the fully sharded and the
  all-resident need: as many blocks as fit keep their gathered weights between steps, the rest are prefetched.

``overlap`` is the share of the all-gather time hidden behind compute: ``1 - (t_sharded - t_replicated) /
t_gather``, where ``t_gather`` is the time to unshard every unit with no compute. Each round times every
variant once, round-robin in one process per rank, so background load hits them alike; a round's time is the
slowest rank's, and ratios are medians of per-round ratios. Steady-state bytes per step come from
:class:`hsdp.measure.comm.CommCounter`.

    .venv/bin/python benchmarks/residency.py      # about 3 minutes on 2 cores; writes bench_results/residency.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

VARIANTS = ("replicated", "fsdp2", "prefetch", "ours")


def _config(width: int, layers: int) -> dict:
    return dict(num_attention_heads=width // 64, attention_head_dim=64, in_channels=16, out_channels=16,
                text_dim=256, freq_dim=64, ffn_dim=4 * width, num_layers=layers, rope_max_seq_len=1024)  # fmt: skip


def _inputs(side: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(1, 16, 1, side, side, generator=g),
        torch.tensor([500]),
        torch.randn(1, 16, 256, generator=g),
    )


def _policy(model, world: int, tokens: int):
    """Residency for a budget halfway between the fully sharded need and the all-resident need."""
    from hsdp.config import ParallelConfig
    from hsdp.planning import Hardware, Layout, Workload, estimate, profile_module, residency_for_budget

    profile, work = profile_module(model), Workload(seq_len=tokens, guidance=False)
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=world).resolved()
    low = estimate([profile], Layout(config, 1, 0), work, Hardware(1)).total
    high = estimate([profile], Layout(config, 0, len(profile.blocks)), work, Hardware(1)).total
    return residency_for_budget(profile, config, (low + high) // 2, work), len(profile.blocks)


def _build_variant(variant: str, width: int, layers: int, side: int):
    import torch.distributed as dist

    from hsdp.config import ParallelConfig
    from hsdp.models.tiny import build_tiny_wan_transformer
    from hsdp.sharding import apply_hsdp_to_model

    model = build_tiny_wan_transformer(**_config(width, layers))
    info = dict(variant=variant, resident=0, prefetch=0)
    if variant == "replicated":
        return model, info
    resident: tuple[str, ...] = ()
    prefetch = 1 if variant == "prefetch" else 0
    if variant == "ours":
        policy, _ = _policy(model, dist.get_world_size(), (side // 2) ** 2)
        resident, prefetch = policy.resident_modules, policy.prefetch
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=dist.get_world_size())
    apply_hsdp_to_model(model, config, resident_modules=resident, forward_prefetch=prefetch)
    return model, dict(info, resident=len(resident), prefetch=prefetch)


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def run_all(width: int, layers: int, side: int, repeats: int) -> list[dict]:
    """Every variant on this rank, timed round-robin so background load hits them alike."""
    from hsdp.measure.comm import measure_comm
    from hsdp.sharding import fsdp_units

    inputs = _inputs(side)
    built = [_build_variant(v, width, layers, side) for v in VARIANTS]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    gather: list[float] = []
    fsdp2 = built[VARIANTS.index("fsdp2")][0]
    units = [m for _, m in reversed(fsdp_units(fsdp2))]

    def gather_all() -> None:  # all-gather time with no compute to hide behind
        for unit in units:
            unit.unshard()
            unit.reshard()

    with torch.no_grad():
        for model, _ in built:  # warm up (and gather the resident blocks)
            model(*inputs)
        for r in range(repeats):
            for model, info in (
                built[r % len(built) :] + built[: r % len(built)]
            ):  # rotate the order each round
                times[info["variant"]].append(_timed(lambda m=model: m(*inputs)))
            gather.append(_timed(gather_all))
        rows = []
        for model, info in built:
            _, report = measure_comm(model, lambda m=model: m(*inputs))
            rows.append(dict(info, times=times[info["variant"]], gather=gather, comm_bytes=report.total,
                             comm_ratio=report.ratio))  # fmt: skip
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument(
        "--sides", type=int, nargs="+", default=[32, 64], help="latent side: tokens = (side/2)^2"
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default="bench_results/residency.json")
    return parser


def main() -> None:
    from hsdp.launch import WorkerGroup

    args = build_parser().parse_args()
    rows = []
    for world in args.worlds:
        with WorkerGroup(world) as group:
            for side in args.sides:
                per_rank = group.run(run_all, args.width, args.layers, side, args.repeats, timeout_s=900)
                # Per round: the slowest rank's time; ratios are taken within a round, then the median.
                slowest = {r["variant"]: [max(x) for x in zip(*(p[i]["times"] for p in per_rank), strict=True)]
                           for i, r in enumerate(per_rank[0])}  # fmt: skip
                gather = [max(x) for x in zip(*(p[0]["gather"] for p in per_rank), strict=True)]
                base = slowest["replicated"]
                for i, variant in enumerate(VARIANTS):
                    info = {k: v for k, v in per_rank[0][i].items() if k not in ("times", "gather")}
                    row = dict(info, world=world, tokens=(side // 2) ** 2, layers=args.layers)
                    row.update(step_s=statistics.median(slowest[variant]), gather_s=statistics.median(gather))
                    row["ratio"] = statistics.median(
                        t / b for t, b in zip(slowest[variant], base, strict=True)
                    )
                    if variant != "replicated":
                        hidden = [
                            1 - (t - b) / g for t, b, g in zip(slowest[variant], base, gather, strict=True)
                        ]
                        row["overlap"] = max(0.0, min(1.0, statistics.median(hidden)))
                    rows.append(row)
    print(f"{'world':>5} {'tokens':>6} {'variant':>10} {'resident':>8} {'prefetch':>8} {'step ms':>8} {'x repl':>7} "
          f"{'overlap':>7} {'MiB/step':>8} {'x min':>6}")  # fmt: skip
    for r in rows:
        overlap = f"{r['overlap']:.2f}" if "overlap" in r else "-"
        print(f"{r['world']:>5} {r['tokens']:>6} {r['variant']:>10} {r['resident']:>5}/{r['layers']:<2} "
              f"{r['prefetch']:>8} {r['step_s'] * 1e3:>8.1f} {r['ratio']:>7.2f} {overlap:>7} "
              f"{r['comm_bytes'] / 2**20:>8.2f} {r['comm_ratio']:>6.3f}")  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
