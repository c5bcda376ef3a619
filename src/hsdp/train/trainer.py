"""The training loop that runs on every rank: load sharded, step, checkpoint, resume, export.

Dtypes: the optimizer always holds fp32 master weights (the sharded parameters are fp32). With
``mixed_precision="bf16"`` (or ``"fp16"``) FSDP2 gathers bf16 copies for compute and reduce-scatters gradients
in fp32; a single process without FSDP uses ``torch.autocast`` instead. fp16 adds dynamic loss scaling
(``ShardedGradScaler``, whose inf check spans all ranks). Checkpoints store the fp32 masters; the export
is fp32 unless ``export_dtype`` says otherwise.

A step is ``grad_accum`` micro-batches; gradient reduction is switched off on all but the last
(``set_requires_gradient_sync``), gradients of replicated (ignored) parameters are averaged by hand, then the
global norm is clipped and AdamW steps. The loss of each micro-batch is its mean over tokens divided by
``grad_accum``, so the gradient equals the one of a single batch of ``batch_size * grad_accum`` rows.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hsdp import lora
from hsdp.attention import set_attention_backend
from hsdp.checkpoint import Checkpointer, export_safetensors, latest_checkpoint
from hsdp.config import DTYPES
from hsdp.distributed import collective_timeout_s, device_type, local_device, rank, world_size
from hsdp.loading import load_pretrained
from hsdp.lora_formats import save_lora
from hsdp.measure import peak_memory, reset_peak_memory
from hsdp.measure.comm import measure_comm
from hsdp.mesh import build_meshes
from hsdp.shard_rules import ShardPlan, resolve_plan
from hsdp.train.config import Preflight, TrainConfig, TrainConfigError, preflight
from hsdp.train.data import (
    IGNORE,
    DatasetError,
    TokenDataset,
    check_packing,
    split_records,
    tokenize_file,
)
from hsdp.train.grads import all_reduce_plain_grads, clip_grad_norm_
from hsdp.train.report import make_reporter, step_metrics, write_summary
from hsdp.train.run_page import write_run_page
from hsdp.train.schedule import build_scheduler
from hsdp.train.stop import requested, signal_name

logger = logging.getLogger("hsdp")

__all__ = ["Trainer", "StepResult", "TrainResult", "load_data", "load_dataset"]

PAGE_EVERY_S = 10.0
"""The run page (:mod:`hsdp.train.run_page`) is rewritten at a log point at most this often."""


@dataclass
class StepResult:
    step: int
    """Optimizer steps done after this one (1-based)."""
    loss: float
    grad_norm: float | None
    tokens_per_s: float
    seconds: float
    peak_memory: list[int]
    """Peak memory of every rank so far (bytes)."""
    lr: float = 0.0
    """The learning rate this step ran at."""
    eval_loss: float | None = None
    """Mean token loss on the eval data after this step (when evaluated)."""
    eval_perplexity: float | None = None


@dataclass
class TrainResult:
    steps: list[StepResult] = field(default_factory=list)
    checkpoint: str | None = None
    export: str | None = None
    export_merged: str | None = None
    unit: str = "tokens"
    """What ``StepResult.tokens_per_s`` counts (``samples`` for diffusion)."""
    memory_kind: str = ""
    """What ``StepResult.peak_memory`` counts (:attr:`hsdp.measure.MemoryReading.kind`: the allocator's tensor peak
    on an accelerator, what ``hsdp plan`` estimates; the resident set on a CPU, which adds the runtime's memory)."""
    comm: dict | None = None
    """With ``comm_stats``: this rank's collectives in the last step against the minimum (calls, bytes, minimum)."""
    stopped_by: str | None = None
    """The signal that stopped the run before ``cfg.steps`` (``SIGTERM``; :mod:`hsdp.train.stop`), its checkpoint
    saved at the step it stopped at; None for a run that went to the end. Nothing is exported then."""
    data: dict | None = None
    """What the run trains on, for its page (:meth:`Trainer.data_table`)."""

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]


