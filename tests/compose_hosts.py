"""What runs a combination case (tests/test_compose.py): engines and servers, kept while consecutive cases share
them, and the requests of each route.

A host is an :class:`hsdp.Engine` (route ``generate``), a server (the three HTTP routes) or, for the torchrun
layout, two torchrun agents (:class:`hsdp.serve.local.LocalNodes`) and a torchrun script for ``generate``. Single-
host servers run in this process (``hsdp.serve.service.Server`` behind uvicorn in a thread) with their engine on
the session's warm worker group (``dist_run``): starting one then costs a model load (~1 s), not new processes.
A killed worker still costs a new group, as in ``hsdp serve``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from hsdp import ParallelConfig
from hsdp.serve.local import LocalNodes, free_port
from tests.forked_cli import preloaded_python

LAYOUTS = {
    "one-process": ParallelConfig(),
    "hsdp2": ParallelConfig(use_hsdp=True, hsdp_shard_size=2),
    "ulysses2": ParallelConfig(use_hsdp=True, ulysses_degree=2),
    "cfg2": ParallelConfig(use_hsdp=True, cfg_parallel_size=2),
    "request-parallel2": ParallelConfig(use_hsdp=True, hsdp_shard_size=2, request_parallel=True),
    "torchrun-2-nodes": ParallelConfig(use_hsdp=True, hsdp_shard_size=2),
}
LAYOUT_FLAGS = {
    "one-process": [],
    "hsdp2": ["--use-hsdp", "--hsdp-shard-size", "2"],
    "ulysses2": ["--use-hsdp", "--ulysses-degree", "2"],
    "cfg2": ["--use-hsdp", "--cfg-parallel-size", "2"],
    "request-parallel2": ["--use-hsdp", "--hsdp-shard-size", "2", "--request-parallel"],
    "torchrun-2-nodes": ["--use-hsdp", "--hsdp-shard-size", "2"],
}
"""The layouts as ``hsdp generate`` / ``hsdp serve`` flags."""
CACHE_CONFIGS = {
    "first-block": {"threshold": 0.2},
    "taylorseer": {
        "cache_interval": 2,
        "disable_cache_before_step": 2,
        "cache_identifiers": [r"blocks\.\d+\.attn\d"],
    },
}
"""Configs that skip within a 6-step run of the tiny model (tests/test_engine_cache.py)."""
ATTENTION_IDENTIFIERS = {"tiny-ltx2": [r"transformer_blocks\.\d+\.(audio_)?attn\d"]}
"""TaylorSeer's layers, "the attention layers inside each block", where the model names them otherwise than Wan
(LTX-2: the video and the audio attention of each block)."""


def cache_config(name: str | None, model: str = "tiny-wan") -> dict | None:
    """The ``--cache-config`` of cache ``name`` on ``model`` (None without a cache)."""
    if name is None:
        return None
    config = dict(CACHE_CONFIGS[name])
    if name == "taylorseer" and model in ATTENTION_IDENTIFIERS:
        config["cache_identifiers"] = ATTENTION_IDENTIFIERS[model]
    return config


MODEL_ADAPTERS = {"wan2.2-a14b": ("w",)}
"""The adapters a model's hosts serve from the start (``--lora NAME=ROOT/NAME``); ``x`` and ``y`` otherwise."""


def start_adapters(model: str) -> tuple[str, ...]:
    return MODEL_ADAPTERS.get(model, ("x", "y"))
SIZE = 32
SPLIT_SIZE = 64
"""``--vae-parallel`` cases: 8 latent rows, 4 per rank (a latent under ``world x 4`` rows decodes whole)."""
FPS = 16
FILE_ADAPTERS = {"kohya": "kohya.safetensors", "late": "comfyui.safetensors"}
"""Adapters added while running, by name prefix (a case's name is the prefix and its index): LoRA files of other
tools under ``--lora-root`` (tests/lora_refs.py kohya_files): musubi-tuner's kohya keys, ComfyUI's."""


def adapter_file(name: str) -> str | None:
    """The file under ``--lora-root`` of an adapter added while running (:data:`FILE_ADAPTERS`), else None."""
    return next((file for prefix, file in FILE_ADAPTERS.items() if name.startswith(prefix)), None)


