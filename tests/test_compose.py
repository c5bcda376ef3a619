"""The combination tier (``-m compose``, issue 27): features that compose, each case against one process.

The axes and the pairwise cases are data (:mod:`tests.compose_axes`); each case runs one request (two with
``beside``, one per adapter with ``rotation``) on ``tiny-wan``, or on the model its values imply (Wan 2.2's two
experts, ``tiny-stable-audio``, LTX-2: :mod:`tests.compose_models`), and compares every output with plain diffusers
in this process for the same request and seed: the case's adapter loaded by ``load_lora_weights`` at its scale (peft
itself for Stable Audio, which diffusers has no LoRA loader for) and its step cache enabled from the diffusers config
class with the fields asked for (:func:`reference`; :data:`HSDP_CACHE_DEFAULTS` names the one field hsdp adds). A refused pair is a case too: refused before loading, by the Engine,
``hsdp generate`` and ``hsdp serve`` alike, with a message naming both flags.

Tolerances (:data:`TOLERANCES`, derived in docs/compose.md): exact where the math is one process's (every layout,
cache, adapter at the slots' rank, ``--offload-layers``, ``--attention-backend``); 1e-5 on pixels in [0, 1] for
requests batched beside another (CPU GEMM kernels round differently for another batch size, docs/serving.md) and
for ``--vae-parallel`` (docs/performance.md); 1e-3 with ``--compile`` (inductor fuses and reorders float ops;
tests/test_engine_compile.py); their sum when a case has several. ``--weight-dtype int8`` is exact against the same
weights quantized and dequantized in one process, and within PSNR 40 dB of plain diffusers' own weights.
Outputs arrive as floats (``generate``), PNG (images: 8 bits, so a pixel within the tolerance may round to the
next level: 1 level), wav (speech: 16 bits, :func:`wav_levels`) or mp4 (chat and videos; sound: with its AAC track;
the encoders are deterministic, so exact cases compare bytes; otherwise the decoded videos and tracks may differ by
as much as the reference's own decoded ones move when its frames or waveform move by the tolerance,
:func:`_codec_bound`, :func:`_track_bound`).

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
from hsdp.engine.outputs import encode_audio, encode_image, save_frames
from hsdp.serve.settings import ServeSettings
from tests import compose_axes
from tests.compose_axes import (
    AXES,
    OPTION_AXES,
    Case,
    cases,
    covered_pairs,
    host_key,
    model_of,
    uncovered_pairs,
)
from tests.compose_hosts import (
    BLOCKER_STEPS,
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
    cache_config,
    host_options,
    option_flags,
    run_concurrently,
    start_adapters,
    submit_video,
    sync_answer,
    torchrun_generate,
    video_content,
    wait_in_progress,
)
from tests.compose_models import SPEECH_SECONDS, build_model, build_root, load_adapters
from tests.engine_refs import _fresh_copies, one_thread
from tests.lora_refs import diffusers_folder

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
    "two-expert": [("w", 1.0)],
}
"""Adapter axis value -> the requests' adapters (one request, or one per adapter in turn) and scales. ``late`` and
``kohya`` are LoRA files added while running (:data:`tests.compose_hosts.FILE_ADAPTERS`), named per case."""
ANY_ADAPTER = ("one", "rotation", "scale", "runtime", "composed", "two-expert")
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
    speech = case.route == "speech"
    frames = None if speech else 1 if case.route == "images" else 5
    cache = None if case.cache == "none" else case.cache
    size = SPLIT_SIZE if case.vae == "parallel" else SIZE
    prompts = PROMPTS if case.batching == "beside" else PROMPTS[:1]
    shape = {"audio_seconds": SPEECH_SECONDS if speech else None, "model": model_of(case.values)}

    def named(name):
        return tuple(case_name(case, n) for n in name) if isinstance(name, tuple) else name and case_name(case, name)

    return [
        [Request(prompt, seed, named(name), scale, steps, frames, cache, size, **shape) for prompt, seed in prompts]
        for name, scale in ADAPTERS[case.adapter]
    ]


# -- fixtures -----------------------------------------------------------------------------------------------
class Models:
    """The tier's models and their ``--lora-root`` folders (tests/compose_models.py), each built on first use: a
    ``-k`` run of tiny-wan cases builds tiny-wan only."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.paths: dict[str, Path] = {}
        self.roots: dict[str, Path] = {}

    def path(self, name: str) -> Path:
        if name not in self.paths:
            self.paths[name] = build_model(name, self.base)
        return self.paths[name]

    def root(self, name: str) -> Path:
        """``--lora-root``: peft adapters x and y (served from the start; Wan 2.2: ``w``, one per expert), rank 4, and
        LoRA files of other tools added while running: ``comfyui.safetensors`` and ``kohya.safetensors`` (tiny-wan:
        one adapter of every block linear layer, feed-forward included, in ComfyUI's and musubi-tuner's keys)."""
        if name not in self.roots:
            self.roots[name] = build_root(name, self.path(name), self.base / "compose-lora" / name)
        return self.roots[name]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.getbasetemp())


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


