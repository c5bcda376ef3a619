"""``hsdp plan``: will the model fit, and how fast, answered from its config alone.

The command over :mod:`hsdp.planning`: its arguments, the table of every candidate layout, and the
``hsdp generate`` / ``hsdp train`` command line that runs the recommendation.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence

from hsdp.cli import add_single_file_arguments, add_source_arguments, resolve_model_argument
from hsdp.config import DTYPES, ShardingStrategy
from hsdp.models.description import describe, is_pipeline
from hsdp.planning.estimate import Estimate, Hardware, Workload
from hsdp.planning.plot import check_plot_path, terminal_chart, write_plot
from hsdp.planning.profile import PlanError, format_ms, format_size, parse_size, profile_model
from hsdp.planning.search import Plan, plan
from hsdp.suggest import did_you_mean

__all__ = ["add_arguments", "run", "command_line", "throughput_command_line"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="model folder (HF or diffusers pipeline / component), a built-in name, or a Hugging Face Hub name "
        "(org/name: only its configs and safetensors headers are fetched)",
    )
    add_source_arguments(parser)
    add_single_file_arguments(parser)
    parser.add_argument("--devices", type=int, required=True, help="number of devices (ranks) to plan for")
    parser.add_argument(
        "--device-memory",
        default=None,
        help="memory per device, e.g. 24GiB, 80GB (default: this machine's: the accelerator's, or on a CPU host "
        "its memory divided among --devices ranks)",
    )
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
    parser.add_argument("--lora-r", type=int, default=0, help="with --train: LoRA rank (default 0: full fine-tuning)")
    parser.add_argument(
        "--lora-target-modules", nargs="+", default=(), help="LoRA targets (default: hsdp train's)"
    )
    diffusion = parser.add_argument_group(
        "diffusion training (--train on a pipeline: the denoiser as hsdp train trains it)"
    )
    diffusion.add_argument("--height", type=int, default=None, help="pixel height of a training item")
    diffusion.add_argument("--width", type=int, default=None, help="pixel width of a training item")
    diffusion.add_argument("--frames", type=int, default=1, help="frames per training item (default 1: images)")
    diffusion.add_argument("--train-component", default=None, help="the denoiser trained (default: the first)")
    diffusion.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute each block's activations in backward"
    )
    parser.add_argument("--dtype", default=None, help="stored weight dtype (default: the checkpoint's)")
    parser.add_argument(
        "--param-dtype", default=None, help="compute dtype of gathered weights (mixed precision)"
    )
    parser.add_argument(
        "--weight-dtype",
        default=None,
        help="int8 or fp8: Linear weights of the sharded units stored and all-gathered in 8 bits (inference)",
    )
    parser.add_argument("--device-tflops", type=float, default=300.0, help="sustained TFLOP/s per device")
    parser.add_argument("--link-gbps", type=float, default=100.0, help="collective bandwidth per rank, GB/s")
    parser.add_argument("--host-gbps", type=float, default=25.0, help="host-device copy bandwidth, GB/s")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="also draw the memory per rank of each layout as a bar chart: FILE.svg, or FILE.png (Pillow)",
    )


def _device_memory(args: argparse.Namespace) -> int:
    """``--device-memory``, or this machine's, said on stderr (a plan for another machine needs the flag)."""
    if args.device_memory is not None:
        return parse_size(args.device_memory)
    from hsdp.measure.memory import device_capacity

    memory, source = device_capacity(args.devices)
    print(
        f"--device-memory not given: {format_size(memory)} per device, {source} (pass it to plan for another "
        "machine)",
        file=sys.stderr,
    )
    return memory


