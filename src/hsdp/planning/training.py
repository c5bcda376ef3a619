"""The layout ``hsdp train`` takes when its command names none: the planner's recommendation on the run's own mesh.

A training command fixes the mesh (``--use-hsdp --hsdp-shard-size N --hsdp-replicate-size R``); what stays open is
how FSDP2 holds the model over it: FULL_SHARD or SHARD_GRAD_OP, and for LoRA whether the frozen base is kept whole
(``--frozen-whole``, never gathered). :func:`planned_layout` profiles the model as the trainer builds it (the LM,
or the pipeline's denoiser with its traced activations), estimates every candidate of :func:`hsdp.planning.plan`
with that mesh, and picks the fastest that fits this machine, as ``hsdp plan --train`` recommends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hsdp.models.description import is_pipeline
from hsdp.planning.estimate import Estimate, Hardware, Workload
from hsdp.planning.profile import (
    ModelProfile,
    PlanError,
    build_meta_model,
    format_size,
    profile_model,
    profile_module,
)
from hsdp.planning.search import plan

if TYPE_CHECKING:
    from hsdp.train.config import TrainConfig

__all__ = ["lm_lora_profiles", "planned_layout", "PlannedLayout"]

RESERVE = 0.10
"""Kept free for the runtime, as ``hsdp plan``'s default ``--reserve``."""


def lm_lora_profiles(model: str, lora_r: int, targets: tuple[str, ...], dtype: torch.dtype | None) -> list[ModelProfile]:
    """The causal LM as ``hsdp train --lora-r`` builds it: the base in its stored dtype (or ``dtype``), frozen, with
    the trainer's own LoRA config injected (fp32 adapters, the only trained parameters)."""
    from hsdp import lora
    from hsdp.models.builtin import resolve_model
    from hsdp.train.config import TrainConfig

    folder = resolve_model(model)
    cfg = TrainConfig(model=model, data="", lora_r=lora_r, lora_target_modules=tuple(targets))
    built, config = build_meta_model(folder, dtype)
    try:
        lora.injector(cfg.lora_config(str(folder), task_type="CAUSAL_LM"))(built)
    except ValueError as exc:
        raise PlanError(f"--lora-target-modules: {exc}") from exc
    return [profile_module(built, folder.name, config)]


@dataclass(frozen=True)
class PlannedLayout:
    cfg: TrainConfig
    """The run with the chosen layout."""
    chosen: Estimate
    reason: str


def _profiles(cfg: TrainConfig, rows_per_rank: int) -> tuple[list[ModelProfile], Workload]:
    """The profiles :func:`planned_layout` weighs, read from the cache when the same model files, arguments and
    code profiled them before: tracing a training step on fake tensors takes seconds (10 s and more on a loaded
    host for a tiny pipeline), paid again by every restart of the same run (a requeued job, ``--resume auto``)."""
    from hsdp.models.builtin import resolve_model

    folder = resolve_model(cfg.model)
    pipeline = is_pipeline(folder)
    arguments = (
        dict(height=cfg.resolution, width=cfg.resolution, frames=cfg.frames or 1, batch=rows_per_rank,
             lora_r=cfg.lora_r, lora_targets=cfg.lora_target_modules, component=cfg.train_component,
             param_dtype=cfg.mixed_precision, activation_checkpointing=cfg.activation_checkpointing)
        if pipeline
        else dict(batch=rows_per_rank, seq_len=cfg.seq_len, lora_r=cfg.lora_r, lora_targets=cfg.lora_target_modules)
    )  # fmt: skip
    cached = _ProfileCache(folder, arguments)
    if (found := cached.read()) is not None:
        return found
    if pipeline:
        from hsdp.planning.diffusion import diffusion_training

        traced = diffusion_training(cfg.model, **arguments)
        result = [traced.profile], traced.work
    else:
        work = Workload(training=True, batch=rows_per_rank, seq_len=cfg.seq_len, guidance=False)
        if cfg.lora_r:
            result = lm_lora_profiles(cfg.model, cfg.lora_r, cfg.lora_target_modules, None), work
        else:
            result = profile_model(cfg.model, torch.float32), work  # full fine-tuning holds fp32 masters
    cached.write(result)
    return result


