"""Training throughput and per-rank peak memory: hsdp's strategies and LoRA vs DeepSpeed ZeRO and Lightning Fabric.

Every run trains the same ~30M-parameter Llama (fp32 weights, AdamW lr 1e-4, no weight decay, no clipping, no mixed
precision) on the same rows of the same text file (each rank takes the same rows at every step in every framework:
``TokenDataset.batch``, the trainer's own batches), on fresh processes over CPU + gloo. Reported: tokens/s from the
median step after warm-up; tokens per CPU-second (the ranks' summed process CPU time of the median step), which a
shared, busy machine disturbs far less than wall time but which leaves out time spent waiting on communication; per
rank the peak resident set size (``hsdp.measure.peak_memory``) with its growth over the post-import baseline
(what model, gradients, optimizer state and activations added); and the loss (mean over ranks) at the first and
the last step, so the reader sees that every framework trained the same thing.

LoRA rows train peft adapters of rank 16, alpha 32, dropout 0 on every linear layer but the output head (peft's
``all-linear``, hsdp's default targets), fp32, on a frozen base: ``hsdp LoRA r16 FULL_SHARD`` (adapters injected
before FSDP2 shards the base), ``DeepSpeed ZeRO-3 + peft LoRA r16`` (``get_peft_model`` then a ZeRO-3 engine) and
``Lightning Fabric FSDP2 + peft LoRA r16`` (``get_peft_model`` then Fabric's ``ModelParallelStrategy``, which
applies FSDP2 ``fully_shard`` per decoder layer). The competitors' adapters start from the values hsdp draws
(``lora_A`` Kaiming-uniform from one generator seeded 0 in parameter order, ``lora_B`` zero), so losses compare.

DeepSpeed and Lightning are optional (``pip install -e .[bench] torch==<installed version>``); a framework that is
not installed, or a run that fails, is still a row of the table, with the reason. DeepSpeed runs with
``DS_ACCELERATOR=cpu`` on the process group the workers already hold (gloo), with ``gradient_clipping`` 0 (its
default clips to norm 1.0; no other row clips). Lightning Fabric runs its ``ModelParallelStrategy``, which shards
with FSDP2 ``fully_shard`` as hsdp does; its ``FSDPStrategy`` (the older FSDP1) has a row too, which says why it
does not run here (Fabric allows it on GPUs only). Accelerate is left out on purpose: on CPU its FSDP plugin
silently trains with plain DDP, so its figures would not be FSDP's.

    .venv/bin/python benchmarks/train.py                 # every row at world 2; benchmarks/results/train.json
    .venv/bin/python benchmarks/train.py --world 4 --only "hsdp HYBRID_SHARD,hsdp FULL_SHARD,DeepSpeed ZeRO-3"
    .venv/bin/python benchmarks/train.py --only lora --repeat 3 --output benchmarks/results/train-lora.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _training import (  # noqa: E402  (the benchmarks' shared helpers, next to this file)
    MIB,
    baseline,
    deepspeed_engine,
    deepspeed_state_bytes,
    median_round,
    run_rounds,
    run_row,
    state_bytes,
    timed_steps,
)

LORA_R = 16
LORA_ALPHA = 2 * LORA_R
LR = 1e-4
SEED = 0
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

    model_dir = folder / "llama-30m"
    build_tiny_llama(seed=0, **MODEL).save_pretrained(model_dir)
    build_byte_tokenizer().save_pretrained(model_dir)
    vocabulary = "sharded data parallel training splits parameters gradients and optimizer state over ranks"
    words = vocabulary.split()
    picks = torch.randint(len(words), (60_000,), generator=torch.Generator().manual_seed(0)).tolist()
    data = folder / "data.txt"
    data.write_text(" ".join(words[i] for i in picks))
    return model_dir, data


def _batches(spec: dict) -> list[dict]:
    """This rank's model inputs of every step: the rows, labels and order hsdp's trainer uses (seed 0)."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from hsdp.train.data import TokenDataset

    data = TokenDataset.from_file(
        spec["data"], AutoTokenizer.from_pretrained(spec["model"]), spec["seq_len"], seed=SEED
    )
    world, rank = dist.get_world_size(), dist.get_rank()
    return [
        data.batch(
            step, 0, batch_size=spec["micro_batch"] * world, grad_accum=1, dp_rank=rank, dp_size=world
        ).model_inputs()
        for step in range(spec["warmup"] + spec["steps"])
    ]


def _timed_loop(spec: dict, step_fn) -> dict:
    """``times``: (wall seconds, CPU seconds of this process) of each step after warm-up; ``losses``: every step's
    loss averaged over the ranks (:func:`_training.timed_steps`); ``setup_peak``: peak RSS before the first step."""
    from hsdp.measure import peak_memory

    batches = _batches(spec)
    setup_peak = peak_memory(
        "cpu"
    ).bytes  # after loading and sharding: is the peak set by setup or by the steps?
    times, losses = timed_steps(batches, step_fn)
    return {"times": times[spec["warmup"] :], "losses": losses, "setup_peak": setup_peak}


def _baseline() -> int:
    return baseline(("peft", "transformers", "hsdp.train"))