def _check_args(args: argparse.Namespace) -> None:
    problems = [
        f"{flag}={value} must be >= 1"
        for flag, value in (
            ("--devices", args.devices),
            ("--seq-len", args.seq_len),
            ("--batch", args.batch),
            ("--frames", args.frames),
        )
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
        f"{flag}={value!r} is not a dtype; use one of {', '.join(sorted(DTYPES))}{did_you_mean(value, DTYPES)}"
        for flag, value in (("--dtype", args.dtype), ("--param-dtype", args.param_dtype))
        if value is not None and value not in DTYPES
    ]
    problems += [f"{flag}={value} must be >= 1" for flag, value in (("--height", args.height),
                 ("--width", args.width)) if value is not None and value < 1]  # fmt: skip
    if args.lora_r < 0:
        problems.append(f"--lora-r={args.lora_r} must be >= 0 (0: full fine-tuning)")
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
                format_ms(e.step_s),
                f"{e.samples_per_s:.1f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def run(args: argparse.Namespace) -> int:
    resolve_model_argument(args, headers_only=True)
    try:
        _check_args(args)
        if args.plot:
            check_plot_path(args.plot)
        memory = _device_memory(args)
        reserve = _parse_reserve(args.reserve, memory)
        hw = Hardware(memory - reserve, args.device_tflops, args.link_gbps, args.host_gbps)
        sharded = _engine_sharded(args.model)
        if args.training and sharded is not None:
            profiles, work = _diffusion_training(args)
        elif args.activation_checkpointing:
            raise PlanError("--activation-checkpointing is planned for diffusion training (--train on a pipeline)")
        elif args.lora_r and not args.training:
            raise PlanError(f"--lora-r {args.lora_r} plans LoRA training: add --train")
        else:
            work = Workload(
                training=args.training, batch=args.batch, seq_len=args.seq_len, guidance=args.guidance
            )
            dtype = DTYPES[args.dtype] if args.dtype else None
            profiles = _lm_lora(args, dtype) if args.lora_r else profile_model(args.model, dtype, sharded)
        result = plan(profiles, args.devices, work, hw, args.param_dtype, args.weight_dtype)
        if args.plot:
            mode = "training" if work.training else "inference"
            title = f"{args.model_name}: memory per rank on {args.devices} devices ({mode})"
            plotted = write_plot(result, args.plot, title)
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
        if work.activation_bytes is not None:
            mode += f" ({_diffusion_label(args)}; the encoders are freed before the first step)"
        elif args.lora_r:
            mode += f" (LoRA r={args.lora_r}: the base frozen in its stored dtype, adapters, their gradients and AdamW in fp32)"
        print(
            f"{mode} on {args.devices} devices of {format_size(memory)} ({format_size(hw.device_memory)} usable, "
            f"--reserve {args.reserve}), batch {work.batch} x {work.seq_len} tokens\n"
        )
        print(_table(result))
        print(
            "(per rank: tensor bytes, what max_memory_allocated counts on an accelerator and what hsdp train logs "
            "there; on a CPU hsdp train logs the resident set, which adds the runtime's own memory)\n"
        )
        print(terminal_chart(result) + "\n")
    if args.plot:
        print(f"plot: {plotted}", file=sys.stderr if args.json else sys.stdout)
    if result.recommended is None:
        print(f"hsdp plan: {result.reason}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"recommended: {result.recommended.layout.label} ({result.reason})")
        config = result.recommended.layout.config
        if not work.training and config.request_parallel and config.hsdp_shard_size == 1:
            print("one request runs on one device (the model fits whole there; replicas would repeat its work)")
        extra = _diffusion_train_flags(args) if work.activation_bytes is not None else _lora_flags(args)
        print(f"run it: {command_line(args.model_name, result.recommended, work.training, extra)}")
        throughput = throughput_command_line(args.model_name, result.recommended, work.training)
        if throughput:
            slots = config.data_parallel_size
            print(f"for throughput, {slots} requests at a time (one per replica): {throughput}")
    return 0


def _diffusion_training(args: argparse.Namespace) -> tuple[list, Workload]:
    """The trained denoiser's profile and its workload (:mod:`hsdp.planning.diffusion`)."""
    from hsdp.planning.diffusion import diffusion_training

    found = diffusion_training(
        args.model,
        height=args.height,
        width=args.width,
        frames=args.frames,
        batch=args.batch,
        lora_r=args.lora_r,
        lora_targets=tuple(args.lora_target_modules),
        component=args.train_component,
        param_dtype=args.param_dtype,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        activation_checkpointing=args.activation_checkpointing,
    )
    return [found.profile], found.work


def _lm_lora(args: argparse.Namespace, dtype) -> list:
    from hsdp.planning.training import lm_lora_profiles

    return lm_lora_profiles(args.model, args.lora_r, tuple(args.lora_target_modules), dtype)


def _lora_flags(args: argparse.Namespace) -> list[str]:
    parts = ["--lora-r", str(args.lora_r)] if args.lora_r else []
    return parts + (["--lora-target-modules", *args.lora_target_modules] if args.lora_target_modules else [])


def _diffusion_label(args: argparse.Namespace) -> str:
    kind = f"LoRA r={args.lora_r}" if args.lora_r else "full fine-tuning"
    checkpointed = ", activation checkpointing" if args.activation_checkpointing else ""
    if args.height is None:  # an audio pipeline: every item at its longest length
        return f"{kind} of the denoiser, audio at the pipeline's longest length{checkpointed}"
    return f"{kind} of the denoiser, {args.height}x{args.width} x {args.frames} frames{checkpointed}"


def _diffusion_train_flags(args: argparse.Namespace) -> list[str]:
    """``hsdp train`` flags for the planned item size and LoRA (its ``--resolution`` is the side of the area)."""
    parts = ["--resolution", str(round((args.height * args.width) ** 0.5))] if args.height is not None else []
    if args.frames > 1:
        parts += ["--frames", str(args.frames)]
    parts += _lora_flags(args)
    if args.train_component:
        parts += ["--train-component", args.train_component]
    if args.activation_checkpointing:
        parts.append("--activation-checkpointing")
    return parts


def _engine_sharded(model: str) -> tuple[str, ...] | None:
    """The components of a pipeline that ``hsdp generate`` shards, by the engine's own rule
    (:meth:`hsdp.models.description.ModelDescription.shardable`); None for a folder that is one model."""
    from hsdp.models.builtin import resolve_model

    try:
        folder = resolve_model(model)
    except FileNotFoundError as exc:
        raise PlanError(str(exc)) from exc
    if not is_pipeline(folder):
        return None
    try:
        return describe(folder).shardable()
    except ValueError as exc:
        raise PlanError(str(exc)) from exc


def command_line(model: str, chosen: Estimate, training: bool, extra: Sequence[str] = ()) -> str:
    """The ``hsdp generate`` / ``hsdp train`` command that runs ``chosen``'s layout for one request (the prompt and
    the data are placeholders). Replicas of a request-parallel inference layout would only repeat one request's
    work, so they are left out: a layout of whole replicas becomes one process on one device
    (:func:`throughput_command_line` gives the command that uses them). Budgeted residency is passed as
    ``--device-memory``, from which the engine plans the same. ``extra``: flags of the planned training run."""
    c = chosen.layout.config
    one_request = not training and c.request_parallel
    parts = ["hsdp", "train" if training else "generate", "--model", model]
    if c.use_hsdp and not (one_request and c.hsdp_shard_size == 1):
        parts += ["--use-hsdp", "--hsdp-shard-size", str(c.hsdp_shard_size)]
    parts += _parallel_flags(chosen, one_request, training)
    parts += [*extra, "--data", "DATA"] if training else ["--prompt", "PROMPT"]
    return shlex.join(parts)


def throughput_command_line(model: str, chosen: Estimate, training: bool) -> str | None:
    """For a request-parallel inference layout over several ranks, the command that gives every rank its own
    request (``--request-parallel``, one ``--prompt`` per rank); None otherwise."""
    c = chosen.layout.config
    if training or not c.request_parallel or c.data_parallel_size < 2:
        return None
    parts = ["hsdp", "generate", "--model", model, "--use-hsdp", "--hsdp-shard-size", str(c.hsdp_shard_size)]
    parts += [*_parallel_flags(chosen, False, training), "--request-parallel"]
    for _ in range(c.data_parallel_size):
        parts += ["--prompt", "PROMPT"]
    return shlex.join(parts)


def _parallel_flags(chosen: Estimate, skip_replicas: bool, training: bool) -> list[str]:
    c, layout = chosen.layout.config, chosen.layout
    parts: list[str] = []
    for flag, value in (
        ("--hsdp-replicate-size", 1 if skip_replicas or not c.use_hsdp else c.hsdp_replicate_size),
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
    if c.offload_layers is not None:
        parts += ["--offload-layers", str(c.offload_layers)]
    if c.frozen_whole:
        parts.append("--frozen-whole")
    if layout.weight_dtype:
        parts += ["--weight-dtype", layout.weight_dtype]
    if not training and (layout.resident or layout.prefetch) and c.offload_layers is None:
        budget = chosen.device_memory
        parts += ["--device-memory", f"{budget // 2**20}MiB" if budget % 2**20 == 0 else str(budget)]
    return parts
