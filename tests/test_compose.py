"""The combination tier (``-m compose``, issue 27): features that compose, each case against one process.

The axes and the pairwise cases are data (:mod:`tests.compose_axes`); each case runs one request (two with
``beside``, one per adapter with ``rotation``) on ``tiny-wan`` and compares every output with plain diffusers in
this process for the same request and seed: the case's adapter loaded by ``load_lora_weights`` at its scale and its
step cache enabled from the diffusers config class with the fields asked for (:func:`reference`;
:data:`HSDP_CACHE_DEFAULTS` names the one field hsdp adds). A refused pair is a case too: refused before loading, by the Engine,
``hsdp generate`` and ``hsdp serve`` alike, with a message naming both flags.

Tolerances: exact where the math is one process's (every layout, cache and adapter at the slots' rank); 1e-5 on
pixels in [0, 1] for requests batched beside another (CPU GEMM kernels round differently for another batch size,
docs/serving.md); 1e-3 with ``--compile`` (inductor fuses and reorders float ops; tests/test_engine_compile.py).
Outputs arrive as floats (``generate``), PNG (images: 8 bits, so a pixel within the tolerance may round to the
next level: 1 level) or mp4 (chat and videos: the encoder is deterministic, so exact cases compare bytes; otherwise
the decoded videos may differ by as much as the reference's own decoded video moves when its frames move by the
tolerance, :func:`_codec_bound`).

Cases run ordered by host (:func:`host_key`) so each engine or server starts once; the matrix with each case's
verdict is printed at the end and written to ``compose-matrix.json`` in pytest's base temp folder (and to
``$HSDP_COMPOSE_MATRIX`` when set).
"""

from __future__ import annotations

import io
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from hsdp import ParallelConfig
from hsdp.cli import main as cli_main
from hsdp.engine import Engine, SamplingParams
from hsdp.engine.model_info import inspect_model
from hsdp.engine.outputs import encode_image, save_frames
from hsdp.serve.settings import ServeSettings
from tests import compose_axes
from tests.compose_axes import AXES, Case, cases, covered_pairs, uncovered_pairs
from tests.compose_hosts import (
    BLOCKER_STEPS,
    CACHE_CONFIGS,
    FPS,
    LAYOUTS,
    ROUTES,
    SIZE,
    SYNC_ROUTES,
    EngineHost,
    NodesHost,
    Request,
    ServerHost,
    assert_batched,
    batch_counts,
    run_concurrently,
    submit_video,
    sync_answer,
    torchrun_generate,
    video_content,
    wait_in_progress,
)
from tests.engine_refs import _fresh_copies, builtin, one_thread
from tests.lora_refs import diffusers_folder, save_adapter

CASES = cases()
PROMPTS = (("a red fox in the snow", 11), ("a cat playing piano", 12))
"""The case's request, and the one beside it (seed + 1: the seed ``generate`` gives a second prompt)."""
ADAPTERS = {
    "none": [(None, 1.0)],
    "one": [("x", 1.0)],
    "rotation": [("x", 1.0), ("y", 1.0)],
    "scale": [("x", 0.5)],
    "runtime": [("late", 1.0)],
}
ANY_ADAPTER = ("one", "rotation", "scale", "runtime")
KNOWN_SEAMS: tuple[tuple[dict, str], ...] = ()
"""Where a case meets a seam that another branch fixes (or that is reported): xfail(strict) until then."""


def known_seam(case: Case) -> str | None:
    hits = [why for when, why in KNOWN_SEAMS if compose_axes.Rule(when, "seam", why).matches(case.values)]
    return "; ".join(hits) or None
RESULTS: dict[str, dict] = {}


def host_key(case: Case) -> tuple:
    """What a case runs on: cases with the same key share one engine or server."""
    if case.refused:
        return ("refused",)
    if case.layout == "torchrun-2-nodes":
        return ("torchrun-generate",) if case.route == "generate" else ("nodes",)
    if case.route == "generate":
        return ("engine", case.layout, case.compile)
    return ("server", case.layout, case.compile, case.cache)


ORDERED = sorted(CASES, key=lambda c: (host_key(c), list(AXES["lifecycle"]).index(c.lifecycle)))


def runtime_name(case: Case) -> str:
    return f"late{CASES.index(case)}"


def requests(case: Case) -> list[list[Request]]:
    """The case's requests, by adapter: each inner list is sent together (one batch when ``beside``)."""
    steps = 12 if case.lifecycle == "killed" else 6  # a longer job to kill mid-way
    frames = 1 if case.route == "images" else 5
    cache = None if case.cache == "none" else case.cache
    prompts = PROMPTS if case.batching == "beside" else PROMPTS[:1]
    return [
        [
            Request(prompt, seed, runtime_name(case) if name == "late" else name, scale, steps, frames, cache)
            for prompt, seed in prompts
        ]
        for name, scale in ADAPTERS[case.adapter]
    ]