def _diffusers_cache(name: str, model: str):
    """The cache as a diffusers user enables it: its config class with the fields asked for (:func:`cache_config`)."""
    import diffusers.hooks

    from hsdp.engine.cache import CACHE_CLASSES

    cls = getattr(diffusers.hooks, CACHE_CLASSES[name])
    return cls(**cache_config(name, model), **HSDP_CACHE_DEFAULTS.get(name, {}))


def _adapter_source(models: Models, model: str, name: str) -> Path:
    """What plain diffusers loads for adapter ``name``: a LoRA file under the root, Wan 2.2's two-expert export,
    a peft folder (Stable Audio, through peft) or the peft folder in diffusers' own format (``load_lora_weights``)."""
    root = models.root(model)
    if file := adapter_file(name):
        return root / file
    if model in ("wan2.2-a14b", "tiny-stable-audio"):
        return root / name
    return diffusers_folder(root / name)


def _plain_pipeline(models: Models, request: Request):
    """diffusers' pipeline in this process, the request's adapters loaded by diffusers itself (``load_lora_weights``
    of a diffusers-format file, or of a kohya / ComfyUI / LTX-2 file its converters read; peft underneath; peft
    itself for Stable Audio, which diffusers has no LoRA loader for) at the request's scales (``set_adapters``, which
    composes several): :func:`tests.compose_models.load_adapters`."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(models.path(request.model))
    _fresh_copies(*(m for m in pipe.components.values() if isinstance(m, torch.nn.Module)))
    pipe.set_progress_bar_config(disable=True)
    if request.adapter is not None:
        names = request.adapter if isinstance(request.adapter, tuple) else (request.adapter,)
        scales = request.scale if isinstance(request.scale, tuple) else (request.scale,)
        loads = [(n, _adapter_source(models, request.model, n), s) for n, s in zip(names, scales, strict=True)]
        load_adapters(pipe, request.model, models.root(request.model), loads)
    return pipe


REFERENCES: dict[tuple, dict] = {}
"""The module's one-process outputs by what they depend on (:func:`reference_key`): computed once, compared by every
case that sends the same request to the same math."""


def reference_key(request: Request, values: dict[str, str]) -> tuple:
    """What plain diffusers' output depends on: the request (its model included), its adapters by file (a name added
    while running is per case, its file is not), the attention backend and int8's round trip of the weights."""

    def source(name: str) -> str:
        return adapter_file(name) or name

    adapter = request.adapter
    adapter = tuple(map(source, adapter)) if isinstance(adapter, tuple) else adapter and source(adapter)
    options = host_options({"layout": "one-process", **values})
    return (dataclasses.replace(request, adapter=adapter), options["attention_backend"], options["weight_dtype"])


def reference(models: Models, request: Request, values: dict[str, str] | None = None) -> dict:
    """:func:`one_process`'s outputs, computed once per :func:`reference_key` in this module."""
    values = values or {}
    key = reference_key(request, values)
    if key not in REFERENCES:
        REFERENCES[key] = one_process(models, request, values)
    return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in REFERENCES[key].items()}


