"""``hsdp.Engine``: load a model sharded over a layout's ranks once, then serve many ``generate()`` calls.

The engine starts ``config.world_size`` worker processes itself (:class:`hsdp.launch.WorkerGroup`, one per
device) or, when the script was started by ``torchrun``, uses the ranks it runs on (every rank constructs the
engine and calls ``generate`` with the same arguments). Everything that can be checked from the model's JSON
files and the arguments is checked before a process starts. A worker that dies or fails surfaces as a
:class:`hsdp.launch.WorkerError` in the caller; the engine is then closed and a new one can be started (an
ordinary exception raised on the ranks, :class:`hsdp.launch.WorkerRaised`, leaves it open and loaded).

>>> with Engine("tiny-wan", ParallelConfig(use_hsdp=True, hsdp_shard_size=2)) as engine:
...     [video] = engine.generate("A cat playing piano", SamplingParams(seed=0))
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from hsdp import distributed
from hsdp.config import ParallelConfig
from hsdp.engine import adapters, components, worker
from hsdp.engine.checks import (
    LoraArg,
    check_lora,
    layout_problems,
    load_options,
    lora_target,
    memory_plan,
    vae_parallel_default,
    vae_problems,
    weight_dtype_problems,
)
from hsdp.engine.control import CancelBoard
from hsdp.engine.model_info import MODEL_PACKAGES, inspect_model
from hsdp.engine.outputs import GenerationOutput
from hsdp.engine.params import (
    SamplingParams,
    batch_size_problem,
    build_requests,
    request_slots,
)
from hsdp.launch import WorkerError, WorkerGroup, event_sink
from hsdp.logging_utils import STARTUP, phase
from hsdp.models.builtin import resolve_model
from hsdp.models.variant import with_variant

if TYPE_CHECKING:
    pass

logger = logging.getLogger("hsdp")

__all__ = ["Engine"]


class _TorchrunRanks:
    """The ranks this script already runs on (``torchrun``), with :class:`WorkerGroup`'s ``run`` interface."""

    def __init__(self) -> None:
        distributed.init_distributed()
        self.world_size = distributed.world_size()
        self.broken = False

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float | None = None,
        on_event: Callable[[int, Any], None] | None = None,
    ) -> list[Any]:
        rank = distributed.rank()
        with event_sink(lambda payload: on_event(rank, payload) if on_event else None):
            result = fn(*args)
        results: list[Any] = [None] * self.world_size
        dist.all_gather_object(results, result)
        return results

    def close(self) -> None:
        worker.unload()


def _loaded_part(rank: int, event: dict) -> None:
    """Rank 0's word that a part of the load is done (every rank loads its own shards in step with the others)."""
    if rank == 0 and "loaded" in event:
        STARTUP.part(f"load: {event['loaded']} ({event['index']} of {event['total']})", event["seconds"])


def _event_listener(
    on_progress: Callable[[int, int, int], None] | None, on_token: Callable[[int, int], None] | None
) -> Callable[[int, dict], None] | None:
    if on_progress is None and on_token is None:
        return None

    def listen(rank: int, event: dict) -> None:
        if on_token is not None and "token_id" in event:
            on_token(event["request_id"], event["token_id"])
        if on_progress is not None:
            on_progress(event["request_id"], event["step"], event["total"])

    return listen


