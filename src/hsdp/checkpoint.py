"""Sharded training checkpoints on DCP, committed atomically, and a consolidated safetensors export.

Layout of ``--output-dir``::

    step-00000020/            a complete checkpoint: DCP shards + .metadata, trainer_state.json,
        COMPLETE              rng/rank<r>.pt; COMPLETE is written last
    .tmp-step-00000030/       a save in progress (or interrupted): never taken as a checkpoint

Every rank writes its own shards into the temporary folder; once all ranks are done (a barrier), rank 0
writes ``trainer_state.json`` and the ``COMPLETE`` marker and renames the folder into place, then deletes all
but the newest ``keep_last``. A crash at any point leaves the previous checkpoint as the latest. DCP stores
each tensor's global shape and offsets, so a checkpoint saved at one world size loads at another (reshard on
load). With ``async_save`` the write runs on a background thread over a separate gloo group, and the commit
happens at the next save or at :meth:`Checkpointer.wait`.

:func:`export_safetensors` writes a Hugging Face model folder (consolidated ``*.safetensors``, ``config.json``,
tokenizer files) straight from the sharded parameters with DCP's ``HuggingFaceStorageWriter``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from hsdp.distributed import rank
from hsdp.exports import commit, staging_dir
from hsdp.loading import CheckpointError

logger = logging.getLogger("hsdp")

__all__ = [
    "Checkpointer",
    "CheckpointError",
    "complete_checkpoints",
    "latest_checkpoint",
    "read_trainer_state",
    "export_safetensors",
    "export_pipeline",
]

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (folders without ``COMPLETE`` are left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / COMPLETE).exists()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The trainer state of a complete checkpoint; :class:`CheckpointError` if it is partial or unreadable."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not (path / COMPLETE).exists():
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {COMPLETE} marker: the save was interrupted); resume from "
            f"{latest_checkpoint(path.parent) or 'an earlier checkpoint'} instead"
        )
    if not (path / ".metadata").exists():
        raise CheckpointError(f"checkpoint {path} has no DCP .metadata file: it is corrupt")
    try:
        return json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is missing or corrupt ({exc})") from exc


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.accelerator.is_available():
        state["accelerator"] = torch.get_device_module(
            torch.accelerator.current_accelerator().type
        ).get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "accelerator" in state and torch.accelerator.is_available():
        torch.get_device_module(torch.accelerator.current_accelerator().type).set_rng_state(
            state["accelerator"]
        )


@contextmanager
def _interrupt_after() -> Iterator[None]:
    """Hold SIGINT until the block ends, then raise it. A KeyboardInterrupt raised inside DCP's file writes
    surfaces as a RuntimeError from torch.save's C++ writer ("unexpected pos"): the checkpoint would be lost and
    the run would end as a crash, not as an interruption. Only the main thread can install handlers; elsewhere the
    block runs as it is, and so where SIGINT is ignored or handled by another handler than Python's default (a
    rank of a group the caller interrupts, a server)."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


