"""The combination tier (``-m compose``, issue 27): features that compose, each case against one process.

The axes and the pairwise cases are data (:mod:`tests.compose_axes`); each case runs one request (two with
``beside``, one per adapter with ``rotation``) on ``tiny-wan`` and compares every output with plain diffusers in
this process for the same request and seed: the case's adapter loaded by ``load_lora_weights`` at its scale and its
step cache enabled from the diffusers config class with the fields asked for (:func:`reference`;
:data:`HSDP_CACHE_DEFAULTS` names the one field hsdp adds). A refused pair is a case too: refused before loading, by the Engine,
``hsdp generate`` and ``hsdp serve`` alike, with a message naming both flags.

Tolerances (:data:`TOLERANCES`, derived in docs/compose.md): exact where the math is one process's (every layout,
cache, adapter at the slots' rank, ``--offload-layers``, ``--attention-backend``); 1e-5 on pixels in [0, 1] for
requests batched beside another (CPU GEMM kernels round differently for another batch size, docs/serving.md) and
for ``--vae-parallel`` (docs/performance.md); 1e-3 with ``--compile`` (inductor fuses and reorders float ops;
tests/test_engine_compile.py); their sum when a case has several. ``--weight-dtype int8`` is exact against the same
weights quantized and dequantized in one process, and within PSNR 40 dB of plain diffusers' own weights.
Outputs arrive as floats (``generate``), PNG (images: 8 bits, so a pixel within the tolerance may round to the
next level: 1 level) or mp4 (chat and videos: the encoder is deterministic, so exact cases compare bytes; otherwise
the decoded videos may differ by as much as the reference's own decoded video moves when its frames move by the
tolerance, :func:`_codec_bound`).

Cases run ordered by host (:func:`host_key`) so each engine or server starts once; the matrix with each case's
verdict is printed at the end and written to ``compose-matrix.json`` in pytest's base temp folder (and to
``$HSDP_COMPOSE_MATRIX`` when set).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from hsdp.cli import main as cli_main
from hsdp.engine import Engine, SamplingParams
from hsdp.engine.model_info import inspect_model
from hsdp.engine.outputs import encode_image, save_frames
from hsdp.serve.settings import ServeSettings
from tests import compose_axes
from tests.compose_axes import AXES, OPTION_AXES, Case, cases, covered_pairs, host_key, uncovered_pairs
from tests.compose_hosts import (
    BLOCKER_STEPS,
    CACHE_CONFIGS,
    FPS,
    LAYOUT_FLAGS,
    ROUTES,
    SIZE,
    SPLIT_SIZE,
    SYNC_ROUTES,
    EngineHost,
    NodesHost,
    Request,
    ServerHost,
    adapter_file,
    assert_batched,
    batch_counts,
    host_options,
    option_flags,
    run_concurrently,
    submit_video,
    sync_answer,
    torchrun_generate,
    video_content,
    wait_in_progress,
)
from tests.engine_refs import _fresh_copies, builtin, one_thread
from tests.lora_refs import WAN_BLOCK_LINEARS, diffusers_folder, kohya_files, save_adapter

CASES = cases()
PROMPTS = (("a red fox in the snow", 11), ("a cat playing piano", 12))
"""The case's request, and the one beside it (seed + 1: the seed ``generate`` gives a second prompt)."""
ADAPTERS = {
    "none": [(None, 1.0)],
    "one": [("x", 1.0)],
    "rotation": [("x", 1.0), ("y", 1.0)],
    "scale": [("x", 0.5)],
    "runtime": [("late", 1.0)],
    "composed": [(("x", "kohya"), (1.0, 0.5))],
}
"""Adapter axis value -> the requests' adapters (one request, or one per adapter in turn) and scales. ``late`` and
``kohya`` are LoRA files added while running (:data:`tests.compose_hosts.FILE_ADAPTERS`), named per case."""
ANY_ADAPTER = ("one", "rotation", "scale", "runtime", "composed")
KNOWN_SEAMS: tuple[tuple[dict, str], ...] = ()
"""Where a case meets a seam that another branch fixes (or that is reported): xfail(strict) until then."""


def known_seam(case: Case) -> str | None:
    hits = [why for when, why in KNOWN_SEAMS if compose_axes.Rule(when, "seam", why).matches(case.values)]
    return "; ".join(hits) or None
RESULTS: dict[str, dict] = {}


