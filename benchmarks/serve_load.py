"""Bounded load test of ``hsdp serve``: N completion requests at concurrency C against a local tiny-llama server.

Starts ``hsdp serve tiny-llama`` (HSDP 2, request-parallel) on a free 127.0.0.1 port, sends ``--requests``
distinct prompts from ``--concurrency`` concurrent clients, then checks that no work was lost or duplicated:

* every request got a 200 answer (a 429 is retried after its ``Retry-After`` and counted);
* every answer is the right one for its prompt: equal to greedy ``generate`` of the same model in this process
  (so no answer was swapped between requests or served twice);
* the server completed exactly one job per request (``/metrics``): none lost, none duplicated.

``--kill-every S`` adds a chaos run: a worker is SIGKILLed every S seconds of service while the load runs (the
clock restarts once the server is healthy again); the server must
still answer every request once, with the right answer (its interrupted jobs run again with the same seed).
``--stream`` sends streamed completions and reports the time to first token. ``--model tiny-flux`` (or any image
pipeline) loads ``/v1/images/generations`` instead (one image per request, seed = its index), checked against the
one-process diffusers pipeline within one 8-bit level per pixel (``--max-batch-size`` > 1 is within 1e-5 of
running alone, not bit-exact); give ``--batch-sizes 1 4`` to compare batching side by side.

Prints latency percentiles and throughput; writes JSON. Stops by itself (every request has a deadline).

    .venv/bin/python benchmarks/serve_load.py                       # 200 requests, concurrency 16
    .venv/bin/python benchmarks/serve_load.py --requests 400 --max-tokens 16 --kill-every 20 --stream
    .venv/bin/python benchmarks/serve_load.py --model tiny-flux --requests 64 --batch-sizes 1 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from hsdp.serve.local import LocalServer


def _metric(text: str, name: str, **labels: str) -> float:
    pattern = re.escape(name) + r"\{([^}]*)\} (\S+)"
    for found, value in re.findall(pattern, text):
        if all(f'{k}="{v}"' in found for k, v in labels.items()):
            return float(value)
    raise KeyError(name)


IMAGE_STEPS = 4


def _image_references(model: str, prompts: list[str]) -> list:
    """One-process diffusers images (uint8) for every prompt, seed = its index."""
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    from hsdp.engine.model_info import inspect_model
    from hsdp.models.builtin import resolve_model

    torch.set_num_threads(1)
    info = inspect_model(resolve_model(model))
    defaults = {k: v for k, v in info.defaults.items() if k in info.call_params}  # what the server fills in
    pipe = DiffusionPipeline.from_pretrained(info.path)
    pipe.set_progress_bar_config(disable=True)
    images = []
    with torch.no_grad():
        for seed, prompt in enumerate(prompts):
            generator = torch.Generator().manual_seed(seed)
            kwargs = {**defaults, "num_inference_steps": IMAGE_STEPS}
            out = pipe(prompt=prompt, generator=generator, output_type="np", **kwargs)
            images.append((np.clip(out.images[0], 0, 1) * 255).round().astype(np.uint8))
    return images


def _same_image(b64: str | None, want) -> bool:
    import base64
    import io

    import imageio.v3 as iio
    import numpy as np

    if b64 is None:
        return False
    got = iio.imread(io.BytesIO(base64.b64decode(b64)), extension=".png").astype(int)
    return got.shape == want.shape and int(np.abs(got - want.astype(int)).max()) <= 1


def _references(prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy continuations from one process (transformers), the ground truth for every answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hsdp.models.builtin import resolve_model

    torch.set_num_threads(1)  # as in the worker ranks; spinning OpenMP threads crawl on a shared CPU
    path = resolve_model("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = []
    with torch.no_grad():
        for prompt in prompts:
            inputs = tokenizer(prompt, return_tensors="pt")
            out = model.generate(
                **inputs, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            texts.append(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    return texts


async def _ask(
    http: httpx.AsyncClient, body: dict, stream: bool
) -> tuple[int, str | None, float | None, dict]:
    """(status, text, seconds to the first text piece when streamed, headers)."""
    started = time.perf_counter()
    if not stream:
        response = await http.post("/v1/completions", json=body)
        text = response.json()["choices"][0]["text"] if response.status_code == 200 else None
        return response.status_code, text, None, dict(response.headers)
    pieces, first = [], None
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None, None, dict(response.headers)
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return 500, None, first, {}
            piece = chunk["choices"][0]["text"] if chunk["choices"] else ""
            if piece and first is None:
                first = time.perf_counter() - started
            pieces.append(piece)
    return 200, "".join(pieces), first, dict(response.headers)


async def _ask_image(http: httpx.AsyncClient, body: dict) -> tuple[int, str | None, None, dict]:
    response = await http.post("/v1/images/generations", json=body)
    b64 = response.json()["data"][0]["b64_json"] if response.status_code == 200 else None
    return response.status_code, b64, None, dict(response.headers)


async def _client(url: str, queue: asyncio.Queue, results: dict, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=args.deadline) as http:
        while True:
            try:
                index, prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            started, retries = time.perf_counter(), 0
            image = args.model != "tiny-llama"
            body = (
                {"prompt": prompt, "n": 1, "seed": index, "num_inference_steps": IMAGE_STEPS}
                if image
                else {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            )
            while True:
                try:
                    if image:
                        status, text, ttft, headers = await _ask_image(http, body)
                    else:
                        status, text, ttft, headers = await _ask(http, body, args.stream)
                except httpx.HTTPError as exc:
                    results[index] = {"status": f"error: {exc!r}", "latency_s": time.perf_counter() - started}
                    break
                if status == 429 and time.perf_counter() - started < args.deadline:
                    retries += 1
                    await asyncio.sleep(float(headers.get("retry-after", "1")))
                    continue
                results[index] = {
                    "status": status,
                    "text": text,
                    "latency_s": time.perf_counter() - started,
                    "ttft_s": ttft,
                    "retries": retries,
                }
                break


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def _run(url: str, prompts: list[str], args: argparse.Namespace) -> tuple[dict, float]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    results: dict = {}
    started = time.perf_counter()
    await asyncio.gather(*(_client(url, queue, results, args) for _ in range(args.concurrency)))
    return results, time.perf_counter() - started


def _kill_workers(server: LocalServer, every_s: float, stop: threading.Event, kills: list[int]) -> None:
    """SIGKILL one worker (at random) every ``every_s`` seconds of service until ``stop``: the clock restarts
    once the engine is healthy again, so a restart slower than the interval (a loaded CPU) does not turn the
    run into one where the same re-run job is killed on every attempt."""
    rng = random.Random(0)
    while not stop.wait(every_s):
        try:
            pids = server.worker_pids()
            if pids:
                os.kill(rng.choice(pids), signal.SIGKILL)
                kills.append(1)
        except (httpx.HTTPError, ProcessLookupError):
            continue
        while not stop.is_set() and httpx.get(server.url + "/health", timeout=10).status_code != 200:
            stop.wait(0.2)


def load_run(
    layout: str,
    prompts: list[str],
    want: list[str],
    args: argparse.Namespace,
    workdir: Path,
    kill_every_s: float | None = None,
) -> dict:
    """One server with ``layout`` flags, the whole load, and the lost / wrong / duplicate accounting."""
    server_args = [*layout.split(), "--output-dir", str(workdir / "out"), "--log-level", "warning"]
    kills: list[int] = []
    with LocalServer(args.model, server_args, log=workdir / "server.log") as server:
        before = httpx.get(server.url + "/metrics").text
        stop = threading.Event()
        chaos = threading.Thread(target=_kill_workers, args=(server, kill_every_s, stop, kills), daemon=True)
        if kill_every_s:
            chaos.start()
        try:
            results, wall_s = asyncio.run(_run(server.url, prompts, args))
        finally:
            stop.set()
        server.wait_healthy()
        after = httpx.get(server.url + "/metrics").text

    def delta(name: str, **labels: str) -> int:
        return int(_metric(after, name, **labels) - _metric(before, name, **labels))

    answered = [i for i in range(len(prompts)) if results.get(i, {}).get("status") == 200]
    same = _same_image if args.model != "tiny-llama" else (lambda got, expected: got == expected)
    wrong = [i for i in answered if not same(results[i]["text"], want[i])]
    latencies = [results[i]["latency_s"] for i in answered] or [float("nan")]
    ttfts = [results[i]["ttft_s"] for i in answered if results[i].get("ttft_s") is not None]
    completed = delta("hsdp_jobs", state="completed")
    return {
        "layout": layout + (f" (a worker killed every {kill_every_s:g}s)" if kill_every_s else ""),
        "requests": len(prompts),
        "answered_200": len(answered),
        "lost": len(prompts) - len(answered),
        "wrong_answers": len(wrong),
        "duplicates": completed - len(answered),
        "retried_429": sum(r.get("retries", 0) for r in results.values()),
        "workers_killed": len(kills),
        "jobs_run_again": delta("hsdp_job_retries_total"),
        "server_jobs_completed": completed,
        "server_requests_run": delta("hsdp_batched_requests_total"),
        "server_batches": delta("hsdp_batches_total"),
        "ttft_s": {f"p{q}": round(_percentile(ttfts, q), 4) for q in (50, 99)} if ttfts else None,
        "wall_s": round(wall_s, 3),
        "throughput_rps": round(len(answered) / wall_s, 2),
        "tokens_per_s": round(len(answered) * args.max_tokens / wall_s, 1)
        if args.model == "tiny-llama"
        else None,
        "latency_s": {f"p{q}": round(_percentile(latencies, q), 4) for q in (50, 90, 99)}
        | {"max": round(max(latencies), 4), "mean": round(statistics.mean(latencies), 4)},
        "not_answered": {
            i: str(results.get(i, {}).get("status")) for i in range(len(prompts)) if i not in answered
        },
        "ok": not wrong and len(answered) == len(prompts) and completed == len(prompts),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help="tiny-llama (completions) or an image pipeline")
    parser.add_argument(
        "--batch-sizes",
        nargs="+",
        type=int,
        default=[1],
        help="image pipelines: one run of the first layout per --max-batch-size",
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds any one request may take")
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["--use-hsdp --hsdp-shard-size 2 --request-parallel", "--use-hsdp --hsdp-shard-size 2"],
        help="server parallel flags, one server each (default: request-parallel HSDP 2, then HSDP 2)",
    )
    parser.add_argument(
        "--kill-every",
        type=float,
        default=None,
        help="also run the first layout while killing a worker every S s",
    )
    parser.add_argument(
        "--stream", action="store_true", help="streamed completions (reports time to first token)"
    )
    parser.add_argument("--output", type=Path, default=Path("bench_results/serve_load.json"))
    args = parser.parse_args()

    prompts = [f"request {i}: " for i in range(args.requests)]
    print(f"computing {len(prompts)} one-process references ...", flush=True)
    image = args.model != "tiny-llama"
    want = _image_references(args.model, prompts) if image else _references(prompts, args.max_tokens)
    layouts = [f"{args.layouts[0]} --max-batch-size {b}" for b in args.batch_sizes] if image else args.layouts
    rows = []
    for layout in layouts:
        print(f"load: {layout} ...", flush=True)
        rows.append(load_run(layout, prompts, want, args, Path(tempfile.mkdtemp(prefix="serve-load-"))))
    if args.kill_every:
        print(f"load with a worker killed every {args.kill_every:g}s: {args.layouts[0]} ...", flush=True)
        workdir = Path(tempfile.mkdtemp(prefix="serve-chaos-"))
        rows.append(load_run(args.layouts[0], prompts, want, args, workdir, kill_every_s=args.kill_every))
    print(
        f"\n{args.requests} requests ({'one image each' if image else f'{args.max_tokens} tokens each'}), "
        f"concurrency {args.concurrency}, {args.model}"
    )
    header = [
        "layout",
        "200",
        "lost",
        "wrong",
        "dup",
        "killed",
        "re-run",
        "batches",
        "req/s",
        "x first",
        "p50 s",
        "p90 s",
        "p99 s",
        "max s",
        "TTFT p50 s",
    ]
    print(" | ".join(header))
    for row in rows:
        lat = row["latency_s"]
        ratio = row["throughput_rps"] / rows[0]["throughput_rps"]
        ttft = row["ttft_s"]["p50"] if row["ttft_s"] else "-"
        cells = [row["layout"], row["answered_200"], row["lost"], row["wrong_answers"], row["duplicates"],
                 row["workers_killed"], row["jobs_run_again"], row["server_batches"], row["throughput_rps"],
                 f"{ratio:.2f}", lat["p50"], lat["p90"], lat["p99"], lat["max"], ttft]  # fmt: skip
        print(" | ".join(str(c) for c in cells))
    ok = all(r["ok"] for r in rows)
    print(
        f"\n{'OK' if ok else 'FAILED'}: every request answered once, with the one-process answer for its prompt"
    )
    summary = {
        "model": args.model,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "stream": args.stream,
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