class _ProfileCache:
    """``$HSDP_CACHE/train-profiles/<key>.pickle``: the key digests the model folder's files (names, sizes,
    modification times), the profiling arguments, the planner's own source and the libraries' versions, so a changed
    model, argument or planner profiles again. An unreadable entry is profiled again and replaced."""

    def __init__(self, folder: Path, arguments: dict) -> None:
        import hashlib
        import importlib.metadata

        digest = hashlib.sha256(repr(sorted(arguments.items())).encode())
        for file in sorted(p for p in Path(folder).resolve().rglob("*") if p.is_file()):
            stat = file.stat()
            digest.update(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        for source in sorted(Path(__file__).parent.glob("*.py")):  # the planner's own source
            digest.update(source.read_bytes())
        for package in ("torch", "diffusers", "transformers", "peft"):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                digest.update(f"{package}={importlib.metadata.version(package)}".encode())
        from hsdp.models.tiny import default_cache_dir

        self.path = default_cache_dir() / "train-profiles" / f"{digest.hexdigest()[:32]}.pickle"

    def read(self) -> tuple[list[ModelProfile], Workload] | None:
        try:
            return pickle.loads(self.path.read_bytes())
        except Exception:  # noqa: BLE001 - missing, partial or from another layout of these classes: profile again
            return None

    def write(self, result: tuple[list[ModelProfile], Workload]) -> None:
        with contextlib.suppress(OSError):  # a read-only or full cache only costs the next run the trace
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
            partial.write_bytes(pickle.dumps(result))
            partial.replace(self.path)


def planned_layout(cfg: TrainConfig, device_memory: int | None = None) -> PlannedLayout | None:
    """``cfg`` with the planner's strategy and ``frozen_whole`` on its own mesh, and why; None when there is nothing
    to choose (one process, tensor or sequence parallel, an adapter folder to continue) or nothing fits (the run
    then says so itself). ``device_memory``: per device (default: this machine's, :func:`device_capacity`)."""
    from hsdp.measure.memory import device_capacity

    parallel = cfg.effective_parallel()
    if not parallel.use_hsdp or parallel.tensor_parallel_size > 1 or parallel.sequence_parallel_size > 1:
        return None
    if cfg.lora_adapter:  # its rank is in the folder; the planner is not asked
        return None
    devices = parallel.world_size
    memory = device_memory if device_memory is not None else device_capacity(devices)[0]
    hw = Hardware(int(memory * (1 - RESERVE)))
    profiles, work = _profiles(cfg, max(1, cfg.batch_size // parallel.data_parallel_size))
    same_mesh = [
        e
        for e in plan(profiles, devices, work, hw, cfg.mixed_precision).estimates
        if e.fits
        and not e.layout.config.cpu_offload
        and e.layout.config.offload_layers is None
        and (e.layout.config.hsdp_shard_size, e.layout.config.hsdp_replicate_size)
        == (parallel.hsdp_shard_size, parallel.hsdp_replicate_size)
    ]
    if not same_mesh:
        return None
    best = min(same_mesh, key=lambda e: (-e.samples_per_s, e.total))  # plan()'s training key
    chosen = dataclasses.replace(
        cfg.parallel,
        sharding_strategy=best.layout.config.sharding_strategy,
        frozen_whole=best.layout.config.frozen_whole,
        reshard_after_forward=None,
        _resolved=False,
    ).resolved()
    reason = (
        f"the planner's pick for this model on {devices} ranks of {format_size(memory)} (hsdp plan --train): highest "
        f"estimated throughput of the {len(same_mesh)} layouts of this mesh that fit, {format_size(best.total)} per "
        "rank"
    )
    return PlannedLayout(cfg.replace(parallel=chosen), best, reason)