def host_options(values: dict[str, str]) -> dict:
    """A case's server-wide settings (``vae``, ``offload``, ``attention``, ``weights`` axes) as ``Engine`` /
    ``ServeSettings`` keyword arguments; the layout's config with ``--offload-layers``."""
    config = LAYOUTS[values["layout"]]
    if values.get("offload") == "on":
        config = dataclasses.replace(config, offload_layers=1)
    return {
        "parallel_config": config,
        "vae_parallel": True if values.get("vae") == "parallel" else None,
        "attention_backend": "_native_math" if values.get("attention") == "math" else None,
        "weight_dtype": "int8" if values.get("weights") == "int8" else None,
    }


def option_flags(values: dict[str, str]) -> list[str]:
    """The same settings as command-line flags (beside the layout's)."""
    options = host_options(values)
    flags = ["--vae-parallel"] if options["vae_parallel"] else []
    if options["parallel_config"].offload_layers is not None:
        flags += ["--offload-layers", str(options["parallel_config"].offload_layers)]
    if options["attention_backend"]:
        flags += ["--attention-backend", options["attention_backend"]]
    if options["weight_dtype"]:
        flags += ["--weight-dtype", options["weight_dtype"]]
    return flags
BLOCKER_STEPS = 30
"""A video job ahead of a case's requests, so that they wait queued together (batched beside each other, or
queued when the server stops)."""


@dataclass(frozen=True)
class Request:
    prompt: str
    seed: int
    adapter: str | tuple[str, ...] | None
    """A name, or names composed in one request (each with its scale in ``scale``)."""
    scale: float | tuple[float, ...]
    steps: int
    frames: int | None
    cache: str | None
    size: int = SIZE
    audio_seconds: float | None = None
    """Speech requests: seconds of audio (no size or frames)."""
    model: str = "tiny-wan"
    """What the request runs on (its cache config, and what the reference loads)."""

    @property
    def fields(self) -> dict:
        """The adapter as a request names it: ``model`` (vLLM) at scale 1, else vLLM-Omni's ``lora`` (a list
        when composed; a LoRA file of :data:`FILE_ADAPTERS` by its ``local_path``, loaded on first use)."""
        if self.adapter is None:
            return {}
        if isinstance(self.adapter, tuple):
            entries = [
                {"name": n, "scale": s, **({"local_path": adapter_file(n)} if adapter_file(n) else {})}
                for n, s in zip(self.adapter, self.scale, strict=True)
            ]
            return {"lora": entries}
        if self.scale == 1.0:
            return {"model": self.adapter}
        return {"lora": {"name": self.adapter, "scale": self.scale}}

    @property
    def generation(self) -> dict:
        if self.audio_seconds is not None:
            return {"seed": self.seed, "audio_seconds": self.audio_seconds, "num_inference_steps": self.steps}
        return {"seed": self.seed, "size": f"{self.size}x{self.size}", "num_inference_steps": self.steps}


# -- HTTP routes --------------------------------------------------------------------------------------------
def _images_body(request: Request) -> dict:
    return {"prompt": request.prompt, **request.generation, **request.fields}


def _chat_body(request: Request) -> dict:
    extra = {**request.generation, "num_frames": request.frames, "fps": FPS}
    body = {"messages": [{"role": "user", "content": request.prompt}], "extra_body": extra}
    if request.adapter is not None:
        body.update(request.fields if "model" in request.fields else {})
        extra.update(request.fields if "lora" in request.fields else {})
    return body


def _speech_body(request: Request) -> dict:
    return {"input": request.prompt, "response_format": "wav", **request.generation, **request.fields}


SYNC_ROUTES = {
    "images": ("/v1/images/generations", _images_body),
    "chat": ("/v1/chat/completions", _chat_body),
    "speech": ("/v1/audio/speech", _speech_body),
}
"""The routes answered on the request's connection: path, and the body for a :class:`Request`."""


def sync_answer(client: httpx.Client, route: str, request: Request) -> httpx.Response:
    """The response of a synchronous route, whatever its status."""
    path, body = SYNC_ROUTES[route]
    return client.post(path, json=body(request))


def _images(client: httpx.Client, request: Request) -> bytes:
    response = sync_answer(client, "images", request)
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][0]["b64_json"])


