"""Rank-side script of the combination tier's torchrun layout, route ``generate``: every rank builds the Engine
(HSDP 2 over the torchrun job) and runs the cases of the spec; rank 0 writes each request's frames.

torchrun --nnodes 2 --nproc-per-node 1 ... -m tests.compose_torchrun SPEC.json OUT.npz
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from hsdp import destroy_distributed
from hsdp.distributed import rank
from hsdp.engine import Engine, SamplingParams
from tests.compose_hosts import host_options


def run(spec: dict) -> dict[str, np.ndarray]:
    """``spec``: ``engines``: a list of engines, each its ``model`` (folder), ``root`` (its adapters and LoRA files),
    ``lora`` (the adapters served from the start, under ``root``), ``values`` (the case's axes that set up the engine:
    compile, vae, offload, attention, weights) and ``cases``, each with its ``key``, ``cache``, ``cache_config``,
    ``steps``, ``size``, ``adapters`` (names to add at run time -> a file under ``root``) and ``calls`` (prompts,
    seed, adapter, scale)."""
    outputs = {}
    for engine_spec in spec["engines"]:
        root = Path(engine_spec["root"])
        values = {"layout": "torchrun-2-nodes", **engine_spec["values"]}
        options = host_options(values)
        config = options.pop("parallel_config")
        lora = {name: root / name for name in engine_spec["lora"]}
        adapters = {} if options["weight_dtype"] else {"lora": lora, "max_loras": 2}
        with Engine(engine_spec["model"], config, compile=values["compile"] == "on", **adapters, **options) as engine:
            for case in engine_spec["cases"]:
                for name, file in case["adapters"].items():
                    engine.add_adapter(name, root / file)
                for i, call in enumerate(case["calls"]):
                    params = SamplingParams(
                        seed=call["seed"],
                        num_inference_steps=case["steps"],
                        height=case["size"],
                        width=case["size"],
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