def one_process(models: Models, request: Request, values: dict[str, str]) -> dict:
    """Plain diffusers in this process for the request: ``frames`` (video, image), ``audio`` (a speech waveform, or
    LTX-2's sound track) and its ``rate``. The adapter by ``load_lora_weights``, the cache by diffusers' config
    class with the fields asked for on every denoiser (both of Wan 2.2's experts), the attention backend by the
    denoisers' ``set_attention_backend``; with ``weights: int8`` in ``values``, the weights that 8-bit shards store
    replaced by their quantize-dequantize round trip (what the sharded run computes with; diffusers has no such
    option). A sound video is made for the mp4's frame rate (``frame_rate``, as the server passes it)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    from hsdp.engine.params import frame_rate_args

    pipe = _plain_pipeline(models, request)
    info = inspect_model(models.path(request.model))
    denoisers = [getattr(pipe, name) for name in info.denoisers]
    default_backend = _AttentionBackendRegistry._active_backend
    if (backend := host_options({"layout": "one-process", **values})["attention_backend"]) is not None:
        for denoiser in denoisers:
            denoiser.set_attention_backend(backend)
    if values.get("weights") == "int8":
        from tests.quantize_fns import fake_quantize_pipeline

        fake_quantize_pipeline(pipe, info.shardable)
    if request.cache is not None:
        for denoiser in denoisers:
            denoiser.enable_cache(_diffusers_cache(request.cache, request.model))
    if request.audio_seconds is not None:
        call = {**info.defaults, info.audio_length_param: request.audio_seconds, "num_inference_steps": request.steps}
    else:
        call = {
            **info.defaults,
            "height": request.size,
            "width": request.size,
            "num_frames": request.frames,
            "num_inference_steps": request.steps,
            **(frame_rate_args(info, FPS) if info.audio_track else {}),
        }
    try:
        with one_thread(), torch.no_grad():
            generator = torch.Generator().manual_seed(request.seed)
            out = pipe(request.prompt, generator=generator, output_type="np", **call)
    finally:
        if request.cache is not None:
            for denoiser in denoisers:
                denoiser.disable_cache()
        # diffusers' set_attention_backend also makes the backend its process-wide default: keep it to this
        # pipeline, or the next case's reference runs it (1e-6 off, found by the int8 case after a math one).
        _AttentionBackendRegistry.set_active_backend(default_backend)
    if request.audio_seconds is not None:
        return {"audio": np.asarray(out.audios[0]), "rate": int(pipe.vae.sampling_rate)}
    result = {"frames": out.frames[0]}
    if info.audio_track:
        result.update(audio=np.asarray(out.audio[0]), rate=int(pipe.vocoder.config.output_sampling_rate))
    return result


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


def wav_levels(tol: float) -> int:
    """16-bit levels two waveforms within ``2 tol`` of each other (``tol`` on the [0, 1] scale of pixels; a waveform
    spans [-1, 1], twice that) may round to: ``floor(32768 * 2 tol) + 1`` (0 when exact)."""
    return 0 if tol == 0 else int(32768 * 2 * tol) + 1


def _decode_wav(data: bytes) -> np.ndarray:
    import soundfile

    return soundfile.read(io.BytesIO(data), dtype="int16")[0].astype(np.int32)


def _decode_track(data: bytes, rate: int, folder: Path) -> np.ndarray:
    """An mp4's sound track decoded to float32 ``(samples, channels)`` at ``rate`` (ffmpeg, as tests/test_audio.py)."""
    import subprocess

    import imageio_ffmpeg

    path = folder / "track.mp4"
    path.write_bytes(data)
    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(path), "-map", "0:a:0", "-f", "f32le",
               "-ac", "2", "-ar", str(rate), "-"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, check=True)
    return np.frombuffer(done.stdout, dtype="<f4").reshape(-1, 2)


def _sound_video(frames: np.ndarray, audio: np.ndarray, rate: int, path: Path) -> bytes:
    """The mp4 the server writes for frames with a sound track (:meth:`GenerationOutput.save`)."""
    return save_frames(np.clip(frames, 0, 1), path, fps=FPS, audio=(audio, rate)).read_bytes()


