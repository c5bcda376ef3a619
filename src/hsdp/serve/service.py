"""The server's state (settings, job store, engine runner) and the translation of requests into jobs.

Everything a request can get wrong is found here, in the HTTP handler, before a job is queued: the served
model name, the endpoint against the model kind, this server's limits, and the engine's own rules (through
:func:`hsdp.engine.params.build_requests`, the same check ``Engine.generate`` runs), so a queued job only
fails for reasons that are not the client's.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import threading
import time
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsdp.engine import Engine, SamplingParams
from hsdp.engine.adapters import SlotSpec, parse_adapters
from hsdp.engine.images import load_image
from hsdp.engine.leader import RESTART_GRACE_S, LeaderRanks
from hsdp.engine.model_info import inspect_model
from hsdp.engine.params import PER_REQUEST_INPUTS, RESERVED_ARGS, build_requests, frame_rate_args, video_fps
from hsdp.models.builtin import resolve_model
from hsdp.serve.jobs import Job, JobStore, QueueFull, Unavailable, answered_by
from hsdp.serve.media import Upload
from hsdp.serve.runner import EngineRunner
from hsdp.serve.schemas import (
    DEFAULT_FPS,
    DEFAULT_MODEL_ALIAS,
    EXTRA_PARAMS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DiffusionFields,
    JobObject,
    LoraRequest,
    VideoJob,
    check_limits,
    closest_fields,
    parse_size,
)
from hsdp.serve.settings import ServeSettings
from hsdp.serve.text import chat_prompt

if TYPE_CHECKING:
    from PIL.Image import Image

logger = logging.getLogger("hsdp")

__all__ = ["Server"]

_PER_REQUEST = ("seed", *PER_REQUEST_INPUTS)
"""Per-job values (the Job holds them), not part of the parameters a batch shares."""
ROUTES = {
    "video": ("/v1/videos", "/v1/videos/sync", "/v1/jobs", "/v1/images/generations", "/v1/chat/completions"),
    "image": ("/v1/images/generations", "/v1/jobs", "/v1/chat/completions"),
    "audio": ("/v1/audio/speech", "/v1/jobs", "/v1/chat/completions"),
    "text": ("/v1/completions", "/v1/chat/completions"),
}
"""The generation routes that serve each kind of output (image routes on a video pipeline make one frame)."""
JOB_KINDS = {
    "video": {"video", "video_sync", "image"},
    "image": {"image", "image_async"},
    "audio": {"audio", "audio_async"},
}
"""The jobs a diffusion pipeline can run, by the kind of output it makes."""
ASYNC_KIND = {"video": "video", "image": "image_async", "audio": "audio_async"}
"""The kind of a ``POST /v1/jobs`` job, by what the pipeline makes."""
CONTENT_TYPES = {
    "mp4": "video/mp4",
    "png": "image/png",
    "jpeg": "image/jpeg",
    "jpg": "image/jpeg",
    "webp": "image/webp",
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
}
_PROBLEM_PARAM = re.compile(r"^([a-z_0-9]+)\s*[:=]")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_ADAPTER_COUNTS = ("loads", "switches", "evictions")


TORCHRUN_RESTART_EXIT = 75
"""Exit status of rank 0 when a torchrun rank is gone: a failure, so torchrun restarts the group."""


def _await_torchrun_restart(stopped: threading.Event) -> None:
    """A torchrun rank died or hangs: this process cannot replace it, torchrun can (``--max-restarts``). The
    interrupted jobs are already queued again on disk, so the restarted server runs them. Wait for torchrun to
    stop this process (the dead rank's agent restarts it and the others follow the new rendezvous), and only
    then exit as failed ourselves: one restarting agent per failure keeps it to one rendezvous round."""
    logger.error(
        "a torchrun rank is gone; waiting up to %.0fs for torchrun to restart every rank (--max-restarts), then "
        "exiting (status %d); queued video jobs stay on disk and run after the restart",
        RESTART_GRACE_S,
        TORCHRUN_RESTART_EXIT,
    )
    if stopped.wait(RESTART_GRACE_S):
        raise RuntimeError("the server is stopping")
    logging.shutdown()
    os._exit(TORCHRUN_RESTART_EXIT)


def _base_names(settings: ServeSettings, folder: Path) -> tuple[str, ...]:
    """What a request's ``model`` may say for the base: ``default``, the served name, ``MODEL`` as given and its
    folder."""
    return (DEFAULT_MODEL_ALIAS, settings.name, str(settings.model), str(folder))


def adapter_name_problem(name: str, base_names: tuple[str, ...], flag: str) -> str | None:
    """Why an adapter cannot be served as ``name``: a request's ``model`` naming the base (``base_names``) would
    get the adapter instead (issue 33 item 4). One check for ``--lora NAME=DIR`` at start-up and
    ``/v1/load_lora_adapter`` at run time."""
    if name not in base_names:
        return None
    fix = f"e.g. {flag} {name}-lora=DIR" if flag == "--lora" else "pick another name"
    return (
        f"{flag}: the adapter name {name!r} is what requests say for the base model "
        f"({', '.join(repr(n) for n in base_names[:2])}), which the adapter would replace; name it apart ({fix})"
    )


def _form_value(value: Any) -> Any:
    """A multipart form's text as the JSON value it spells, else the text itself."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


class Server:
    """One model behind one queue. Building it checks what needs no loading (the settings, the model folder);
    ``start`` loads the model (errors surface before the server listens).
    ``workers``: under torchrun, rank 0's :class:`hsdp.engine.leader.LeaderRanks` over every rank of the job."""

    def __init__(self, settings: ServeSettings, workers: LeaderRanks | None = None):
        problems = settings.problems()
        folder = resolve_model(settings.model)
        kind = inspect_model(folder).kind  # from the folder's files: nothing loads yet
        try:
            startup_adapters = parse_adapters(settings.lora)
        except ValueError as exc:
            problems.append(str(exc))
            startup_adapters = {}
        base_names = _base_names(settings, folder)
        problems += [p for name in startup_adapters if (p := adapter_name_problem(name, base_names, "--lora"))]
        if kind == "causal_lm" and settings.max_batch_size > 1:
            problems.append(
                f"--max-batch-size {settings.max_batch_size}: causal LMs run one request at a time per rank "
                "(per-request seeds); use --request-parallel to run several side by side"
            )
        if problems:
            raise ValueError("invalid server settings:\n" + "\n".join(f"  - {p}" for p in problems))
        self.settings = settings
        self.store = JobStore(settings.output_dir, settings.max_queue, max_attempts=settings.max_attempts)
        self.runner = EngineRunner(
            self._make_engine,
            self.store,
            step_timeout_s=settings.step_timeout_s,
            max_batch_size=settings.max_batch_size,
        )
        self.runner.job_timeout_s = settings.job_timeout_s
        self.tokenizer = None
        self.max_positions: int | None = None
        self.startup_adapters: dict[str, Path] = startup_adapters
        self.adapter_paths: dict[str, Path] = dict(self.startup_adapters)
        """Adapter name -> folder: ``--lora`` and those loaded since, which a restarted engine serves again (those
        that still load) and a restarted server too (:meth:`_recall_adapters`)."""
        self._adapters_lock = threading.Lock()
        self._slots: SlotSpec | None = None
        """The adapter slots the first engine made; every restart makes the same."""
        self.base_loads = 0
        """Engines started: the base is loaded once per engine, never to switch adapters."""
        self._earlier_adapter_counts: Counter = Counter()
        self.leader = workers
        self._stopped = threading.Event()
        self.load_s = 0.0
        """How long :meth:`start` took to load the model: what a restarted server takes again (``Retry-After``)."""

    def _make_engine(self) -> Engine:
        s = self.settings
        if self.leader is not None and self.leader.broken:
            self.expect_torchrun_restart("a torchrun rank was lost and torchrun restarts every rank")
            _await_torchrun_restart(self._stopped)
        previous = self.runner.engine.adapter_stats if self.runner.engine is not None else None
        first = self.base_loads == 0
        if first:  # the slots from the flags: --lora's adapters, --max-loras, --max-lora-rank
            slots = {
                "lora": dict(self.startup_adapters) or None,
                "max_loras": s.adapter_slots,
                "max_lora_rank": s.max_lora_rank,
                "lora_target_modules": s.slot_modules,
            }
        else:  # the same slots, not re-derived from the adapters served now
            slots = {"adapter_slots": self._slots}
        engine = Engine(
            s.model,
            s.parallel_config,
            dtype=s.dtype,
            weight_dtype=s.weight_dtype,
            device_memory=s.device_memory,
            forward_prefetch=s.forward_prefetch,
            cache=s.cache,
            cache_config=s.cache_config,
            compile=s.compile,
            attention_backend=s.attention_backend,
            vae_parallel=s.vae_parallel,
            vae_tiling=s.vae_tiling,
            vae_slicing=s.vae_slicing,
            **slots,
            call_timeout_s=s.job_timeout_s,
            start_timeout_s=s.engine_start_timeout_s,
            # torchrun's ranks have no cancel board (a cancelled running job's output is dropped instead).
            cancellable=self.leader is None,
            workers=self.leader,
            # The server stops gracefully on SIGTERM as on SIGINT (hsdp.serve.cli), and both reach every process
            # of its group: the ranks stop when it tells them, after the running batch.
            shield_sigterm=True,
        )
        if first:
            self._slots = engine.adapter_slots
        self._serve_adapters(engine, skip=self.startup_adapters if first else {})
        self.base_loads += 1
        self._earlier_adapter_counts.update({k: (previous or {}).get(k, 0) for k in _ADAPTER_COUNTS})
        return engine

    def _serve_adapters(self, engine: Engine, skip: dict[str, Path]) -> None:
        """Add the adapters served (but those in ``skip``, which the engine has) to a new engine. One that no
        longer loads (its folder gone or changed) is dropped with the reason logged: the engine starts on what
        still loads, and requests naming it get a 404."""
        with self._adapters_lock:
            dropped = []
            for name, folder in self.adapter_paths.items():
                if name in skip:
                    continue
                try:
                    engine.add_adapter(name, folder, "adapter")
                except ValueError as exc:
                    logger.warning("no longer serving the LoRA adapter %s: %s", name, exc)
                    dropped.append(name)
            for name in dropped:
                del self.adapter_paths[name]
            if dropped:
                self._record_adapters()

    def _recall_adapters(self) -> None:
        """The adapters loaded at run time before this server (re)started, from the output dir; one that a
        ``--lora`` now names, or that is no longer under ``--lora-root``, is dropped with the reason logged."""
        root = self.settings.lora_root
        for name, folder in self.store.load_adapters().items():
            if name in self.adapter_paths:
                reason = f"--lora now names {name!r}"
            elif root is None or not folder.resolve().is_relative_to(Path(root).resolve()):
                reason = f"its folder {folder} is not under --lora-root {root}"
            else:
                self.adapter_paths[name] = folder
                continue
            logger.warning("no longer serving the LoRA adapter %s loaded before the restart: %s", name, reason)

    def _record_adapters(self) -> None:
        """Write the adapters loaded at run time to the output dir (a failure to is logged: they stay served)."""
        runtime = {n: p for n, p in self.adapter_paths.items() if n not in self.startup_adapters}
        try:
            self.store.save_adapters(runtime)
        except OSError as exc:
            logger.warning("could not record the adapters loaded at run time (%s); a restart forgets them", exc)

    def adapter_counts(self) -> dict[str, int]:
        """Adapter slot loads, switches and evictions since the server started (over engine restarts)."""
        engine = self.runner.engine
        current = (engine.adapter_stats if engine is not None else None) or {}
        return {k: self._earlier_adapter_counts[k] + current.get(k, 0) for k in _ADAPTER_COUNTS}

    def expect_torchrun_restart(self, why: str) -> None:
        """Under torchrun, this process is about to be replaced: torchrun restarts every rank after a rank's
        loss, rank 0's HTTP server included, and stops every rank on SIGTERM. A synchronous request lives in
        this process only, on its client's connection, so it cannot wait for the new one: it is answered now,
        503 with ``Retry-After`` (the time the model took to load, at least 5 s), and so is any that arrives
        meanwhile. Queued ``/v1/videos`` jobs stay on disk and run after the restart."""
        retry_s = max(5, round(self.load_s))
        error = {
            "code": "restarting",
            "message": f"{why}, this server's HTTP process included, so this request cannot be kept: send it "
            f"again in {retry_s}s, once torchrun has restarted them (POST /v1/videos jobs are kept on disk and run "
            "after the restart)",
            "retry_after_s": retry_s,
        }
        ended = self.store.fail_transient(error)
        logger.warning(
            "%s; answered %d waiting synchronous request(s) with 503 (Retry-After %ds)", why, len(ended), retry_s
        )

    def start(self) -> None:
        started = time.monotonic()
        self.store.lock()  # first: a second server on this --output-dir is refused before anything loads
        self._recall_adapters()
        loaded, requeued = self.store.load()
        if loaded:
            logger.info(
                "reloaded %d job record(s) from %s; %d queued again",
                loaded,
                self.settings.output_dir,
                requeued,
            )
        self.runner.start()
        if self.kind == "causal_lm":
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.info.path)
            config = json.loads((Path(self.info.path) / "config.json").read_text())
            self.max_positions = config.get("max_position_embeddings")
        self.load_s = time.monotonic() - started

    def stop(self) -> None:
        self._stopped.set()
        try:
            self.runner.stop()
        finally:  # an engine that fails to close (a rank died meanwhile) must not keep the output dir locked
            self.store.unlock()

    @property
    def info(self):
        assert self.runner.engine is not None, "start() first"
        return self.runner.engine.info

    @property
    def kind(self) -> str:
        return self.info.kind

    @property
    def name(self) -> str:
        return self.settings.name

    # -- checks ----------------------------------------------------------------------------------------------
    def _model_names(self) -> tuple[str, ...]:
        """What a request's ``model`` may say for the base (adapters go by their names)."""
        return _base_names(self.settings, self.info.path)

    def _not_served(self, requested: str, param: str) -> ApiError:
        served = ", ".join([repr(self.name), *(repr(n) for n in sorted(self.adapter_paths))])
        return ApiError(
            404,
            f"model {requested!r} is not served here; this server serves {served} (GET /v1/models)",
            param=param,
            code="model_not_found",
        )

    def check_model(self, requested: str | None, needs: str) -> None:
        if requested is not None and requested not in self._model_names() and requested not in self.adapter_paths:
            raise self._not_served(requested, "model")
        if self.kind != needs:
            raise ApiError(
                400,
                f"this server runs {self.name!r}, a {self.kind.replace('_', ' ')} model; use {self.routes_hint()}",
                code="wrong_model_kind",
            )

    @property
    def outputs(self) -> str:
        """What the served model makes: ``video``, ``image``, ``audio`` (diffusion) or ``text``."""
        return self.info.output if self.kind == "diffusion" else "text"

    def routes_hint(self) -> str:
        routes = ROUTES[self.outputs]
        return f"POST {', '.join(routes[:-1])} or {routes[-1]}"

    def check_job_kind(self, kind: str) -> None:
        """400 when the pipeline cannot make what a route asks for (images from an audio pipeline, ...)."""
        if kind not in JOB_KINDS[self.info.output]:
            made = f"an {self.info.output}" if self.info.output in ("image", "audio") else f"a {self.info.output}"
            raise ApiError(
                400,
                f"this server runs {self.name!r}, {made} pipeline ({self.info.class_name}); use "
                f"{self.routes_hint()}",
                code="wrong_model_kind",
            )

    # -- adapters --------------------------------------------------------------------------------------------
    def adapter_choice(self, model: str | None, lora: LoraRequest | list[LoraRequest] | None) -> dict:
        """The job ``meta`` naming a request's adapter and scale (empty for the base): ``model`` naming an
        adapter (vLLM), or the ``lora`` field (vLLM-Omni), whose ``local_path`` loads it under its name; a list
        composes its adapters (``adapter`` and ``adapter_scale`` are lists then, as ``Engine.generate`` takes
        them)."""
        adapter = model if model in self.adapter_paths else None
        if lora is None:
            return {"adapter": adapter, "adapter_scale": 1.0} if adapter else {}
        chosen = lora if isinstance(lora, list) else [lora]
        names = [item.name for item in chosen]
        if adapter is not None and [adapter] != names:
            raise ApiError(
                400, f"model names the adapter {adapter!r} and lora names {', '.join(names)}; give one", param="lora"
            )
        slots = self._slots.count if self._slots is not None else None
        if slots is not None and len(names) > slots:
            raise ApiError(
                400,
                f"lora composes {len(names)} adapters and this server holds {slots} adapter slot(s); restart it "
                f"with --max-loras {len(names)} (or more), or compose fewer",
                param="lora",
            )
        for i, item in enumerate(chosen):
            field = "lora" if len(chosen) == 1 and not isinstance(lora, list) else f"lora.{i}"
            if item.local_path is not None:
                self.load_adapter(item.name, item.local_path, f"{field}.local_path")
            elif item.name not in self.adapter_paths:
                raise self._not_served(item.name, f"{field}.name")
        if not isinstance(lora, list):
            return {"adapter": lora.name, "adapter_scale": lora.scale}
        return {"adapter": names, "adapter_scale": [item.scale for item in chosen]}

    def check_adapter_admin(self, flag: str) -> None:
        """Loading adapters from paths is refused off loopback without ``--api-key`` (anyone could point the
        server at any folder under ``--lora-root``)."""
        if self.settings.api_key is None and self.settings.host not in LOOPBACK:
            raise ApiError(
                403,
                f"{flag}: loading adapters is refused on {self.settings.host} without --api-key; restart with "
                "--api-key (or bind to 127.0.0.1)",
                param=flag,
                code="forbidden",
            )

    def load_adapter(self, name: str, path: str, flag: str) -> None:
        """Serve the adapter folder ``path`` (under ``--lora-root``) as ``name``; idempotent for the same
        folder. 400 naming ``flag`` when it is outside the root, not a LoRA folder or for another base."""
        self.check_adapter_admin(flag)
        root = self.settings.lora_root
        if root is None:
            raise ApiError(
                400, f"{flag}: this server loads no adapters from paths; start it with --lora-root DIR", param=flag
            )
        folder = (Path(root) / path).resolve()
        if not folder.is_relative_to(Path(root).resolve()):
            raise ApiError(400, f"{flag} {path}: outside --lora-root {root}; give a folder under it", param=flag)
        with self._adapters_lock:
            if self.adapter_paths.get(name) == folder:
                return
            if name in self.adapter_paths:
                raise ApiError(400, f"{flag}: the name {name!r} is already served; unload it or pick another")
            problem = adapter_name_problem(name, self._model_names(), flag)
            if problem:
                raise ApiError(400, problem, param=flag)
            engine = self.runner.engine
            if engine is None or engine.closed:
                raise ApiError(503, f"{flag}: the engine is restarting; retry in a few seconds", code="restarting")
            try:
                engine.add_adapter(name, folder, flag)
            except ValueError as exc:
                raise ApiError(400, str(exc), param=flag, code="invalid_lora") from exc
            self.adapter_paths[name] = folder
            self._record_adapters()
        logger.info("serving the LoRA adapter %s from %s", name, folder)

    def unload_adapter(self, name: str) -> None:
        self.check_adapter_admin("lora_name")
        with self._adapters_lock:
            if name not in self.adapter_paths:
                raise self._not_served(name, "lora_name")
            del self.adapter_paths[name]
            self._record_adapters()
            engine = self.runner.engine
            if engine is not None and not engine.closed and name in engine.adapter_stats["adapters"]:
                engine.remove_adapter(name)
        logger.info("stopped serving the LoRA adapter %s", name)

    def _engine_params(
        self, params: SamplingParams, fields_named: dict[str, str] | None = None
    ) -> SamplingParams:
        """The engine's own validation (shape rules, arguments the pipeline takes, defaults) on the caller side;
        returns concrete params. ``fields_named`` maps engine names to the client's (``image`` ->
        ``input_reference``) for the error's ``param``."""
        config = self.runner.engine.config if self.runner.engine else self.settings.parallel_config.resolved()
        try:
            # Messages name the client's fields ("(height)", "drop true_cfg_scale"), not the CLI's flags.
            named = fields_named or {}
            slots = ["x"] * max(1, self.store.slots)
            _, resolved = build_requests(self.info, config, slots, params, lambda name: named.get(name, name))
        except ValueError as exc:
            # One problem per "  - " line, each starting with its parameter ("width=40 must ...", "image: ...").
            lines = str(exc).replace("invalid generation request:", "").strip().splitlines()
            problems = [line.strip().removeprefix("- ") for line in lines if line.strip()]
            message = "; ".join(problems)
            first = _PROBLEM_PARAM.match(message)
            param = first.group(1) if first else None
            raise ApiError(
                400, message, param=(fields_named or {}).get(param, param), code="invalid_parameters"
            ) from exc
        return resolved

    @staticmethod
    def _shared(params: SamplingParams) -> dict:
        return {f.name: getattr(params, f.name) for f in fields(params) if f.name not in _PER_REQUEST}

    def submit(self, jobs: list[Job]) -> None:
        try:
            self.store.submit(jobs)
        except QueueFull as exc:
            raise ApiError(
                429,
                f"{exc}: {self.store.capacity} requests are already waiting (hsdp serve --max-queue)",
                code="queue_full",
                kind="rate_limit_error",
                headers={"Retry-After": str(exc.retry_after_s)},
            ) from exc
        except Unavailable as exc:
            error = exc.error
            raise ApiError(
                503,
                error["message"],
                code=error["code"],
                kind="server_error",
                headers={"Retry-After": str(error["retry_after_s"])},
            ) from exc
        except OSError as exc:  # the job's record or upload could not be written (a full disk)
            raise ApiError(
                507,
                f"the server could not store this job under --output-dir ({exc}); nothing was queued, retry later",
                code="storage_error",
                kind="server_error",
            ) from exc

    # -- diffusion -------------------------------------------------------------------------------------------
    def check_video_model(self) -> None:
        """The ``/v1/videos`` routes need a pipeline that makes video."""
        self.check_job_kind("video")

    def _decode(self, upload: Upload) -> Image:
        """The upload as the PIL image the pipeline gets; 400 naming the client's field when it is not one."""
        try:
            return load_image(upload.data, upload.engine_field, max_side=self.settings.limits.max_side)
        except ValueError as exc:
            message = str(exc).removeprefix(f"{upload.engine_field}: ")
            raise ApiError(
                400,
                f"{upload.field}: {message}; send a PNG, JPEG or WebP image (sides up to "
                f"{self.settings.limits.max_side} pixels, hsdp serve --max-side)",
                param=upload.field,
                code="invalid_image",
            ) from exc

    def _check_inputs(self, image: Upload | None, mask: Upload | None, image_field: str) -> None:
        """Input images against what the pipeline's ``__call__`` takes, naming the client's fields."""
        info = self.info
        if image is not None and not info.takes_image:
            raise ApiError(
                400,
                f"{image.field}: {info.class_name} takes no input image; drop {image.field} "
                f"(text-to-{info.output} only)",
                param=image.field,
            )
        if image is None and "image" in info.required_params:
            raise ApiError(
                400,
                f"{image_field}: {info.class_name} generates from an input image; send one as {image_field}",
                param=image_field,
            )
        if mask is not None and not info.takes_mask:
            raise ApiError(
                400,
                f"{mask.field}: {info.class_name} takes no mask (it is not an inpainting pipeline); drop {mask.field}",
                param=mask.field,
            )

    def _check_extra_args(self, extra: dict) -> None:
        """``extra_args`` names arguments of the pipeline's ``__call__`` that no field covers (the engine sets
        the rest: prompts, images, the fields above)."""
        takes = self.info.call_params - RESERVED_ARGS
        unknown = [name for name in extra if name not in takes]
        if unknown:
            named = [n + (f" (did you mean {c}?)" if c else "") for n, c in closest_fields(unknown, takes).items()]
            raise ApiError(
                400,
                f"extra_args: {self.info.class_name}.__call__ takes no {', '.join(named)}; it takes "
                f"{', '.join(sorted(takes))}",
                param="extra_args",
            )

    def _other_api_args(self, request: DiffusionFields) -> dict:
        """The other API's fields (:attr:`~hsdp.serve.schemas._Strict.other_fields`) the pipeline's ``__call__``
        takes, and vLLM-Omni's ``extra_params`` (its ``extra_args``), as pipeline arguments. Form fields come as
        text: a value that reads as JSON (``4``, ``0.5``, ``true``) is that value."""
        takes = self.info.call_params - RESERVED_ARGS
        other = request.other_fields
        args = {name: _form_value(value) for name, value in other.items() if name in takes}
        params = _form_value(other.get(EXTRA_PARAMS)) or {}
        if not isinstance(params, dict):
            raise ApiError(400, f"{EXTRA_PARAMS}: give a JSON object of pipeline arguments", param=EXTRA_PARAMS)
        return {**args, **params}

    def unused_fields(self, request: DiffusionFields) -> list[str]:
        """The other API's fields this request gave that the pipeline does not take: accepted, not applied, and
        named in the ``X-Hsdp-Unused-Fields`` response header."""
        takes = self.info.call_params - RESERVED_ARGS
        return sorted(name for name in request.other_fields if name not in takes and name != EXTRA_PARAMS)

    def _size(self, request: DiffusionFields, image: Image | None) -> tuple[int | None, int | None]:
        """``size``/``width``/``height``; ``size='auto'`` with an input image is its size, rounded down to the
        model's spatial multiple (the pipeline refuses other sizes)."""
        if request.size == "auto" and image is not None:
            m = self.info.spatial_multiple
            return max(m, image.width // m * m), max(m, image.height // m * m)
        return parse_size(request.size, request.width, request.height)

    def diffusion_jobs(
        self,
        request: DiffusionFields,
        kind: str,
        *,
        count: int = 1,
        num_frames: int | None = None,
        fps: int | None = None,
        output_format: str = "png",
        image: Upload | None = None,
        mask: Upload | None = None,
        image_field: str = "image",
        pipeline_kwargs: dict | None = None,
    ) -> list[Job]:
        """``count`` jobs (seeds ``seed + i``) for one request, after every check the engine would make.

        Only what the client set is passed (plus ``num_frames`` where the endpoint fixes it), so a field the
        pipeline does not take is a 400 naming it. ``image_field`` names the endpoint's image field in the error
        when the pipeline needs an image and none came."""
        self.check_job_kind(kind)
        self._check_inputs(image, mask, image_field)
        kwargs = {k: v for k, v in (pipeline_kwargs or {}).items() if v is not None}
        for name in kwargs:
            if name not in self.info.call_params:
                raise ApiError(400, f"{name}: {self.info.class_name} takes no {name}; drop it", param=name)
        extra = {**self._other_api_args(request), **(request.extra_args or {})}
        self._check_extra_args(extra)
        # The pipeline generates for the mp4's rate (LTX-2's sound), as hsdp generate --fps; extra_args may override.
        rate = frame_rate_args(self.info, fps) if kind in ("video", "video_sync") else {}
        kwargs = {**rate, **extra, **kwargs}
        decoded = {u.engine_field: self._decode(u) for u in (image, mask) if u is not None}
        width, height = self._size(request, decoded.get("image"))
        check_limits(request, self.settings.limits, width, height)
        params = self._engine_params(
            SamplingParams(
                height=height,
                width=width,
                num_frames=num_frames,
                num_inference_steps=request.num_inference_steps,
                guidance_scale=request.guidance_scale,
                guidance_scale_2=request.guidance_scale_2,
                true_cfg_scale=request.true_cfg_scale,
                audio_seconds=request.audio_seconds,
                negative_prompt=request.negative_prompt,
                pipeline_kwargs=kwargs,
                **decoded,
            ),
            fields_named={"image": image_field, **{u.engine_field: u.field for u in (image, mask) if u}},
        )
        check_limits(request, self.settings.limits, params.width, params.height)  # the model's defaults too
        if (params.num_frames or 1) > self.settings.limits.max_frames:
            raise ApiError(
                400,
                f"num_frames={params.num_frames} (the model's default, or from seconds) exceeds this server's "
                f"{self.settings.limits.max_frames} (hsdp serve --max-frames); set num_frames",
                param="num_frames",
            )
        seed = request.seed if request.seed is not None else random.randrange(2**31)
        adapter = self.adapter_choice(request.model, request.lora)
        meta = {"fps": self.video_fps(fps), "model": answered_by(adapter, self.name), "format": output_format, **adapter}
        inputs = {u.engine_field: u.data for u in (image, mask) if u is not None}
        return [
            Job(
                kind,
                request.prompt,
                self._shared(params),
                seed + i,
                request.negative_prompt,
                meta=dict(meta),
                inputs=inputs,
            )
            for i in range(count)
        ]

    def video_fps(self, fps: int | None) -> int:
        """The mp4's frame rate: the request's ``fps``, else the pipeline's ``frame_rate`` default, else 16."""
        return video_fps(self.info, fps, DEFAULT_FPS)

    @staticmethod
    def _steps(job: Job) -> dict:
        """Step ``k`` of ``n`` and the time the steps left take at the pace of those done (while it runs)."""
        steps = job.steps or job.params.get("num_inference_steps")
        eta = None
        if job.status == "in_progress" and job.step and steps and job.started_at:
            eta = round((time.time() - job.started_at) / job.step * max(0, steps - job.step), 2)
        return {"step": job.step if job.status != "completed" else steps or job.step, "steps": steps, "eta_seconds": eta}

    def job_view(self, job: Job) -> JobObject:
        """Any asynchronous job as ``GET /v1/jobs/{id}`` reports it."""
        fmt = "mp4" if job.kind == "video" else job.meta.get("format", "png")
        fields = self.video_view(job).model_dump() if job.kind == "video" else self._image_or_audio(job)
        fields.pop("object", None)
        return JobObject(**fields, output=job.output_kind, content_type=CONTENT_TYPES[fmt])

    def _image_or_audio(self, job: Job) -> dict:
        p = job.params
        size = job.meta.get("size") or (f"{p['width']}x{p['height']}" if p.get("width") else None)
        return {
            "id": job.id,
            "model": job.meta.get("model", self.name),
            "status": job.status,
            "progress": job.progress,
            "created_at": int(job.created_at),
            "completed_at": int(job.completed_at) if job.completed_at else None,
            "prompt": job.prompt,
            "size": size if job.output_kind == "image" else None,
            "seed": job.seed,
            "attempts": job.attempts,
            "error": job.error,
            **self._steps(job),
        }

    def video_view(self, job: Job) -> VideoJob:
        p = job.params
        frames = p.get("num_frames") or 1
        return VideoJob(
            id=job.id,
            model=job.meta.get("model", self.name),
            status=job.status,
            progress=job.progress,
            created_at=int(job.created_at),
            completed_at=int(job.completed_at) if job.completed_at else None,
            prompt=job.prompt,
            size=f"{p['width']}x{p['height']}",
            seconds=f"{frames / job.meta['fps']:.2f}",
            num_frames=frames,
            fps=job.meta["fps"],
            seed=job.seed,
            attempts=job.attempts,
            error=job.error,
            **self._steps(job),
        )

    # -- causal LM -------------------------------------------------------------------------------------------
    def text_jobs(self, request: CompletionRequest | ChatCompletionRequest) -> list[Job]:
        check_limits(request, self.settings.limits)
        if isinstance(request, ChatCompletionRequest):
            with_image = next((i for i, m in enumerate(request.messages) if m.images()), None)
            if with_image is not None:
                raise ApiError(
                    400,
                    f"messages[{with_image}].content: image_url parts need a diffusion model; this server runs "
                    f"the causal LM {self.name!r}, which reads text only",
                    param="messages",
                )
            prompts, max_tokens = [chat_prompt(self.tokenizer, request.messages)], request.token_budget()
        else:
            prompts = [request.prompt] if isinstance(request.prompt, str) else list(request.prompt)
            max_tokens = request.max_tokens
        params = self._engine_params(
            SamplingParams(
                max_new_tokens=max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
            )
        )
        seed = request.seed if request.seed is not None else random.randrange(2**31)
        adapter = self.adapter_choice(request.model, request.lora)
        jobs = []
        for i, prompt in enumerate(prompts):
            prompt_tokens = len(self.tokenizer(prompt)["input_ids"])
            if self.max_positions and prompt_tokens + max_tokens > self.max_positions:
                raise ApiError(
                    400,
                    f"prompt {i} has {prompt_tokens} tokens; with max_tokens={max_tokens} that exceeds the "
                    f"model's context of {self.max_positions} tokens; shorten the prompt or lower max_tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            jobs.append(
                Job(
                    "text", prompt, self._shared(params), seed + i, meta={"prompt_tokens": prompt_tokens, **adapter}
                )
            )
        return jobs