# -- fixtures -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> Path:
    return builtin("tiny-wan", tmp_path_factory.getbasetemp() / "hsdp-cache")


@pytest.fixture(scope="module")
def root(wan, tmp_path_factory) -> Path:
    """``--lora-root``: adapters x and y (served from the start) and late (loaded at run time), rank 4."""
    from diffusers import WanTransformer3DModel

    folder = tmp_path_factory.mktemp("compose-lora")
    transformer = WanTransformer3DModel.from_pretrained(str(wan / "transformer"))
    targets = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]
    for seed, name in enumerate(("x", "y", "late"), start=3):
        save_adapter(transformer, folder / name, targets, seed=seed)
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
    """diffusers' pipeline in this process, the request's adapter loaded by diffusers itself (``load_lora_weights``
    of its diffusers-format file, peft underneath) at the request's scale (``set_adapters``)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(wan)
    _fresh_copies(*(m for m in pipe.components.values() if isinstance(m, torch.nn.Module)))
    pipe.set_progress_bar_config(disable=True)
    if request.adapter is not None:
        folder = root / ("late" if request.adapter.startswith("late") else request.adapter)
        pipe.load_lora_weights(str(diffusers_folder(folder)), adapter_name="case")
        pipe.set_adapters(["case"], adapter_weights=[request.scale])
    return pipe


def reference(wan: Path, root: Path, request: Request) -> np.ndarray:
    """Frames of plain diffusers in this process for the request: the adapter by ``load_lora_weights``, the cache by
    diffusers' config class with the fields asked for."""
    pipe = _plain_pipeline(wan, root, request)
    if request.cache is not None:
        pipe.transformer.enable_cache(_diffusers_cache(request.cache))
    call = {
        **inspect_model(wan).defaults,
        "height": SIZE,
        "width": SIZE,
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


def tolerance(case: Case) -> float:
    if case.compile == "on":
        return 1e-3
    return 1e-5 if case.batching == "beside" else 0.0


def _decode_mp4(data: bytes, folder: Path) -> np.ndarray:
    import imageio.v3 as iio

    path = folder / "decode.mp4"
    path.write_bytes(data)
    return iio.imread(path, extension=".mp4").astype(np.int16)


def compare(case: Case, got, expected: np.ndarray, folder: Path) -> float:
    """Assert ``got`` (floats, PNG or mp4 bytes) equals the one-process frames within the case's tolerance;
    returns the largest difference seen (pixels in [0, 1], or 8-bit levels for encoded outputs)."""
    tol = tolerance(case)
    if case.route == "generate":
        diff = float(np.abs(got - expected).max())
        assert got.shape == expected.shape and diff <= tol, f"max|diff| {diff:.3g} > {tol:g}"
        return diff
    if case.route == "images":
        want = encode_image(expected[0], ".png")
        if tol == 0:
            assert got == want, "PNG differs from one process"
            return 0.0
        from PIL import Image

        a, b = (np.asarray(Image.open(io.BytesIO(x))).astype(np.int16) for x in (got, want))
        diff = float(np.abs(a - b).max())
        assert diff <= 1, f"PNG levels differ by {diff:g} > 1"
        return diff
    want = save_frames(expected, folder / "ref.mp4", fps=FPS).read_bytes()
    if tol == 0:
        assert got == want, "mp4 differs from one process"
        return 0.0
    decoded_want = _decode_mp4(want, folder)
    diff = float(np.abs(_decode_mp4(got, folder) - decoded_want).max())
    bound = _codec_bound(expected, tol, decoded_want, folder)
    assert diff <= bound, f"decoded mp4 differs by {diff:g} levels > {bound:g} (frames moved by {tol:g})"
    return diff


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
    return ServeSettings(
        model=str(wan),
        parallel_config=LAYOUTS[case.layout],
        output_dir=folder,
        lora=(f"x={root / 'x'}", f"y={root / 'y'}"),
        max_loras=2,
        lora_root=root,
        cache=cache,
        cache_config=CACHE_CONFIGS.get(cache) if cache else None,
        compile=case.compile == "on",
        max_batch_size=2,
        # A compiled server's first batch of two compiles the blocks again for that shape, with no step or heartbeat
        # meanwhile: minutes on a loaded CPU, which 120 s took for a hang (the jobs then ran again alone, unbatched).
        step_timeout_s=600 if case.compile == "on" else 120,
    )


def _nodes_args(root: Path, folder: Path) -> list[str]:
    return [
        *("--use-hsdp", "--hsdp-shard-size", "2", "--max-loras", "2", "--max-batch-size", "2"),
        *("--lora", f"x={root / 'x'}", "--lora", f"y={root / 'y'}", "--lora-root", str(root)),
        *("--output-dir", str(folder)),
    ]


def _blocker() -> Request:
    return Request("a long job ahead", 1, None, 1.0, BLOCKER_STEPS, 5, None)


def run_on_server(host, case: Case) -> list:
    """The case's outputs, in :func:`requests` order, through its route on ``host``."""
    host.wait_ready()  # an earlier case may have killed a worker
    client = host.client
    if case.adapter == "runtime":
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": runtime_name(case), "lora_path": "late"})
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
    if case.adapter == "runtime":
        engine.add_adapter(runtime_name(case), host.root / "late")
    outputs = []
    for group in requests(case):
        first = group[0]
        params = SamplingParams(
            seed=first.seed,
            num_inference_steps=first.steps,
            height=SIZE,
            width=SIZE,
            num_frames=first.frames,
            cache=first.cache,
            cache_config=CACHE_CONFIGS.get(first.cache) if first.cache else None,
        )
        results = engine.generate(
            [r.prompt for r in group], params, batch_size=len(group), adapter=first.adapter, adapter_scale=first.scale
        )
        if first.cache is not None:
            assert all(out.cache and out.cache["skipped"] > 0 for out in results), "the cache skipped nothing"
        outputs += [out.frames for out in results]
    return outputs


class TorchrunGenerate:
    """Every torchrun ``generate`` case in one launch of tests/compose_torchrun.py (an Engine per compile)."""

    def __init__(self, wan: Path, root: Path, folder: Path):
        engines: dict[str, list] = {}
        for case in ORDERED:
            if host_key(case) != ("torchrun-generate",):
                continue
            calls = [
                {"prompts": [r.prompt for r in g], "seed": g[0].seed, "adapter": g[0].adapter, "scale": g[0].scale}
                for g in requests(case)
            ]
            first = requests(case)[0][0]
            engines.setdefault(case.compile, []).append(
                {
                    "key": case.id,
                    "cache": first.cache,
                    "cache_config": CACHE_CONFIGS.get(first.cache) if first.cache else None,
                    "steps": first.steps,
                    "runtime": runtime_name(case) if case.adapter == "runtime" else None,
                    "calls": calls,
                }
            )
        spec = {"root": str(root), "engines": engines}
        self.outputs = torchrun_generate(wan, spec, folder / "torchrun.npz", folder / "torchrun.log")

    def frames(self, case: Case) -> list:
        groups = requests(case)
        return [self.outputs[f"{case.id}|{i}|{j}"] for i, g in enumerate(groups) for j in range(len(g))]


def _host(hosts: Hosts, case: Case, wan: Path, root: Path, dist_run, folder: Path):
    key = host_key(case)
    name = "-".join(str(k) for k in key)
    if key[0] == "engine":
        return hosts.get(key, lambda: EngineHost(wan, case.layout, case.compile == "on", root, dist_run))
    if key[0] == "server":
        return hosts.get(key, lambda: ServerHost(_server_settings(wan, root, case, folder / name), dist_run))
    if key[0] == "nodes":
        return hosts.get(key, lambda: NodesHost(wan, _nodes_args(root, folder / name / "out"), folder / name))
    return hosts.get(key, lambda: TorchrunGenerate(wan, root, folder))


def _refusal(case: Case, wan: Path, tmp_path: Path, capsys) -> str:
    """The refused pair: Engine, hsdp generate and hsdp serve each refuse it before loading, naming both flags."""
    rule = case.refused
    cache, fields = case.cache, CACHE_CONFIGS[case.cache]
    with pytest.raises(ValueError) as info:
        Engine(wan, ParallelConfig(), compile=True, cache=cache, cache_config=fields)
    messages = [str(info.value)]
    flags = ["--compile", "--cache", cache, "--cache-config", json.dumps(fields)]
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
            row["detail"] = _refusal(case, wan, tmp_path, capsys)
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
        diffs = [compare(case, out, reference(wan, root, r), tmp_path) for out, r in zip(outputs, flat, strict=True)]
        row["max_diff"] = max(diffs)
        row["verdict"] = "pass"
    except BaseException as exc:
        row["detail"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
        if known_seam(case):
            row["verdict"] = f"xfail ({known_seam(case)})"
        raise


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
        detail = "" if row is None else row.get("detail", f"max diff {row.get('max_diff', 0):.2g}")
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
