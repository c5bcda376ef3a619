"""``hsdp plan``: will the model fit, and how fast, answered from its config alone.

The model is built on the meta device (no weights are read) and split into the FSDP units the real sharding
code would make (:mod:`hsdp.model_profile`); every candidate layout is then estimated per rank
(:mod:`hsdp.plan_estimate`): weights, gradients, optimizer state and collective bytes exactly, including
FSDP2's padding of dim 0 to a multiple of the shard size, so :mod:`hsdp.simulate` can check them against what
``fully_shard`` allocates at 1,024 ranks; gather buffers, activations and step time as estimates. This module
enumerates the layouts, picks the fastest that fits, chooses budgeted residency for inference and is the
``hsdp plan`` command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hsdp.config import DTYPES, ConfigError, ParallelConfig, ShardingStrategy
from hsdp.model_profile import (
    ModelProfile,
    PlanError,
    format_size,
    main_component,
    parse_size,
    profile_model,
    profile_module,
)
from hsdp.plan_estimate import Estimate, Hardware, Layout, Workload, estimate

__all__ = [
    "PlanError",
    "parse_size",
    "format_size",
    "ModelProfile",
    "profile_module",
    "profile_model",
    "Workload",
    "Hardware",
    "Layout",
    "Estimate",
    "estimate",
    "candidate_layouts",
    "Plan",
    "plan",
    "ResidencyPolicy",
    "residency_for_budget",
    "add_arguments",
    "run",
    "command_line",
]


# -- candidates and the recommendation -----------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _valid(**kwargs) -> ParallelConfig | None:
    try:
        return ParallelConfig(**kwargs).resolved()
    except ConfigError:
        return None


def _base_configs(
    main: ModelProfile, devices: int, work: Workload, param_dtype: str | None
) -> list[ParallelConfig]:
    common = dict(param_dtype=param_dtype)
    out: list[ParallelConfig | None] = []
    for shard in _divisors(devices):
        rep = devices // shard
        out.append(
            _valid(
                use_hsdp=True,
                hsdp_shard_size=shard,
                hsdp_replicate_size=rep,
                request_parallel=not work.training and devices > 1,
                **common,
            )
        )
        if work.training and rep == 1 and shard > 1:
            out.append(
                _valid(use_hsdp=True, hsdp_shard_size=shard, sharding_strategy="SHARD_GRAD_OP", **common)
            )
    if main.kind == "diffusion" and not work.training and devices > 1:
        for cfg in (1, 2) if work.guidance else (1,):
            uly = devices // cfg
            if devices % cfg or (main.heads and main.heads % uly) or work.seq_len % uly:
                continue
            out.append(_valid(ulysses_degree=uly, cfg_parallel_size=cfg, **common))
            for rep in _divisors(devices)[:-1]:
                out.append(
                    _valid(
                        use_hsdp=True,
                        ulysses_degree=uly,
                        cfg_parallel_size=cfg,
                        hsdp_replicate_size=rep,
                        **common,
                    )
                )
    return [c for c in out if c is not None]


@dataclass(frozen=True)
class ResidencyPolicy:
    resident_modules: tuple[str, ...]
    """Qualified names of the blocks to keep gathered (``reshard_after_forward=False``)."""
    prefetch: int
    """Forward prefetch depth for the sharded blocks."""
    estimate: Estimate


def residency_for_budget(
    model: nn.Module | ModelProfile | Sequence[ModelProfile],
    config: ParallelConfig,
    budget: int,
    work: Workload | None = None,
    hw: Hardware | None = None,
) -> ResidencyPolicy:
    """Memory-budgeted inference: keep as many blocks gathered as ``budget`` bytes per device allow.

    A model that almost fits then pays almost no communication: resident blocks are gathered once and kept
    (``reshard_after_forward=False``), the rest are sharded and all-gathered each step with one block of forward
    prefetch. Pass the result to
    ``apply_hsdp_to_model(..., resident_modules=policy.resident_modules, forward_prefetch=policy.prefetch)``.
    Raises :class:`PlanError` when not even the fully sharded layout fits.
    """
    profiles = (
        [profile_module(model)]
        if isinstance(model, nn.Module)
        else list(model)
        if isinstance(model, Sequence)
        else [model]
    )
    work, hw = work or Workload(), dataclasses.replace(hw or Hardware(budget), device_memory=budget)
    config = config.resolved()
    main = main_component(profiles)
    # One block of prefetch costs little memory in FSDP2 (the previous all-gather buffer lives until the next
    # copy-out anyway; +6 % peak measured in benchmarks/plan_accuracy.py's model), so every layout with blocks
    # left to gather prefetches one, and the estimate counts its buffer.
    fitting = [
        k for k in range(len(main.blocks) + 1) if estimate(profiles, Layout(config, 1, k), work, hw).fits
    ]
    if not fitting:
        need = estimate(profiles, Layout(config), work, hw).total
        raise PlanError(
            f"{config.describe()} needs {format_size(need)} per device even fully sharded, over the budget of "
            f"{format_size(budget)}; shard over more ranks, use --param-dtype bf16 or --cpu-offload"
        )
    resident = max(fitting)
    best = Layout(config, 0 if resident == len(main.blocks) else 1, resident)
    return ResidencyPolicy(
        resident_modules=tuple(u.name for u in main.blocks[: best.resident]),
        prefetch=best.prefetch,
        estimate=estimate(profiles, best, work, hw),
    )


def candidate_layouts(
    profiles: Sequence[ModelProfile],
    devices: int,
    work: Workload,
    hw: Hardware,
    param_dtype: str | None = None,
) -> list[Layout]:
    """Every valid layout over ``devices`` ranks, each as FSDP2's defaults and, for inference, with the
    budgeted residency and prefetch; CPU-offload variants are added where the layout does not fit without."""
    main = main_component(profiles)
    layouts: list[Layout] = []
    for config in _base_configs(main, devices, work, param_dtype):
        layouts.append(Layout(config))
        sharded = config.use_hsdp and config.hsdp_shard_size > 1
        if not work.training and sharded:
            try:
                policy = residency_for_budget(profiles, config, hw.device_memory, work, hw)
                if (policy.estimate.layout.prefetch, policy.estimate.layout.resident) != (0, 0):
                    layouts.append(policy.estimate.layout)
            except PlanError:
                pass
        if config.use_hsdp and not estimate(profiles, layouts[-1], work, hw).fits:
            layouts.append(Layout(dataclasses.replace(config, cpu_offload=True, _resolved=False).resolved()))
    return layouts


@dataclass(frozen=True)
class Plan:
    profiles: tuple[ModelProfile, ...]
    devices: int
    workload: Workload
    hardware: Hardware
    estimates: tuple[Estimate, ...]
    recommended: Estimate | None
    reason: str

    def to_dict(self) -> dict:
        return dict(
            model=[
                dict(
                    name=p.name,
                    class_name=p.class_name,
                    params=p.num_params,
                    param_bytes=p.param_bytes,
                    fsdp_units=len(p.units),
                )
                for p in self.profiles
            ],
            devices=self.devices,
            workload=dataclasses.asdict(self.workload),
            hardware=dataclasses.asdict(self.hardware),
            layouts=[e.to_dict() for e in self.estimates],
            recommended=self.recommended.layout.label if self.recommended else None,
            reason=self.reason,
        )


def plan(
    profiles: Sequence[ModelProfile],
    devices: int,
    work: Workload,
    hw: Hardware,
    param_dtype: str | None = None,
) -> Plan:
    """Estimate every candidate layout and pick the fastest that fits (inference: lowest step time of one
    request, then throughput; training: highest throughput), fewer bytes per device breaking ties."""
    main = main_component(profiles)
    if not main.blocks:
        raise PlanError(
            f"the shard plan matches no module of {main.class_name} ({main.name}), so it cannot be sharded: give "
            "the model _no_split_modules naming its block class, or register a plan in hsdp.shard_rules"
        )
    estimates = [
        estimate(profiles, lay, work, hw)
        for lay in candidate_layouts(profiles, devices, work, hw, param_dtype)
    ]
    fitting = [e for e in estimates if e.fits]
    if work.training:
        key = lambda e: (-e.samples_per_s, e.total)  # noqa: E731
        goal = "highest estimated throughput"
    else:
        key = lambda e: (round(e.step_s, 9), -e.samples_per_s, e.total)  # noqa: E731
        goal = "lowest estimated step time for one request"
    if not fitting:
        smallest = min(estimates, key=lambda e: e.total)
        return Plan(
            tuple(profiles),
            devices,
            work,
            hw,
            tuple(estimates),
            None,
            f"nothing fits in {format_size(hw.device_memory)} per device; the smallest layout "
            f"({smallest.layout.label}) needs {format_size(smallest.total)} per device: use more devices, "
            "a larger device, or --param-dtype bf16",
        )
    best = min(fitting, key=key)
    reason = (
        f"{goal} among the {len(fitting)} of {len(estimates)} layouts that fit: "
        f"{_ms(best.step_s)} ms per step, {format_size(best.total)} of {format_size(hw.device_memory)} per device, "
        f"{format_size(best.allgather_bytes + best.reduce_scatter_bytes + best.allreduce_bytes)} of collectives per rank per step"
    )
    return Plan(tuple(profiles), devices, work, hw, tuple(estimates), best, reason)


# -- the command ---------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="model folder (HF or diffusers pipeline / component) or a built-in name"
    )
    parser.add_argument("--devices", type=int, required=True, help="number of devices (ranks) to plan for")
    parser.add_argument("--device-memory", required=True, help="memory per device, e.g. 24GiB, 80GB")
    parser.add_argument(
        "--reserve",
        default="10%",
        help="memory kept free for the runtime, communication buffers and fragmentation: a size or a percentage",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--infer", dest="training", action="store_false", help="plan inference (default)")
    mode.add_argument("--train", dest="training", action="store_true", help="plan training (AdamW)")
    parser.set_defaults(training=False)
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (default 1024)")
    parser.add_argument(
        "--batch", type=int, default=1, help="samples per request (inference) or per rank (training)"
    )
    parser.add_argument(
        "--no-guidance", dest="guidance", action="store_false", help="diffusion without CFG branches"
    )
    parser.add_argument("--dtype", default=None, help="stored weight dtype (default: the checkpoint's)")
    parser.add_argument(
        "--param-dtype", default=None, help="compute dtype of gathered weights (mixed precision)"
    )
    parser.add_argument("--device-tflops", type=float, default=300.0, help="sustained TFLOP/s per device")
    parser.add_argument("--link-gbps", type=float, default=100.0, help="collective bandwidth per rank, GB/s")
    parser.add_argument("--host-gbps", type=float, default=25.0, help="host-device copy bandwidth, GB/s")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _check_args(args: argparse.Namespace) -> None:
    problems = [
        f"{flag}={value} must be >= 1"
        for flag, value in (("--devices", args.devices), ("--seq-len", args.seq_len), ("--batch", args.batch))
        if value < 1
    ]
    problems += [
        f"{flag}={value} must be > 0"
        for flag, value in (
            ("--device-tflops", args.device_tflops),
            ("--link-gbps", args.link_gbps),
            ("--host-gbps", args.host_gbps),
        )
        if not value > 0
    ]
    problems += [
        f"{flag}={value!r} is not a dtype; use one of {', '.join(sorted(DTYPES))}"
        for flag, value in (("--dtype", args.dtype), ("--param-dtype", args.param_dtype))
        if value is not None and value not in DTYPES
    ]
    if problems:
        raise PlanError("; ".join(problems))


def _parse_reserve(text: str, memory: int) -> int:
    if str(text).strip().endswith("%"):
        try:
            percent = float(str(text).strip()[:-1])
        except ValueError:
            percent = -1.0
        if not 0 <= percent < 100:
            raise PlanError(f"--reserve={text!r}: a percentage must be in [0, 100), e.g. 10%")
        return int(memory * percent / 100)
    reserve = parse_size(text, "--reserve")
    if reserve >= memory:
        raise PlanError(f"--reserve={text} leaves nothing of --device-memory={format_size(memory)}")
    return reserve


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.2f}" if ms >= 0.01 else f"{ms:.1e}"


def _table(result: Plan) -> str:
    header = "layout weights gather grads+opt activations total fits host all-gather reduce step-ms samples/s"
    rows = [tuple(header.split())]
    for e in result.estimates:
        mark = ("yes *" if e is result.recommended else "yes") if e.fits else "no"
        sizes = (e.weights, e.gather, e.grads + e.optimizer, e.activations, e.total)
        comm = (e.host, e.allgather_bytes, e.reduce_scatter_bytes + e.allreduce_bytes)
        rows.append(
            (
                e.layout.label,
                *map(format_size, sizes),
                mark,
                *map(format_size, comm),
                _ms(e.step_s),
                f"{e.samples_per_s:.1f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def run(args: argparse.Namespace) -> int:
    try:
        _check_args(args)
        memory = parse_size(args.device_memory)
        reserve = _parse_reserve(args.reserve, memory)
        hw = Hardware(memory - reserve, args.device_tflops, args.link_gbps, args.host_gbps)
        work = Workload(
            training=args.training, batch=args.batch, seq_len=args.seq_len, guidance=args.guidance
        )
        profiles = profile_model(args.model, DTYPES[args.dtype] if args.dtype else None)
        result = plan(profiles, args.devices, work, hw, args.param_dtype)
    except PlanError as exc:
        print(f"hsdp plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        for p in result.profiles:
            print(
                f"{p.name}: {p.class_name}, {p.num_params:,} parameters, {format_size(p.param_bytes)}, {len(p.blocks)} blocks"
                + ("" if p.blocks else " (kept whole on every rank)")
            )
        mode = "training" if work.training else "inference"
        print(
            f"{mode} on {args.devices} devices of {format_size(memory)} ({format_size(hw.device_memory)} usable, "
            f"--reserve {args.reserve}), batch {work.batch} x {work.seq_len} tokens\n"
        )
        print(_table(result))
        print()
    if result.recommended is None:
        print(f"hsdp plan: {result.reason}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"recommended: {result.recommended.layout.label} ({result.reason})")
        print(f"run it: {command_line(args.model, result.recommended, work.training)}")
    return 0


def command_line(model: str, chosen: Estimate, training: bool) -> str:
    """The ``hsdp generate`` / ``hsdp train`` command that runs ``chosen``'s layout; the prompt and the data are
    placeholders. Budgeted residency is passed as ``--device-memory``, from which the engine plans the same."""
    c, layout = chosen.layout.config, chosen.layout
    parts = ["hsdp", "train" if training else "generate", "--model", model]
    if c.use_hsdp:
        parts += ["--use-hsdp", "--hsdp-shard-size", str(c.hsdp_shard_size)]
    for flag, value in (
        ("--hsdp-replicate-size", c.hsdp_replicate_size if c.use_hsdp else 1),
        ("--ulysses-degree", c.ulysses_degree),
        ("--ring-degree", c.ring_degree),
        ("--cfg-parallel-size", c.cfg_parallel_size),
        ("--tensor-parallel-size", c.tensor_parallel_size),
    ):
        if value > 1:
            parts += [flag, str(value)]
    if c.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP:
        parts += ["--strategy", c.sharding_strategy.value]
    if c.param_dtype:
        parts += ["--param-dtype", c.param_dtype]
    if c.cpu_offload:
        parts.append("--cpu-offload")
    if not training and (layout.resident or layout.prefetch):
        budget = chosen.device_memory
        parts += ["--device-memory", f"{budget // 2**20}MiB" if budget % 2**20 == 0 else str(budget)]
    parts += ["--data", "DATA"] if training else ["--prompt", "PROMPT"]
    return shlex.join(parts)
