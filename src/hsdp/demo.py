"""``hsdp demo``: shard a built-in model across local ranks and prove the output equals one process.

It loads the model sharded (each rank reads only its slices), runs one forward pass on a fixed input, and
prints per-rank parameter memory against the unsharded model and the largest difference from a one-process run.
"""

from __future__ import annotations

import argparse

import torch

from hsdp.cli import ALL_PARALLEL_GROUPS, add_parallel_arguments, parallel_config_from_args
from hsdp.config import ParallelConfig


def _inputs(model_dir: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer(
        ["A cat playing piano", "Sharded weights, same answer"], return_tensors="pt", padding=True
    )["input_ids"]


def _rank_forward(model_dir: str, config: ParallelConfig) -> dict:
    from hsdp.distributed import local_device
    from hsdp.loading import load_pretrained
    from hsdp.mesh import build_meshes

    model = load_pretrained(model_dir, config, meshes=build_meshes(config), dtype=torch.float32)
    with torch.no_grad():  # inputs on the rank's device; logits back on the CPU for the caller's comparison
        logits = model(_inputs(model_dir).to(local_device())).logits.cpu()
    report = model.hsdp_report
    return {"logits": logits, "local": report.local_param_bytes, "total": report.total_param_bytes}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="tiny-llama", help="built-in name or a Hugging Face causal-LM folder"
    )
    add_parallel_arguments(parser, groups=ALL_PARALLEL_GROUPS)
    parser.set_defaults(use_hsdp=True, hsdp_shard_size=2)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from hsdp.launch import WorkerGroup
    from hsdp.models.builtin import resolve_model

    config = parallel_config_from_args(args)
    model_dir = str(resolve_model(args.model))
    with WorkerGroup(config.world_size, packages=["transformers"]) as group:
        results = group.run(_rank_forward, model_dir, config)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(_inputs(model_dir)).logits
    print(f"\nlayout: {config.describe()}")
    print(
        f"{'rank':>4} | {'params held (KiB)':>17} | {'unsharded (KiB)':>15} | {'fraction':>8} | max |diff| vs 1 process"
    )
    worst = 0.0
    for rank, out in enumerate(results):
        diff = (out["logits"] - want).abs().max().item()
        worst = max(worst, diff)
        print(
            f"{rank:>4} | {out['local'] / 1024:>17.1f} | {out['total'] / 1024:>15.1f} | "
            f"{out['local'] / out['total']:>8.3f} | {diff:.3g}"
        )
    print(f"largest difference from the one-process output: {worst:.3g}")
    return 0 if worst == 0.0 else 1