def _track_bound(expected: dict, tol: float, decoded: np.ndarray, folder: Path) -> float:
    """How far the decoded sound track moves when the waveform moves by at most ``2 tol`` (the [-1, 1] scale):
    the reference's waveform shifted by +, - and a random sign per sample, muxed and decoded like the server's."""
    signs = np.random.default_rng(0).choice([-1.0, 1.0], size=expected["audio"].shape)
    worst = 0.0
    for shift in (2 * tol, -2 * tol, 2 * tol * signs):
        moved = _sound_video(expected["frames"], expected["audio"] + shift, expected["rate"], folder / "moved.mp4")
        worst = max(worst, float(np.abs(_decode_track(moved, expected["rate"], folder) - decoded).max()))
    return worst


def compare(case: Case, got, expected: dict, folder: Path) -> tuple[float, float]:
    """Assert ``got`` (floats, PNG, wav or mp4 bytes) equals the one-process output (:func:`one_process`) within the
    case's tolerance; returns the largest difference seen and its bound (pixels in [0, 1], or 8-bit levels for
    encoded frames, 16-bit levels for a wav; for a sound video the larger of the frames' and the track's)."""
    tol = tolerance(case)
    if case.route == "speech":
        want = encode_audio(expected["audio"], expected["rate"], ".wav")
        if tol == 0:
            assert got == want, "wav differs from one process"
            return 0.0, 0.0
        got_pcm, want_pcm = _decode_wav(got), _decode_wav(want)
        assert got_pcm.shape == want_pcm.shape, (got_pcm.shape, want_pcm.shape)
        diff = float(np.abs(got_pcm - want_pcm).max())
        assert diff <= wav_levels(tol), f"wav samples differ by {diff:g} levels > {wav_levels(tol)}"
        return diff, wav_levels(tol)
    if case.route == "sound":
        want = _sound_video(expected["frames"], expected["audio"], expected["rate"], folder / "ref.mp4")
        if tol == 0:
            assert got == want, "mp4 (picture and sound) differs from one process"
            return 0.0, 0.0
        picture = _compare_mp4(got, want, expected["frames"], tol, folder)
        decoded_want = _decode_track(want, expected["rate"], folder)
        decoded_got = _decode_track(got, expected["rate"], folder)
        assert decoded_got.shape == decoded_want.shape, (decoded_got.shape, decoded_want.shape)
        diff = float(np.abs(decoded_got - decoded_want).max())
        bound = _track_bound(expected, tol, decoded_want, folder)
        assert diff <= bound, f"decoded sound track differs by {diff:g} > {bound:g} (waveform moved by {2 * tol:g})"
        return max(picture[0], diff), max(picture[1], bound)
    expected = expected["frames"]
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
    return _compare_mp4(got, want, expected, tol, folder)


def _compare_mp4(got: bytes, want: bytes, expected: np.ndarray, tol: float, folder: Path) -> tuple[float, float]:
    """The decoded pictures of two mp4s within :func:`_codec_bound`."""
    decoded_want = _decode_mp4(want, folder)
    diff = float(np.abs(_decode_mp4(got, folder) - decoded_want).max())
    bound = _codec_bound(expected, tol, decoded_want, folder)
    assert diff <= bound, f"decoded mp4 differs by {diff:g} levels > {bound:g} (frames moved by {tol:g})"
    return diff, bound


def _decode_png(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data))).astype(np.int16)


