"""Step caches and ``--compile`` against the plain model, through the engine, side by side in one run.

Caches: for the built-in ``tiny-wan`` and ``tiny-flux`` under each layout, one engine generates the same prompt
and seed with no cache, then with each cache configuration (the cache is per call, so the variants share the
loaded model and alternate on the same ranks). Per row: denoiser block (or attention) computations skipped and
the reduction factor (``calls / computed``, from the run's own counts), median seconds per step, and PSNR of the
output against the uncached output of the same seed (pixels in [0, 1]; identical outputs show ``inf``).

Compile: a Wan-shaped pipeline whose transformer is ``--compile-width`` wide (128 per head, 4 blocks; the
built-ins are overhead-bound at width 32) generates eagerly and with ``compile=True`` at HSDP 2; per row the
median seconds per step after a warm-up call (the compiled engine's first call compiles), the ratio to eager,
and the largest pixel difference.

    .venv/bin/python benchmarks/inference_cache.py                       # ~10 minutes on 2 cores
    .venv/bin/python benchmarks/inference_cache.py --skip-compile --steps 30
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPT = "A cat playing piano"
SEED = 7
CACHES = {
    "first-block (default 0.05)": ("first-block", {}),
    "first-block 0.1": ("first-block", {"threshold": 0.1}),
    "first-block 0.2": ("first-block", {"threshold": 0.2}),
    "taylorseer": (
        "taylorseer",
        {"cache_identifiers": [r"(blocks|transformer_blocks|single_transformer_blocks)\.\d+"]},
    ),
    "pab": ("pab", {}),
}
"""Rows: label -> (cache, config). TaylorSeer's default patterns name FLUX's attention layers only; whole blocks
here, for every family."""
LAYOUTS = {
    "HSDP 2": dict(use_hsdp=True, hsdp_shard_size=2),
    "Ulysses 2": dict(use_hsdp=True, ulysses_degree=2),
    "CFG 2": dict(use_hsdp=True, cfg_parallel_size=2),
}
GUIDANCE = {"tiny-wan": {"guidance_scale": 4.0}, "tiny-flux": {"true_cfg_scale": 4.0}}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def pixels(out) -> np.ndarray:
    return out.frames if out.frames is not None else out.images


def cache_rows(model: str, layout: str, steps: int) -> list[dict]:
    from hsdp import ParallelConfig
    from hsdp.engine import Engine, SamplingParams

    config = ParallelConfig(**LAYOUTS[layout]).resolved()
    base = dict(seed=SEED, num_inference_steps=steps, negative_prompt="blurry", **GUIDANCE[model])
    rows = []
    with Engine(model, config) as engine:
        [plain] = engine.generate(PROMPT, SamplingParams(**base))
        variants = {"none": (None, None), **CACHES}
        for label, (cache, fields) in variants.items():
            if cache == "pab" and config.cfg_parallel_size == 2:
                continue  # refused: one PAB state serves both guidance branches
            [out] = engine.generate(PROMPT, SamplingParams(**base, cache=cache, cache_config=fields))
            stats = out.cache or {"calls": 0, "computed": 0, "skipped": 0, "unit": "-"}
            rows.append(
                {
                    "model": model,
                    "layout": layout,
                    "cache": label,
                    "unit": stats["unit"],
                    "calls": stats["calls"],
                    "skipped": stats["skipped"],
                    "fewer": stats["calls"] / stats["computed"] if stats["computed"] else 1.0,
                    "s_per_step": out.timings.seconds_per_step,
                    "psnr_db": psnr(pixels(out), pixels(plain)),
                }
            )
            print(_cache_line(rows[-1]), flush=True)
    return rows


def _cache_line(r: dict) -> str:
    return (
        f"| {r['model']} | {r['layout']} | {r['cache']} | {r['skipped']} of {r['calls']} {r['unit']} | "
        f"{r['fewer']:.2f}x | {r['s_per_step']:.3f} | {r['psnr_db']:.1f} |"
    )


def wide_wan(folder: Path, width: int, size: int, frames: int) -> Path:
    from hsdp.models.tiny_wan import TINY_WAN_DEFAULTS, build_tiny_wan_pipeline, write_generation_defaults

    pipe = build_tiny_wan_pipeline(
        num_attention_heads=width // 128, attention_head_dim=128, ffn_dim=4 * width, num_layers=4
    )
    pipe.save_pretrained(folder)
    write_generation_defaults(
        folder, {**TINY_WAN_DEFAULTS, "height": size, "width": size, "num_frames": frames}
    )
    return folder


def compile_rows(width: int, steps: int, repeats: int, size: int = 64, frames: int = 9) -> list[dict]:
    from hsdp import ParallelConfig
    from hsdp.engine import Engine, SamplingParams

    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2).resolved()
    params = SamplingParams(seed=SEED, num_inference_steps=steps)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = wide_wan(Path(tmp) / "wan", width, size, frames)
        engines = {"eager": Engine(path, config), "compiled": Engine(path, config, compile=True)}
        try:
            started = time.perf_counter()
            for engine in engines.values():  # warm-up: the compiled engine compiles here
                engine.generate(PROMPT, params)
            warmup_s = time.perf_counter() - started
            for _ in range(repeats):  # alternate, so background load hits both alike
                for name, engine in engines.items():
                    [out] = engine.generate(PROMPT, params)
                    results.setdefault(name, []).append(out)
        finally:
            for engine in engines.values():
                engine.close()
    eager = statistics.median(o.timings.seconds_per_step for o in results["eager"])
    rows = []
    for name, outs in results.items():
        per_step = statistics.median(o.timings.seconds_per_step for o in outs)
        diff = float(np.abs(outs[-1].frames - results["eager"][-1].frames).max())
        rows.append(
            {
                "variant": name,
                "width": width,
                "video": f"{size}x{size}x{frames}",
                "s_per_step": per_step,
                "speedup": eager / per_step,
                "max_abs_diff": diff,
                "warmup_s": warmup_s,
            }
        )
        print(f"| {name} | {width} | {per_step:.3f} | {eager / per_step:.2f}x | {diff:.1e} |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-wan", "tiny-flux"])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=20, help="denoising steps of the cache rows")
    parser.add_argument("--compile-width", type=int, default=512)
    parser.add_argument("--compile-steps", type=int, default=4)
    parser.add_argument(
        "--compile-size", type=int, default=64, help="height and width of the compile rows' video"
    )
    parser.add_argument("--compile-frames", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--skip-caches", action="store_true")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/inference_cache.json"))
    args = parser.parse_args()
    report: dict = {"steps": args.steps, "seed": SEED, "prompt": PROMPT}
    if not args.skip_caches:
        print(
            "| model | layout | cache | skipped | fewer | s/step | PSNR dB |\n|---|---|---|---|---|---|---|"
        )
        report["caches"] = [
            row
            for model in args.models
            for layout in args.layouts
            for row in cache_rows(model, layout, args.steps)
        ]
    if not args.skip_compile:
        print("| variant | width | s/step | vs eager | max abs diff |\n|---|---|---|---|---|")
        report["compile"] = compile_rows(
            args.compile_width, args.compile_steps, args.repeats, args.compile_size, args.compile_frames
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
