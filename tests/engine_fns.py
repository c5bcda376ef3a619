"""Rank-side script for the torchrun test: every rank builds the Engine, which then runs on these ranks.

torchrun --standalone --nproc-per-node 2 -m tests.engine_fns MODEL_DIR OUT.npz
"""

from __future__ import annotations

import sys

import numpy as np

from hsdp import ParallelConfig, destroy_distributed
from hsdp.distributed import rank
from hsdp.engine import Engine, SamplingParams

PROMPTS = ["A cat playing piano", "A red fox in the snow"]
PARAMS = SamplingParams(seed=21, num_inference_steps=2)


def main(model: str, out: str) -> None:
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, request_parallel=True)
    with Engine(model, config) as engine:
        outputs = engine.generate(PROMPTS, PARAMS)
    if rank() == 0:
        frames = {f"frames_{i}": o.frames for i, o in enumerate(outputs)}
        np.savez(out, ranks=[o.rank for o in outputs], seeds=[o.seed for o in outputs], **frames)
    destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:3])