def int8_psnr(twin: dict, plain: dict) -> float:
    """PSNR (dB) of int8 outputs against plain diffusers' full-precision ones (the lower of the frames' and the
    waveform's; a waveform in [-1, 1] taken to [0, 1] as pixels are). ``twin``: plain diffusers' output with the
    weights quantized and dequantized, which the output equals within the case's bound (:func:`compare`): an mp4
    of 32 x 32 frames would add its codec's own loss (decoded, 35 dB for frames 0.005 apart)."""
    worst = float("inf")
    for key, scale in (("frames", 1.0), ("audio", 0.5)):
        if key in twin:
            mse = float(np.mean(((twin[key].astype(np.float64) - plain[key]) * scale) ** 2))
            worst = min(worst, float("inf") if mse == 0 else 10 * np.log10(1.0 / mse))
    return worst


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
def _server_settings(models: Models, case: Case, folder: Path) -> ServeSettings:
    model = model_of(case.values)
    root = models.root(model)
    cache = None if case.cache == "none" else case.cache
    # 8-bit shards take no adapter slots (refused): an int8 server serves the base only.
    adapters = {"lora": tuple(f"{n}={root / n}" for n in start_adapters(model)), "max_loras": 2, "lora_root": root}
    return ServeSettings(
        model=str(models.path(model)),
        output_dir=folder,
        **({} if case.weights == "int8" else adapters),
        **host_options(case.values),
        cache=cache,
        cache_config=cache_config(cache, model),
        compile=case.compile == "on",
        max_batch_size=2,
        # A compiled server's first batch of two compiles the blocks again for that shape, with no step or heartbeat
        # meanwhile: minutes on a loaded CPU, which 120 s took for a hang (the jobs then ran again alone, unbatched).
        step_timeout_s=600 if case.compile == "on" else 120,
    )


def _nodes_args(case: Case, root: Path, folder: Path) -> list[str]:
    lora = [arg for name in start_adapters(model_of(case.values)) for arg in ("--lora", f"{name}={root / name}")]
    adapters = ["--max-loras", "2", *lora, "--lora-root", str(root)]
    return [
        *("--use-hsdp", "--hsdp-shard-size", "2", "--max-batch-size", "2"),
        *([] if case.weights == "int8" else adapters),
        *option_flags(case.values),
        *("--output-dir", str(folder)),
    ]


AUDIO_BLOCKER_STEPS = 100
"""A speech job ahead of a case's requests: ``hsdp serve``'s default ``--max-steps`` (tiny-stable-audio's steps are
cheaper than tiny-wan's, so the most a request may ask)."""


def _blocker(client, case: Case, pool: ThreadPoolExecutor):
    """A long job ahead of the case's requests, so that they wait queued together: a video (its id), or on an audio
    server a speech request sent from ``pool`` (its future)."""
    if case.route == "speech":
        job = Request("a long job ahead", 1, None, 1.0, AUDIO_BLOCKER_STEPS, None, None, audio_seconds=SPEECH_SECONDS,
                      model=model_of(case.values))  # fmt: skip
        return pool.submit(ROUTES["speech"], client, job)
    return submit_video(client, Request("a long job ahead", 1, None, 1.0, BLOCKER_STEPS, 5, None))


def run_on_server(host, case: Case) -> list:
    """The case's outputs, in :func:`requests` order, through its route on ``host``."""
    with ThreadPoolExecutor(1) as blockers:
        outputs = _run_on_server(host, case, blockers)
    return outputs


def _run_on_server(host, case: Case, blockers: ThreadPoolExecutor) -> list:
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
        _blocker(client, case, blockers)
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
                _blocker(client, case, blockers)
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
            _blocker(client, case, blockers)
            wait_in_progress(client)
        outputs += run_concurrently(client, case.route, group)
        assert_batched(client, since, [len(group)])
    return outputs


def _sampling(request: Request) -> SamplingParams:
    """``Engine.generate``'s parameters for a request (the same fields a server request sends)."""
    return SamplingParams(
        seed=request.seed,
        num_inference_steps=request.steps,
        height=request.size,
        width=request.size,
        num_frames=request.frames,
        cache=request.cache,
        cache_config=cache_config(request.cache, request.model),
    )