def _report(baseline: int, loop: dict, trained: int) -> dict:
    from hsdp.measure import peak_memory

    peak = peak_memory("cpu").bytes
    return {
        "step_s": statistics.median(t[0] for t in loop["times"]),
        "cpu_s": statistics.median(t[1] for t in loop["times"]),
        "peak": peak,
        "growth": peak - baseline,
        "setup_peak": loop["setup_peak"],
        "losses": loop["losses"],
        "trained_state": trained,
    }


def _load_model(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).train()


def _peft_lora(model, lora_r: int):
    """peft LoRA on every linear layer but the head, started from the adapter values hsdp draws
    (``hsdp.lora.init_adapters``: one generator seeded 0, ``lora_A`` in parameter order, ``lora_B`` zero)."""
    import math

    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora_r, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A.default." in name:
                torch.nn.init.kaiming_uniform_(param, a=math.sqrt(5), generator=generator)
            elif ".lora_B.default." in name:
                param.zero_()
    return model


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
        batch_size=spec["micro_batch"] * world, seq_len=spec["seq_len"], lr=LR, seed=SEED, progress=False,
        log_every=10**6, lora_r=lora_r, lora_alpha=float(LORA_ALPHA),
    )  # fmt: skip
    trainer = Trainer(cfg)  # it draws the same rows as _batches(spec), by step
    loop = _timed_loop(spec, lambda batch: trainer.train_step().loss)
    return _report(baseline, loop, state_bytes(trainer.params, trainer.optimizer))


def rank_deepspeed(spec: dict, stage: int, lora_r: int = 0) -> dict:
    import torch

    baseline = _baseline()
    torch.manual_seed(SEED)
    model = _load_model(spec)
    if lora_r:
        model = _peft_lora(model, lora_r)
    engine = deepspeed_engine(model, stage=stage, micro_batch=spec["micro_batch"], lr=LR)

    def step(batch):
        loss = engine(**batch, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    loop = _timed_loop(spec, step)
    return _report(
        baseline, loop, deepspeed_state_bytes(engine, [p for p in model.parameters() if p.requires_grad])
    )


def rank_lightning(spec: dict, lora_r: int = 0, fsdp1: bool = False) -> dict:
    """Fabric's ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` per decoder layer); ``fsdp1``: its
    ``FSDPStrategy`` (FSDP1 wrapping each decoder layer), which Fabric refuses on the CPU."""
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    def parallelize(model, device_mesh):
        mesh = device_mesh["data_parallel"]
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        for layer in base.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    baseline = _baseline()
    if fsdp1:
        strategy = FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, use_orig_params=True)
    else:
        strategy = ModelParallelStrategy(
            parallelize_fn=parallelize, data_parallel_size=spec["world"], tensor_parallel_size=1
        )
    fabric = Fabric(accelerator="cpu", devices=spec["world"], strategy=strategy)
    fabric.launch()  # the workers' process group and RANK / LOCAL_RANK env: Fabric starts no processes
    torch.manual_seed(SEED)
    model = _load_model(spec)
    if lora_r:
        model = _peft_lora(model, lora_r)
    model = fabric.setup_module(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(params, lr=LR, weight_decay=0.0))

    def step(batch):
        loss = model(**batch, use_cache=False).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    loop = _timed_loop(spec, step)
    return _report(baseline, loop, state_bytes(params, optimizer))


def runs_for(world: int) -> dict[str, tuple]:
    """name -> (rank function, extra args, required modules)."""
    lora = f"peft LoRA r{LORA_R}"
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"] + (["HYBRID_SHARD"] if world >= 4 else [])
    runs = {f"hsdp {s}": (rank_hsdp, (s,), ("hsdp",)) for s in strategies}
    runs[f"hsdp LoRA r{LORA_R} FULL_SHARD"] = (rank_hsdp, ("FULL_SHARD", LORA_R), ("peft",))
    runs |= {f"DeepSpeed ZeRO-{z}": (rank_deepspeed, (z,), ("deepspeed",)) for z in (1, 2, 3)}
    runs[f"DeepSpeed ZeRO-3 + {lora}"] = (rank_deepspeed, (3, LORA_R), ("deepspeed", "peft"))
    runs["Lightning Fabric FSDP2"] = (rank_lightning, (), ("lightning",))
    runs[f"Lightning Fabric FSDP2 + {lora}"] = (rank_lightning, (LORA_R,), ("lightning", "peft"))
    runs[f"Lightning Fabric FSDPStrategy + {lora}"] = (rank_lightning, (LORA_R, True), ("lightning", "peft"))
    return runs


LORA_SET = (
    "hsdp FULL_SHARD",
    f"hsdp LoRA r{LORA_R} FULL_SHARD",
    "DeepSpeed ZeRO-3",
    f"DeepSpeed ZeRO-3 + peft LoRA r{LORA_R}",
    "Lightning Fabric FSDP2",
    f"Lightning Fabric FSDP2 + peft LoRA r{LORA_R}",
    f"Lightning Fabric FSDPStrategy + peft LoRA r{LORA_R}",
)


