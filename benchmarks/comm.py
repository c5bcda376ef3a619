"""Communication per step: measured bytes against the minimum, and against the planner's prediction.

Each row shards a model on real ranks, runs one warm step under :class:`hsdp.measure.comm.CommCounter` (a dispatch
mode counting collectives and the bytes each moves) and divides the bytes by :func:`hsdp.measure.comm.minimum_bytes`:
every gathered unit moving ``(N - 1) / N`` of its unpadded weights once per all-gather it needs, every gradient reduce-scattered
once. Target 1.00 to 1.05; what is above 1.00 is FSDP2's dim-0 padding. ``planned`` is
:func:`hsdp.planning.estimate`'s all-gather + reduce-scatter + all-reduce bytes for the same layout.

    .venv/bin/python benchmarks/comm.py      # about a minute; writes bench_results/comm.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# name, world, config kwargs, training, resident blocks
ROWS = [
    ("infer Wan 1x2", 2, dict(hsdp_shard_size=2), False, 0),
    ("infer Wan 1x2 resident 3/6", 2, dict(hsdp_shard_size=2), False, 3),
    ("train Llama 1x2 FULL_SHARD", 2, dict(hsdp_shard_size=2), True, 0),
    ("train Llama 1x2 bf16 / fp32 reduce", 2, dict(hsdp_shard_size=2, param_dtype="bf16"), True, 0),
    ("infer Wan 1x4", 4, dict(hsdp_shard_size=4), False, 0),
    ("infer Wan 2x2", 4, dict(hsdp_shard_size=2, hsdp_replicate_size=2), False, 0),
    ("train Llama 2x2 HYBRID_SHARD", 4, dict(hsdp_shard_size=2, hsdp_replicate_size=2), True, 0),
    ("train Llama 1x4 SHARD_GRAD_OP", 4, dict(hsdp_shard_size=4, sharding_strategy="SHARD_GRAD_OP"), True, 0),
]
WAN = dict(num_attention_heads=6, attention_head_dim=64, in_channels=16, out_channels=16, text_dim=96,
           freq_dim=64, ffn_dim=1000, num_layers=6, rope_max_seq_len=256)  # fmt: skip
LLAMA = dict(
    hidden_size=384, intermediate_size=1000, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=4
)


def _build(training: bool):
    from hsdp.models.tiny import build_tiny_llama, build_tiny_wan_transformer

    return build_tiny_llama(**LLAMA).train() if training else build_tiny_wan_transformer(**WAN)


def measure(kwargs: dict, training: bool, resident: int) -> dict:
    from hsdp.config import ParallelConfig
    from hsdp.measure.comm import measure_comm
    from hsdp.sharding import apply_hsdp_to_model

    model = _build(training)
    names = tuple(f"blocks.{i}" for i in range(resident))
    apply_hsdp_to_model(
        model, ParallelConfig(use_hsdp=True, **kwargs), training=training, resident_modules=names
    )
    g = torch.Generator().manual_seed(0)
    if training:
        ids = torch.randint(0, 384, (2, 64), generator=g)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    else:
        inputs = (
            torch.randn(1, 16, 1, 16, 16, generator=g),
            torch.tensor([500]),
            torch.randn(1, 8, 96, generator=g),
        )

        def step():
            with torch.no_grad():
                model(*inputs)

    step()  # warm: resident blocks gathered, optimizer state created
    _, report = measure_comm(model, step, training=training)
    return report.to_dict()


def planned_bytes(kwargs: dict, training: bool, resident: int) -> int:
    from hsdp.config import ParallelConfig
    from hsdp.planning import Hardware, Layout, Workload, estimate, profile_module

    layout = Layout(ParallelConfig(use_hsdp=True, **kwargs).resolved(), 0, resident)
    est = estimate([profile_module(_build(training))], layout, Workload(training=training), Hardware(2**40))
    return est.allgather_bytes + est.reduce_scatter_bytes + est.allreduce_bytes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench_results/comm.json")
    return parser


def main() -> None:
    from hsdp.launch import WorkerGroup

    args = build_parser().parse_args()
    rows = []
    for world in (2, 4):
        with WorkerGroup(world) as group:
            for name, w, kwargs, training, resident in ROWS:
                if w == world:
                    report = group.run(measure, kwargs, training, resident, timeout_s=300)[0]
                    rows.append(
                        dict(
                            name=name,
                            world=world,
                            **report,
                            planned=planned_bytes(kwargs, training, resident),
                        )
                    )
    print(
        f"{'step':36} {'world':>5} {'collectives':>48} {'KiB/rank':>9} {'minimum':>9} {'x min':>6} {'planned':>9}"
    )
    for r in rows:
        calls = ", ".join(f"{n} {k.replace('_', '-')}" for k, n in sorted(r["calls"].items()))
        print(f"{r['name']:36} {r['world']:>5} {calls:>48} {r['total'] / 1024:>9.1f} "
              f"{sum(r['minimum'].values()) / 1024:>9.1f} {r['ratio']:>6.3f} {r['planned'] / 1024:>9.1f}")  # fmt: skip
    worst = max(r["ratio"] for r in rows)
    print(f"worst measured / minimum: {worst:.3f} (target 1.00 to 1.05)")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(dict(rows=rows, worst_ratio=worst), indent=2) + "\n")


if __name__ == "__main__":
    main()
