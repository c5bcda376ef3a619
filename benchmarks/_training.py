"""What the training benchmarks (``train.py`` for LMs, ``train_diffusion.py`` for diffusers denoisers) share: running
one row of the table in fresh worker processes, rounds in rotated order, the timed step loop, the per-rank trained
state, and DeepSpeed's engine on the CPU.

Not a benchmark itself; the scripts import it from their own folder (``sys.path``), and the worker processes find
it the same way (a spawned worker starts with its parent's ``sys.path``).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import time
from collections.abc import Callable, Iterable

MIB = 2**20


def first_line_of_exception(text: str) -> str:
    """``Type: message`` (its first line) of the last exception in a worker's traceback."""
    lines = text.splitlines()
    pattern = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Timeout)\b(: |$)")
    for index in range(len(lines) - 1, -1, -1):
        if pattern.match(lines[index]):
            return lines[index].strip()
    return next((line.strip() for line in reversed(lines) if line.strip()), text)


def run_row(name: str, run: tuple, spec: dict, world: int) -> dict:
    """One row in fresh processes: ``{"name", "ranks"}`` (each rank's return value of ``fn(spec, *extra)``), or
    ``{"name", "error"}`` saying why it did not run. ``run`` is (rank function, extra args, required modules)."""
    from hsdp.launch import WorkerError, WorkerGroup

    fn, extra, modules = run
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        reason = f"{', '.join(missing)} not installed (pip install -e .[bench])"
        print(f"{name}: not run: {reason}", flush=True)
        return {"name": name, "error": reason}
    from hsdp.distributed import device_type

    env = {"DS_ACCELERATOR": "cpu"} if device_type() == "cpu" else {}  # DeepSpeed finds an accelerator itself
    try:
        with WorkerGroup(world, env=env) as group:
            return {"name": name, "ranks": group.run(fn, spec, *extra, timeout_s=600)}
    except WorkerError as exc:
        reason = first_line_of_exception(str(exc))
        print(f"{name}: failed: {reason}", flush=True)
        return {"name": name, "error": reason, "traceback": str(exc)[-4000:]}


def run_rounds(names: list[str], repeat: int, run_one: Callable[[str], dict]) -> dict[str, list[dict]]:
    """Every row ``repeat`` times; each round starts one row later, so no row always runs first (while the machine
    is busiest). Returns each row's result in every round."""
    found: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(repeat):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            found[name].append(run_one(name))
    return found


def median_round(rounds: list[dict], key: str) -> dict:
    """The round with the median ``key`` (the lower middle of an even count), with every round's ``key`` beside
    it as ``rounds_<key>``; a row that failed in any round reports that failure."""
    failed = next((r for r in rounds if "ranks" not in r), None)
    if failed is not None:
        return failed
    ordered = sorted(rounds, key=lambda r: r[key])
    return {**ordered[(len(ordered) - 1) // 2], f"rounds_{key}": [r[key] for r in rounds]}


def timed_steps(batches: Iterable, step_fn: Callable) -> tuple[list[tuple[float, float]], list[float]]:
    """(wall seconds, CPU seconds of this process) of each step, and every step's loss averaged over the ranks
    (``step_fn(batch)`` returns this rank's loss; averaged after the loop, untimed)."""
    import torch
    import torch.distributed as dist

    times, losses = [], []
    for batch in batches:
        wall, cpu = time.perf_counter(), time.process_time()
        losses.append(float(step_fn(batch)))
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    from hsdp.distributed import local_device

    mean = torch.tensor(losses, dtype=torch.float64, device=local_device())  # NCCL reduces device tensors only
    dist.all_reduce(mean)
    return times, (mean / dist.get_world_size()).tolist()


def baseline(modules: Iterable[str]) -> int:
    """Peak memory of this rank's device (RSS on the CPU) once ``modules`` (everything every framework of the
    benchmark needs) are imported, so growth counts only the run itself."""
    from hsdp.measure import peak_memory

    for module in modules:
        importlib.import_module(module)
    return peak_memory().bytes


def state_bytes(params, optimizer) -> int:
    """This rank's bytes of trainable parameters (or their shards), their gradients' size and the optimizer state
    (DeepSpeed's partitioned flat fp32 groups count as what its optimizer holds)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    state = sum(
        local(v)
        for s in optimizer.state.values()
        for k, v in s.items()
        if k != "step" and isinstance(v, torch.Tensor)
    )
    return 2 * sum(local(p) for p in params) + state


def deepspeed_engine(model, *, stage: int, micro_batch: int, lr: float):
    """A DeepSpeed ZeRO-``stage`` engine over ``model``'s trainable parameters with torch's AdamW (no weight
    decay, no clipping, no mixed precision), on the process group the worker already holds."""
    import deepspeed
    import torch

    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # 0.19 clips to norm 1.0 by default; the other rows do not clip
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def deepspeed_state_bytes(engine, params) -> int:
    """:func:`state_bytes` of a ZeRO engine: ZeRO keeps fp32 flat partitions of the trainable parameters (their
    gradients alike) and the inner AdamW's state over them; stage 3 empties the inner optimizer's param groups
    between steps, so its partitions are read instead."""
    zero = engine.optimizer
    inner = getattr(zero, "optimizer", zero)
    flat = getattr(zero, "fp32_partitioned_groups_flat", None) or getattr(
        zero, "single_partition_of_fp32_groups", None
    )
    return state_bytes(flat or params, inner)
