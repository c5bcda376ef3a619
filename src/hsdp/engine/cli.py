"""``hsdp generate``: one command from prompt (and image) to video, images or text, with the model sharded
across local ranks.

The number of processes follows from the parallel flags (the layout's world size); flags keep vLLM-Omni's
names. The output format follows the output name (.mp4 / .gif for video, .png / .jpg / .webp for images).
Example (runs on a 2-core CPU in seconds)::

    hsdp generate --model tiny-wan --use-hsdp --hsdp-shard-size 2 --prompt "A cat playing piano" --output cat.mp4
    hsdp generate --model tiny-flux --use-hsdp --hsdp-shard-size 2 --prompt "A red fox" --output fox.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from hsdp.cli import (
    ALL_PARALLEL_GROUPS,
    add_parallel_arguments,
    add_single_file_arguments,
    add_source_arguments,
    parallel_config_from_args,
    resolve_model_argument,
)
from hsdp.models.builtin import builtin_names

__all__ = ["add_arguments", "add_engine_arguments", "run"]


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (``--pipeline-kwargs``, ``--cache-config``); anything else is exit 2 with
    the reason, as argparse reports a bad value."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not valid JSON ({exc}); give an object like '{{\"a\": 1}}'"
        ) from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} is JSON but not an object ({type(value).__name__}); give an object like '{{\"a\": 1}}'"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help=f"a local model folder, a Hugging Face Hub name (org/name) or a built-in name ({builtin_names()})",
    )
    add_source_arguments(parser)
    add_single_file_arguments(parser)
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several requests")
    parser.add_argument("--negative-prompt", default=None, help="for the unconditional guidance branch")
    video = parser.add_argument_group(
        "diffusion (defaults: the model's; each is passed when the pipeline's __call__ takes it)"
    )
    video.add_argument("--image", default=None, help="input image (image-to-video, editing): a file")
    video.add_argument("--mask-image", default=None, help="inpainting mask (white = repaint): a file")
    video.add_argument("--num-inference-steps", type=int, default=None)
    video.add_argument("--height", type=int, default=None, help="pixels, a multiple of the model's (e.g. 16)")
    video.add_argument("--width", type=int, default=None, help="pixels, a multiple of the model's (e.g. 16)")
    video.add_argument("--num-frames", type=int, default=None, help="video: 4k+1 for Wan")
    video.add_argument(
        "--guidance-scale", type=float, default=None, help="> 1 enables classifier-free guidance"
    )
    video.add_argument("--guidance-scale-2", type=float, default=None, help="Wan2.2: low-noise transformer")
    video.add_argument(
        "--true-cfg-scale", type=float, default=None, help="FLUX / Qwen-Image: > 1 with a negative prompt"
    )
    video.add_argument(
        "--pipeline-kwargs",
        type=json_object,
        default=None,
        help="other __call__ arguments as JSON, e.g. '{\"strength\": 0.6}'",
    )
    video.add_argument(
        "--audio-seconds",
        type=float,
        default=None,
        help="audio pipelines: seconds of audio (the pipeline's audio_end_in_s / audio_length_in_s / ...)",
    )
    video.add_argument(
        "--fps",
        type=int,
        default=None,
        help="frame rate of the written video (default 8, or the pipeline's frame_rate, which --fps then sets)",
    )
    video.add_argument(
        "--no-audio", action="store_true", help="write a video without the sound track its pipeline made (LTX-2)"
    )
    video.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="run up to this many prompts (per rank) as one pipeline batch, each with its own seed; within 1e-5 "
        "of one at a time",
    )
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
        # hsdp.engine.outputs.SUFFIXES (tests/test_cli_contract.py checks each is here); not imported: the engine's stack
        help="video: .mp4 or .gif (default output.mp4); images: .png, .jpg, .jpeg or .webp (default output.png; "
        "several images get numbered names); audio: .wav, .flac or .mp3 (default output.wav); text: a file "
        "(default: print)",
    )
    add_engine_arguments(parser)
    parser.add_argument(
        "--lora-scale",
        action="append",
        type=float,
        default=None,
        metavar="W",
        help="the weight of each --lora, in their order (default 1 each; one value for all): several --lora are "
        "composed, as diffusers' set_adapters([a, b], adapter_weights=[wa, wb])",
    )
    parser.add_argument(
        "--comm-stats",
        action="store_true",
        help="count every collective and compare with the minimum (slower: the counter sees every op)",
    )
    add_parallel_arguments(parser, groups=ALL_PARALLEL_GROUPS)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """How the engine loads and holds the sharded weights (shared by ``hsdp generate`` and ``hsdp serve``)."""
    parser.add_argument("--dtype", default=None, help="convert the sharded components (bf16, fp16, fp32)")
    parser.add_argument(
        "--attention-backend",
        default=None,
        metavar="NAME",
        help="attention kernel: a diffusers backend for a pipeline's denoisers (native, _native_math, flex, flash, "
        "sage, xformers, ...), a transformers implementation for a causal LM (sdpa, eager, flex_attention, "
        "flash_attention_2, ...); checked before loading",
    )
    parser.add_argument(
        "--weight-dtype",
        choices=["int8", "fp8"],
        default=None,
        help="store the sharded Linear weights in 8 bits (per-output-channel scales) and all-gather them so: "
        "about half the weight memory and gathered bytes of bf16; fp8 needs a GPU with fp8 kernels",
    )
    parser.add_argument(
        "--device-memory",
        default=None,
        metavar="SIZE",
        help="memory per rank, e.g. 24GiB: keep as many blocks gathered between forwards as fit and prefetch the "
        "rest (planned as hsdp plan does; refused with the smallest fitting layout when nothing fits)",
    )
    parser.add_argument(
        "--no-prefetch", dest="forward_prefetch", action="store_false", help="no explicit all-gather prefetch"
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="[NAME=]PATH",
        help="a peft LoRA adapter folder (hsdp train --export, PeftModel.save_pretrained) for the sharded causal LM "
        "or a pipeline's one denoiser, or a diffusers LoRA folder or kohya / ComfyUI .safetensors file (read by the "
        "pipeline's converters): unmerged, in fp32 as peft loads it, sharded with the base (hsdp generate: "
        "repeatable, composed with --lora-scale; hsdp serve: repeatable, each served under NAME, default the "
        "folder's name)",
    )
    parser.add_argument(
        "--cache",
        default=None,
        metavar="NAME",
        help="a diffusers step cache on the denoiser, with skip decisions agreed across ranks: first-block, "
        "taylorseer, magcache, pab or fastercache (those the installed diffusers has; hsdp serve: every request)",
    )
    parser.add_argument(
        "--cache-config",
        type=json_object,
        default=None,
        metavar="JSON",
        help="fields of the cache's diffusers config class, e.g. '{\"threshold\": 0.1}' (first-block's default: 0.05)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each repeated denoiser block (regional; FSDP hooks stay outside the graph), once per "
        "input shape; needs inductor's compiler (g++ on CPU, Triton on GPU)",
    )
    parser.add_argument(
        "--vae-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split the VAE's decode over the ranks that share a request by rows, equal to the whole decode within "
        "float rounding (halos, group-norm statistics and attention exchanged; a VAE it cannot keep exact decodes "
        "whole, with a warning); with --vae-tiling, split diffusers' tiled decode and encode tile by tile instead; "
        "default: off, rank 0 decodes whole as one process does",
    )
    parser.add_argument(
        "--vae-tiling", action="store_true", help="diffusers' enable_tiling of the VAE: less memory on each rank"
    )
    parser.add_argument(
        "--vae-slicing",
        action="store_true",
        help="diffusers' enable_slicing of the VAE: a batch decoded one sample at a time",
    )


def _comm_line(comm: dict) -> str:
    calls = ", ".join(f"{n} {kind}" for kind, n in sorted(comm["calls"].items())) or "no collectives"
    forwards = max(1, comm["forwards"])
    return (
        f"communication (rank 0): {calls} over {comm['forwards']} sharded forwards; "
        f"{comm['total'] / forwards / 2**20:.2f} MiB per rank per forward, {comm['ratio']:.3f}x the minimum"
    )


def _output_paths(output: str | None, count: int, kind: str) -> list[Path | None]:
    from hsdp.engine.outputs import numbered

    if output is None:
        if kind == "text":
            return [None] * count
        output = {"video": "output.mp4", "audio": "output.wav"}.get(kind, "output.png")
    path = Path(output)
    return [path] if count == 1 else [numbered(path, i) for i in range(count)]


def _summary(engine, outputs: list, written: list[Path | None], composed: list[str]) -> str:
    first = outputs[0]
    per_rank = ", ".join(f"rank{r} {b / 2**20:.0f} MiB" for r, b in enumerate(first.peak_memory_bytes))
    unit = "s/step" if engine.kind == "diffusion" else "s/token"
    steps = ", ".join(f"{o.timings.seconds_per_step:.3f}" for o in outputs)
    lines = [
        f"layout: {engine.config.describe()}",
        f"model: {engine.model_path} ({engine.info.class_name})"
        + (f" with the LoRA adapter {engine.lora}" if engine.lora else "")
        + (f" with the LoRA adapters {', '.join(composed)} composed" if composed else "")
        + f", loaded in {engine.load_s:.1f}s",
        f"{unit} (median per request): {steps}; total {sum(o.timings.total_s for o in outputs):.2f}s",
        f"peak memory ({first.memory_kind}): {per_rank}",
    ]
    if first.cache is not None:
        c = first.cache
        lines.append(
            f"step cache {c['name']}: skipped {c['skipped']} of {c['calls']} {c['unit']} computations "
            f"({c['calls'] / max(1, c['computed']):.2f}x fewer)"
        )
    lines += [f"wrote {p}" for p in written]
    return "\n".join(lines)


def _lora_scales(scales: list[float] | None, count: int) -> list[float] | float:
    """``--lora-scale``: one weight per ``--lora`` (or one for all; default 1)."""
    if not scales:
        return 1.0
    if not count:
        raise ValueError("--lora-scale needs --lora (the adapter it weighs)")
    if not all(math.isfinite(s) for s in scales):
        raise ValueError(f"--lora-scale {scales}: each must be a finite number (1: the adapter as trained)")
    if len(scales) == 1:
        return scales[0]
    if len(scales) != count:
        raise ValueError(
            f"--lora-scale is given {len(scales)} times for {count} --lora adapters; give one per --lora, in "
            "the same order, or one for all"
        )
    return scales


def run(args: argparse.Namespace) -> int:
    from hsdp.distributed import rank
    from hsdp.engine import Engine, SamplingParams
    from hsdp.engine.adapters import parse_adapters
    from hsdp.engine.model_info import inspect_model
    from hsdp.engine.outputs import output_suffix_problem
    from hsdp.engine.params import batch_size_problem, build_requests, frame_rate_args, video_fps
    from hsdp.launch import WorkerError
    from hsdp.logging_utils import phase
    from hsdp.models.builtin import resolve_model

    resolve_model_argument(args)  # a hub name: downloaded (once per node) before any rank starts
    try:  # everything checkable is checked before any process starts
        config = parallel_config_from_args(args)
        with phase("checks (the model's folder and pipeline class)"):
            info = inspect_model(resolve_model(args.model))
        paths = _output_paths(args.output, len(args.prompt), info.output)
        problem = paths[0] and output_suffix_problem(paths[0], info.output)
        if problem:
            raise ValueError(f"--output {problem}")
        params = SamplingParams(
            seed=args.seed,
            num_inference_steps=args.num_inference_steps,
            height=args.height,
            width=args.width,
            num_frames=args.num_frames,
            guidance_scale=args.guidance_scale,
            guidance_scale_2=args.guidance_scale_2,
            true_cfg_scale=args.true_cfg_scale,
            audio_seconds=args.audio_seconds,
            negative_prompt=args.negative_prompt,
            image=args.image,
            mask_image=args.mask_image,
            pipeline_kwargs=frame_rate_args(info, args.fps) | (args.pipeline_kwargs or {}),
            cache=args.cache,
            cache_config=args.cache_config,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
        )
        build_requests(info, config, args.prompt, params)
        problem = batch_size_problem(info.kind, args.batch_size, "--batch-size")
        if problem:
            raise ValueError(problem)
        if args.compile:
            from hsdp.distributed import device_type
            from hsdp.engine.compile import compile_problems

            if problems := compile_problems(device_type(), args.cache):
                raise ValueError("; ".join(problems))
        adapters = parse_adapters(args.lora or ())
        scales = _lora_scales(args.lora_scale, len(adapters))
    except (ValueError, FileNotFoundError) as exc:
        print(f"hsdp generate: {exc}", file=sys.stderr)
        return 2
    try:
        with Engine(
            args.model,
            config,
            dtype=args.dtype,
            forward_prefetch=args.forward_prefetch,
            progress=True,
            weight_dtype=args.weight_dtype,
            device_memory=args.device_memory,
            lora=next(iter(adapters.values())) if len(adapters) == 1 else adapters or None,
            compile=args.compile,
            attention_backend=args.attention_backend,
            vae_parallel=args.vae_parallel,
            vae_tiling=args.vae_tiling,
            vae_slicing=args.vae_slicing,
        ) as engine:
            outputs = engine.generate(
                args.prompt,
                params,
                measure_comm=args.comm_stats,
                batch_size=args.batch_size,
                adapter=list(adapters) if len(adapters) > 1 else None,
                adapter_scale=scales,
            )
            writer = rank() == 0  # under torchrun every rank has the outputs: one writes them (shared storage)
    except (ValueError, FileNotFoundError) as exc:  # found by the engine's own checks
        print(f"hsdp generate: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        print(f"hsdp generate: a worker failed, nothing was written: {exc}", file=sys.stderr)
        return 1
    if not writer:
        return 0
    written: list[Path] = []
    for output, path in zip(outputs, paths, strict=True):
        if path is None:
            print(output.text)
        else:
            written += output.save(path, fps=video_fps(info, args.fps), with_audio=not args.no_audio)
    composed = [str(p) for p in adapters.values()] if len(adapters) > 1 else []
    print(_summary(engine, outputs, written, composed), file=sys.stderr)
    if engine.last_comm and engine.last_comm[0]:
        print(_comm_line(engine.last_comm[0]), file=sys.stderr)
    return 0