class Engine:
    """A model loaded sharded across worker ranks; call :meth:`generate` as often as needed, then :meth:`close`."""

    def __init__(
        self,
        model: str | os.PathLike,
        parallel_config: ParallelConfig | None = None,
        *,
        dtype: str | None = None,
        forward_prefetch: bool = True,
        progress: bool = False,
        call_timeout_s: float | None = None,
        start_timeout_s: float = 300.0,
        workers: WorkerGroup | None = None,
        cancellable: bool = False,
        weight_dtype: str | None = None,
        device_memory: int | str | None = None,
        lora: LoraArg = None,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        lora_target_modules: str | Sequence[str] | None = None,
        adapter_slots: adapters.SlotSpec | None = None,
        cache: str | None = None,
        cache_config: dict | None = None,
        compile: bool = False,
        attention_backend: str | None = None,
        vae_parallel: bool | None = None,
        vae_tiling: bool = False,
        vae_slicing: bool = False,
        revision: str | None = None,
        shield_sigterm: bool = False,
        variant: str | None = None,
    ):
        """``model``: a built-in name (``tiny-wan``, ``tiny-llama``), a diffusers pipeline folder, a Hugging
        Face causal-LM folder or a Hugging Face Hub name (``org/name``, at ``revision``; downloaded here, once
        per node, before any rank starts: :mod:`hsdp.models.hub`); ``variant`` (``fp16``) loads that variant's
        weights where a component has them (:mod:`hsdp.models.variant`). ``dtype`` converts the sharded components (default: as stored).
        ``forward_prefetch`` chains explicit all-gather prefetch through the blocks. ``progress`` shows a bar
        over denoising steps (rank 0). ``call_timeout_s`` bounds each ``generate`` call (None: no limit; a
        dead worker is still noticed at once). ``workers``: an existing group of ``world_size`` ranks to load
        into instead of starting processes (e.g. to swap models without a restart); it is left running on
        :meth:`close`, with the model unloaded. ``cancellable`` lets :meth:`cancel` stop a running request at
        its next forward (the ranks then agree once per forward: a tiny all-reduce; engine-spawned ranks only).
        ``weight_dtype`` (``int8``; ``fp8`` on devices with fp8 kernels) stores the sharded Linear weights in 8 bits
        and all-gathers them so (:mod:`hsdp.quantize`). ``device_memory`` (bytes or a size such as ``"24GiB"``)
        plans which blocks stay gathered and the prefetch depth from that budget per rank
        (:mod:`hsdp.engine.device_memory`; the choice is in :attr:`memory_plan`). ``lora``: peft LoRA adapter
        folders for a causal LM or a pipeline's one denoiser, held unmerged in ``max_loras`` slots (default: one
        per adapter) of rank ``max_lora_rank`` (default: the largest adapter's) sharded with the base
        (:mod:`hsdp.engine.adapters`): one folder is applied to every call unless ``generate(adapter=...)`` says
        otherwise; a mapping ``{name: folder}`` is served by name per call (the base when none is named), and
        ``max_loras`` alone makes slots for adapters added at run time (:meth:`add_adapter`). The slots cover the
        layers of ``lora``'s adapters and those ``lora_target_modules`` selects (peft's ``target_modules``; default
        ``"all-linear"`` when ``max_loras`` is given, so an adapter added later may adapt any linear layer; without
        ``max_loras``, only ``lora``'s layers: slots cost memory, :func:`hsdp.engine.adapters.slot_spec`). ``adapter_slots``
        gives the slots as another engine made them (:attr:`adapter_slots`; a restarted server keeps its start-up
        slots), instead of ``max_loras`` / ``max_lora_rank``.
        ``cache`` / ``cache_config``: the diffusers step cache of every call whose ``SamplingParams.cache`` is
        None (:mod:`hsdp.engine.cache`; skip decisions agreed across ranks). ``compile``: regional
        ``torch.compile`` of the denoisers' repeated blocks (:mod:`hsdp.engine.compile`). ``attention_backend``:
        the denoisers' diffusers attention backend, or the causal LM's transformers attention implementation
        (:mod:`hsdp.attention`). ``vae_parallel``: split the VAE's tiled decode and encode over the ranks that
        share a request (:mod:`hsdp.vae_parallel`; None: off, rank 0 decodes whole as one process does).
        ``vae_tiling`` / ``vae_slicing``: diffusers' ``enable_tiling`` / ``enable_slicing`` of the VAE (memory on
        each rank). ``shield_sigterm``: the engine-spawned ranks ignore SIGTERM as they ignore SIGINT, for a caller
        that stops gracefully on it (``hsdp serve``: a group's SIGTERM, systemd's stop, must not cut the running
        call off); :meth:`close` still stops them."""
        from hsdp.attention import attention_backend_problems
        from hsdp.engine.cache import cache_problems
        from hsdp.engine.compile import compile_problems

        self.config = (parallel_config or ParallelConfig()).resolved()
        folder = resolve_model(model, revision=revision, variant=variant)
        self.info = inspect_model(with_variant(folder, variant) if variant else folder)
        self.cache, self.cache_config, self.compiled = cache, cache_config, compile
        problems = layout_problems(self.info, self.config) + weight_dtype_problems(weight_dtype, self.config)
        problems += cache_problems(cache, cache_config, self.info, self.config)
        if compile:
            problems += compile_problems(distributed.device_type(), cache)
        if attention_backend is not None:
            problems += attention_backend_problems(
                attention_backend, self.info.kind, distributed.device_type(), self.config.sequence_parallel_size > 1
            )
        problems += vae_problems(self.info, self.config, vae_parallel, vae_tiling, vae_slicing)
        if problems:
            raise ValueError(
                "cannot run this model with this layout:\n" + "\n".join(f"  - {p}" for p in problems)
            )
        slotted = lora is None and (max_loras or adapter_slots)
        specs = check_lora(self.info, self.config, weight_dtype, {} if slotted else lora)
        slots = adapter_slots
        if slots is None and (specs or max_loras):
            modules = lora_target_modules if lora_target_modules is not None else ("all-linear" if max_loras else None)
            slots = adapters.slot_spec(
                specs.values(), lora_target(self.info), max_loras or len(specs), max_lora_rank, modules
            )
        self.adapters = adapters.AdapterCache(slots, specs.values()) if slots is not None else None
        self.default_adapter = next(iter(specs)) if specs and not isinstance(lora, Mapping) else None
        """The adapter of every call that names none (a single ``lora`` folder), else None (the base)."""
        self.lora = specs[self.default_adapter].given if self.default_adapter else None
        self.vae_parallel = vae_parallel_default(self.info, self.config, vae_parallel)
        """Whether the VAE's tiles are split over the ranks (``vae_parallel``, resolved)."""
        self.memory_plan = memory_plan(
            self.info, self.config, device_memory, dtype, weight_dtype, forward_prefetch
        )
        self.progress = progress
        self.call_timeout_s = call_timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self.last_comm: list[dict | None] | None = None
        self._owns_group = workers is None
        self._call_id = 0
        if cancellable and (distributed.launched_by_torchrun() or not isinstance(workers, (WorkerGroup, type(None)))):
            raise ValueError(
                "cancellable=True needs ranks that share a store with this caller (engine-spawned ranks or "
                "workers= a WorkerGroup); under torchrun every rank is its own caller"
            )
        if call_timeout_s is not None and workers is None and distributed.launched_by_torchrun():
            raise ValueError(
                f"call_timeout_s={call_timeout_s}: under torchrun every rank runs generate itself and no caller "
                "watches the call, so nothing could stop it; drop call_timeout_s (a stuck collective still ends at "
                "the process group's timeout, HSDP_COLLECTIVE_TIMEOUT seconds), or pass workers= a group that times "
                "its calls (hsdp serve under torchrun does)"
            )
        started = time.perf_counter()
        self._group = self._ranks(workers, start_timeout_s, shield_sigterm)
        self._board = CancelBoard(self._group.store) if cancellable else None
        spec = components.LoadSpec(
            self.info.path,
            self.info.kind,
            self.config,
            dtype,
            forward_prefetch,
            cancel_prefix=self._board.prefix if self._board else None,
            weight_dtype=weight_dtype,
            load_options=load_options(self.info, self.memory_plan),
            lora=self.adapters.slots if self.adapters else None,
            compile=compile,
            attention_backend=attention_backend,
            vae_parallel=self.vae_parallel,
            vae_tiling=vae_tiling,
            vae_slicing=vae_slicing,
        )
        try:
            with phase(f"load (build, read and shard the model on {self.config.world_size} ranks)"):
                self.load_report = self._group.run(
                    worker.load, spec, timeout_s=start_timeout_s, on_event=_loaded_part
                )
            for name in list(specs)[: self.adapters.slots.count if self.adapters else 0]:
                self._slot_for(name)
        except BaseException as exc:
            self.close(graceful=not isinstance(exc, KeyboardInterrupt))  # Ctrl-C, SIGTERM: the ranks stop at once
            raise
        self.load_s = time.perf_counter() - started
        STARTUP.close()
        logger.info("Engine ready in %.1fs: %s, %s", self.load_s, self.info.path, self.config.describe())
        self._first_call = True

    def _first_step_timer(
        self, listen: Callable[[int, dict], None] | None
    ) -> Callable[[int, dict], None] | None:
        """The engine's first call logs (at debug) when its first step or token came: the last start-up phase."""
        if not getattr(self, "_first_call", False):
            return listen
        self._first_call = False
        started = time.monotonic()
        timed = []

        def on_event(rank: int, event: dict) -> None:
            if not timed:
                timed.append(True)
                STARTUP.end("first step (of the first call)", time.monotonic() - started)
            if listen is not None:
                listen(rank, event)

        return on_event

    def _ranks(
        self, workers: WorkerGroup | None, start_timeout_s: float, shield_sigterm: bool
    ) -> WorkerGroup | _TorchrunRanks:
        """The ranks to load into: the caller's group, this script's own torchrun ranks, or new processes."""
        if workers is not None:
            if workers.world_size != self.config.world_size or workers.broken:
                raise ValueError(
                    f"workers= has {workers.world_size} ranks (broken={workers.broken}), but the layout "
                    f"({self.config.describe()}) needs {self.config.world_size}"
                )
            return workers
        if distributed.launched_by_torchrun():
            return _TorchrunRanks()
        return WorkerGroup(
            self.config.world_size,
            start_timeout_s=start_timeout_s,
            packages=[MODEL_PACKAGES[self.info.kind]],
            shield_sigterm=shield_sigterm,
        )

    @property
    def model_path(self) -> Path:
        return self.info.path

    @property
    def kind(self) -> str:
        """``diffusion`` or ``causal_lm``."""
        return self.info.kind

    @property
    def request_slots(self) -> int:
        """Requests generated side by side; ``generate`` takes a multiple of this many prompts."""
        return request_slots(self.config)

    @property
    def quantized(self) -> dict | None:
        """With ``weight_dtype``: the ``nn.Linear`` weights of the loaded components (``linear_weights``), how many
        are stored in 8 bits (``quantized_weights``) and the fraction of their elements that is
        (``quantized_fraction``); weights whose rows do not divide by the shard size, tied or replicated ones keep
        the compute dtype (:func:`hsdp.quantize.quantized_share`). None without ``weight_dtype``."""
        return self.load_report[0].get("quantized")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pids(self) -> list[int]:
        """Worker process ids (empty under torchrun)."""
        return list(getattr(self._group, "pids", []))

    @property
    def last_heard(self) -> float | None:
        """``time.monotonic()`` when a rank last showed life (a step, a token, or computing in any module: prompt
        encoding and VAE decode included); None under torchrun."""
        return getattr(self._group, "last_heard", None)

    def generate(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | None = None,
        *,
        measure_comm: bool = False,
        on_progress: Callable[[int, int, int], None] | None = None,
        on_token: Callable[[int, int], None] | None = None,
        batch_size: int = 1,
        adapter: str | Sequence[str] | None = None,
        adapter_scale: float | Sequence[float] = 1.0,
        on_start: Callable[[int], None] | None = None,
    ) -> list[GenerationOutput]:
        """Generate one output per prompt, in prompt order. Thread-safe: concurrent calls run one after another.

        ``measure_comm`` counts every collective of the call (slower: the counter sees every op) and leaves the
        per-rank figures in :attr:`last_comm`. ``on_progress(request_id, step, total)`` is called (in the
        caller's thread) after each denoising step or generated token of each request, as the ranks run;
        ``on_token(request_id, token_id)`` after each generated token (causal LMs), for streaming.
        ``batch_size`` > 1 (diffusion) runs up to that many of a rank's requests as one batch through the
        pipeline, each with its own seed and noise: one forward per step for all of them. Requests that differ in
        which inputs they give (negative prompt, image, mask) run in separate batches and rounds
        (:func:`hsdp.engine.params.lockstep_rounds`), so request-parallel ranks always run the same forwards;
        requests giving an input the pipeline takes one of per call (Wan image-to-video's image) run one at a time.
        ``adapter``: the LoRA adapter (by name) every request of the call uses, its ``lora_alpha / r`` times
        ``adapter_scale`` (None: :attr:`default_adapter`, the base when that is None too); a list of names
        composes them, each with its ``adapter_scale`` (a list as long, or one scale for all), as diffusers'
        ``set_adapters(names, adapter_weights=scales)`` does. The engine needs a slot for each.
        ``on_start(call_id)`` is called once the call has its id, before the ranks start: :meth:`cancel` with
        that id reaches this call's requests and no other's.
        """
        if self._closed:
            raise RuntimeError("this Engine is closed; start a new one")
        chosen = self._adapter_choice(adapter, adapter_scale)
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        problem = batch_size_problem(self.kind, batch_size)
        if problem:
            raise ValueError(problem)
        requests, resolved = build_requests(self.info, self.config, prompt_list, self._with_cache(params))
        with self._lock:
            self._call_id += 1
            if on_start is not None:
                on_start(self._call_id)
            try:
                active = self._activate(chosen)
                results = self._group.run(
                    worker.generate,
                    requests,
                    resolved,
                    self.progress,
                    measure_comm,
                    self._call_id,
                    batch_size,
                    active,
                    self.info.single_inputs,
                    timeout_s=self.call_timeout_s,
                    on_event=self._first_step_timer(_event_listener(on_progress, on_token)),
                )
            except WorkerError:
                if self._group.broken:  # its processes are already gone; an ordinary error leaves it intact
                    self.close()
                raise
        memory = [r.peak_memory_bytes for r in results]
        self.last_comm = [r.comm for r in results] if measure_comm else None
        outputs = []
        for result in results:
            for request_id, payload in result.outputs:
                request = requests[request_id]
                outputs.append(
                    GenerationOutput(
                        request_id=request_id,
                        prompt=request.prompt,
                        seed=request.seed,
                        peak_memory_bytes=memory,
                        memory_kind=result.memory_kind,
                        rank=result.rank,
                        **payload,
                    )
                )
        return sorted(outputs, key=lambda o: o.request_id)

    def _with_cache(self, params: SamplingParams | None) -> SamplingParams:
        """``params`` with the engine's cache when it names none; a cache the compiled blocks cannot take is a
        ``ValueError`` here, before the ranks see it."""
        from dataclasses import replace

        from hsdp.engine.compile import COMPILABLE_CACHES

        params = params or SamplingParams()
        if params.cache is None and self.cache is not None:
            params = replace(params, cache=self.cache, cache_config=self.cache_config)
        if self.compiled and params.cache not in (None, "none", *COMPILABLE_CACHES):
            raise ValueError(
                f"cache={params.cache!r}: this engine compiled its blocks (--compile), and that cache hooks layers "
                f"inside them; use one of {', '.join(sorted(COMPILABLE_CACHES))} or none"
            )
        return params

    def _adapter_choice(
        self, adapter: str | Sequence[str] | None, scale: float | Sequence[float]
    ) -> list[tuple[str, float]]:
        """``generate``'s ``adapter`` / ``adapter_scale`` as ``(name, scale)`` pairs (none: the base), checked."""
        adapter = adapter or self.default_adapter
        names = [adapter] if isinstance(adapter, str) else list(adapter or ())
        scales = list(scale) if isinstance(scale, Sequence) else [scale] * len(names)
        if not names:
            return []
        if self.adapters is None:
            raise ValueError(
                f"adapter={adapter!r}: this engine holds no LoRA adapters; start it with lora= (--lora NAME=PATH)"
            )
        if len(scales) != len(names):
            raise ValueError(
                f"adapter_scale has {len(scales)} values for {len(names)} adapters ({', '.join(names)}); give one "
                "scale for each, or one for all"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"adapter={names}: an adapter is named twice; name each once (its scale adds up)")
        if len(names) > self.adapters.slots.count:
            raise ValueError(
                f"adapter={names}: {len(names)} adapters composed, and this engine holds {self.adapters.slots.count} "
                f"adapter slot(s); start it with max_loras={len(names)} or more (--max-loras {len(names)})"
            )
        for name, value in zip(names, scales, strict=True):
            self.adapters.spec(name)
            if not math.isfinite(value):
                raise ValueError(
                    f"adapter_scale={value} (adapter {name!r}) must be a finite number (1.0: the adapter as trained)"
                )
        return list(zip(names, scales, strict=True))

    def _slot_for(self, name: str, keep: Sequence[str] = ()) -> int:
        """The slot holding adapter ``name``, filled on the ranks first when it is in none (evicting the least
        recently used that is not in ``keep``, the call's other adapters). Caller holds the lock."""
        assert self.adapters is not None
        slot = self.adapters.lookup(name)
        if slot is None:
            slot = self.adapters.free_slot(keep)
            self._group.run(worker.load_adapter, slot, self.adapters.spec(name), timeout_s=self.call_timeout_s)
            self.adapters.loaded(name, slot)
        return slot

    def _activate(self, chosen: list[tuple[str, float]]) -> tuple[adapters.ActiveAdapter, ...]:
        """What the ranks activate for a call with the adapters ``chosen`` (loading each into a slot as needed)."""
        if self.adapters is None:
            return ()
        names = [name for name, _ in chosen]
        return self.adapters.use([(name, self._slot_for(name, names), scale) for name, scale in chosen])

    def add_adapter(self, name: str, path: str | os.PathLike, flag: str = "lora") -> None:
        """Serve the peft LoRA adapter folder ``path`` as ``name`` from now on (checked like ``lora=``; loaded
        into a slot when first used). ``ValueError`` naming ``flag`` when it does not fit the model or the slots."""
        if self.adapters is None:
            raise ValueError(f"{flag}: this engine has no adapter slots; start it with --max-loras N (or --lora)")
        target = lora_target(self.info)
        self.adapters.add(adapters.describe_adapter(name, path, target, flag, self.info.class_name), flag)

    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` (its slot is free for the next one)."""
        if self.adapters is None:
            raise adapters.UnknownAdapter(name, [])
        self.adapters.remove(name)

    @property
    def adapter_slots(self) -> adapters.SlotSpec | None:
        """The adapter slots on the ranks (None without any)."""
        return self.adapters.slots if self.adapters else None

    @property
    def adapter_stats(self) -> dict | None:
        """Adapters known and resident, slot loads, switches and evictions (None without adapter slots)."""
        return self.adapters.stats() if self.adapters else None

    def cancel(self, request_id: int, call_id: int | None = None) -> None:
        """Stop request ``request_id`` (its index in the running :meth:`generate` call's prompts) at its next
        forward; its output comes back with ``cancelled=True``. Callable from any thread; needs
        ``cancellable=True``. In request-parallel layouts a request stops once every request running beside it
        in lockstep is cancelled too; until then it runs to its end and the caller drops its output.
        ``call_id`` (from ``generate``'s ``on_start``) names the call; without it, the latest call, which a
        cancel racing with the call's end can mistake for the next one."""
        if self._board is None:
            raise RuntimeError("this Engine was started without cancellable=True")
        self._board.cancel(self._call_id if call_id is None else call_id, request_id)

    def ping(self, timeout_s: float = 2.0) -> None:
        """Check that every rank answers within ``timeout_s`` (between calls); a dead or hung worker raises
        :class:`hsdp.launch.WorkerError` and closes the engine, as a failed ``generate`` does."""
        if self._closed:
            raise RuntimeError("this Engine is closed; start a new one")
        with self._lock:
            try:
                self._group.run(worker.ping, timeout_s=timeout_s)
            except WorkerError:
                self.close()
                raise

    def kill_workers(self) -> None:
        """SIGKILL every worker process (from any thread), e.g. when a call shows no progress: the running
        call, if any, then fails with :class:`hsdp.launch.WorkerDiedError` and the engine closes."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def memory_report(self) -> list[dict]:
        """Per rank, now: ``param_bytes`` held (weights kept gathered count in full), resident and peak memory."""
        if self._closed:
            raise RuntimeError("this Engine is closed; start a new one")
        with self._lock:
            try:
                return self._group.run(worker.memory_report, timeout_s=self.call_timeout_s)
            except WorkerError:
                self.close()  # as in generate: the group is broken, so is this Engine
                raise

    def close(self, *, graceful: bool = True) -> None:
        """Stop the workers (idempotent): a running call first finishes unless ``graceful`` is False."""
        if self._closed:
            return
        self._closed = True
        group = getattr(self, "_group", None)
        if group is None:
            return
        if isinstance(group, WorkerGroup) and self._owns_group:
            group.close(graceful=graceful)
        elif self._owns_group:  # torchrun's ranks: they return from follow() and end with the job
            group.close()
        elif not group.broken:
            group.run(worker.unload)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Ctrl-C: stop the ranks now (they ignore SIGINT and would finish their call first)
        self.close(graceful=exc_type is None or not issubclass(exc_type, KeyboardInterrupt))

    def __del__(self) -> None:
        # A borrowed group is left to its owner; calling into it during garbage collection is not safe.
        if not getattr(self, "_closed", True) and getattr(self, "_owns_group", False):
            self.close()