class Checkpointer:
    """Saves and loads model + optimizer + trainer state under one output folder (see the module docstring)."""

    def __init__(
        self, root: str | Path, *, keep_last: int = 2, async_save: bool = False, trainable_only: bool = False
    ):
        """``trainable_only``: save and load only parameters that require grad (LoRA adapters; the frozen base
        is read from the model folder again on resume)."""
        if keep_last < 1:
            raise ValueError(f"--keep-last={keep_last} must be >= 1")
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending: tuple[Any, int, Path, dict] | None = None
        self._options = StateDictOptions(ignore_frozen_params=trainable_only)
        # DCP already fails on a key the checkpoint lacks; the frozen keys are absent on purpose.
        self._load_options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
        # A CPU group of its own: the background writer must not interleave collectives with training. Owned
        # here and destroyed by close(), so a process that keeps running after training does not leak it.
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None

    def close(self, *, finish_pending: bool = True) -> None:
        """Finish a pending save (unless ``finish_pending`` is False: after a failure its barriers could only
        wait for the collective timeout) and destroy the checkpoint group."""
        if finish_pending:
            self.wait()
        self._pending = None
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(finish_pending=exc_type is None)

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Checkpoint after optimizer step ``step``; collective (every rank calls it). A Ctrl-C meanwhile takes
        effect once the checkpoint is complete."""
        with _interrupt_after():
            self._save(step, model, optimizer, state)

    def _save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        self.wait()
        tmp = self.root / f".tmp-step-{step:08d}"
        if rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-step-*"):  # interrupted saves
                shutil.rmtree(stale, ignore_errors=True)
        _barrier(self._group)
        (tmp / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(_rng_state(), tmp / "rng" / f"rank{rank()}.pt")
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options)
        app_state = {"model": self._saved_part(model, model_sd), "optim": optim_sd}
        if self.async_save:
            future = dcp.async_save(app_state, checkpoint_id=str(tmp), process_group=self._group)
            self._pending = (future, step, tmp, state)
        else:
            dcp.save(app_state, checkpoint_id=str(tmp), process_group=self._group)
            self._commit(step, tmp, state)

    def _saved_part(self, model: nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
        """With ``trainable_only``, drop what ``ignore_frozen_params`` keeps: a frozen tied alias (``lm_head``)."""
        if not self._options.ignore_frozen_params:
            return model_sd
        trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        return {k: v for k, v in model_sd.items() if k in trainable}

    def wait(self) -> Path | None:
        """Finish and commit a pending asynchronous save; returns its folder."""
        if self._pending is None:
            return None
        future, step, tmp, state = self._pending
        self._pending = None
        future.result()
        return self._commit(step, tmp, state)

    def _commit(self, step: int, tmp: Path, state: dict[str, Any]) -> Path:
        final = self.root / f"step-{step:08d}"
        _barrier(self._group)  # every rank's shards are on disk
        if rank() == 0:
            (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=1))
            (tmp / COMPLETE).write_text(f"{step}\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in complete_checkpoints(self.root)[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier(self._group)
        if rank() == 0:
            logger.info("Saved checkpoint %s", final)
        return final

    def agreed(self, path: str | Path | None) -> Path | None:
        """``path`` (the checkpoint this rank chose to resume from, or None) once every rank chose the same one;
        collective. Each rank picks it from the folder (``--resume auto`` / ``latest``); ranks that disagree (a
        folder not shared by every node, a save committed between their looks) would otherwise wait in different
        collectives until the timeout."""
        chosen = str(path) if path is not None else None
        every: list[str | None] = [chosen]
        if self._group is not None:
            every = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(every, chosen, group=self._group)
        if len(set(every)) > 1:
            raise CheckpointError(
                f"ranks chose different checkpoints to resume from ({', '.join(map(str, every))}, by rank): is "
                f"--output-dir {self.root} one folder that every node sees? Pass --resume PATH to pick one"
            )
        return None if chosen is None else Path(chosen)

    def load(self, path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load a complete checkpoint into the (already sharded) model and optimizer, at any world size."""
        path = Path(path)
        state = read_trainer_state(path)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options)
        app_state = {"model": self._saved_part(model, model_sd), "optim": optim_sd}
        try:
            dcp.load(app_state, checkpoint_id=str(path), process_group=self._group)
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            raise CheckpointError(
                f"checkpoint {path} could not be loaded (corrupt or from another model): {exc}"
            ) from exc
        set_state_dict(
            model,
            optimizer,
            model_state_dict=app_state["model"],
            optim_state_dict=app_state["optim"],
            options=self._load_options,
        )
        rng_file = path / "rng" / f"rank{rank()}.pt"
        if rng_file.exists():  # a resharded resume has ranks the checkpoint did not have
            _set_rng_state(torch.load(rng_file, weights_only=True))  # tensors only: no pickle code
        return state


def _tied_aliases(model: nn.Module) -> set[str]:
    """Names under which an already-listed parameter appears again (``lm_head.weight`` when tied)."""
    seen: set[int] = set()
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