ORDERED = sorted(CASES, key=lambda c: (host_key(c), list(AXES["lifecycle"]).index(c.lifecycle)))


def case_name(case: Case, name: str) -> str:
    """An adapter added while running is named per case (``late7``), so that each case adds its own."""
    return f"{name}{CASES.index(case)}" if adapter_file(name) else name


def added_adapters(case: Case) -> dict[str, str]:
    """The case's adapters added while running: name -> its file under the root."""
    names = [n for name, _ in ADAPTERS[case.adapter] for n in (name if isinstance(name, tuple) else (name,)) if n]
    return {case_name(case, n): adapter_file(n) for n in names if adapter_file(n)}


def requests(case: Case) -> list[list[Request]]:
    """The case's requests, by adapter: each inner list is sent together (one batch when ``beside``)."""
    steps = 12 if case.lifecycle == "killed" else 6  # a longer job to kill mid-way
    frames = 1 if case.route == "images" else 5
    cache = None if case.cache == "none" else case.cache
    size = SPLIT_SIZE if case.vae == "parallel" else SIZE
    prompts = PROMPTS if case.batching == "beside" else PROMPTS[:1]

    def named(name):
        return tuple(case_name(case, n) for n in name) if isinstance(name, tuple) else name and case_name(case, name)

    return [
        [Request(prompt, seed, named(name), scale, steps, frames, cache, size) for prompt, seed in prompts]
        for name, scale in ADAPTERS[case.adapter]
    ]


# -- fixtures -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> Path:
    return builtin("tiny-wan", tmp_path_factory.getbasetemp() / "hsdp-cache")


@pytest.fixture(scope="module")
def root(wan, tmp_path_factory) -> Path:
    """``--lora-root``: peft adapters x and y (served from the start), rank 4, and LoRA files of other tools added
    while running: ``comfyui.safetensors`` and ``kohya.safetensors`` (one adapter of every block linear layer,
    feed-forward included, in ComfyUI's and musubi-tuner's keys)."""
    from diffusers import WanTransformer3DModel

    folder = tmp_path_factory.mktemp("compose-lora")
    transformer = WanTransformer3DModel.from_pretrained(str(wan / "transformer"))
    targets = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]
    for seed, name in enumerate(("x", "y"), start=3):
        save_adapter(transformer, folder / name, targets, seed=seed)
    kohya_files(save_adapter(transformer, folder / "k", WAN_BLOCK_LINEARS, seed=5), transformer, folder)
    return folder


class Hosts:
    """The host of the current run of cases; a case with another :func:`host_key` closes it first."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.host = None

    def get(self, key: tuple, make):
        if key != self.key:
            self.close()
            self.host, self.key = make(), key
        return self.host

    def close(self) -> None:
        host, self.host, self.key = self.host, None, None
        if host is not None and hasattr(host, "close"):
            host.close()


@pytest.fixture(scope="module")
def hosts(dist_run, request, tmp_path_factory):
    """Single-host servers in this process load their engine on the session's warm worker group."""
    from hsdp.serve import service

    original = service.Engine

    def on_warm_group(model, config, *, workers=None, **kwargs):
        return original(model, config, workers=workers or dist_run.group(config.resolved().world_size), **kwargs)

    patch = pytest.MonkeyPatch()
    patch.setattr(service, "Engine", on_warm_group)
    manager = Hosts()
    yield manager
    manager.close()
    patch.undo()
    _report(request.config, tmp_path_factory.getbasetemp())


# -- one process --------------------------------------------------------------------------------------------
HSDP_CACHE_DEFAULTS = {"taylorseer": {"taylor_factors_dtype": None}}
"""What hsdp puts in a cache config beyond the fields a user gives (``hsdp.engine.cache.DEFAULT_FIELDS``), named here
so that the reference sets it in the open: diffusers keeps TaylorSeer's factors in bfloat16 by default, hsdp in the
features' dtype, so ``--cache taylorseer`` differs from plain diffusers at its defaults (issue 33, What to build 3:
the one remaining hsdp choice in this reference)."""


def _diffusers_cache(name: str):
    """The cache as a diffusers user enables it: its config class with the fields asked for (CACHE_CONFIGS)."""
    import diffusers.hooks

    from hsdp.engine.cache import CACHE_CLASSES

    cls = getattr(diffusers.hooks, CACHE_CLASSES[name])
    return cls(**CACHE_CONFIGS[name], **HSDP_CACHE_DEFAULTS.get(name, {}))


