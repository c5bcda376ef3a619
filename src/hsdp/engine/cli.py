"""``hsdp generate``: one command from prompt to video (or text) with the model sharded across local ranks.

The number of processes follows from the parallel flags (the layout's world size); flags keep vLLM-Omni's
names. Example (runs on a 2-core CPU in seconds)::

    hsdp generate --model tiny-wan --use-hsdp --hsdp-shard-size 2 --prompt "A cat playing piano" --output cat.mp4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hsdp.cli import add_parallel_arguments, parallel_config_from_args

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help="built-in name (tiny-wan, tiny-llama) or a local folder"
    )
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several requests")
    parser.add_argument("--negative-prompt", default=None, help="for the unconditional guidance branch")
    video = parser.add_argument_group("video diffusion (defaults: the model's)")
    video.add_argument("--num-inference-steps", type=int, default=None)
    video.add_argument("--height", type=int, default=None, help="pixels, a multiple of 16")
    video.add_argument("--width", type=int, default=None, help="pixels, a multiple of 16")
    video.add_argument("--num-frames", type=int, default=None, help="4k+1")
    video.add_argument(
        "--guidance-scale", type=float, default=None, help="> 1 enables classifier-free guidance"
    )
    video.add_argument("--fps", type=int, default=8, help="frame rate of the written video")
    text = parser.add_argument_group("causal LM")
    text.add_argument("--max-new-tokens", type=int, default=32)
    text.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    text.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the first request (the i-th gets seed + i)"
    )
    parser.add_argument(
        "--output",
        default=None,
        help="video: .mp4, .gif or .png (default output.mp4); text: a file (default: print)",
    )
    parser.add_argument("--dtype", default=None, help="convert the sharded weights (bf16, fp16, fp32)")
    parser.add_argument(
        "--no-prefetch", dest="forward_prefetch", action="store_false", help="no explicit all-gather prefetch"
    )
    parser.add_argument(
        "--comm-stats",
        action="store_true",
        help="count every collective and compare with the minimum (slower: the counter sees every op)",
    )
    add_parallel_arguments(parser)


def _comm_line(comm: dict) -> str:
    calls = ", ".join(f"{n} {kind}" for kind, n in sorted(comm["calls"].items())) or "no collectives"
    forwards = max(1, comm["forwards"])
    return (
        f"communication (rank 0): {calls} over {comm['forwards']} sharded forwards; "
        f"{comm['total'] / forwards / 2**20:.2f} MiB per rank per forward, {comm['ratio']:.3f}x the minimum"
    )


def _output_paths(output: str | None, count: int, kind: str) -> list[Path | None]:
    if output is None:
        if kind == "causal_lm":
            return [None] * count
        output = "output.mp4"
    path = Path(output)
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}_{i}{path.suffix}") for i in range(count)]


def _summary(engine, outputs: list, written: list[Path | None]) -> str:
    first = outputs[0]
    per_rank = ", ".join(f"rank{r} {b / 2**20:.0f} MiB" for r, b in enumerate(first.peak_memory_bytes))
    unit = "s/step" if engine.kind == "diffusion" else "s/token"
    steps = ", ".join(f"{o.timings.seconds_per_step:.3f}" for o in outputs)
    lines = [
        f"layout: {engine.config.describe()}",
        f"model: {engine.model_path} ({engine.info.class_name}), loaded in {engine.load_s:.1f}s",
        f"{unit} (median per request): {steps}; total {sum(o.timings.total_s for o in outputs):.2f}s",
        f"peak memory ({first.memory_kind}): {per_rank}",
    ]
    lines += [f"wrote {p}" for p in written if p is not None]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from hsdp.engine import Engine, SamplingParams
    from hsdp.engine.model_info import inspect_model
    from hsdp.engine.outputs import VIDEO_SUFFIXES
    from hsdp.engine.params import build_requests
    from hsdp.launch import WorkerError
    from hsdp.models.builtin import resolve_model

    try:  # everything checkable is checked before any process starts
        config = parallel_config_from_args(args)
        info = inspect_model(resolve_model(args.model))
        paths = _output_paths(args.output, len(args.prompt), info.kind)
        if info.kind == "diffusion" and paths[0].suffix.lower() not in VIDEO_SUFFIXES:
            raise ValueError(f"--output {args.output}: a video needs one of {', '.join(VIDEO_SUFFIXES)}")
        params = SamplingParams(
            seed=args.seed,
            num_inference_steps=args.num_inference_steps,
            height=args.height,
            width=args.width,
            num_frames=args.num_frames,
            guidance_scale=args.guidance_scale,
            negative_prompt=args.negative_prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
        )
        build_requests(info, config, args.prompt, params)
    except (ValueError, FileNotFoundError) as exc:
        print(f"hsdp generate: {exc}", file=sys.stderr)
        return 2
    try:
        with Engine(
            args.model, config, dtype=args.dtype, forward_prefetch=args.forward_prefetch, progress=True
        ) as engine:
            outputs = engine.generate(args.prompt, params, measure_comm=args.comm_stats)
    except (ValueError, FileNotFoundError) as exc:  # found by the engine's own checks
        print(f"hsdp generate: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        print(f"hsdp generate: a worker failed, nothing was written: {exc}", file=sys.stderr)
        return 1
    for output, path in zip(outputs, paths, strict=True):
        if path is None:
            print(output.text)
        else:
            output.save(path, fps=args.fps)
    print(_summary(engine, outputs, paths), file=sys.stderr)
    if engine.last_comm and engine.last_comm[0]:
        print(_comm_line(engine.last_comm[0]), file=sys.stderr)
    return 0
