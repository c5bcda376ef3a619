"""Planner accuracy: predicted vs measured per-rank peak memory (inference, budgeted inference, 8-bit weight
shards and training).

Each layout runs on real ranks (CPU + gloo here, the same code on CUDA + NCCL). The prediction is
:func:`hsdp.planning.estimate` on the unsharded model; the measurement is torch's ``MemTracker`` peak over one
step: every live tensor storage on the rank, by category (parameters, gradients, optimizer state,
activations, temporaries), which is what ``torch.cuda.max_memory_allocated`` counts on a GPU, without the
Python and allocator overheads that make CPU RSS useless for this. Inference measures the first forward (resident
blocks are gathered in it and kept), training the second step. Budget rows plan residency with
:func:`hsdp.planning.residency_for_budget` for a rank that may hold that fraction of the full weights between
steps (as ``benchmarks/inference.py``'s ``budget-*`` variants). Target: within 10 %.

``--wide`` runs the budgeted and 8-bit rows on ``benchmarks/inference.py``'s model instead (Wan 2.1 1.3B's block:
width 1536, FFN 8960, 4 blocks, bf16 with diffusers' fp32 modules, 64 text tokens) at ``--tokens``.

    .venv/bin/python benchmarks/plan_accuracy.py      # about 2-3 minutes; writes bench_results/plan_accuracy.json
    .venv/bin/python benchmarks/plan_accuracy.py --wide --tokens 256 1024 --output bench_results/plan_accuracy_wide.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

MIB = 2**20

# name, world, config kwargs, training, resident blocks (or a budget: a fraction of the full weights), prefetch,
# weight dtype
LAYOUTS = [
    ("infer 1x2 FSDP2 default", 2, dict(hsdp_shard_size=2), False, 0, 0),
    ("infer 1x2 resident 2 + prefetch", 2, dict(hsdp_shard_size=2), False, 2, 1),
    ("infer 1x2 all 4 resident", 2, dict(hsdp_shard_size=2), False, 4, 0),
    ("infer 1x2 budget 0.75x", 2, dict(hsdp_shard_size=2), False, 0.75, None),
    ("infer 1x2 int8 prefetch 1", 2, dict(hsdp_shard_size=2), False, 0, 1, "int8"),
    ("infer 1x2 int8 all 4 resident", 2, dict(hsdp_shard_size=2), False, 4, 0, "int8"),
    ("infer 1x2 int8 budget 0.5x", 2, dict(hsdp_shard_size=2), False, 0.5, None, "int8"),
    ("infer 1x4 prefetch 1", 4, dict(hsdp_shard_size=4), False, 0, 1),
    ("infer 1x4 budget 0.5x", 4, dict(hsdp_shard_size=4), False, 0.5, None),
    ("infer 1x4 budget 0.75x", 4, dict(hsdp_shard_size=4), False, 0.75, None),
    ("infer 1x4 int8 prefetch 1", 4, dict(hsdp_shard_size=4), False, 0, 1, "int8"),
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
# The --wide rows: benchmarks/inference.py's budgeted and 8-bit variants.
WIDE_LAYOUTS = [
    ("infer 1x2 budget 0.75x", 2, dict(hsdp_shard_size=2), False, 0.75, None),
    ("infer 1x2 all 4 resident", 2, dict(hsdp_shard_size=2), False, 4, 0),
    ("infer 1x2 int8 prefetch 1", 2, dict(hsdp_shard_size=2), False, 0, 1, "int8"),
    ("infer 1x4 budget 0.5x", 4, dict(hsdp_shard_size=4), False, 0.5, None),
    ("infer 1x4 budget 0.75x", 4, dict(hsdp_shard_size=4), False, 0.75, None),
    ("infer 1x4 int8 prefetch 1", 4, dict(hsdp_shard_size=4), False, 0, 1, "int8"),
    ("infer 1x4 int8 budget 0.5x", 4, dict(hsdp_shard_size=4), False, 0.5, None, "int8"),
]
WIDE = dict(num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=256,
            freq_dim=256, ffn_dim=8960, num_layers=4, rope_max_seq_len=1024)  # fmt: skip
WAN = dict(num_attention_heads=8, attention_head_dim=64, in_channels=16, out_channels=16, text_dim=256,
           freq_dim=64, ffn_dim=2048, num_layers=4, rope_max_seq_len=256)  # fmt: skip
LLAMA = dict(
    hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=4
)
FRAMES, SIDE, TEXT_TOKENS = 1, 32, 16  # 16 x 16 patches: 256 tokens
TRAIN_BATCH, TRAIN_SEQ = 2, 128


def _build(training: bool, wide: bool = False):
    from hsdp.models.tiny import build_tiny_llama, build_tiny_wan_transformer

    if training:
        return build_tiny_llama(**LLAMA).train()
    if not wide:
        return build_tiny_wan_transformer(**WAN)
    model = build_tiny_wan_transformer(
        **WIDE
    )  # bf16, the fp32 modules kept (as load_pretrained(dtype="bf16"))
    keep = set(model._keep_in_fp32_modules or ())
    for name, param in model.named_parameters():
        if not keep.intersection(name.split(".")):
            param.data = param.data.bfloat16()
    return model


def _wide_step(model, tokens: int) -> None:
    side = 2 * int(tokens**0.5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, WIDE["in_channels"], 1, side, side, generator=g).bfloat16()
    text = torch.randn(1, 64, WIDE["text_dim"], generator=g).bfloat16()
    with torch.no_grad():
        model(x, torch.tensor([500]), text)


def _step(model, training: bool, optimizer=None, wide_tokens: int | None = None):
    if wide_tokens:
        return _wide_step(model, wide_tokens)
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


def measure(
    config_kwargs: dict,
    training: bool,
    resident: int,
    prefetch: int,
    weight_dtype: str | None,
    wide_tokens: int | None = None,
) -> int:
    """Per-rank MemTracker peak (bytes) of one step (``wide_tokens``: the --wide model at that length)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from hsdp.config import ParallelConfig
    from hsdp.sharding import apply_hsdp_to_model

    class InferenceMemTracker(MemTracker):
        """No gradient hooks in inference: an 8-bit weight is frozen and refuses them."""

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    torch.set_num_threads(1)
    model = _build(training, wide=bool(wide_tokens))
    names = tuple(f"blocks.{i}" for i in range(resident))
    config = ParallelConfig(use_hsdp=True, **config_kwargs)
    apply_hsdp_to_model(
        model,
        config,
        training=training,
        resident_modules=names,
        forward_prefetch=prefetch,
        weight_dtype=weight_dtype,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if training else None
    tracker = MemTracker() if training else InferenceMemTracker()
    if training:  # the first step creates the optimizer state; measure the second
        _step(model, training, optimizer)
        tracker.track_external(model, optimizer)
    else:  # inference: the first call gathers the resident blocks and keeps them, so measure it
        tracker.track_external(model)
    with tracker:
        _step(model, training, optimizer, wide_tokens)
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def _work(training: bool, wide_tokens: int | None = None):
    from hsdp.planning import Workload

    if training:
        return Workload(training=True, batch=TRAIN_BATCH, seq_len=TRAIN_SEQ)
    return Workload(seq_len=wide_tokens or FRAMES * (SIDE // 2) ** 2, guidance=False)


def plan_layout(
    config_kwargs: dict,
    training: bool,
    resident: float,
    prefetch: int | None,
    weight_dtype: str | None,
    wide_tokens: int | None = None,
):
    """The layout a row runs: as given, or (``resident`` a fraction) what the planner picks for a rank that may
    hold that fraction of the full weights between steps, plus what every sharded layout needs on top."""
    from hsdp.config import ParallelConfig
    from hsdp.planning import Hardware, Layout, estimate, profile_module, residency_for_budget

    config = ParallelConfig(use_hsdp=True, **config_kwargs).resolved()
    if prefetch is not None:
        return Layout(config, prefetch, int(resident), weight_dtype)
    profile, work = profile_module(_build(training, bool(wide_tokens))), _work(training, wide_tokens)
    sharded = estimate([profile], Layout(config, 1, 0, weight_dtype), work, Hardware(1))
    budget = int(resident * profile.param_bytes) + sharded.total - sharded.weights
    return residency_for_budget(profile, config, budget, work, weight_dtype=weight_dtype).estimate.layout


def predict(layout, training: bool, wide_tokens: int | None = None):
    from hsdp.planning import Hardware, estimate, profile_module

    profile = profile_module(_build(training, bool(wide_tokens)))
    return estimate([profile], layout, _work(training, wide_tokens), Hardware(2**40))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench_results/plan_accuracy.json")
    parser.add_argument(
        "--wide", action="store_true", help="benchmarks/inference.py's model, budgeted and int8"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024], help="--wide: square numbers")
    return parser


def main() -> None:
    from hsdp.launch import WorkerGroup

    args = build_parser().parse_args()
    rows = []
    runs = (
        [(row, t) for t in args.tokens for row in WIDE_LAYOUTS] if args.wide else [(r, None) for r in LAYOUTS]
    )
    for world in (2, 4):
        with WorkerGroup(world) as group:
            for (name, w, kwargs, training, resident, prefetch, *weight_dtype), tokens in runs:
                if w != world:
                    continue
                wd = weight_dtype[0] if weight_dtype else None
                layout = plan_layout(kwargs, training, resident, prefetch, wd, tokens)
                peaks = group.run(
                    measure, kwargs, training, layout.resident, layout.prefetch, wd, tokens, timeout_s=1800
                )
                est = predict(layout, training, tokens)
                measured = max(peaks)
                rows.append(
                    dict(
                        layout=name + (f" @{tokens}" if tokens else ""),
                        world=world,
                        resident=layout.resident,
                        prefetch=layout.prefetch,
                        weight_dtype=wd,
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
    print(
        f"{'layout':34} {'world':>5} {'resident/prefetch':>17} {'predicted MiB':>14} {'measured MiB':>13} {'error':>7}"
    )
    for r in rows:
        held = f"{r['resident']}/{r['prefetch']}"
        print(
            f"{r['layout']:34} {r['world']:>5} {held:>17} {r['predicted'] / MIB:>14.2f} {r['measured'] / MIB:>13.2f} {r['error']:>+7.1%}"
        )
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {worst:.1%} (target within 10%)")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(dict(rows=rows, worst_error=worst), indent=2) + "\n")


if __name__ == "__main__":
    main()
