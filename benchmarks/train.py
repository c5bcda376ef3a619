"""Training throughput and per-rank peak memory: hsdp's strategies and LoRA vs DeepSpeed ZeRO-1/2/3 and Lightning FSDP2.

Every run trains the same ~29M-parameter Llama (fp32 weights, AdamW, no mixed precision) on the same packed
rows of the same text file (each rank takes the same rows in every framework), on fresh processes over CPU +
gloo. Reported: tokens/s from the median step after warm-up; tokens per CPU-second (the ranks' summed process
CPU time of the median step), which a shared, busy machine disturbs far less than wall time but which leaves
out time spent waiting on communication; and per rank the peak resident set size
(``hsdp.memory.peak_memory_bytes``) with its growth over the post-import baseline (what model, gradients,
optimizer state and activations added). LoRA runs (``hsdp LoRA r16 FULL_SHARD``: peft adapters of rank 16 on every
linear layer, fp32, the base frozen and sharded; ``DeepSpeed ZeRO-3 + peft LoRA r16``: the same peft adapters on a
ZeRO-3 engine) train the same rows. DeepSpeed and Lightning are optional (``pip install -e .[bench]``);
a framework that is not installed is skipped. Accelerate is left out on purpose: on CPU its FSDP plugin
silently trains with plain DDP, so its figures would not be FSDP's.

    .venv/bin/python benchmarks/train.py                 # world 2: ~4 min on an idle 2-core CPU; bench_results/train.json
    .venv/bin/python benchmarks/train.py --world 4 --only "hsdp HYBRID_SHARD,hsdp FULL_SHARD,DeepSpeed ZeRO-3"
    .venv/bin/python benchmarks/train.py --only "hsdp FULL_SHARD,hsdp LoRA r16 FULL_SHARD,DeepSpeed ZeRO-3 + peft LoRA r16"
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

MIB = 2**20
LORA_R = 16
MODEL = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=512,
)


def write_inputs(folder: Path) -> tuple[Path, Path]:
    """The benchmark model (random weights, fixed seed) with a byte tokenizer, and a text file."""
    import torch

    from hsdp.models.tiny import build_byte_tokenizer, build_tiny_llama

    model_dir = folder / "llama-29m"
    build_tiny_llama(seed=0, **MODEL).save_pretrained(model_dir)
    build_byte_tokenizer().save_pretrained(model_dir)
    vocabulary = "sharded data parallel training splits parameters gradients and optimizer state over ranks"
    words = vocabulary.split()
    picks = torch.randint(len(words), (60_000,), generator=torch.Generator().manual_seed(0)).tolist()
    data = folder / "data.txt"
    data.write_text(" ".join(words[i] for i in picks))
    return model_dir, data


def _rows(spec: dict):
    """This rank's micro-batches, identical for every framework."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from hsdp.train.data import PackedDataset

    data = PackedDataset.from_file(
        spec["data"], AutoTokenizer.from_pretrained(spec["model"]), spec["seq_len"]
    )
    world, rank = dist.get_world_size(), dist.get_rank()
    return [
        data.micro_batch(
            step, 0, batch_size=spec["micro_batch"] * world, grad_accum=1, dp_rank=rank, dp_size=world
        )
        for step in range(spec["warmup"] + spec["steps"])
    ]


def _timed_loop(spec: dict, step_fn) -> list[tuple[float, float]]:
    """(wall seconds, CPU seconds of this process) of each step after warm-up."""
    times = []
    for batch in _rows(spec):
        wall, cpu = time.perf_counter(), time.process_time()
        step_fn(batch)
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return times[spec["warmup"] :]


def _baseline() -> int:
    """Peak RSS once everything every framework needs is imported, so growth counts only the run itself."""
    import transformers  # noqa: F401

    import hsdp.train  # noqa: F401
    from hsdp.memory import peak_memory_bytes

    return peak_memory_bytes()


def _report(spec: dict, baseline: int, times: list[tuple[float, float]]) -> dict:
    from hsdp.memory import peak_memory_bytes

    peak = peak_memory_bytes()
    return {
        "step_s": statistics.median(t[0] for t in times),
        "cpu_s": statistics.median(t[1] for t in times),
        "peak": peak,
        "growth": peak - baseline,
    }


def _load_model(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).train()