def _plain_pipeline(wan: Path, root: Path, request: Request):
    """diffusers' pipeline in this process, the request's adapters loaded by diffusers itself (``load_lora_weights``
    of a diffusers-format file, or of a kohya / ComfyUI file its converters read; peft underneath) at the request's
    scales (``set_adapters``, which composes several)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(wan)
    _fresh_copies(*(m for m in pipe.components.values() if isinstance(m, torch.nn.Module)))
    pipe.set_progress_bar_config(disable=True)
    if request.adapter is not None:
        names = request.adapter if isinstance(request.adapter, tuple) else (request.adapter,)
        scales = request.scale if isinstance(request.scale, tuple) else (request.scale,)
        for i, name in enumerate(names):
            file = adapter_file(name)
            pipe.load_lora_weights(str(root / file if file else diffusers_folder(root / name)), adapter_name=f"a{i}")
        pipe.set_adapters([f"a{i}" for i in range(len(names))], adapter_weights=list(scales))
    return pipe


REFERENCES: dict[tuple, np.ndarray] = {}
"""The module's one-process frames by what they depend on (:func:`reference_key`): computed once, compared by every
case that sends the same request to the same math."""


def reference_key(request: Request, values: dict[str, str]) -> tuple:
    """What plain diffusers' frames depend on: the request, its adapters by file (a name added while running is
    per case, its file is not), the attention backend and int8's round trip of the weights."""

    def source(name: str) -> str:
        return adapter_file(name) or name

    adapter = request.adapter
    adapter = tuple(map(source, adapter)) if isinstance(adapter, tuple) else adapter and source(adapter)
    options = host_options({"layout": "one-process", **values})
    return (dataclasses.replace(request, adapter=adapter), options["attention_backend"], options["weight_dtype"])


def reference(wan: Path, root: Path, request: Request, values: dict[str, str] | None = None) -> np.ndarray:
    """:func:`one_process`'s frames, computed once per :func:`reference_key` in this module."""
    values = values or {}
    key = reference_key(request, values)
    if key not in REFERENCES:
        REFERENCES[key] = one_process(wan, root, request, values)
    return REFERENCES[key].copy()


