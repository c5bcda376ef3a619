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
running alone, not bit-exact); give ``--batch-sizes 1 4`` to compare batching side by side. ``--model tiny-wan`` (a
video pipeline) sends asynchronous ``/v1/videos`` jobs and polls them; each mp4 must equal the one-process frames
encoded the same way: byte for byte, or (where request-parallel HSDP's ~1e-6 differences flip a pixel's rounding)
decoded within one level on average (another request's video is ~20 levels away).

``--mixed`` varies what requests carry: every third has a negative prompt and, where the pipeline takes an input
image, every third another is an edit of an input image (``/v1/images/edits``); true-CFG pipelines get
``true_cfg_scale`` 4 on all, so the negative prompt decides whether the unconditional pass runs (the case where
ranks side by side must run the same forwards). ``--disk-full-every S`` adds a chaos run in which, every S
seconds, the server's output dir is "full" for ``--disk-full-for`` seconds (fault injection from
``tests/fault_injection``: job records and videos fail to write with ENOSPC); a request refused with 507, or a
job whose output could not be stored, is sent again by its client, as a 429 is. Every row reports ``stuck``:
jobs the server still holds queued or running once the load is over, plus requests that ran past their deadline.

``--nodes N`` runs every server over N local torchrun "nodes" (:class:`hsdp.serve.local.LocalNodes`, c10d
rendezvous on loopback, ``--nproc-per-node`` ranks each); ``--kill-node-every S`` (30 when given no value) adds a
chaos run in which the ranks of a node without rank 0 are SIGKILLed every S seconds of service, under
``torchrun --max-restarts``: torchrun restarts the whole group, rank 0's HTTP server included, so only a video
pipeline's asynchronous jobs (persisted, run again after the restart) can be checked; clients wait out the
restart (a refused connection or a 503 is sent again and counted). Job counts then come from the job records on
disk (the server's counters start again with each restart), and each kill's times to leave and to regain
``/health`` 200 are reported.

Prints latency percentiles and throughput; writes JSON. Stops by itself (every request has a deadline).

    .venv/bin/python benchmarks/serve_load.py                       # 200 requests, concurrency 16
    .venv/bin/python benchmarks/serve_load.py --requests 400 --max-tokens 16 --kill-every 20 --stream
    .venv/bin/python benchmarks/serve_load.py --model tiny-flux --requests 64 --batch-sizes 1 4
    .venv/bin/python benchmarks/serve_load.py --model tiny-flux-kontext --mixed --kill-every 10 --requests 48
    .venv/bin/python benchmarks/serve_load.py --model tiny-wan --mixed --kill-every 10 --disk-full-every 6
    .venv/bin/python benchmarks/serve_load.py --model tiny-wan --nodes 2 --kill-node-every 30 --requests 400
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
from collections.abc import Callable
from pathlib import Path

import httpx

from hsdp.serve.local import LocalNodes, LocalServer


def _metric(text: str, name: str, **labels: str) -> float:
    pattern = re.escape(name) + r"\{([^}]*)\} (\S+)"
    for found, value in re.findall(pattern, text):
        if all(f'{k}="{v}"' in found for k, v in labels.items()):
            return float(value)
    raise KeyError(name)


IMAGE_STEPS = 4
VIDEO = {"size": "32x32", "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 4.0, "fps": 8}
NEGATIVE = "blurry, low quality"
STORAGE_CODES = ("storage_error", "output_error")
"""Errors of a request whose output could not be stored (a full disk): its client sends it again."""
NODE_MAX_RESTARTS = 100
"""torchrun's ``--max-restarts`` in the node-kill run: more than it kills."""


def _input_png(seed: int) -> bytes:
    """A deterministic 64x64 noise image (every pixel matters) as PNG bytes."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _diffusion_requests(model: str, prompts: list[str], mixed: bool) -> list[dict]:
    """Per request (seed = its index): the HTTP body, the input image (edits) and the one-process arguments."""
    from hsdp.engine.model_info import inspect_model
    from hsdp.models.builtin import resolve_model

    info = inspect_model(resolve_model(model))
    video = info.output == "video"
    true_cfg = mixed and info.cfg_scale_param == "true_cfg_scale"
    requests = []
    for seed, prompt in enumerate(prompts):
        body = {
            "prompt": prompt,
            "seed": seed,
            **(VIDEO if video else {"n": 1, "num_inference_steps": IMAGE_STEPS}),
        }
        body |= {"true_cfg_scale": 4.0} if true_cfg else {}
        negative = NEGATIVE if mixed and seed % 3 == 1 else None
        image = _input_png(seed) if mixed and seed % 3 == 2 and info.takes_image and not video else None
        body |= {"negative_prompt": negative} if negative else {}
        requests.append({"body": body, "image": image, "video": video})
    return requests


def _diffusion_references(model: str, requests: list[dict]) -> list:
    """One-process diffusers outputs: uint8 images, or mp4 bytes encoded as the server encodes them."""
    import io
    import tempfile

    import numpy as np
    import torch
    from diffusers import DiffusionPipeline
    from PIL import Image

    from hsdp.engine.model_info import inspect_model
    from hsdp.engine.outputs import save_frames
    from hsdp.models.builtin import resolve_model

    torch.set_num_threads(1)
    info = inspect_model(resolve_model(model))
    defaults = {k: v for k, v in info.defaults.items() if k in info.call_params}  # what the server fills in
    pipe = DiffusionPipeline.from_pretrained(info.path)
    pipe.set_progress_bar_config(disable=True)
    wants = []
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        for request in requests:
            body = request["body"]
            kwargs = {**defaults, "num_inference_steps": body["num_inference_steps"]}
            for name in ("negative_prompt", "true_cfg_scale", "guidance_scale", "num_frames"):
                kwargs |= {name: body[name]} if name in body else {}
            if request["video"]:
                width, height = (int(v) for v in body["size"].split("x"))
                kwargs |= {"width": width, "height": height}
            if request["image"] is not None:
                kwargs["image"] = Image.open(io.BytesIO(request["image"])).convert("RGB")
            generator = torch.Generator().manual_seed(body["seed"])
            out = pipe(prompt=body["prompt"], generator=generator, output_type="np", **kwargs)
            if request["video"]:
                path = save_frames(out.frames[0], Path(tmp) / "ref.mp4", fps=body["fps"])
                wants.append(path.read_bytes())
            else:
                wants.append((np.clip(out.images[0], 0, 1) * 255).round().astype(np.uint8))
    return wants


def _same_image(b64: str | None, want) -> bool:
    import base64
    import io

    import imageio.v3 as iio
    import numpy as np

    if b64 is None:
        return False
    got = iio.imread(io.BytesIO(base64.b64decode(b64)), extension=".png").astype(int)
    return got.shape == want.shape and int(np.abs(got - want.astype(int)).max()) <= 1


def _same_video(got: bytes | None, want: bytes) -> bool:
    """The reference mp4's bytes, or its decoded frames within 1 level on average. Request-parallel HSDP differs
    from one process by ~1e-6 on some requests (a pixel's 8-bit rounding flips, and so do the H.264 bytes:
    decoded, 0.4 level on average); another request's video differs by ~20 levels."""
    import imageio.v3 as iio
    import numpy as np

    if got is None or got == want:
        return got is not None
    a, b = (iio.imread(data, extension=".mp4").astype(int) for data in (got, want))
    return a.shape == b.shape and float(np.abs(a - b).mean()) <= 1.0


def _same(got, want) -> bool:
    """Text exactly; videos and images as close as sharded and one-process runs are (see the module docstring)."""
    if isinstance(want, str):
        return got == want
    return _same_video(got, want) if isinstance(want, bytes) else _same_image(got, want)


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


async def _ask_image(http: httpx.AsyncClient, request: dict) -> tuple[int, str | None, None, dict]:
    if request["image"] is None:
        response = await http.post("/v1/images/generations", json=request["body"])
    else:  # an edit: multipart, the input image as a file part
        form = {k: str(v) for k, v in request["body"].items()}
        files = [("image", ("in.png", request["image"], "image/png"))]
        response = await http.post("/v1/images/edits", data=form, files=files)
    b64 = response.json()["data"][0]["b64_json"] if response.status_code == 200 else None
    return response.status_code, b64, None, dict(response.headers)


async def _get(http: httpx.AsyncClient, path: str, restarts: bool, until: float) -> httpx.Response:
    """GET ``path``; with ``restarts``, a refused or dropped connection or a 503 (torchrun restarting the group)
    is asked again until ``until`` (``time.perf_counter()``)."""
    while True:
        try:
            response = await http.get(path)
            if not (restarts and response.status_code == 503):
                return response
        except httpx.TransportError:
            if not restarts or time.perf_counter() > until:
                raise
        await asyncio.sleep(0.5)


async def _ask_video(
    http: httpx.AsyncClient, request: dict, restarts: bool, until: float
) -> tuple[int, bytes | None, None, dict]:
    """An asynchronous video job, polled until it ends (through restarts of the group, with ``restarts``); its
    mp4. A job whose output could not be stored comes back as 507, which the client sends again."""
    response = await http.post("/v1/videos", json=request["body"])
    if response.status_code != 200:
        return response.status_code, None, None, dict(response.headers)
    video_id = response.json()["id"]
    while (job := (await _get(http, f"/v1/videos/{video_id}", restarts, until)).json())["status"] not in (
        "completed",
        "failed",
        "cancelled",
    ):
        await asyncio.sleep(0.1)
    if job["status"] != "completed":
        code = (job.get("error") or {}).get("code")
        return (507 if code in STORAGE_CODES else 500), json.dumps(job.get("error")), None, {}
    content = await _get(http, f"/v1/videos/{video_id}/content", restarts, until)
    return content.status_code, content.content, None, dict(content.headers)


async def _client(url: str, queue: asyncio.Queue, results: dict, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=args.deadline) as http:
        while True:
            try:
                index, request = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            started, retries, resent, restarted = time.perf_counter(), 0, 0, 0
            # Over nodes, torchrun restarts rank 0's HTTP server with the group: a refused connection or a 503
            # means the job was not accepted, and is sent again.
            restarts = args.nodes > 1
            while True:
                try:
                    if isinstance(request, str):
                        body = {"prompt": request, "max_tokens": args.max_tokens, "temperature": 0}
                        status, text, ttft, headers = await _ask(http, body, args.stream)
                    elif request["video"]:
                        until = started + args.deadline
                        status, text, ttft, headers = await _ask_video(http, request, restarts, until)
                    else:
                        status, text, ttft, headers = await _ask_image(http, request)
                except httpx.HTTPError as exc:
                    restarting = restarts and isinstance(exc, httpx.TransportError)
                    if restarting and time.perf_counter() - started < args.deadline:
                        restarted += 1
                        await asyncio.sleep(1.0)
                        continue
                    results[index] = {"status": f"error: {exc!r}", "latency_s": time.perf_counter() - started}
                    break
                if status in (429, 507, *((503,) if restarts else ())) and (
                    time.perf_counter() - started < args.deadline
                ):
                    restarted += status == 503
                    retries += status == 429
                    resent += status == 507  # the disk was full: stored nothing, or lost the output
                    await asyncio.sleep(float(headers.get("retry-after", "1")))
                    continue
                results[index] = {
                    "status": status,
                    "text": text,
                    "latency_s": time.perf_counter() - started,
                    "ttft_s": ttft,
                    "retries": retries,
                    "resent": resent,
                    "restarted": restarted,
                }
                break


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def _run(url: str, requests: list, args: argparse.Namespace) -> tuple[dict, float]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in enumerate(requests):
        queue.put_nowait(item)
    results: dict = {}
    started = time.perf_counter()
    await asyncio.gather(*(_client(url, queue, results, args) for _ in range(args.concurrency)))
    return results, time.perf_counter() - started


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.HTTPError:  # busy, or (over nodes) restarting with the group
        return None


def _kill_every(
    url: str, every_s: float, stop: threading.Event, kills: list[dict], kill: Callable[[], bool]
) -> None:
    """``kill()`` every ``every_s`` seconds of service until ``stop``: the clock restarts once the engine is
    healthy again, so a restart slower than the interval (a loaded CPU) does not turn the run into one where the
    same re-run job is killed on every attempt. Per kill: seconds until ``/health`` left 200 and until it was
    200 again (waited for even after ``stop``, up to 600 s)."""
    while not stop.wait(every_s):
        try:
            if not kill():
                continue
        except (httpx.HTTPError, ProcessLookupError):
            continue
        killed = time.monotonic()
        while _health(url) == 200 and time.monotonic() - killed < 60:
            time.sleep(0.05)
        noticed_s = time.monotonic() - killed
        while _health(url) != 200 and time.monotonic() - killed < 600:
            time.sleep(0.2)
        kills.append({"noticed_s": round(noticed_s, 2), "back_s": round(time.monotonic() - killed, 2)})


def _kill_a_worker(server: LocalServer, rng: random.Random) -> bool:
    """SIGKILL one worker of the local server, at random."""
    pids = server.worker_pids()
    if pids:
        os.kill(rng.choice(pids), signal.SIGKILL)
    return bool(pids)


def _kill_a_node(nodes: LocalNodes, rng: random.Random) -> bool:
    """SIGKILL every rank of one node without rank 0 (the node's torchrun agent lives on and restarts them)."""
    head = nodes.head_node()
    if head is None:  # between rounds
        return False
    return bool(nodes.kill_node(rng.choice([n for n in range(nodes.nnodes) if n != head])))


def _disk_counts(out: Path) -> dict:
    """Job records on disk: jobs completed and jobs run again (what the counters, reset by every restart of a
    torchrun group, cannot say)."""
    records = [json.loads(p.read_text()) for p in (out / "jobs").glob("*.json")]
    done = [r for r in records if r["status"] == "completed"]
    return {"completed": len(done), "run_again": sum(max(0, r["attempts"] - 1) for r in done)}


def _fill_disk(flag: Path, every_s: float, for_s: float, stop: threading.Event, windows: list[int]) -> None:
    """Every ``every_s`` seconds, the output dir is full for ``for_s`` seconds (while ``flag`` exists, the fault
    injection makes the server's record and video writes fail with ENOSPC)."""
    while not stop.wait(every_s):
        flag.touch()
        windows.append(1)
        stop.wait(for_s)
        flag.unlink(missing_ok=True)


def _settle(server: LocalServer | LocalNodes, timeout_s: float = 60.0) -> str:
    """``/metrics`` once the server holds no queued or running job (or at the deadline: those are stuck)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        held = sum(_metric(text, "hsdp_jobs", state=s) for s in ("queued", "in_progress"))
        if not held or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def load_run(
    layout: str,
    requests: list,
    want: list,
    args: argparse.Namespace,
    workdir: Path,
    kill_every_s: float | None = None,
    disk_full_every_s: float | None = None,
    kill_node_every_s: float | None = None,
) -> dict:
    """One server with ``layout`` flags (over ``args.nodes`` local torchrun nodes when above 1), the whole load,
    and the lost / wrong / duplicate / stuck accounting."""
    server_args = [*layout.split(), "--output-dir", str(workdir / "out"), "--log-level", "warning"]
    kills: list[dict] = []
    windows: list[int] = []
    flag = workdir / "disk-full"
    env = {}
    if disk_full_every_s:
        faults = Path(__file__).resolve().parent.parent / "tests" / "fault_injection"
        env = {"PYTHONPATH": os.pathsep.join([str(faults), os.environ.get("PYTHONPATH", "")])}
        env["HSDP_TEST_DISK_FULL"] = str(flag)
    if args.nodes > 1:
        server: LocalServer | LocalNodes = LocalNodes(
            args.model,
            server_args,
            log_dir=workdir,
            nnodes=args.nodes,
            nproc_per_node=args.nproc_per_node,
            max_restarts=NODE_MAX_RESTARTS if kill_node_every_s else 0,
            env=env,
        )
    else:
        server = LocalServer(args.model, server_args, log=workdir / "server.log", env=env)
    rng = random.Random(0)
    kill = (lambda: _kill_a_worker(server, rng)) if kill_every_s else (lambda: _kill_a_node(server, rng))
    with server:
        before = httpx.get(server.url + "/metrics").text
        stop = threading.Event()
        chaos = [
            threading.Thread(
                target=_kill_every,
                args=(server.url, kill_every_s or kill_node_every_s, stop, kills, kill),
                daemon=True,
            )
            if kill_every_s or kill_node_every_s
            else None,
            threading.Thread(
                target=_fill_disk,
                args=(flag, disk_full_every_s, args.disk_full_for, stop, windows),
                daemon=True,
            )
            if disk_full_every_s
            else None,
        ]
        for thread in filter(None, chaos):
            thread.start()
        try:
            results, wall_s = asyncio.run(_run(server.url, requests, args))
        finally:
            stop.set()
            flag.unlink(missing_ok=True)
        server.wait_healthy()
        for thread in filter(None, chaos):
            thread.join()  # a kill's recovery is measured to its end
        after = _settle(server)

    def delta(name: str, **labels: str) -> int:
        return int(_metric(after, name, **labels) - _metric(before, name, **labels))

    answered = [i for i in range(len(requests)) if results.get(i, {}).get("status") == 200]
    wrong = [i for i in answered if not _same(results[i]["text"], want[i])]
    stuck = sum(_metric(after, "hsdp_jobs", state=s) for s in ("queued", "in_progress"))
    stuck += sum(1 for r in results.values() if "ReadTimeout" in str(r.get("status")))
    latencies = [results[i]["latency_s"] for i in answered] or [float("nan")]
    ttfts = [results[i]["ttft_s"] for i in answered if results[i].get("ttft_s") is not None]
    completed, run_again = delta("hsdp_jobs", state="completed"), delta("hsdp_job_retries_total")
    restarted = bool(args.nodes > 1 and kill_node_every_s)
    if restarted:  # the counters start again with each restart of the group: count the records
        on_disk = _disk_counts(workdir / "out")
        completed, run_again = on_disk["completed"], on_disk["run_again"]
    nodes = f" over {args.nodes} nodes x {args.nproc_per_node}" if args.nodes > 1 else ""
    return {
        "layout": layout
        + nodes
        + _chaos_label(kill_every_s, disk_full_every_s, args.disk_full_for, kill_node_every_s),
        "requests": len(requests),
        "answered_200": len(answered),
        "lost": len(requests) - len(answered),
        "wrong_answers": len(wrong),
        "wrong": wrong,
        "duplicates": completed - len(answered),
        "stuck": int(stuck),
        "retried_429": sum(r.get("retries", 0) for r in results.values()),
        "resent_after_disk_full": sum(r.get("resent", 0) for r in results.values()),
        "disk_full_windows": len(windows),
        "record_write_errors": delta("hsdp_record_write_errors_total"),
        "workers_killed": len(kills) if kill_every_s else 0,
        "nodes_killed": len(kills) if kill_node_every_s else 0,
        "recovery_s": kills,
        "resent_while_restarting": sum(r.get("restarted", 0) for r in results.values()),
        "jobs_run_again": run_again,
        "server_jobs_completed": completed,
        "server_requests_run": None if restarted else delta("hsdp_batched_requests_total"),
        "server_batches": None if restarted else delta("hsdp_batches_total"),
        "ttft_s": {f"p{q}": round(_percentile(ttfts, q), 4) for q in (50, 99)} if ttfts else None,
        "wall_s": round(wall_s, 3),
        "throughput_rps": round(len(answered) / wall_s, 2),
        "tokens_per_s": round(len(answered) * args.max_tokens / wall_s, 1)
        if args.model == "tiny-llama"
        else None,
        "latency_s": {f"p{q}": round(_percentile(latencies, q), 4) for q in (50, 90, 99)}
        | {"max": round(max(latencies), 4), "mean": round(statistics.mean(latencies), 4)},
        "not_answered": {
            i: str(results.get(i, {}).get("status")) for i in range(len(requests)) if i not in answered
        },
        "ok": not wrong and not stuck and len(answered) == len(requests) and completed == len(requests),
    }


def _chaos_label(
    kill_every_s: float | None,
    disk_full_every_s: float | None,
    disk_full_for_s: float,
    kill_node_every_s: float | None = None,
) -> str:
    faults = [f"a worker killed every {kill_every_s:g}s"] if kill_every_s else []
    faults += [f"a node killed every {kill_node_every_s:g}s"] if kill_node_every_s else []
    faults += [f"disk full {disk_full_for_s:g}s of every {disk_full_every_s:g}s"] if disk_full_every_s else []
    return f" ({', '.join(faults)})" if faults else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="tiny-llama", help="tiny-llama (completions), an image or a video pipeline"
    )
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
        "--disk-full-every",
        type=float,
        default=None,
        help="also run the first layout while the output dir is full --disk-full-for s of every S s",
    )
    parser.add_argument("--disk-full-for", type=float, default=2.0)
    parser.add_argument(
        "--nodes", type=int, default=1, help="run each server over N local torchrun nodes (c10d on loopback)"
    )
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node with --nodes")
    parser.add_argument(
        "--kill-node-every",
        type=float,
        nargs="?",
        const=30.0,
        default=None,
        help="with --nodes and a video pipeline: also run the first layout while the ranks of a node without "
        "rank 0 are killed every S s (default 30), under torchrun --max-restarts",
    )
    parser.add_argument(
        "--mixed",
        action="store_true",
        help="pipelines: some requests with a negative prompt, some with an image",
    )
    parser.add_argument(
        "--stream", action="store_true", help="streamed completions (reports time to first token)"
    )
    parser.add_argument("--output", type=Path, default=Path("bench_results/serve_load.json"))
    args = parser.parse_args()
    if args.nodes > 1 and (args.kill_every or args.disk_full_every):
        parser.error("--kill-every and --disk-full-every run on one host; over --nodes use --kill-node-every")
    if args.kill_node_every and args.nodes < 2:
        parser.error("--kill-node-every needs --nodes 2 or more")
    if args.kill_node_every:
        from hsdp.engine.model_info import inspect_model
        from hsdp.models.builtin import resolve_model

        if inspect_model(resolve_model(args.model)).output != "video":
            parser.error(
                "--kill-node-every needs a video pipeline (--model tiny-wan): torchrun restarts rank 0's HTTP "
                "server with the group, and only asynchronous video jobs outlive it"
            )

    prompts = [f"request {i}: " for i in range(args.requests)]
    print(f"computing {len(prompts)} one-process references ...", flush=True)
    image = args.model != "tiny-llama"
    if image:
        requests: list = _diffusion_requests(args.model, prompts, args.mixed)
        want = _diffusion_references(args.model, requests)
    else:
        requests, want = prompts, _references(prompts, args.max_tokens)
    layouts = [f"{args.layouts[0]} --max-batch-size {b}" for b in args.batch_sizes] if image else args.layouts
    rows = []
    over = f" over {args.nodes} nodes x {args.nproc_per_node}" if args.nodes > 1 else ""
    for layout in layouts:
        print(f"load: {layout}{over} ...", flush=True)
        rows.append(load_run(layout, requests, want, args, Path(tempfile.mkdtemp(prefix="serve-load-"))))
    chaos = [(args.kill_every, None, None)] if args.kill_every else []
    chaos += [(args.kill_every, args.disk_full_every, None)] if args.disk_full_every else []
    chaos += [(None, None, args.kill_node_every)] if args.kill_node_every else []
    chaos_layout = layouts[-1] if image else layouts[0]  # pipelines: the largest --max-batch-size
    for kill_every_s, disk_full_every_s, kill_node_every_s in chaos:
        label = _chaos_label(kill_every_s, disk_full_every_s, args.disk_full_for, kill_node_every_s)
        print(f"load{label}: {chaos_layout}{over} ...", flush=True)
        workdir = Path(tempfile.mkdtemp(prefix="serve-chaos-"))
        faults = (kill_every_s, disk_full_every_s, kill_node_every_s)
        rows.append(load_run(chaos_layout, requests, want, args, workdir, *faults))
    what = (
        "one output each" + (", mixed inputs" if args.mixed else "")
        if image
        else f"{args.max_tokens} tokens each"
    )
    print(f"\n{args.requests} requests ({what}), concurrency {args.concurrency}, {args.model}")
    header = [
        "layout",
        "200",
        "lost",
        "wrong",
        "dup",
        "stuck",
        "killed",
        "nodes killed",
        "disk full",
        "resent",
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
                 row["stuck"], row["workers_killed"], row["nodes_killed"], row["disk_full_windows"], row["resent_after_disk_full"],
                 row["jobs_run_again"], row["server_batches"], row["throughput_rps"],
                 f"{ratio:.2f}", lat["p50"], lat["p90"], lat["p99"], lat["max"], ttft]  # fmt: skip
        print(" | ".join(str(c) for c in cells))
    ok = all(r["ok"] for r in rows)
    print(
        f"\n{'OK' if ok else 'FAILED'}: every request answered once, with the one-process answer for its prompt, "
        "nothing stuck"
    )
    summary = {
        "model": args.model,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "stream": args.stream,
        "mixed": args.mixed,
        "nodes": args.nodes,
        "nproc_per_node": args.nproc_per_node,
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