def _select(runs: dict, only: str | None) -> dict:
    if not only:
        return runs
    names = list(LORA_SET) if only == "lora" else [n.strip() for n in only.split(",")]
    unknown = [n for n in names if n not in runs]
    if unknown:
        raise SystemExit(f"--only: unknown run(s) {unknown}; known: {', '.join(runs)}, or 'lora'")
    return {n: runs[n] for n in names}


def _loss_note(rows: list[dict]) -> list[str]:
    """How far each row's last-step loss is from hsdp's of the same kind (full or LoRA)."""
    ok = {r["name"]: r for r in rows if "ranks" in r}
    out = []
    for row in ok.values():
        kind = f"hsdp LoRA r{LORA_R} FULL_SHARD" if "LoRA" in row["name"] else "hsdp FULL_SHARD"
        if kind in ok and row["name"] != kind:
            ref, mine = ok[kind]["losses"], row["losses"]
            worst = max(abs(a - b) for a, b in zip(ref, mine, strict=True))
            out.append(f"{row['name']}: largest loss difference to {kind} over all steps {worst:.2e}")
    return out


def _run_row(name: str, run: tuple, spec: dict, world: int, tokens: int) -> dict:
    """One row in fresh processes (:func:`_training.run_row`) with its throughput."""
    row = run_row(name, run, spec, world)
    if "ranks" not in row:
        return row
    results = row["ranks"]
    step_s = max(r["step_s"] for r in results)
    cpu_s = sum(r["cpu_s"] for r in results)
    losses = results[0]["losses"]
    print(
        f"{name}: {tokens / step_s:.0f} tokens/s, {tokens / cpu_s:.0f} tokens per CPU-second, "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}",
        flush=True,
    )
    return {
        **row,
        "tokens_per_s": tokens / step_s,
        "tokens_per_cpu_s": tokens / cpu_s,
        "losses": losses,
    }


def _median_round(rounds: list[dict]) -> dict:
    """The round with the median tokens per CPU-second (:func:`_training.median_round`), with every round's
    tokens/s beside it."""
    row = median_round(rounds, "tokens_per_cpu_s")
    if "ranks" in row:
        row["rounds_tokens_per_s"] = [r["tokens_per_s"] for r in rounds]
    return row


def main() -> None:
    from hsdp.memory import count_parameters
    from hsdp.models.tiny import tiny_llama_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="measured steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--only", default=None, help="comma-separated run names, or 'lora' (full vs LoRA in each framework)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds over the rows (each in a rotated order); median round reported",
    )
    parser.add_argument("--output", default="benchmarks/results/train.json")
    args = parser.parse_args()

    runs = _select(runs_for(args.world), args.only)
    params = count_parameters(tiny_llama_config(**MODEL))
    tokens = args.micro_batch * args.world * args.seq_len
    names = list(runs)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = write_inputs(Path(tmp))
        spec = {
            "model": str(model_dir), "data": str(data), "world": args.world, "steps": args.steps,
            "warmup": args.warmup, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        }  # fmt: skip
        found = run_rounds(
            names, args.repeat, lambda name: _run_row(name, runs[name], spec, args.world, tokens)
        )
    rows = [_median_round(found[name]) for name in names]

    reference = next((r for r in rows if r["name"] == "hsdp FULL_SHARD" and "ranks" in r), None)
    total = args.warmup + args.steps
    print(
        f"\nLlama {params / 1e6:.1f}M params, fp32 AdamW, seq {args.seq_len}, micro-batch {args.micro_batch}/rank, "
        f"world {args.world} (CPU + gloo), median of {args.steps} steps after {args.warmup} warm-up"
        + (
            f"; each row's round with the median tokens per CPU-second of {args.repeat}"
            if args.repeat > 1
            else ""
        )
    )
    print(
        "| run | tokens/s | tokens per CPU-second | vs hsdp FULL_SHARD | peak RSS per rank (MiB) "
        f"| growth over imports (MiB) | trained params + grads + optimizer per rank (MiB) | loss step 1 -> {total} |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "ranks" not in row:
            print(f"| {row['name']} | not run: {row['error']} | | | | | | |")
            continue
        ratio = f"{row['tokens_per_cpu_s'] / reference['tokens_per_cpu_s']:.2f} x" if reference else "-"
        peaks = " / ".join(f"{r['peak'] / MIB:.0f}" for r in row["ranks"])
        growth = " / ".join(f"{r['growth'] / MIB:.0f}" for r in row["ranks"])
        trained = " / ".join(f"{r['trained_state'] / MIB:.1f}" for r in row["ranks"])
        print(
            f"| {row['name']} | {row['tokens_per_s']:.0f} | {row['tokens_per_cpu_s']:.0f} | {ratio} | {peaks} "
            f"| {growth} | {trained} | {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f} |"
        )
    if args.repeat > 1:
        for row in rows:
            if "rounds_tokens_per_cpu_s" in row:
                every = " / ".join(f"{x:.0f}" for x in row["rounds_tokens_per_cpu_s"])
                print(f"{row['name']}: tokens per CPU-second in each round {every}")
    for line in _loss_note(rows):
        print(line)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"params": params, "args": vars(args), "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
