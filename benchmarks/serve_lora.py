"""Requests per second of ``hsdp serve`` with one LoRA adapter vs several in rotation, on one server.

Starts ``hsdp serve tiny-llama`` (HSDP 2) with ``--adapters`` peft adapters (rank 8, every linear layer, random
weights) and ``--max-loras`` slots, then alternates rounds on the same server: every request names adapter ``a``
("1 adapter"), or request i names adapter i mod N ("N in rotation": each engine call switches adapter). Rounds
alternate ``--repeat`` times so both modes see the same machine load; the median round of each is reported, with
the ratio (goal: rotation >= 0.9x one adapter when every adapter has a slot). Every answer must equal the answer
the same adapter gave for the same prompt in a sequential warm-up (none wrong), and ``/metrics`` must show the base
loaded once. Writes JSON.

    .venv/bin/python benchmarks/serve_lora.py                          # 3 adapters, --max-loras 3
    .venv/bin/python benchmarks/serve_lora.py --max-loras 1            # the LRU reloading every switch
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from hsdp.models.builtin import resolve_model
from hsdp.serve.local import LocalServer

PROMPTS = [f"Request number {i} asks about sharding" for i in range(8)]


def _metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + "{")))


def _adapters(base: Path, folder: Path, count: int) -> dict[str, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for i in range(count):
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(base),
            LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
        )
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        name = "abcdefghij"[i]
        model.save_pretrained(folder / name)
        out[name] = folder / name
    return out


def _ask(client: httpx.Client, model: str, prompt: str, max_tokens: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def _round(client: httpx.Client, models: list[str], args, expected: dict) -> tuple[float, int]:
    """Requests per second of one round, and the answers that differ from the warm-up's."""
    work = [(models[i % len(models)], PROMPTS[i % len(PROMPTS)]) for i in range(args.requests)]
    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        answers = list(pool.map(lambda w: _ask(client, *w, args.max_tokens), work))
    elapsed = time.perf_counter() - started
    return args.requests / elapsed, sum(expected[w] != a for w, a in zip(work, answers, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=3)
    parser.add_argument("--max-loras", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of each mode, alternated")
    parser.add_argument("--output", type=Path, default=Path("bench_results/serve_lora.json"))
    args = parser.parse_args()
    base = resolve_model("tiny-llama")
    with tempfile.TemporaryDirectory() as tmp:
        adapters = _adapters(base, Path(tmp), args.adapters)
        flags = ["--use-hsdp", "--hsdp-shard-size", "2", "--max-loras", str(args.max_loras)]
        flags += [x for name, path in adapters.items() for x in ("--lora", f"{name}={path}")]
        flags += ["--output-dir", f"{tmp}/out"]
        with (
            LocalServer(str(base), flags, log=Path(tmp) / "log") as server,
            httpx.Client(base_url=server.url, timeout=600) as client,
        ):
            expected = {(m, p): _ask(client, m, p, args.max_tokens) for m in adapters for p in PROMPTS}
            modes = {"1 adapter": ["a"], f"{args.adapters} in rotation": list(adapters)}
            rates: dict[str, list[float]] = {mode: [] for mode in modes}
            wrong = 0
            for _ in range(args.repeat):
                for mode, models in modes.items():
                    rate, bad = _round(client, models, args, expected)
                    rates[mode].append(rate)
                    wrong += bad
            metrics = client.get("/metrics").text
    medians = {mode: statistics.median(r) for mode, r in rates.items()}
    one, rotation = medians.values()
    summary = {
        "config": vars(args) | {"output": str(args.output)},
        "requests_per_s": rates,
        "median_requests_per_s": medians,
        "ratio": rotation / one,
        "wrong": wrong,
        "base_loads": _metric(metrics, "hsdp_base_loads_total"),
        "adapter_loads": _metric(metrics, "hsdp_adapter_loads_total"),
        "adapter_switches": _metric(metrics, "hsdp_adapter_switches_total"),
    }
    print(f"| mode | requests/s (median of {args.repeat}) |\n|---|---|")
    for mode, value in medians.items():
        print(f"| {mode} | {value:.2f} |")
    print(
        f"rotation / one adapter: {summary['ratio']:.2f}x; wrong answers {wrong}; base loads "
        f"{summary['base_loads']:.0f}; adapter loads {summary['adapter_loads']:.0f}; switches "
        f"{summary['adapter_switches']:.0f}"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2))
    return 0 if wrong == 0 and summary["base_loads"] == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