def one_process(wan: Path, root: Path, request: Request, values: dict[str, str]) -> np.ndarray:
    """Frames of plain diffusers in this process for the request: the adapter by ``load_lora_weights``, the cache by
    diffusers' config class with the fields asked for, the attention backend by the denoisers'
    ``set_attention_backend``; with ``weights: int8`` in ``values``, the weights that 8-bit shards store replaced by
    their quantize-dequantize round trip (what the sharded run computes with; diffusers has no such option)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    pipe = _plain_pipeline(wan, root, request)
    info = inspect_model(wan)
    default_backend = _AttentionBackendRegistry._active_backend
    if (backend := host_options({"layout": "one-process", **values})["attention_backend"]) is not None:
        for name in info.denoisers:
            getattr(pipe, name).set_attention_backend(backend)
    if values.get("weights") == "int8":
        from tests.quantize_fns import fake_quantize_pipeline

        fake_quantize_pipeline(pipe, info.shardable)
    if request.cache is not None:
        pipe.transformer.enable_cache(_diffusers_cache(request.cache))
    call = {
        **info.defaults,
        "height": request.size,
        "width": request.size,
        "num_frames": request.frames,
        "num_inference_steps": request.steps,
    }
    try:
        with one_thread():
            import torch

            with torch.no_grad():
                generator = torch.Generator().manual_seed(request.seed)
                return pipe(request.prompt, generator=generator, output_type="np", **call).frames[0]
    finally:
        if request.cache is not None:
            pipe.transformer.disable_cache()
        # diffusers' set_attention_backend also makes the backend its process-wide default: keep it to this
        # pipeline, or the next case's reference runs it (1e-6 off, found by the int8 case after a math one).
        _AttentionBackendRegistry.set_active_backend(default_backend)


TOLERANCES = {
    ("compile", "on"): 1e-3,
    ("batching", "beside"): 1e-5,
    ("vae", "parallel"): 1e-5,
}
"""Each setting whose output is not one process's bit for bit, and its bound on pixels in [0, 1] (derived in
docs/compose.md, Tolerances). Every other value is exact."""
INT8_PSNR_MIN_DB = 40.0
"""``--weight-dtype int8`` against plain diffusers' full-precision weights (docs/compose.md, Tolerances): exact
against the same weights quantized and dequantized in one process, and this close to the unquantized pipeline."""


def tolerance(case: Case) -> float:
    """The sum of the case's settings' bounds: each moves the output by at most its own bound whatever the others
    do (each is a rounding of the same computation, a few ulps of the values it touches)."""
    return sum(bound for (axis, value), bound in TOLERANCES.items() if case.values[axis] == value)


def png_levels(tol: float) -> int:
    """8-bit levels two pixels within ``tol`` of each other may round to: ``floor(255 tol) + 1`` (0 when exact)."""
    return 0 if tol == 0 else int(255 * tol) + 1


def _decode_mp4(data: bytes, folder: Path) -> np.ndarray:
    import imageio.v3 as iio

    path = folder / "decode.mp4"
    path.write_bytes(data)
    return iio.imread(path, extension=".mp4").astype(np.int16)


def compare(case: Case, got, expected: np.ndarray, folder: Path) -> tuple[float, float]:
    """Assert ``got`` (floats, PNG or mp4 bytes) equals the one-process frames within the case's tolerance;
    returns the largest difference seen and its bound (pixels in [0, 1], or 8-bit levels for encoded outputs)."""
    tol = tolerance(case)
    if case.route == "generate":
        diff = float(np.abs(got - expected).max())
        assert got.shape == expected.shape and diff <= tol, f"max|diff| {diff:.3g} > {tol:g}"
        return diff, tol
    if case.route == "images":
        want = encode_image(expected[0], ".png")
        if tol == 0:
            assert got == want, "PNG differs from one process"
            return 0.0, 0.0
        diff = float(np.abs(_decode_png(got) - _decode_png(want)).max())
        assert diff <= png_levels(tol), f"PNG levels differ by {diff:g} > {png_levels(tol)}"
        return diff, png_levels(tol)
    want = save_frames(expected, folder / "ref.mp4", fps=FPS).read_bytes()
    if tol == 0:
        assert got == want, "mp4 differs from one process"
        return 0.0, 0.0
    decoded_want = _decode_mp4(want, folder)
    diff = float(np.abs(_decode_mp4(got, folder) - decoded_want).max())
    bound = _codec_bound(expected, tol, decoded_want, folder)
    assert diff <= bound, f"decoded mp4 differs by {diff:g} levels > {bound:g} (frames moved by {tol:g})"
    return diff, bound


def _decode_png(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data))).astype(np.int16)


def int8_psnr(twin: np.ndarray, plain: np.ndarray) -> float:
    """PSNR (dB) of int8 frames against plain diffusers' full-precision frames. ``twin``: plain diffusers' frames with
    the weights quantized and dequantized, which the output equals within the case's bound (:func:`compare`): an mp4
    of 32 x 32 frames would add its codec's own loss (decoded, 35 dB for frames 0.005 apart)."""
    mse = float(np.mean((twin.astype(np.float64) - plain) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def _codec_bound(expected: np.ndarray, tol: float, decoded: np.ndarray, folder: Path) -> float:
    """How far the decoded video moves when the frames move by at most ``tol``: the reference frames shifted by
    +tol, -tol and a random sign per pixel, encoded and decoded like the server's."""
    signs = np.random.default_rng(0).choice([-1.0, 1.0], size=expected.shape)
    worst = 0.0
    for shift in (tol, -tol, tol * signs):
        moved = save_frames(np.clip(expected + shift, 0, 1), folder / "moved.mp4", fps=FPS).read_bytes()
        worst = max(worst, float(np.abs(_decode_mp4(moved, folder) - decoded).max()))
    return worst


# -- running a case -----------------------------------------------------------------------------------------
def _server_settings(wan: Path, root: Path, case: Case, folder: Path) -> ServeSettings:
    cache = None if case.cache == "none" else case.cache
    # 8-bit shards take no adapter slots (refused): an int8 server serves the base only.
    adapters = {"lora": (f"x={root / 'x'}", f"y={root / 'y'}"), "max_loras": 2, "lora_root": root}
    return ServeSettings(
        model=str(wan),
        output_dir=folder,
        **({} if case.weights == "int8" else adapters),
        **host_options(case.values),
        cache=cache,
        cache_config=CACHE_CONFIGS.get(cache) if cache else None,
        compile=case.compile == "on",
        max_batch_size=2,
        # A compiled server's first batch of two compiles the blocks again for that shape, with no step or heartbeat
        # meanwhile: minutes on a loaded CPU, which 120 s took for a hang (the jobs then ran again alone, unbatched).
        step_timeout_s=600 if case.compile == "on" else 120,
    )


def _nodes_args(case: Case, root: Path, folder: Path) -> list[str]:
    adapters = ["--max-loras", "2", "--lora", f"x={root / 'x'}", "--lora", f"y={root / 'y'}", "--lora-root", str(root)]
    return [
        *("--use-hsdp", "--hsdp-shard-size", "2", "--max-batch-size", "2"),
        *([] if case.weights == "int8" else adapters),
        *option_flags(case.values),
        *("--output-dir", str(folder)),
    ]


def _blocker() -> Request:
    return Request("a long job ahead", 1, None, 1.0, BLOCKER_STEPS, 5, None)


def run_on_server(host, case: Case) -> list:
    """The case's outputs, in :func:`requests` order, through its route on ``host``."""
    host.wait_ready()  # an earlier case may have killed a worker
    client = host.client
    if case.adapter == "runtime":  # a composed request's file loads on first use (its lora.local_path)
        for name, file in added_adapters(case).items():
            loaded = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": file})
            assert loaded.status_code == 200, loaded.text
    groups = requests(case)
    flat = [r for group in groups for r in group]
    sizes = [len(group) for group in groups]
    if case.lifecycle == "restarted":  # queued behind a long job when the server stops
        submit_video(client, _blocker())
        wait_in_progress(client)
        ids = [submit_video(client, r) for r in flat]
        host.restart()
        host.wait_ready()
        outputs = [video_content(host.client, i) for i in ids]
        # The restarted server counts from 0; the blocker, if it runs again, runs alone (another batch key).
        assert_batched(host.client, (0.0, 0.0), sizes)
        return outputs
    if case.lifecycle == "killed":
        mark = host.failure_mark()
        # torchrun restarts rank 0's process (the HTTP server) with the group: a synchronous request cannot wait
        # for its re-run there; it is answered 503 with Retry-After, and the client sends it again.
        resent = isinstance(host, NodesHost) and case.route in SYNC_ROUTES
        send = (lambda c, r: sync_answer(c, case.route, r)) if resent else ROUTES[case.route]
        with ThreadPoolExecutor(len(flat)) as pool:
            if max(sizes) > 1:  # the requests wait queued together behind a long job, to be killed in one batch
                submit_video(client, _blocker())
                wait_in_progress(client)
            futures = [pool.submit(send, client, r) for r in flat]
            # Beside: the kill hits one engine call running a group's requests together (those that were
            # interrupted then run again alone, so only the running jobs can show the batch).
            wait_in_progress(client, received=len(flat), together=max(sizes))
            host.kill_worker()
            outputs = [f.result() for f in futures]
        if resent:
            for answer in outputs:
                assert answer.status_code == 503 and answer.json()["error"]["code"] == "restarting", answer.text
                assert int(answer.headers["Retry-After"]) >= 5, answer.headers
            host.wait_ready()
            outputs = [ROUTES[case.route](host.client, r) for r in flat]
        assert host.failure_noticed(mark), "the kill was not noticed"
        return outputs
    outputs = []
    for group in groups:
        since = batch_counts(client)
        if len(group) > 1:  # the two wait queued together behind a long job: one batch
            submit_video(client, _blocker())
            wait_in_progress(client)
        outputs += run_concurrently(client, case.route, group)
        assert_batched(client, since, [len(group)])
    return outputs


def run_on_engine(host: EngineHost, case: Case) -> list:
    engine = host.engine
    for name, file in added_adapters(case).items():
        engine.add_adapter(name, host.root / file)
    outputs = []
    for group in requests(case):
        first = group[0]
        params = SamplingParams(
            seed=first.seed,
            num_inference_steps=first.steps,
            height=first.size,
            width=first.size,
            num_frames=first.frames,
            cache=first.cache,
            cache_config=CACHE_CONFIGS.get(first.cache) if first.cache else None,
        )
        adapter, scale = _engine_adapter(first)
        results = engine.generate(
            [r.prompt for r in group], params, batch_size=len(group), adapter=adapter, adapter_scale=scale
        )
        if first.cache is not None:
            assert all(out.cache and out.cache["skipped"] > 0 for out in results), "the cache skipped nothing"
        outputs += [out.frames for out in results]
    return outputs


def _engine_adapter(request: Request) -> tuple:
    """``Engine.generate``'s ``adapter`` and ``adapter_scale`` for a request (lists when composed)."""
    if isinstance(request.adapter, tuple):
        return list(request.adapter), list(request.scale)
    return request.adapter, request.scale


class TorchrunGenerate:
    """Every torchrun ``generate`` case in one launch of tests/compose_torchrun.py (an Engine per set of
    :data:`OPTION_AXES` values)."""

    def __init__(self, wan: Path, root: Path, folder: Path):
        engines: dict[tuple, dict] = {}
        for case in ORDERED:
            if host_key(case) != ("torchrun-generate",):
                continue
            calls = [
                dict(zip(("adapter", "scale"), _engine_adapter(g[0]), strict=True), prompts=[r.prompt for r in g],
                     seed=g[0].seed)
                for g in requests(case)
            ]  # fmt: skip
            first = requests(case)[0][0]
            values = {a: case.values[a] for a in OPTION_AXES}
            engine = engines.setdefault(tuple(values.values()), {"values": values, "cases": []})
            engine["cases"].append(
                {
                    "key": case.id,
                    "cache": first.cache,
                    "cache_config": CACHE_CONFIGS.get(first.cache) if first.cache else None,
                    "steps": first.steps,
                    "size": first.size,
                    "adapters": added_adapters(case),
                    "calls": calls,
                }
            )
        spec = {"root": str(root), "engines": list(engines.values())}
        self.outputs = torchrun_generate(wan, spec, folder / "torchrun.npz", folder / "torchrun.log")

    def frames(self, case: Case) -> list:
        groups = requests(case)
        return [self.outputs[f"{case.id}|{i}|{j}"] for i, g in enumerate(groups) for j in range(len(g))]


def _host(hosts: Hosts, case: Case, wan: Path, root: Path, dist_run, folder: Path):
    key = host_key(case)
    name = "-".join(str(k) for k in key)
    if key[0] == "engine":
        return hosts.get(key, lambda: EngineHost(wan, case.values, root, dist_run))
    if key[0] == "server":
        return hosts.get(key, lambda: ServerHost(_server_settings(wan, root, case, folder / name), dist_run))
    if key[0] == "nodes":
        return hosts.get(key, lambda: NodesHost(wan, _nodes_args(case, root, folder / name / "out"), folder / name))
    return hosts.get(key, lambda: TorchrunGenerate(wan, root, folder))


def _refusal(case: Case, wan: Path, root: Path, tmp_path: Path, capsys) -> str:
    """The refused pair: Engine, hsdp generate and hsdp serve each refuse it before loading, naming both flags."""
    rule = case.refused
    options = host_options(case.values)
    config = options.pop("parallel_config")
    cache = None if case.cache == "none" else case.cache
    fields = CACHE_CONFIGS.get(cache) if cache else None
    adapters = {} if case.adapter == "none" else {"lora": {"x": root / "x"}}
    with pytest.raises(ValueError) as info:
        Engine(wan, config, compile=case.compile == "on", cache=cache, cache_config=fields, **adapters, **options)
    messages = [str(info.value)]
    flags = [*LAYOUT_FLAGS[case.layout], *option_flags(case.values), *(["--compile"] if case.compile == "on" else [])]
    flags += ["--cache", cache, "--cache-config", json.dumps(fields)] if cache else []
    flags += ["--lora", f"x={root / 'x'}"] if adapters else []
    generate = ["generate", "--model", str(wan), *flags, "--prompt", "x", "--output", str(tmp_path / "x.mp4")]
    serve = ["serve", str(wan), *flags, "--output-dir", str(tmp_path / "serve")]
    for argv in (generate, serve):
        capsys.readouterr()
        assert cli_main(argv) == 2, argv
        messages.append(capsys.readouterr().err)
    for message in messages:
        assert all(s in message for s in rule.says), message
        assert "Traceback" not in message
    return messages[0].splitlines()[-1].strip()


def _params():
    for case in ORDERED:
        seam = known_seam(case)
        marks = [pytest.mark.xfail(strict=True, reason=seam)] if seam else []
        yield pytest.param(case, id=case.id, marks=marks)


@pytest.mark.compose
@pytest.mark.slow
@pytest.mark.parametrize("case", list(_params()))
def test_case_equals_one_process(case, hosts, wan, root, dist_run, tmp_path, tmp_path_factory, capsys):
    row = RESULTS[case.id] = {**case.values, "host": "/".join(map(str, host_key(case))), "verdict": "FAIL"}
    try:
        if case.refused:
            row["detail"] = _refusal(case, wan, root, tmp_path, capsys)
            row["verdict"] = "refused (expected)"
            return
        host = _host(hosts, case, wan, root, dist_run, tmp_path_factory.getbasetemp() / "compose")
        if isinstance(host, TorchrunGenerate):
            outputs = host.frames(case)
        elif isinstance(host, EngineHost):
            outputs = run_on_engine(host, case)
        else:
            outputs = run_on_server(host, case)
        flat = [r for group in requests(case) for r in group]
        assert len(outputs) == len(flat)
        diffs = []
        for out, r in zip(outputs, flat, strict=True):
            expected = reference(wan, root, r, case.values)
            diffs.append(compare(case, out, expected, tmp_path))
            if case.weights == "int8":  # no diffusers twin: its derived bound against plain diffusers' weights
                psnr = int8_psnr(expected, reference(wan, root, r))
                row["psnr_db"] = min(psnr, row.get("psnr_db", float("inf")))
                assert psnr >= INT8_PSNR_MIN_DB, f"int8 PSNR {psnr:.1f} dB against plain diffusers < {INT8_PSNR_MIN_DB}"
        row["max_diff"], row["bound"] = max(d for d, _ in diffs), max(b for _, b in diffs)
        row["verdict"] = "pass"
    except BaseException as exc:
        row["detail"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
        if known_seam(case):
            row["verdict"] = f"xfail ({known_seam(case)})"
        raise


def _measured(row: dict) -> str:
    text = f"max diff {row.get('max_diff', 0):.2g} (bound {row.get('bound', 0):.2g})"
    return text + (f", int8 PSNR {row['psnr_db']:.1f} dB (>= {INT8_PSNR_MIN_DB:g})" if "psnr_db" in row else "")


def _report(config: pytest.Config, base: Path) -> None:
    if not RESULTS:
        return
    axes = list(AXES)
    widths = {a: max(len(a), *(len(v) for v in AXES[a])) for a in axes}
    lines = [
        f"combination tier: {len(CASES)} cases, {covered_pairs(CASES)} of {len(compose_axes.all_pairs())} value "
        "pairs covered (the rest do not exist: docs/compose.md)",
        " | ".join(a.ljust(widths[a]) for a in axes) + " | verdict",
    ]
    for case in ORDERED:
        row = RESULTS.get(case.id)
        verdict = "not run" if row is None else row["verdict"]
        detail = "" if row is None else row.get("detail", _measured(row))
        lines.append(" | ".join(case.values[a].ljust(widths[a]) for a in axes) + f" | {verdict}: {detail}")
    reporter = config.pluginmanager.getplugin("terminalreporter")
    text = "\n".join(lines)
    if reporter is not None:
        reporter.write_line("\n" + text)
    payload = json.dumps({"cases": [RESULTS.get(c.id, {**c.values, "verdict": "not run"}) for c in ORDERED]}, indent=1)
    (base / "compose-matrix.json").write_text(payload)
    if os.environ.get("HSDP_COMPOSE_MATRIX"):
        Path(os.environ["HSDP_COMPOSE_MATRIX"]).write_text(payload)


# -- the axes themselves (cheap) ----------------------------------------------------------------------------
@pytest.mark.unit
def test_every_pair_is_covered_or_does_not_exist():
    assert uncovered_pairs(CASES) == []
    assert len({c.id for c in CASES}) == len(CASES)
    # each refused pair is a case whose outcome is the refusal; no other case holds a refused pair
    for case in CASES:
        hit = [r for r in compose_axes.REFUSED if r.matches(case.values)]
        assert (case.refused is not None) == bool(hit), case.id


@pytest.mark.unit
def test_docs_table_is_generated_from_the_axes():
    text = compose_axes.DOC.read_text()
    assert compose_axes.render_doc(text) == text, "run: python -m tests.compose_axes --docs"
    for values in AXES.values():
        assert all(re.search(rf"`{re.escape(v)}`", text) for v in values)