def rank_hsdp(spec: dict, strategy: str, lora_r: int = 0) -> dict:
    from hsdp.config import ParallelConfig
    from hsdp.train import TrainConfig, Trainer

    world = spec["world"]
    shard, replicate = {"NO_SHARD": (1, world), "HYBRID_SHARD": (2, world // 2)}.get(strategy, (world, 1))
    baseline = _baseline()
    parallel = ParallelConfig(
        use_hsdp=True, hsdp_shard_size=shard, hsdp_replicate_size=replicate, sharding_strategy=strategy
    )
    cfg = TrainConfig(
        model=spec["model"], data=spec["data"], parallel=parallel, steps=spec["warmup"] + spec["steps"],
        batch_size=spec["micro_batch"] * world, seq_len=spec["seq_len"], lr=1e-4, progress=False,
        log_every=10**6, lora_r=lora_r, lora_alpha=2.0 * lora_r,
    )  # fmt: skip
    trainer = Trainer(cfg)  # it draws the same rows as _rows(spec), by step
    report = _report(spec, baseline, _timed_loop(spec, lambda batch: trainer.train_step()))
    return {**report, "trained_state": _trained_state_bytes(trainer)}


def _trained_state_bytes(trainer) -> int:
    """This rank's bytes of trainable parameter shards, their gradients' size and the optimizer state."""
    from torch.distributed.tensor import DTensor

    def local(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = sum(local(p) for p in trainer.params)
    state = sum(local(v) for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step")
    return 2 * params + state


def rank_deepspeed(spec: dict, stage: int, lora_r: int = 0) -> dict:
    import deepspeed
    import torch

    baseline = _baseline()
    model = _load_model(spec)
    if lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear")
        )
    config = {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(batch):
        loss = engine(input_ids=batch, labels=batch, use_cache=False).loss
        engine.backward(loss)
        engine.step()

    return _report(spec, baseline, _timed_loop(spec, step))


def rank_lightning(spec: dict) -> dict:
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    def parallelize(model, device_mesh):
        mesh = device_mesh["data_parallel"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    baseline = _baseline()
    strategy = ModelParallelStrategy(
        parallelize_fn=parallelize, data_parallel_size=spec["world"], tensor_parallel_size=1
    )
    fabric = Fabric(accelerator="cpu", devices=spec["world"], strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(_load_model(spec))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(batch):
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _report(spec, baseline, _timed_loop(spec, step))


def runs_for(world: int) -> dict[str, tuple]:
    """name -> (rank function, extra args, required module)."""
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"] + (["HYBRID_SHARD"] if world >= 4 else [])
    runs = {f"hsdp {s}": (rank_hsdp, (s,), "hsdp") for s in strategies}
    runs[f"hsdp LoRA r{LORA_R} FULL_SHARD"] = (rank_hsdp, ("FULL_SHARD", LORA_R), "peft")
    runs |= {f"DeepSpeed ZeRO-{z}": (rank_deepspeed, (z,), "deepspeed") for z in (1, 2, 3)}
    runs[f"DeepSpeed ZeRO-3 + peft LoRA r{LORA_R}"] = (rank_deepspeed, (3, LORA_R), "deepspeed")
    runs["Lightning Fabric FSDP2"] = (rank_lightning, (), "lightning")
    return runs


def main() -> None:
    from hsdp.launch import WorkerError, WorkerGroup
    from hsdp.memory import count_parameters
    from hsdp.models.tiny import tiny_llama_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="measured steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--only", default=None, help="comma-separated run names")
    parser.add_argument("--output", default="bench_results/train.json")
    args = parser.parse_args()

    runs = runs_for(args.world)
    if args.only:
        runs = {k: v for k, v in runs.items() if k in args.only.split(",")}
    params = count_parameters(tiny_llama_config(**MODEL))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = write_inputs(Path(tmp))
        spec = {
            "model": str(model_dir), "data": str(data), "world": args.world, "steps": args.steps,
            "warmup": args.warmup, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        }  # fmt: skip
        for name, (fn, extra, module) in runs.items():
            if importlib.util.find_spec(module) is None:
                print(f"skipping {name}: {module} is not installed (pip install -e .[bench])")
                continue
            try:
                with WorkerGroup(args.world, env={"DS_ACCELERATOR": "cpu"}) as group:
                    results = group.run(fn, spec, *extra, timeout_s=600)
            except WorkerError as exc:
                print(f"{name} failed: {str(exc).splitlines()[-1]}")
                rows.append({"name": name, "error": str(exc)[-2000:]})
                continue
            step_s = max(r["step_s"] for r in results)
            tokens = args.micro_batch * args.world * args.seq_len
            cpu_s = sum(r["cpu_s"] for r in results)
            rows.append(
                {
                    "name": name,
                    "tokens_per_s": tokens / step_s,
                    "tokens_per_cpu_s": tokens / cpu_s,
                    "ranks": results,
                }
            )
            print(f"{name}: {tokens / step_s:.0f} tokens/s", flush=True)

    ok = [r for r in rows if "error" not in r]
    reference = next((r for r in ok if r["name"] == "hsdp FULL_SHARD"), None)
    print(
        f"\nLlama {params / 1e6:.1f}M params, fp32 AdamW, seq {args.seq_len}, micro-batch {args.micro_batch}/rank, "
        f"world {args.world} (CPU + gloo), median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(
        "| run | tokens/s | vs hsdp FULL_SHARD | tokens per CPU-second | vs hsdp FULL_SHARD "
        "| peak RSS per rank (MiB) | growth over imports (MiB) | trained params + grads + optimizer per rank (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in ok:
        ratio = f"{row['tokens_per_s'] / reference['tokens_per_s']:.2f} x" if reference else "-"
        cpu_ratio = f"{row['tokens_per_cpu_s'] / reference['tokens_per_cpu_s']:.2f} x" if reference else "-"
        peaks = " / ".join(f"{r['peak'] / MIB:.0f}" for r in row["ranks"])
        growth = " / ".join(f"{r['growth'] / MIB:.0f}" for r in row["ranks"])
        trained = " / ".join(
            f"{r['trained_state'] / MIB:.1f}" if "trained_state" in r else "-" for r in row["ranks"]
        )
        print(
            f"| {row['name']} | {row['tokens_per_s']:.0f} | {ratio} | {row['tokens_per_cpu_s']:.0f} | {cpu_ratio} "
            f"| {peaks} | {growth} | {trained} |"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"params": params, "args": vars(args), "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