def _name_plain_class(config_file: Path, model: torch.nn.Module) -> None:
    """Name the model's own class in a diffusers ``config.json``: ``save_config`` writes the class of the instance,
    which FSDP2 swapped for ``FSDP<Name>`` (a class no library has, so no loader could read the folder)."""
    from hsdp.sharding import unwrapped_class

    plain = unwrapped_class(model)
    config = json.loads(config_file.read_text())
    config["_class_name"] = plain.__name__
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export_safetensors(
    model: nn.Module,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    source_dir: str | Path | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    run: str = "",
) -> Path:
    """Write a ``from_pretrained``-loadable folder from a (sharded) model; collective.

    Each rank writes its own slices, then rank 0 consolidates them into full tensors. Tied aliases are left
    out (``from_pretrained`` re-ties them); ``dtype`` casts floating tensors (default: as trained).
    ``config.json`` records the dtype; tokenizer files are copied from ``source_dir``. ``state_dict`` (sharded or
    plain tensors under the model's keys, e.g. a LoRA-merged state) is written instead of the model's own.
    Written into a temporary sibling and moved into place (:func:`hsdp.exports.commit`), so a failed export
    leaves nothing behind and only what an earlier export of ``run`` wrote in ``out_dir`` is replaced.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    if rank() == 0:
        staging_dir(out_dir)
    _barrier()
    _write_model(model, tmp, dtype=dtype, source_dir=source_dir, state_dict=state_dict)
    try:  # rank 0 may refuse to commit (a file appeared in out_dir): the other ranks must not wait for it
        if rank() == 0:
            commit(tmp, out_dir, run)
    finally:
        _barrier()
    if rank() == 0:
        logger.info("Exported %s (%s) to %s", type(model).__name__, dtype or "as trained", out_dir)
    return out_dir


def export_pipeline(
    models: Mapping[str, nn.Module],
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    run: str = "",
) -> Path:
    """A diffusers pipeline folder: ``model_dir``'s files with each component of ``models`` (name -> trained,
    sharded model) replaced, written and moved into place as :func:`export_safetensors` does; collective."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    if rank() == 0:
        shutil.copytree(
            model_dir, staging_dir(out_dir), dirs_exist_ok=True, ignore=shutil.ignore_patterns(*models, ".complete")
        )
    _barrier()
    for component, model in models.items():
        _write_model(model, tmp / component, dtype=dtype, source_dir=Path(model_dir) / component, state_dict=None)
    try:
        if rank() == 0:
            commit(tmp, out_dir, run)
    finally:
        _barrier()
    return out_dir


def _write_model(
    model: nn.Module,
    tmp: Path,
    *,
    dtype: torch.dtype | None,
    source_dir: str | Path | None,
    state_dict: dict[str, torch.Tensor] | None,
) -> None:
    """Every rank's slices into ``tmp``, consolidated there by rank 0 (see :func:`export_safetensors`)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    skip = _tied_aliases(model)
    state = {
        k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach())
        for k, v in (get_model_state_dict(model) if state_dict is None else state_dict).items()
        if k not in skip
    }
    writer = HuggingFaceStorageWriter(
        str(tmp),
        save_distributed=True,
        enable_consolidation=True,
        fqn_to_index_mapping=dict.fromkeys(state, 1),
    )
    dcp.save(state, storage_writer=writer)
    if rank() == 0:
        shutil.rmtree(tmp / "sharded", ignore_errors=True)
        if hasattr(model, "save_config"):  # a diffusers model: its config and weights file names
            model.save_config(tmp)
            _name_plain_class(tmp / "config.json", model)
            (tmp / "model.safetensors.index.json").unlink(missing_ok=True)
            (written,) = tmp.glob("model-*.safetensors")  # one file: every key maps to index 1
            written.rename(tmp / "diffusion_pytorch_model.safetensors")
        elif hasattr(model, "config"):
            config = copy.deepcopy(model.config)
            saved = dtype or next(v.dtype for v in state.values() if v.is_floating_point())
            config.dtype = saved
            config.save_pretrained(tmp)
        if source_dir is not None:
            for item in Path(source_dir).iterdir():
                if (
                    item.is_file()
                    and not item.name.endswith(".safetensors")
                    and item.name
                    not in (
                        "config.json",
                        "model.safetensors.index.json",
                        ".complete",
                    )
                ):
                    shutil.copy2(item, tmp / item.name)