def _chat(client: httpx.Client, request: Request) -> bytes:
    response = sync_answer(client, "chat", request)
    assert response.status_code == 200, response.text
    url = response.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    assert url.startswith("data:video/mp4;base64,"), url[:40]
    return base64.b64decode(url.split(",", 1)[1])


def _speech(client: httpx.Client, request: Request) -> bytes:
    response = sync_answer(client, "speech", request)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "audio/wav", response.headers
    return response.content


def submit_video(client: httpx.Client, request: Request) -> str:
    body = {"prompt": request.prompt, **request.generation, "num_frames": request.frames, "fps": FPS}
    response = client.post("/v1/videos", json={**body, **request.fields})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def wait_video(client: httpx.Client, video_id: str, timeout_s: float = 600) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            job = client.get(f"/v1/videos/{video_id}").json()
        except httpx.HTTPError:  # a server being restarted
            job = {"status": "unreachable"}
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def video_content(client: httpx.Client, video_id: str) -> bytes:
    job = wait_video(client, video_id)
    assert job["status"] == "completed", job
    return client.get(f"/v1/videos/{video_id}/content").content


def _videos(client: httpx.Client, request: Request) -> bytes:
    return video_content(client, submit_video(client, request))


ROUTES = {"images": _images, "chat": _chat, "videos": _videos, "speech": _speech, "sound": _videos}


def run_concurrently(client: httpx.Client, route: str, requests: list[Request]) -> list[bytes]:
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: ROUTES[route](client, r), requests))


def metric(client: httpx.Client, name: str, label: str = "") -> float:
    text = client.get("/metrics").text
    values = re.findall(rf"^{name}\{{[^}}]*{re.escape(label)}[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for v in values)


def wait_in_progress(client: httpx.Client, timeout_s: float = 120, received: int = 1, together: int = 1) -> None:
    """Until ``together`` jobs run (``hsdp_jobs{state="in_progress"}``: the jobs of the one running engine call)
    and ``received`` jobs are queued or running."""
    deadline = time.monotonic() + timeout_s
    while (running := metric(client, "hsdp_jobs", 'state="in_progress"')) < together or (
        running + metric(client, "hsdp_jobs", 'state="queued"') < received
    ):
        assert time.monotonic() < deadline, f"not {together} job(s) running at once: {running}"
        time.sleep(0.005)


def batch_counts(client: httpx.Client) -> tuple[float, float]:
    """The runner's batch statistics from ``/metrics``: engine calls, and the requests they held (padding not
    counted)."""
    return metric(client, "hsdp_batches_total"), metric(client, "hsdp_batched_requests_total")


def assert_batched(client: httpx.Client, since: tuple[float, float], sizes: list[int]) -> None:
    """The engine calls since ``since`` (:func:`batch_counts`) held batches of ``sizes`` beside requests alone:
    each call adds one request more than it adds calls per request beside the first, so the excess of requests
    over calls is ``sum(size - 1)``. Requests run one per call (a server that never batches) add none."""
    calls, held = batch_counts(client)
    shared = (held - since[1]) - (calls - since[0])
    want = sum(size - 1 for size in sizes)
    assert shared == want, (
        f"batches of {sizes} should have formed: {held - since[1]:g} request(s) ran in {calls - since[0]:g} "
        f"engine call(s), so {shared:g} request(s) beside another, not {want}"
    )


# -- hosts --------------------------------------------------------------------------------------------------
class EngineHost:
    """Route ``generate``: an Engine on the session's warm group, the model's adapters (:func:`start_adapters`),
    slots for one more."""

    def __init__(self, model: Path, values: dict[str, str], root: Path, dist_run, name: str = "tiny-wan"):
        from hsdp.engine import Engine

        options = host_options(values)
        config = options.pop("parallel_config")
        self.root = root
        # 8-bit shards take no adapter slots (refused): an int8 engine serves the base only.
        lora = {n: root / n for n in start_adapters(name)}
        adapters = {} if options["weight_dtype"] else {"lora": lora, "max_loras": 2}
        self.engine = Engine(
            model,
            config,
            workers=dist_run.group(config.resolved().world_size),
            compile=values["compile"] == "on",
            call_timeout_s=600,
            **adapters,
            **options,
        )

    def close(self) -> None:
        self.engine.close()


class ServerHost:
    """The three HTTP routes on one single-host server (in this process, on the warm group)."""

    def __init__(self, settings, dist_run):
        self.settings, self.dist_run = settings, dist_run
        self._start()

    def _start(self) -> None:
        import uvicorn

        from hsdp.serve.app import create_app
        from hsdp.serve.service import Server

        # The warm group (and the fork server its ranks come from) before the server locks its --output-dir: a
        # fork server started while the lock is held would hold it too, and a restart would find it in use.
        self.dist_run.group(self.settings.parallel_config.resolved().world_size)
        self.server = Server(self.settings)
        self.server.start()
        self.port = free_port()
        config = uvicorn.Config(create_app(self.server), host="127.0.0.1", port=self.port, log_level="warning")
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uvicorn.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)

    def worker_pids(self) -> list[int]:
        return self.server.runner.engine.pids

    def kill_worker(self) -> None:
        os.kill(self.worker_pids()[-1], signal.SIGKILL)

    def failure_mark(self) -> int:
        return self.server.runner.stats.worker_failures

    def failure_noticed(self, mark: int) -> bool:
        """Whether a worker failure was noticed since :meth:`failure_mark` returned ``mark``."""
        return self.server.runner.stats.worker_failures > mark

    def restart(self) -> None:
        """Stop (the running batch finishes, queued jobs stay on disk), then start on the same --output-dir."""
        self.close()
        self._start()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 600
        while self.client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "server not ready"
            time.sleep(0.2)

    def close(self) -> None:
        self.client.close()
        self.uvicorn.should_exit = True  # its lifespan's end stops the server (and the engine)
        self.thread.join(120)