def run_on_engine(host: EngineHost, case: Case) -> list:
    engine = host.engine
    for name, file in added_adapters(case).items():
        engine.add_adapter(name, host.root / file)
    outputs = []
    for group in requests(case):
        first = group[0]
        adapter, scale = _engine_adapter(first)
        results = engine.generate(
            [r.prompt for r in group], _sampling(first), batch_size=len(group), adapter=adapter, adapter_scale=scale
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
    """Every torchrun ``generate`` case in one launch of tests/compose_torchrun.py (an Engine per model and set of
    :data:`OPTION_AXES` values)."""

    def __init__(self, models: Models, folder: Path):
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
            model = model_of(case.values)
            values = {a: case.values[a] for a in OPTION_AXES}
            engine = engines.setdefault(
                (model, *values.values()),
                {"model": str(models.path(model)), "root": str(models.root(model)), "lora": start_adapters(model),
                 "values": values, "cases": []},
            )  # fmt: skip
            engine["cases"].append(
                {
                    "key": case.id,
                    "cache": first.cache,
                    "cache_config": cache_config(first.cache, model),
                    "steps": first.steps,
                    "size": first.size,
                    "adapters": added_adapters(case),
                    "calls": calls,
                }
            )
        spec = {"engines": list(engines.values())}
        self.outputs = torchrun_generate(spec, folder / "torchrun.npz", folder / "torchrun.log")

    def frames(self, case: Case) -> list:
        groups = requests(case)
        return [self.outputs[f"{case.id}|{i}|{j}"] for i, g in enumerate(groups) for j in range(len(g))]


def _host(hosts: Hosts, case: Case, models: Models, dist_run, folder: Path):
    key = host_key(case)
    name = "-".join(str(k) for k in key)
    model = model_of(case.values)
    if key[0] == "engine":
        return hosts.get(
            key, lambda: EngineHost(models.path(model), case.values, models.root(model), dist_run, model)
        )
    if key[0] == "server":
        return hosts.get(key, lambda: ServerHost(_server_settings(models, case, folder / name), dist_run))
    if key[0] == "nodes":
        args = _nodes_args(case, models.root(model), folder / name / "out")
        return hosts.get(key, lambda: NodesHost(models.path(model), args, folder / name))
    return hosts.get(key, lambda: TorchrunGenerate(models, folder))


def _refusal(case: Case, models: Models, tmp_path: Path, capsys) -> str:
    """The refused pair: Engine, hsdp generate and hsdp serve each refuse it before loading, naming both flags."""
    rule = case.refused
    model = model_of(case.values)
    path, root = models.path(model), models.root(model)
    options = host_options(case.values)
    config = options.pop("parallel_config")
    cache = None if case.cache == "none" else case.cache
    fields = cache_config(cache, model)
    # An adapter of the model (a LoRA file where the case adds one at run time), named as the case names it.
    name = next((n for n, _ in ADAPTERS[case.adapter] for n in (n if isinstance(n, tuple) else (n,))), None)
    name = name if adapter_file(name or "") else start_adapters(model)[0]
    adapters = {} if case.adapter == "none" else {"lora": {name: root / (adapter_file(name) or name)}}
    with pytest.raises(ValueError) as info:
        Engine(path, config, compile=case.compile == "on", cache=cache, cache_config=fields, **adapters, **options)
    messages = [str(info.value)]
    flags = [*LAYOUT_FLAGS[case.layout], *option_flags(case.values), *(["--compile"] if case.compile == "on" else [])]
    flags += ["--cache", cache, "--cache-config", json.dumps(fields)] if cache else []
    flags += [arg for n, p in adapters.get("lora", {}).items() for arg in ("--lora", f"{n}={p}")]
    output = tmp_path / ("x.wav" if case.route == "speech" else "x.mp4")
    generate = ["generate", "--model", str(path), *flags, "--prompt", "x", "--output", str(output)]
    serve = ["serve", str(path), *flags, "--output-dir", str(tmp_path / "serve")]
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
def test_case_equals_one_process(case, hosts, models, dist_run, tmp_path, tmp_path_factory, capsys):
    row = RESULTS[case.id] = {**case.values, "host": "/".join(map(str, host_key(case))), "verdict": "FAIL"}
    try:
        if case.refused:
            row["detail"] = _refusal(case, models, tmp_path, capsys)
            row["verdict"] = "refused (expected)"
            return
        host = _host(hosts, case, models, dist_run, tmp_path_factory.getbasetemp() / "compose")
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
            expected = reference(models, r, case.values)
            diffs.append(compare(case, out, expected, tmp_path))
            if case.weights == "int8":  # no diffusers twin: its derived bound against plain diffusers' weights
                psnr = int8_psnr(expected, reference(models, r))
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
