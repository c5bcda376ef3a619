"""Bounded load test of ``hsdp serve``: N completion requests at concurrency C against a local tiny-llama server.

Starts ``hsdp serve tiny-llama`` (HSDP 2, request-parallel) on a free 127.0.0.1 port, sends ``--requests``
distinct prompts from ``--concurrency`` concurrent clients, then checks that no work was lost or duplicated:

* every request got a 200 answer (a 429 is retried after its ``Retry-After`` and counted);
* every answer is the right one for its prompt: equal to greedy ``generate`` of the same model in this process
  (so no answer was swapped between requests or served twice);
* the server ran exactly one job per request (``/metrics``: completed jobs and batched requests both rose by N).

Prints latency percentiles and throughput; writes JSON. Stops by itself (every request has a deadline).

    .venv/bin/python benchmarks/serve_load.py                       # 200 requests, concurrency 16
    .venv/bin/python benchmarks/serve_load.py --requests 400 --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
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


def _references(prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy continuations from one process (transformers), the ground truth for every answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hsdp.models.builtin import resolve_model

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


async def _client(url: str, queue: asyncio.Queue, results: dict, max_tokens: int, deadline_s: float) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=deadline_s) as http:
        while True:
            try:
                index, prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            started, retries = time.perf_counter(), 0
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            while True:
                try:
                    response = await http.post("/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    results[index] = {"status": f"error: {exc!r}", "latency_s": time.perf_counter() - started}
                    break
                if response.status_code == 429 and time.perf_counter() - started < deadline_s:
                    retries += 1
                    await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                    continue
                text = response.json()["choices"][0]["text"] if response.status_code == 200 else None
                latency = time.perf_counter() - started
                results[index] = {
                    "status": response.status_code,
                    "text": text,
                    "latency_s": latency,
                    "retries": retries,
                }
                break


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def _run(
    url: str, prompts: list[str], concurrency: int, max_tokens: int, deadline_s: float
) -> tuple[dict, float]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    results: dict = {}
    started = time.perf_counter()
    await asyncio.gather(*(_client(url, queue, results, max_tokens, deadline_s) for _ in range(concurrency)))
    return results, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds any one request may take")
    parser.add_argument("--server-args", default="--use-hsdp --hsdp-shard-size 2 --request-parallel")
    parser.add_argument("--output", type=Path, default=Path("bench_results/serve_load.json"))
    args = parser.parse_args()

    prompts = [f"request {i}: " for i in range(args.requests)]
    print(f"computing {len(prompts)} one-process references ...", flush=True)
    want = _references(prompts, args.max_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="serve-load-"))
    server_args = [*args.server_args.split(), "--output-dir", str(workdir / "out"), "--log-level", "warning"]
    with LocalServer("tiny-llama", server_args, log=workdir / "server.log") as server:
        before = httpx.get(server.url + "/metrics").text
        results, wall_s = asyncio.run(
            _run(server.url, prompts, args.concurrency, args.max_tokens, args.deadline)
        )
        after = httpx.get(server.url + "/metrics").text
    completed = _metric(after, "hsdp_jobs", state="completed") - _metric(
        before, "hsdp_jobs", state="completed"
    )
    batched = _metric(after, "hsdp_batched_requests_total") - _metric(before, "hsdp_batched_requests_total")
    batches = _metric(after, "hsdp_batches_total") - _metric(before, "hsdp_batches_total")

    answered = [i for i in range(len(prompts)) if results.get(i, {}).get("status") == 200]
    wrong = [i for i in answered if results[i]["text"] != want[i]]
    latencies = [results[i]["latency_s"] for i in answered]
    summary = {
        "requests": len(prompts),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "server_args": server_args,
        "answered_200": len(answered),
        "unanswered_or_error": len(prompts) - len(answered),
        "wrong_answers": len(wrong),
        "retried_429": sum(r.get("retries", 0) for r in results.values()),
        "server_jobs_completed": int(completed),
        "server_requests_run": int(batched),
        "server_batches": int(batches),
        "wall_s": round(wall_s, 3),
        "throughput_rps": round(len(answered) / wall_s, 2),
        "tokens_per_s": round(len(answered) * args.max_tokens / wall_s, 1),
        "latency_s": {f"p{q}": round(_percentile(latencies, q), 4) for q in (50, 90, 99)}
        | {"max": round(max(latencies), 4), "mean": round(statistics.mean(latencies), 4)}
        if latencies
        else {},
    }
    ok = not wrong and len(answered) == len(prompts) and completed == batched == len(prompts)
    summary["ok"] = ok
    print(
        f"\n{'requests':>8} | {'conc':>4} | {'200':>4} | {'wrong':>5} | {'jobs run':>8} | {'batches':>7} | "
        f"{'req/s':>6} | {'p50 s':>6} | {'p90 s':>6} | {'p99 s':>6} | {'max s':>6}"
    )
    lat = summary["latency_s"]
    print(
        f"{len(prompts):>8} | {args.concurrency:>4} | {len(answered):>4} | {len(wrong):>5} | {int(batched):>8} | "
        f"{int(batches):>7} | {summary['throughput_rps']:>6} | {lat.get('p50', 0):>6} | {lat.get('p90', 0):>6} | "
        f"{lat.get('p99', 0):>6} | {lat.get('max', 0):>6}"
    )
    print(
        f"\n{'OK' if ok else 'FAILED'}: lost={len(prompts) - len(answered)} wrong={len(wrong)} "
        f"server ran {int(batched)} requests for {len(prompts)} sent (duplicates={int(batched) - len(prompts)})"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