class NodesHost:
    """``hsdp serve`` over two torchrun agents (one rank each, HSDP 2), restarted by torchrun after a kill."""

    def __init__(self, model: Path, args: list[str], log_dir: Path):
        self.model, self.args, self.log_dir = model, args, log_dir
        self._start()

    def _start(self) -> None:
        # A new LocalNodes each start: a stopped one still holds its ended agents.
        # One thread per rank, as the warm group's ranks and torchrun_generate's: torchrun sets none at one rank per
        # agent, so each rank took every core and two ranks' gloo waits fought over them (a 30-step job ran 1.6 s a
        # step on 2 cores).
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.nodes = LocalNodes(str(self.model), self.args, log_dir=self.log_dir, max_restarts=1, env=env)
        self.nodes.start()
        self.client = httpx.Client(base_url=self.nodes.url, timeout=600)

    def kill_worker(self) -> None:
        self.nodes.kill_node(1 - (self.nodes.head_node() or 0))

    def failure_mark(self) -> dict:
        return self.nodes.ranks()

    def failure_noticed(self, mark: dict) -> bool:
        """Whether torchrun restarted the ranks since :meth:`failure_mark` returned ``mark`` (a restarted rank 0
        counts its failures anew, so the ranks' process ids tell)."""
        self.wait_ready()
        return self.nodes.ranks() != mark

    def restart(self) -> None:
        self.close()
        self._start()  # on a new port, the same --output-dir

    def wait_ready(self) -> None:
        self.nodes.wait_healthy(600)

    def close(self) -> None:
        self.client.close()
        self.nodes.stop()


def torchrun_generate(spec: dict, out: Path, log: Path, timeout_s: float = 900) -> dict:
    """Run ``tests/compose_torchrun.py`` on two torchrun agents (one rank each); its outputs by request key."""
    import numpy as np

    spec_path = out.with_suffix(".json")
    spec_path.write_text(json.dumps(spec))
    rdzv = free_port()
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    # Agents and ranks forked from a process with the imports done (tests/forked_cli.py); `-m tests...` is found
    # from the repository's root, their working folder
    cmd = [preloaded_python(), "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv}", "-m", "tests.compose_torchrun"]
    with open(log, "ab") as sink:
        agents = [
            subprocess.Popen([*cmd, str(spec_path), str(out)], stdout=sink, stderr=subprocess.STDOUT, env=env,
                             cwd=Path(__file__).parents[1])  # fmt: skip
            for _ in range(2)
        ]
        codes = [agent.wait(timeout_s) for agent in agents]
    assert codes == [0, 0], f"torchrun exit codes {codes}:\n{log.read_text()[-3000:]}"
    with np.load(out) as data:
        return {key: data[key] for key in data.files}
