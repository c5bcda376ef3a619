"""Rank-side script of the combination tier's torchrun layout, route ``generate``: every rank builds the Engine
(HSDP 2 over the torchrun job) and runs the cases of the spec; rank 0 writes each request's frames.

torchrun --nnodes 2 --nproc-per-node 1 ... -m tests.compose_torchrun SPEC.json OUT.npz
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from hsdp import ParallelConfig, destroy_distributed
from hsdp.distributed import rank
from hsdp.engine import Engine, SamplingParams


def run(spec: dict) -> dict[str, np.ndarray]:
    """``spec``: ``model``, ``root`` (adapters x, y, late) and ``engines``: compile flag -> cases, each with its
    ``key``, ``cache``, ``cache_config``, ``steps``, ``runtime`` (an adapter name to add from ``late``) and
    ``calls`` (prompts, seed, adapter, scale)."""
    root = Path(spec["root"])
    outputs = {}
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    for compiled, cases in spec["engines"].items():
        lora = {"x": root / "x", "y": root / "y"}
        with Engine(spec["model"], config, lora=lora, max_loras=2, compile=compiled == "on") as engine:
            for case in cases:
                if case["runtime"]:
                    engine.add_adapter(case["runtime"], root / "late")
                for i, call in enumerate(case["calls"]):
                    params = SamplingParams(
                        seed=call["seed"],
                        num_inference_steps=case["steps"],
                        height=32,
                        width=32,
                        num_frames=5,
                        cache=case["cache"],
                        cache_config=case["cache_config"],
                    )
                    results = engine.generate(
                        call["prompts"],
                        params,
                        batch_size=len(call["prompts"]),
                        adapter=call["adapter"],
                        adapter_scale=call["scale"],
                    )
                    for j, out in enumerate(results):
                        outputs[f"{case['key']}|{i}|{j}"] = out.frames
    return outputs


def main(spec_path: str, out: str) -> None:
    outputs = run(json.loads(Path(spec_path).read_text()))
    if rank() == 0:
        np.savez(out, **outputs)
    destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:3])