def _rows(cfg: TrainConfig, encoded: list, tokenizer, source: str) -> TokenDataset:
    if cfg.packing:
        return TokenDataset.pack(encoded, cfg.seq_len, seed=cfg.seed, source=source)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise DatasetError("--no-packing pads rows, but the tokenizer has no pad or eos token; use packing")
    return TokenDataset.pad(encoded, cfg.seq_len, pad, seed=cfg.seed, source=source)


def load_data(cfg: TrainConfig, model_dir: Path) -> tuple[TokenDataset, TokenDataset | None]:
    """Tokenize ``cfg.data`` (and the eval data) with the model's tokenizer: (train, eval or None).
    :class:`DatasetError` if a record is malformed or one step's batch does not fit."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoded = tokenize_file(cfg.data, tokenizer, cfg.text_key)
    held: list | None = None
    if cfg.eval_split:
        encoded, held = split_records(encoded, cfg.eval_split, cfg.seed)
    elif cfg.eval_data:
        held = tokenize_file(cfg.eval_data, tokenizer, cfg.text_key, flag="--eval-data")
    data = _rows(cfg, encoded, tokenizer, str(cfg.data))
    data.require(cfg.batch_size * cfg.grad_accum)
    if data.positions is not None:  # records packed side by side: the model must keep them apart
        check_packing(model_dir)
    evaluation = None
    if held is not None:
        evaluation = _rows(
            cfg, held, tokenizer, cfg.eval_data or f"{cfg.data} (--eval-split {cfg.eval_split})"
        )
        evaluation.require(1)
    return data, evaluation


def load_dataset(cfg: TrainConfig, model_dir: Path) -> TokenDataset:
    """The training rows of ``cfg`` (see :func:`load_data`)."""
    return load_data(cfg, model_dir)[0]


class Trainer:
    """Build everything for ``cfg`` on this rank (collective when the world has several ranks)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        checks = self._preflight()  # before any collective: every rank fails alike on bad input
        self.parallel = cfg.effective_parallel()
        self.rank, self.world_size = rank(), world_size()
        self.device = local_device()
        self.model_dir = checks.model_dir
        self.fingerprint = checks.fingerprint

        self.data, self.eval_data = self._load_data()
        self.meshes = build_meshes(self.parallel)  # the first collective
        # Ranks of one sequence-parallel group train on the same rows (HSDP overlays them, so they are the FSDP
        # mesh when the layout has them: data parallel is then 1).
        self.sequence_parallel = self.parallel.sequence_parallel_size
        self.dp_size = self.parallel.data_parallel_size // self.sequence_parallel
        self.dp_rank = self.meshes.data_parallel_rank // self.sequence_parallel

        torch.manual_seed(cfg.seed)
        self.lora = self._lora_config() if cfg.use_lora else None
        self.model = self._load_model()
        self.model.train()
        if cfg.attention_backend is not None:  # before the sequence split, which wraps the attention processors
            for model in self._models():
                set_attention_backend(model, cfg.attention_backend)
        if self.sequence_parallel > 1:
            self._enable_sequence_parallel()
        if self.lora:
            count = lora.init_adapters(self.model, cfg.seed, cfg.lora_adapter)
            logger.info("LoRA r=%d alpha=%g: %d adapter parameters", self.lora.r, self.lora.lora_alpha, count)
        self._freeze()
        if cfg.activation_checkpointing:
            self._enable_activation_checkpointing()
        if cfg.compile:
            self._compile_blocks()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise TrainConfigError(f"--freeze {' '.join(cfg.freeze)} froze every parameter; nothing to train")
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self._prepare_optimizer()
        self.scheduler = build_scheduler(self.optimizer, cfg.lr_scheduler, cfg.warmup_steps, cfg.steps)
        self.checkpointer = (
            Checkpointer(
                cfg.output_dir,
                keep_last=cfg.keep_last,
                async_save=cfg.async_save,
                trainable_only=self.lora is not None,
            )
            if cfg.output_dir
            else None
        )
        self.scaler = self._grad_scaler()
        self.step = 0
        self._stepped = False  # train_step ran (the first one trims the freed heap, reset_peak_memory)
        self._ahead: tuple[int, Any] | None = None  # (micro-batch number, its inputs), see _prepare_ahead
        self.stop_agreed = False  # some rank received a stop signal (hsdp.train.stop): all stop after this step
        resume_from = self.checkpointer.agreed(checks.resume_from) if self.checkpointer else None
        if resume_from is not None:
            state = self.checkpointer.load(resume_from, self.model, self.optimizer)
            self.step = int(state["step"])
            if self.scaler is not None and state.get("grad_scaler"):
                self.scaler.load_state_dict(state["grad_scaler"])
            if state.get("scheduler"):
                self.scheduler.load_state_dict(state["scheduler"])
            logger.info("Resumed from %s at step %d", resume_from, self.step)

    def close(self, *, finish_pending: bool = True) -> None:
        """Release the process group the trainer owns (the checkpointer's; the meshes' groups belong to the
        process and are reused by the next model on the same layout, :func:`hsdp.mesh.build_meshes`)."""
        if self.checkpointer is not None:
            self.checkpointer.close(finish_pending=finish_pending)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(finish_pending=exc_type is None)

    # -- what a kind of model changes (hsdp.train.diffusion.DiffusionTrainer overrides these) -------------------
    unit = "tokens"
    """What ``StepResult.tokens_per_s`` counts."""

    def _preflight(self) -> Preflight:
        return preflight(self.cfg)

    def _load_data(self) -> tuple:
        return load_data(self.cfg, self.model_dir)

    def _weights_dir(self) -> Path:
        """The folder whose weights are trained."""
        return self.model_dir

    def _lora_config(self):
        return self.cfg.lora_config(str(self.model_dir), task_type="CAUSAL_LM")

    def _load_weights(self, folder: Path) -> nn.Module:
        """The model of ``folder`` loaded sharded for training, with the LoRA adapters injected when set."""
        return load_pretrained(
            folder,
            self.parallel,
            plan=self._shard_plan,
            # LoRA keeps the frozen base in its checkpoint dtype; full fine-tuning keeps fp32 masters.
            dtype="auto" if self.lora else torch.float32,
            meshes=self.meshes,
            training=True,
            prepare=lora.injector(self.lora) if self.lora else None,
            model_config=self._model_config(),
        )

    def _model_config(self) -> dict:
        """Fields set over the trained model's config when it is loaded (a diffusers family's: its training script's)."""
        return {}

    def _load_model(self) -> nn.Module:
        """The trained model (``self.model``)."""
        return self._load_weights(self._weights_dir())

    def _models(self) -> list[nn.Module]:
        """The separately loaded (and sharded) models ``self.model`` holds: itself, or the experts of a
        :class:`hsdp.train.diffusion.DiffusionTrainer` that trains several denoisers."""
        return [self.model]

    def _prepare_optimizer(self) -> None:
        """Called once the optimizer exists, before a resume loads its state."""

    def _compile_blocks(self) -> None:
        """``--compile``: the engine's regional compilation, on the model being trained (after LoRA and activation
        checkpointing, which the compiled ``forward`` runs inside)."""
        from hsdp.engine.compile import compile_blocks

        try:
            for model in self._models():
                compile_blocks(model)
        except ValueError as exc:
            raise TrainConfigError(str(exc)) from exc

    def _enable_activation_checkpointing(self) -> None:
        """Recompute each block in the backward (``--activation-checkpointing``); refused for a model without it."""
        if not getattr(self.model, "supports_gradient_checkpointing", False):
            raise TrainConfigError(f"--activation-checkpointing: {type(self.model).__name__} does not support it")
        kwargs = {"use_reentrant": False}
        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5
            self.model.activation_checkpointing_enable(kwargs)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def _enable_sequence_parallel(self) -> None:
        raise TrainConfigError(
            "--ulysses-degree: sequence-parallel training splits a diffusers denoiser's sequence (its _cp_plan); "
            f"{type(self.model).__name__} has none"
        )

    def _items_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.grad_accum * self.cfg.seq_len

    def _micro_inputs(self, number: int) -> Any:
        """This rank's rows of micro-batch ``number`` (``step * grad_accum + micro``), on its device, with the
        step's global target count when records are masked."""
        cfg = self.cfg
        step, micro = divmod(number, cfg.grad_accum)
        batch = self.data.batch(
            step, micro, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, dp_rank=self.dp_rank,
            dp_size=self.dp_size,
        ).to(self.device)  # fmt: skip
        targets = None if self.data.uniform else self.data.step_targets(step, cfg.batch_size, cfg.grad_accum)
        return batch, targets

    def _micro_loss(self, inputs: Any) -> torch.Tensor:
        """This rank's loss on its rows of a micro-batch (:meth:`_micro_inputs`), scaled so that the summed
        gradients of the step's micro-batches are those of one batch.

        Masked labels: every rank divides its summed token losses by the step's global target count (times dp,
        since FSDP averages gradients over dp), so the step's loss is the token mean over all ranks' rows."""
        batch, targets = inputs
        with self._autocast():
            if targets is None:
                return self.model(**batch.model_inputs(), use_cache=False).loss / self.cfg.grad_accum
            per_rank = torch.tensor(max(1, targets) / self.dp_size, device=self.device)
            return self.model(**batch.model_inputs(), use_cache=False, num_items_in_batch=per_rank).loss

    def _inputs_for(self, number: int) -> Any:
        """Micro-batch ``number``'s inputs: made ahead by :meth:`_prepare_ahead`, or now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == number:
            return ahead[1]
        return self._micro_inputs(number)

    def _prepare_ahead(self, number: int) -> None:
        """Make micro-batch ``number``'s inputs while an accelerator still runs the backward just queued (a step
        waits for the device only at its end): their CPU work (rows, noise, stacking) and copies then overlap
        the compute instead of leaving the device idle at the start of the next micro-batch. The inputs depend on
        ``number`` alone, so making them early changes nothing."""
        if number < self.cfg.steps * self.cfg.grad_accum:
            self._ahead = (number, self._micro_inputs(number))

    def _data_state(self) -> dict:
        cfg = self.cfg
        return {"path": str(cfg.data), "seq_len": cfg.seq_len, "seed": cfg.seed}

    def _validate(self) -> bool:
        """Validation samples when due, before the first step and after each (diffusion); none for an LM. True when
        it wrote some."""
        return False

    def _step_note(self, step: int) -> str:
        """What the log line of step ``step`` (0-based) adds: which of several denoisers it trained."""
        return ""

    # -- setup -----------------------------------------------------------------------------------------------
    def _shard_plan(self, model: nn.Module) -> ShardPlan:
        return resolve_plan(model).with_ignored(self.cfg.replicated_modules)

    def _freeze(self) -> None:
        patterns = [re.compile(p) for p in self.cfg.freeze]
        frozen = 0
        for name, param in self.model.named_parameters():
            if any(p.search(name) for p in patterns):
                param.requires_grad_(False)
                frozen += param.numel()
        if patterns:
            logger.info("Froze %d parameters matching %s", frozen, ", ".join(self.cfg.freeze))

    def _grad_scaler(self) -> torch.amp.GradScaler | None:
        if self.cfg.mixed_precision not in ("fp16", "float16"):
            return None
        if dist.is_initialized():
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(device=device_type())
        return torch.amp.GradScaler(device_type())

    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP's MixedPrecisionPolicy casts for sharded models; autocast gives a lone model the same compute dtype.
        if self.cfg.mixed_precision and not self.parallel.use_hsdp:
            return torch.autocast(device_type(), dtype=DTYPES[self.cfg.mixed_precision])
        return contextlib.nullcontext()

    def _set_grad_sync(self, enabled: bool) -> None:
        for model in self._models():
            if isinstance(model, FSDPModule):
                model.set_requires_gradient_sync(enabled)

    # -- the loop ----------------------------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        cfg = self.cfg
        # Each step's peak (weights, optimizer state, activations of this step). The freed heap is handed back
        # only before this trainer's first step (what loading left): trimming at every step made each step fault
        # its activations' pages in again, ~20 % of a small CPU step, with the same losses.
        reset_peak_memory(self.device, release_freed=not self._stepped)
        self._stepped = True
        started = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        total = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            number = self.step * cfg.grad_accum + micro
            self._set_grad_sync(micro == cfg.grad_accum - 1)
            loss = self._micro_loss(self._inputs_for(number))
            # Under sequence parallel each rank's gradients cover its share of the sequence and FSDP averages
            # over all of them: scaled by the degree, the average is the sum, the whole sequence's gradient.
            scaled = loss * self.sequence_parallel if self.sequence_parallel > 1 else loss
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            self._prepare_ahead(number + 1)
            total += loss.detach().float()
        all_reduce_plain_grads(self.params)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = clip_grad_norm_(self.params, cfg.max_grad_norm) if cfg.max_grad_norm else None
        if self.scaler:  # skips the step when any rank saw inf/nan, then adapts the scale
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # A stop signal rides on the loss all-reduce: every rank learns of any rank's at the same step boundary.
        stop = torch.tensor(float(requested() or 0), device=self.device)
        if dist.is_initialized():
            # Ranks of one TP group hold the same loss, so the world mean is the data-parallel mean.
            both = torch.stack([total, stop])
            dist.all_reduce(both)
            total, stop = both[0] / self.world_size, both[1]
        self.stop_agreed = bool(stop.item())
        peaks = torch.tensor([peak_memory(self.device).bytes], device=self.device)
        if dist.is_initialized():
            gathered = [torch.zeros_like(peaks) for _ in range(self.world_size)]
            dist.all_gather(gathered, peaks)
            peaks = torch.cat(gathered)
        self.step += 1
        seconds = time.perf_counter() - started
        tokens = self._items_per_step()
        return StepResult(
            step=self.step,
            loss=total.item(),
            grad_norm=None if norm is None else norm.item(),
            lr=lr,
            tokens_per_s=tokens / seconds,
            seconds=seconds,
            peak_memory=[int(p) for p in peaks.tolist()],
        )

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """(mean token loss, perplexity) over all eval rows, split over the data-parallel ranks; collective.

        Every rank runs the same number of forwards (FSDP gathers collectively): a rank past the last row runs
        one of its rows again with every label masked, which adds nothing to the sums."""
        assert self.eval_data is not None
        per_rank = self.cfg.batch_size // self.dp_size
        rows = torch.arange(len(self.eval_data))
        mine = rows[self.dp_rank :: self.dp_size]
        forwards = -(-len(rows[:: self.dp_size]) // per_rank)
        sums = torch.zeros(2, device=self.device)  # summed token loss, targets
        self.model.eval()
        for i in range(forwards):
            index = mine[i * per_rank : (i + 1) * per_rank]
            batch = self.eval_data.batch_of(index if len(index) else rows[:1])
            if not len(index):
                batch.labels.fill_(IGNORE)
            batch = batch.to(self.device)
            with self._autocast():
                out = self.model(**batch.model_inputs(), use_cache=False, num_items_in_batch=1)
            sums += torch.stack([out.loss.float(), torch.tensor(float(batch.targets), device=self.device)])
        self.model.train()
        if dist.is_initialized():
            dist.all_reduce(sums)  # tensor-parallel peers add equal copies to both sums: the ratio holds
        loss = (sums[0] / sums[1].clamp(min=1)).item()
        return loss, math.exp(min(loss, 50.0))

    def _state(self) -> dict:
        cfg = self.cfg
        return {
            "model": self.fingerprint,
            "data": self._data_state(),
            "batch_size": cfg.batch_size,
            "grad_accum": cfg.grad_accum,
            "world_size": self.world_size,
            "layout": self.parallel.describe() if self.parallel.use_hsdp else "single process",
            "grad_scaler": self.scaler.state_dict() if self.scaler else None,
            "settings": cfg.resume_settings(),  # what a resume must repeat (train.config._check_settings)
            "scheduler": self.scheduler.state_dict(),
        }

    def save(self) -> None:
        assert self.checkpointer is not None
        self.checkpointer.save(self.step, self.model, self.optimizer, self._state())

    def data_table(self) -> dict:
        """What the run trains on, for its page: source, items and their unit; diffusion adds size buckets and the
        files left out or upscaled, with why."""
        return {"source": str(self.cfg.data), "items": len(self.data), "unit": f"rows of {self.data.seq_len} tokens"}

    def _write_page(self, result: TrainResult, state: str) -> None:
        """Rank 0 rewrites ``<output-dir>/report.html`` (:mod:`hsdp.train.run_page`); a page it cannot write is a
        warning, never the end of the run."""
        if self.rank != 0 or not self.cfg.output_dir:
            return
        last = latest_checkpoint(self.checkpointer.root) if self.checkpointer else None
        try:
            write_run_page(self.cfg.output_dir, result, self.cfg, state=state, checkpoint=last and str(last))
        except OSError as exc:
            logger.warning("the run page was not written: %s", exc)

    def fit(self, on_step=None) -> TrainResult:
        """Train up to ``cfg.steps``; ``on_step(StepResult)`` is called on every rank after each step."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        result = TrainResult(unit=self.unit, memory_kind=peak_memory(self.device).kind, data=self.data_table())
        reporter = make_reporter(cfg) if self.rank == 0 else None
        bar = tqdm(
            total=cfg.steps,
            initial=self.step,
            desc="train",
            disable=self.rank != 0 or not cfg.progress,
            leave=False,
        )
        page_due = time.monotonic() + PAGE_EVERY_S
        try:
            self._write_page(result, "running")
            if self.step == 0:
                self._validate()
                self._write_page(result, "running")
            while self.step < cfg.steps:
                if cfg.comm_stats and self.step == cfg.steps - 1:
                    step, report = measure_comm(self.model, self._guarded_step, training=True)
                    result.comm = {"calls": report.calls, "bytes": report.bytes, "minimum": report.minimum}
                else:
                    step = self._guarded_step()
                result.steps.append(step)
                if self.rank == 0 and cfg.summary_json:  # after every step: an interrupted run keeps its figures
                    write_summary(cfg.summary_json, result.steps)
                bar.update(1)
                bar.set_postfix(loss=f"{step.loss:.4f}", per_s=f"{step.tokens_per_s:.1f} {self.unit}")
                logged = step.step % cfg.log_every == 0 or step.step == cfg.steps
                if self.rank == 0 and logged:
                    logger.info(
                        "step %d/%d loss %.4f lr %.3g%s %s/s %.1f peak memory per rank (MiB, %s) %s%s",
                        step.step,
                        cfg.steps,
                        step.loss,
                        step.lr,
                        "" if step.grad_norm is None else f" grad-norm {step.grad_norm:.4f}",
                        self.unit,
                        step.tokens_per_s,
                        result.memory_kind,
                        " ".join(f"{p / 2**20:.0f}" for p in step.peak_memory),
                        self._step_note(step.step - 1),
                    )
                evaluated = self.eval_data is not None and (
                    (cfg.eval_every and step.step % cfg.eval_every == 0) or step.step == cfg.steps
                )
                if evaluated:
                    step.eval_loss, step.eval_perplexity = self.evaluate()
                    if self.rank == 0:
                        perplexity = step.eval_perplexity  # None for diffusion: a loss, not a likelihood
                        logger.info(
                            "eval at step %d: loss %.4f%s",
                            step.step,
                            step.eval_loss,
                            "" if perplexity is None else f" perplexity {perplexity:.2f}",
                        )
                sampled = self._validate()
                if reporter is not None:
                    reporter.log(step.step, step_metrics(step))
                if on_step is not None:
                    on_step(step)
                saved = self.checkpointer and (
                    (cfg.save_every and self.step % cfg.save_every == 0) or self.step == cfg.steps or self.stop_agreed
                )
                if saved:
                    self.save()
                # A log point rewrites the page at most every PAGE_EVERY_S (it grows with the run; the first step
                # of this process shows at once); eval, samples and checkpoints always do.
                if evaluated or sampled or saved or (logged and (len(result.steps) == 1 or time.monotonic() >= page_due)):
                    self._write_page(result, "running")
                    page_due = time.monotonic() + PAGE_EVERY_S
                if self.stop_agreed and self.step < cfg.steps:
                    result.stopped_by = signal_name(requested())
                    if self.rank == 0:
                        logger.info("stopping at step %d/%d: %s", self.step, cfg.steps, result.stopped_by)
                    break
        except BaseException as exc:  # the page stops reloading itself and says why
            self._write_page(result, f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:300])
            raise
        finally:
            bar.close()
            if reporter is not None:
                reporter.close()
        if self.checkpointer:
            self.checkpointer.wait()
            result.checkpoint = str(latest_checkpoint(self.checkpointer.root))
        if result.stopped_by is None:  # a stopped run is not finished: its export would pass for the trained model
            self._export(result)
        self._write_page(result, "finished" if result.stopped_by is None else f"stopped by {result.stopped_by}")
        return result

    def _export(self, result: TrainResult) -> None:
        cfg = self.cfg
        dtype = DTYPES[cfg.export_dtype] if cfg.export_dtype else None
        if cfg.export and self.lora:
            result.export = str(self._export_lora())
        elif cfg.export:
            result.export = str(
                export_safetensors(self.model, cfg.export, dtype=dtype, source_dir=self.model_dir, run=cfg.run_name())
            )
        if cfg.export_merged:
            merged = lora.merged_state(self.model, dtype)
            result.export_merged = str(
                export_safetensors(
                    self.model, cfg.export_merged, dtype=dtype, source_dir=self.model_dir, state_dict=merged,
                    run=cfg.run_name(),
                )
            )  # fmt: skip

    def _export_lora(self, component: str = "transformer", diffusers: bool = False, pipeline: type | None = None) -> Path:
        """The adapters in each ``--export-format`` (several: one subfolder each), cast to ``--export-dtype``;
        ``pipeline`` the diffusers pipeline class the single-file formats are checked by."""
        cfg = self.cfg
        dtype = DTYPES[cfg.export_dtype] if cfg.export_dtype else None
        for fmt, folder in cfg.export_folders(diffusers).items():
            save_lora(self.model, self.lora, folder, format=fmt, component=component, dtype=dtype, run=cfg.run_name(),
                      pipeline=pipeline)  # fmt: skip
        return Path(cfg.export)

    def _guarded_step(self) -> StepResult:
        try:
            return self.train_step()
        except RuntimeError as exc:
            if not dist.is_initialized():
                raise
            last = latest_checkpoint(self.checkpointer.root) if self.checkpointer else None
            raise RuntimeError(
                f"rank {self.rank}: step {self.step + 1} failed ({exc}). If another rank died, the others stop "
                f"within the collective timeout (HSDP_COLLECTIVE_TIMEOUT, now {collective_timeout_s():.0f}s). Last "
                f"complete checkpoint: {last or 'none'}" + ("; rerun with --resume" if last else "")
            ) from exc

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered whole on every rank, on the CPU (for tests and small exports); collective."""
        out = {}
        for name, param in self.model.named_parameters():
            tensor = param.full_tensor() if isinstance(param, DTensor) else param
            out[name] = tensor.detach().cpu().clone()
        return out
