"""Planner accuracy for diffusion training: ``hsdp plan --train`` on a pipeline vs the real trainer's per-rank peak.

Each row trains with :class:`hsdp.train.diffusion.DiffusionTrainer` at world 2 (HSDP 1x2, fp32, one sample per
rank) and measures the second step with torch's ``MemTracker`` (:func:`hsdp.planning.diffusion.trainer_step_peak`:
every live tensor storage, what ``max_memory_allocated`` counts on a GPU). The prediction is
:func:`hsdp.planning.diffusion.diffusion_training` + :func:`hsdp.planning.estimate` for the same item size.
Models: ``tiny-wan`` (width 32, 3 blocks), a wider Wan (width 128, FFN 512, 5 blocks) built into ``--work``,
``tiny-flux`` and ``tiny-sdxl``.
Target: within 10 %. ``--activation-checkpointing`` trains and plans every row with per-block recomputation.

    .venv/bin/python benchmarks/plan_diffusion_train.py    # about 4 minutes; bench_results/plan_diffusion_train.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

MIB = 2**20
WIDE = dict(num_attention_heads=4, attention_head_dim=32, ffn_dim=512, num_layers=5)
# model ("wide": the WIDE pipeline), side, frames
ROWS = [("tiny-wan", 64, 1), ("tiny-wan", 64, 9), ("wide", 96, 5), ("wide", 128, 9), ("tiny-flux", 64, 1), ("tiny-sdxl", 64, 1)]


def clips(folder: Path, frames: int, side: int) -> Path:
    """Two captioned clips (GIF; one frame: PNG) of one size."""
    import imageio.v3 as iio

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(2):
        pixels = rng.integers(0, 255, (frames, side, side, 3), dtype=np.uint8)
        iio.imwrite(folder / (f"v{i}.gif" if frames > 1 else f"v{i}.png"), pixels if frames > 1 else pixels[0])
        (folder / f"v{i}.txt").write_text(f"a clip {i}")
    return folder


def wide_pipeline(folder: Path) -> str:
    import hsdp.models.builtin  # noqa: F401  (registers the built-ins before tiny_wan is imported)
    from hsdp.models.tiny_wan import build_tiny_wan_pipeline

    if not (folder / "model_index.json").exists():
        build_tiny_wan_pipeline(**WIDE).save_pretrained(folder)
    return str(folder)


def measure(cfg) -> int:
    from hsdp.planning.diffusion import trainer_step_peak
    from hsdp.train.diffusion import DiffusionTrainer

    with DiffusionTrainer(cfg) as trainer:
        trainer.train_step()  # creates the AdamW state
        return trainer_step_peak(trainer)


def main() -> None:
    from hsdp.config import ParallelConfig
    from hsdp.launch import WorkerGroup
    from hsdp.planning import Hardware, Layout, estimate
    from hsdp.planning.diffusion import diffusion_training
    from hsdp.train import TrainConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="bench_results/plan_diffusion_train")
    parser.add_argument("--output", default="bench_results/plan_diffusion_train.json")
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    args = parser.parse_args()
    ac = args.activation_checkpointing
    work = Path(args.work)
    layout = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    rows = []
    with WorkerGroup(2) as group:
        for name, side, frames in ROWS:
            model = wide_pipeline(work / "wide") if name == "wide" else name
            data = clips(work / f"clips-{frames}x{side}", frames, side)
            for lora_r in (4, 0):
                cfg = TrainConfig(model=model, data=str(data), resolution=side, frames=frames, steps=2,
                                  batch_size=2, lora_r=lora_r, seed=0, progress=False, parallel=layout,
                                  activation_checkpointing=ac)  # fmt: skip
                measured = max(group.run(measure, cfg, timeout_s=1800))
                plan = diffusion_training(model, height=side, width=side, frames=frames, lora_r=lora_r,
                                          activation_checkpointing=ac)  # fmt: skip
                est = estimate([plan.profile], Layout(layout.resolved()), plan.work, Hardware(2**40))
                rows.append(dict(model=name, side=side, frames=frames, lora_r=lora_r, tokens=plan.work.seq_len,
                                 activation_checkpointing=ac,
                                 predicted=est.total, measured=measured, error=est.total / measured - 1,
                                 weights=est.weights, gather=est.gather, grads=est.grads, optimizer=est.optimizer,
                                 activations=est.activations))  # fmt: skip
    print(f"{'model':9} {'item':>10} {'training':>9} {'tokens':>6} {'predicted MiB':>14} {'measured MiB':>13} {'error':>7}")
    for r in rows:
        item = f"{r['side']}x{r['side']}x{r['frames']}"
        kind = f"LoRA r={r['lora_r']}" if r["lora_r"] else "full"
        print(f"{r['model']:9} {item:>10} {kind:>9} {r['tokens']:>6} {r['predicted'] / MIB:>14.2f} "
              f"{r['measured'] / MIB:>13.2f} {r['error']:>+7.1%}")  # fmt: skip
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {worst:.1%} (target within 10%)")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(dict(rows=rows, worst_error=worst), indent=2) + "\n")


if __name__ == "__main__":
    main()
