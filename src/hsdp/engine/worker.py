"""Rank-side entry points of the engine, sent by the caller through :class:`hsdp.launch.WorkerGroup`.

The loaded runner lives in :func:`hsdp.launch.worker_state` between calls, so a model is loaded once and serves
many :func:`generate` calls. Functions are module-level (they are pickled by reference).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, replace

import torch

from hsdp.distributed import rank
from hsdp.engine import adapters
from hsdp.engine.components import LoadSpec
from hsdp.engine.control import CancelWatch, RequestCancelled
from hsdp.engine.outputs import Timings
from hsdp.engine.params import Request, SamplingParams, lockstep_rounds, request_slots
from hsdp.launch import rendezvous_store, worker_state
from hsdp.measure import peak_memory, reset_peak_memory, resident_memory
from hsdp.measure.comm import CommAccounting
from hsdp.mesh import build_meshes

logger = logging.getLogger("hsdp")

__all__ = [
    "RankResult",
    "load",
    "load_adapter",
    "generate",
    "memory_report",
    "unload",
    "ping",
]

_KEY = "hsdp.engine.runner"


@dataclass
class RankResult:
    rank: int
    outputs: list[tuple[int, dict]]
    """(request_id, payload) for the requests this rank reports."""
    peak_memory_bytes: int
    memory_kind: str
    comm: dict | None = None
    """With ``measure_comm``: collectives counted over the call (:meth:`hsdp.measure.comm.CommReport.to_dict`) and the
    number of sharded-model forwards they served."""


def load(spec: LoadSpec) -> dict:
    """Build the meshes and load the model sharded on this rank; returns :func:`memory_report` plus
    ``baseline_memory_bytes``, what the process held before loading (runtime and libraries on CPU), and with
    ``weight_dtype`` how much of the Linear weights is 8-bit (``quantized``, :func:`hsdp.quantize.quantized_share`)."""
    unload()
    if spec.kind == "diffusion":
        import diffusers  # noqa: F401  (imported before the baseline is taken)

        from hsdp.engine.diffusion import DiffusionRunner as runner_cls
    else:
        import transformers  # noqa: F401

        from hsdp.engine.causal_lm import CausalLMRunner as runner_cls
    reset_peak_memory()
    baseline = resident_memory()
    spec = replace(spec, config=spec.config.resolved())
    meshes = build_meshes(spec.config)
    runner = runner_cls(spec, meshes)
    watch = (
        CancelWatch(rendezvous_store(), spec.cancel_prefix, runner.watched_modules()) if spec.cancel_prefix else None
    )
    worker_state()[_KEY] = (runner, spec.config, meshes, watch)
    report = {**memory_report(), "baseline_memory_bytes": baseline, "sharded": runner.sharded}
    if spec.weight_dtype:
        from hsdp.quantize import quantized_share

        report["quantized"] = quantized_share(runner.modules())
    if spec.config.offload_layers is not None:  # --offload-layers: the blocks each sharded model keeps on the host
        from hsdp.sharding import unwrapped_class

        report["offloaded"] = {
            unwrapped_class(m).__name__: m.hsdp_report.offloaded_modules
            for m in runner.modules()
            if getattr(m, "hsdp_report", None) is not None
        }
    return report


def load_adapter(slot: int, adapter: adapters.AdapterSpec) -> int:
    """Fill adapter ``slot`` of the loaded model with ``adapter`` (this rank's slices; no communication)."""
    count = adapters.fill(_loaded()[0].adapted(), slot, adapter)
    logger.info("LoRA adapter %s in slot %d: %d parameters", adapter.name, slot, count)
    return count


def memory_report() -> dict:
    """This rank's memory now: ``param_bytes`` held (sharded parameters count their local shard, gathered
    ones, e.g. kept gathered between steps, their full size), resident and peak memory."""
    from hsdp.sharding import parameter_bytes

    runner = _loaded()[0]
    peak, kind = peak_memory()
    return {
        "rank": rank(),
        "param_bytes": sum(parameter_bytes(m)[0] for m in runner.modules()),
        "resident_memory_bytes": resident_memory(),
        "peak_memory_bytes": peak,
        "memory_kind": kind,
    }


def _loaded() -> tuple:
    if _KEY not in worker_state():
        raise RuntimeError("no model is loaded on this rank; call hsdp.engine.worker.load first")
    return worker_state()[_KEY]


def generate(
    requests: list[Request],
    params: SamplingParams,
    progress: bool,
    measure_comm: bool = False,
    call_id: int = 0,
    batch_size: int = 1,
    active: tuple[adapters.ActiveAdapter, ...] = (),
    single_inputs: frozenset[str] = frozenset(),
) -> RankResult:
    """Generate this rank's share of ``requests`` in lockstep with the other ranks, ``batch_size`` at a time.

    Same-request layouts run every request on every rank and only rank 0 decodes and reports it; in
    request-parallel HSDP the rank with data-parallel index ``d`` takes group ``d`` of each of
    :func:`hsdp.engine.params.lockstep_rounds` (requests ``d, d + N, d + 2N, ...`` when their inputs are alike).
    A request cancelled on the caller's board (``call_id``) stops at the next forward and reports
    ``cancelled``. ``active``: the LoRA slots and scalings the call uses, in order (none: the base alone).
    ``single_inputs``: inputs the pipeline takes one of per call (requests giving one are not batched).
    """
    runner, config, meshes, watch = _loaded()
    adapters.activate(runner.adapted(), active)
    slots = request_slots(config)
    slot = meshes.data_parallel_rank if slots > 1 else 0
    reports = slots > 1 or rank() == 0
    reset_peak_memory()
    outputs = []
    accounting = CommAccounting(runner.modules()) if measure_comm else contextlib.nullcontext()
    with torch.no_grad(), accounting:
        for groups in lockstep_rounds(requests, slots, batch_size, single_inputs):
            group = groups[slot]
            decode = reports and not all(r.filler for r in group)
            payloads = _generate_group(runner, watch, call_id, group, params, decode, progress and rank() == 0)
            if decode:
                outputs += [(r.request_id, p) for r, p in zip(group, payloads, strict=True) if not r.filler]
    memory, kind = peak_memory()
    comm = {**accounting.report().to_dict(), "forwards": sum(accounting.forwards)} if measure_comm else None
    return RankResult(rank=rank(), outputs=outputs, peak_memory_bytes=memory, memory_kind=kind, comm=comm)


def _generate_group(
    runner, watch, call_id: int, group: list[Request], params, reports: bool, progress: bool
) -> list[dict]:
    if watch is None:
        return runner.generate(group, params, decode=reports, progress=progress)
    watch.active = [(call_id, r.request_id) for r in group]
    started = time.perf_counter()
    try:
        return runner.generate(group, params, decode=reports, progress=progress)
    except RequestCancelled:
        return [{"cancelled": True, "timings": Timings(total_s=time.perf_counter() - started)} for _ in group]
    finally:
        watch.active = []


def ping() -> int:
    """A round trip: proves this rank's command loop answers (the engine's liveness check)."""
    return rank()


def unload() -> None:
    """Drop the loaded model (a new :func:`load` replaces it)."""
    if worker_state().pop(_KEY, None) is not None:
        gc.collect()
