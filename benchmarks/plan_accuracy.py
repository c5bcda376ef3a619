"""Planner accuracy: predicted vs measured per-rank peak memory for seven layouts (inference and training).

Each layout runs on real ranks (CPU + gloo here, the same code on CUDA + NCCL). The prediction is
:func:`hsdp.planning.estimate` on the unsharded model; the measurement is torch's ``MemTracker`` peak over one
steady step: every live tensor storage on the rank, by category (parameters, gradients, optimizer state,
activations, temporaries), which is what ``torch.cuda.max_memory_allocated`` counts on a GPU, without the
Python and allocator overheads that make CPU RSS useless for this. Target: within 10 %.

    .venv/bin/python benchmarks/plan_accuracy.py      # about 1-2 minutes; writes bench_results/plan_accuracy.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

MIB = 2**20

# name, world, config kwargs, training, resident blocks, prefetch
LAYOUTS = [
    ("infer 1x2 FSDP2 default", 2, dict(hsdp_shard_size=2), False, 0, 0),
    ("infer 1x2 resident 2 + prefetch", 2, dict(hsdp_shard_size=2), False, 2, 1),
    ("infer 1x4 prefetch 1", 4, dict(hsdp_shard_size=4), False, 0, 1),
    (
        "infer 2x2 HSDP, bf16 compute",
        4,
        dict(hsdp_shard_size=2, hsdp_replicate_size=2, param_dtype="bf16"),
        False,
        0,
        0,
    ),
    ("train 1x2 FULL_SHARD", 2, dict(hsdp_shard_size=2), True, 0, 0),
    ("train 2x2 HYBRID_SHARD", 4, dict(hsdp_shard_size=2, hsdp_replicate_size=2), True, 0, 0),
    ("train 1x4 SHARD_GRAD_OP", 4, dict(hsdp_shard_size=4, sharding_strategy="SHARD_GRAD_OP"), True, 0, 0),
]
WAN = dict(num_attention_heads=8, attention_head_dim=64, in_channels=16, out_channels=16, text_dim=256,
           freq_dim=64, ffn_dim=2048, num_layers=4, rope_max_seq_len=256)  # fmt: skip
LLAMA = dict(
    hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=4
)
FRAMES, SIDE, TEXT_TOKENS = 1, 32, 16  # 16 x 16 patches: 256 tokens
TRAIN_BATCH, TRAIN_SEQ = 2, 128


def _build(training: bool):
    from hsdp.models.tiny import build_tiny_llama, build_tiny_wan_transformer

    return build_tiny_llama(**LLAMA).train() if training else build_tiny_wan_transformer(**WAN)


def _step(model, training: bool, optimizer=None):
    if training:
        ids = torch.randint(0, 384, (TRAIN_BATCH, TRAIN_SEQ), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, WAN["in_channels"], FRAMES, SIDE, SIDE, generator=g)
    text = torch.randn(1, TEXT_TOKENS, WAN["text_dim"], generator=g)
    with torch.no_grad():
        model(x, torch.tensor([500]), text)


def measure(config_kwargs: dict, training: bool, resident: int, prefetch: int) -> int:
    """Per-rank MemTracker peak (bytes) of one steady step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from hsdp.config import ParallelConfig
    from hsdp.sharding import apply_hsdp_to_model

    model = _build(training)
    names = tuple(f"blocks.{i}" for i in range(resident))
    config = ParallelConfig(use_hsdp=True, **config_kwargs)
    apply_hsdp_to_model(model, config, training=training, resident_modules=names, forward_prefetch=prefetch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if training else None
    tracker = MemTracker()
    if training:  # the first step creates the optimizer state; measure the second
        _step(model, training, optimizer)
        tracker.track_external(model, optimizer)
    else:  # inference: the first call gathers the resident blocks and keeps them, so measure it
        tracker.track_external(model)
    with tracker:
        _step(model, training, optimizer)
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def predict(config_kwargs: dict, training: bool, resident: int, prefetch: int):
    from hsdp.config import ParallelConfig
    from hsdp.planning import Hardware, Layout, Workload, estimate, profile_module

    profile = profile_module(_build(training))
    if training:
        work = Workload(training=True, batch=TRAIN_BATCH, seq_len=TRAIN_SEQ)
    else:
        work = Workload(seq_len=FRAMES * (SIDE // 2) ** 2, guidance=False)
    layout = Layout(ParallelConfig(use_hsdp=True, **config_kwargs).resolved(), prefetch, resident)
    return estimate([profile], layout, work, Hardware(2**40))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench_results/plan_accuracy.json")
    return parser


def main() -> None:
    from hsdp.launch import WorkerGroup

    args = build_parser().parse_args()
    rows = []
    for world in (2, 4):
        with WorkerGroup(world) as group:
            for name, w, kwargs, training, resident, prefetch in LAYOUTS:
                if w != world:
                    continue
                peaks = group.run(measure, kwargs, training, resident, prefetch, timeout_s=300)
                est = predict(kwargs, training, resident, prefetch)
                measured = max(peaks)
                rows.append(
                    dict(
                        layout=name,
                        world=world,
                        predicted=est.total,
                        measured=measured,
                        error=est.total / measured - 1,
                        weights=est.weights,
                        gather=est.gather,
                        grads_optimizer=est.grads + est.optimizer,
                        activations=est.activations,
                        measured_per_rank=peaks,
                    )  # fmt: skip
                )
    print(f"{'layout':34} {'world':>5} {'predicted MiB':>14} {'measured MiB':>13} {'error':>7}")
    for r in rows:
        print(
            f"{r['layout']:34} {r['world']:>5} {r['predicted'] / MIB:>14.2f} {r['measured'] / MIB:>13.2f} {r['error']:>+7.1%}"
        )
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {worst:.1%} (target within 10%)")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(dict(rows=rows, worst_error=worst), indent=2) + "\n")


if __name__ == "__main__":
    main()
