"""What a training run is: :class:`TrainConfig`, and the checks that run before any heavy work.

:func:`preflight` reads only small files (config.json, trainer_state.json, the data file's tokens) and raises a
:class:`TrainConfigError` naming the flag and the fix. It runs in the launching process before any rank is
spawned and again on every rank before the first collective, so a bad input never leaves one rank waiting on
another, and nothing in ``--output-dir`` or ``--export`` is overwritten.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsdp.config import DTYPES, ParallelConfig
from hsdp.models.description import INDEX_FILE, class_for_folder, is_pipeline
from hsdp.suggest import did_you_mean
from hsdp.train.report import report_problems
from hsdp.train.schedule import schedule_problems

logger = logging.getLogger("hsdp")

__all__ = [
    "TrainConfig",
    "TrainConfigError",
    "preflight",
    "model_fingerprint",
    "Preflight",
    "RESUME_AUTO",
    "check_export_formats",
]

RESUME_AUTO = "auto"
"""``--resume auto``: the newest complete checkpoint in ``--output-dir`` if there is one, else step 0 (one command
line for the first start and every restart of an elastic job)."""
# Settings a resumed run may change without changing the math of the steps after resume are absent from
# TrainConfig.resume_settings: --log-every, --save-every, --keep-last, --async-save, --output-dir, --export*,
# --eval-*, --report-to, --activation-checkpointing (recomputes the same values), --compile (the same math, fused),
# --steps with a constant schedule.
_LAYOUT_FLAGS = ("--strategy", "layout")

_FINGERPRINT_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


class TrainConfigError(ValueError):
    """A training setting or input file that cannot work; the message names the flag and the fix."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One fine-tuning run: of a causal LM, or of a diffusers pipeline's denoiser."""

    model: str
    """A Hugging Face model folder, or a built-in name (``tiny-llama``)."""
    data: str
    """A ``.txt`` file (one document) or ``.jsonl`` file (one ``{"text": ...}`` per line)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The layout; ``sharding_strategy`` picks FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD."""
    steps: int = 10
    """Optimizer steps to reach (a resumed run continues up to this step)."""
    batch_size: int = 8
    """Sequences per micro-batch over all data-parallel ranks (each rank takes batch_size / dp)."""
    seq_len: int = 128
    grad_accum: int = 1
    """Micro-batches per optimizer step; gradients are synchronised on the last one only."""
    lr: float = 1e-4
    weight_decay: float = 0.0
    lr_scheduler: str = "constant"
    """``constant``, ``linear`` or ``cosine`` (transformers' schedules; see :mod:`hsdp.train.schedule`)."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to ``lr``; must be shorter than ``steps``."""
    max_grad_norm: float | None = None
    """Clip gradients to this global norm (over all shards and replicated parameters)."""
    mixed_precision: str | None = None
    """``bf16`` or ``fp16``: compute in it, reduce gradients in fp32, keep fp32 master weights (saved in fp32).
    fp16 adds dynamic loss scaling (a gradient scaler whose state is checkpointed)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in backward instead of keeping them."""
    compile: bool = False
    """``torch.compile`` each repeated block of the trained model (regional, as ``hsdp generate --compile``): its
    forward and backward run as fused kernels, FSDP2's hooks stay outside; each input shape compiles once."""
    attention_backend: str | None = None
    """The trained model's attention kernel (``--attention-backend``, as ``hsdp generate`` takes it): a diffusers
    backend for a denoiser, a transformers implementation for a causal LM (:mod:`hsdp.attention`)."""
    freeze: tuple[str, ...] = ()
    """Regular expressions; matching parameters are frozen (LoRA-style partial fine-tuning)."""
    lora_r: int = 0
    """LoRA rank; > 0 trains peft LoRA adapters (fp32) on a frozen base kept in its checkpoint dtype."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the update is ``lora_alpha / lora_r * B @ A``."""
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ()
    """Module names (or suffixes) to adapt; empty: every linear layer but the output head (peft's all-linear)."""
    lora_adapter: str | None = None
    """Start from this peft adapter folder (its r, alpha and targets) instead of a fresh adapter."""
    export_merged: str | None = None
    """With LoRA: write the base model with the adapters merged in, as a safetensors model folder."""
    replicated_modules: tuple[str, ...] = ()
    """Module names kept whole on every rank (FSDP ignored modules); their gradients are all-reduced."""
    seed: int = 0
    text_key: str = "text"
    packing: bool = True
    """Pack records into ``seq_len`` blocks (attention masked per record); False: one padded row per record."""
    eval_data: str | None = None
    """A held-out file in any ``data`` format; eval loss and perplexity every ``eval_every`` steps and at the end."""
    eval_split: float = 0.0
    """Hold out this fraction of ``data``'s records for evaluation instead of ``eval_data``."""
    eval_every: int = 0
    """Evaluate every N steps (0: only at the end, when there is eval data)."""
    validation_prompts: tuple[str, ...] = ()
    """Diffusion: prompts generated with the model being trained, written under ``<output_dir>/samples/step-N``."""
    validation_every: int = 0
    """Validation samples every N steps (0: only before the first step and at the end)."""
    validation_negative_prompt: str | None = None
    """The validation samples' negative prompt (as ``hsdp generate --negative-prompt``)."""
    validation_cfg_scale: float | None = None
    """The validation samples' classifier-free guidance: the pipeline's ``true_cfg_scale`` (FLUX, Qwen-Image: > 1
    with a negative prompt runs the unconditional pass) or else its ``guidance_scale``; None = the model's default."""
    output_dir: str | None = None
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end, when --output-dir is set)."""
    keep_last: int = 2
    async_save: bool = False
    resume: str | None = None
    """``latest`` (the newest complete checkpoint in ``output_dir``, which must exist), ``auto`` (the newest one
    if any, else start at step 0) or a checkpoint folder."""
    export: str | None = None
    """Write a consolidated safetensors model folder here at the end (with LoRA: a peft adapter folder)."""
    export_dtype: str | None = None
    """dtype of the export (default: fp32, as trained)."""
    export_format: str | None = None
    """With LoRA: ``peft`` (adapter folder), ``diffusers`` (``pytorch_lora_weights.safetensors``, what
    ``pipe.load_lora_weights`` reads) or ``comfyui`` (``diffusion_model.`` keys), or several comma-separated (each
    into ``<export>/<format>``); default: ``diffusers`` for a diffusers pipeline, ``peft`` for a causal LM. See
    :mod:`hsdp.lora_formats`."""
    log_every: int = 1
    report_to: str = "none"
    """``none``, ``tensorboard`` or ``wandb``: where rank 0 reports loss, lr, grad norm, tokens/s, eval figures."""
    logging_dir: str | None = None
    """TensorBoard / wandb folder (default ``<output_dir>/runs``)."""
    progress: bool = True
    summary_json: str | None = None
    """Rank 0 rewrites this JSON file (one object per step: loss, lr, grad norm, throughput, peak memory) after every
    step, so a run that is interrupted or fails keeps the figures of the steps it made."""
    comm_stats: bool = False
    """Count the collectives of the last step and compare with the minimum (the counter slows that step)."""
    # Diffusion pipelines (hsdp.train.diffusion): ignored for causal LMs.
    resolution: int = 256
    """Side of the training area: each item's size bucket has about ``resolution ** 2`` pixels."""
    frames: int | None = None
    """Most frames per video clip (``k * t + 1`` frames are kept, t the VAE's temporal factor)."""
    timestep_sampling: str = "uniform"
    """Flow matching: ``uniform``, ``logit_normal`` or ``mode`` (diffusers' density sampling)."""
    flow_shift: float | None = None
    """Flow matching shift of the sampled sigmas (default: the pipeline scheduler's)."""
    caption_dropout: float = 0.0
    """Probability of training a row on the empty caption (for classifier-free guidance)."""
    max_sequence_length: int | None = None
    """Caption tokens the pipeline's ``encode_prompt`` pads to (its ``__call__`` argument of that name, as diffusers'
    training scripts' ``--max_sequence_length``; default: the pipeline's own, e.g. 1024 for LTX-2)."""
    train_component: str | None = None
    """The denoiser to train (``transformer``, ``transformer_2`` or ``unet``; default: the pipeline's first)."""
    cache_latents: bool = False
    """Keep encoded latents and caption embeddings in ``<output_dir>/latent-cache`` and reuse them next run."""

    @property
    def use_lora(self) -> bool:
        return self.lora_r > 0 or self.lora_adapter is not None

    def export_formats(self, diffusers: bool) -> tuple[str, ...]:
        """``--export-format``'s formats, or the model's default: the diffusers LoRA for a pipeline (what
        ``pipe.load_lora_weights`` reads), a peft adapter folder for a causal LM."""
        if self.export_format:
            return tuple(f.strip() for f in self.export_format.split(","))
        return ("diffusers",) if diffusers else ("peft",)

    def export_folders(self, diffusers: bool) -> dict[str, Path]:
        """Where each LoRA format goes: ``--export`` itself for one format, ``<export>/<format>`` for several."""
        formats = self.export_formats(diffusers)
        root = Path(self.export or ".")
        return {formats[0]: root} if len(formats) == 1 else {f: root / f for f in formats}

    def run_name(self) -> str:
        """What names this run in its exports' manifests (:mod:`hsdp.exports`): a re-run of the same run (a restart,
        ``--resume auto`` after the last step) may replace its own export, nothing else."""
        out = str(Path(self.output_dir).resolve()) if self.output_dir else "none"
        return f"--model {self.model} --data {Path(self.data).resolve()} --output-dir {out}"

    def resume_settings(self) -> dict[str, Any]:
        """What a checkpoint stores of this run and a resumed run must repeat, by flag: every setting that changes
        the math of the steps after resume (plus the layout, which changes only the summation order). Checked by
        :func:`preflight` against the checkpoint's (``trainer_state.json``)."""
        parallel = self.effective_parallel()
        return {
            "--lr": self.lr,
            "--weight-decay": self.weight_decay,
            "--lr-scheduler": self.lr_scheduler,
            "--warmup-steps": self.warmup_steps,
            "--steps": self.steps,  # the horizon of a decaying schedule; free with a constant one
            "--max-grad-norm": self.max_grad_norm,
            "--batch-size": self.batch_size,
            "--grad-accum": self.grad_accum,
            "--seq-len": self.seq_len,
            "--data": _file_digest(self.data),
            "--text-key": self.text_key,
            "--packing": self.packing,
            "--eval-split": self.eval_split,  # held-out records leave the training rows
            "--seed": self.seed,
            "--mixed-precision": _PRECISION.get(self.mixed_precision, self.mixed_precision),
            "--freeze": sorted(self.freeze),
            "--lora-r": self.lora_r,
            "--lora-alpha": self.lora_alpha if self.use_lora else None,
            "--lora-dropout": self.lora_dropout if self.use_lora else None,
            "--lora-target-modules": sorted(self.lora_target_modules),
            "--lora-adapter": self.lora_adapter,
            "--strategy": parallel.sharding_strategy.value if parallel.use_hsdp else None,
            "--resolution": self.resolution,
            "--frames": self.frames,
            "--timestep-sampling": self.timestep_sampling,
            "--flow-shift": self.flow_shift,
            "--caption-dropout": self.caption_dropout,
            "--max-sequence-length": self.max_sequence_length,
            "--train-component": self.train_component,
            "layout": parallel.describe() if parallel.use_hsdp else "single process",
        }

    def lora_config(self, base: str = "", default_targets: list[str] | str = "all-linear", task_type: str | None = None):
        """This run's ``peft.LoraConfig`` (``--lora-adapter``'s when given; ``default_targets`` without
        ``--lora-target-modules``: every linear layer but the output head for an LM)."""
        from hsdp.lora import lora_config

        return lora_config(
            r=self.lora_r,
            alpha=self.lora_alpha,
            dropout=self.lora_dropout,
            targets=list(self.lora_target_modules) or default_targets,
            adapter=self.lora_adapter,
            base=base,
            task_type=task_type,
        )

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def effective_parallel(self) -> ParallelConfig:
        """The layout with ``mixed_precision`` applied to FSDP's policy (param dtype, fp32 reduce)."""
        parallel = self.parallel
        if self.mixed_precision and parallel.use_hsdp:
            parallel = dataclasses.replace(parallel, param_dtype=self.mixed_precision, reduce_dtype="fp32")
        return parallel.resolved()

    def problems(self) -> list[str]:
        out = []
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "keep_last", "log_every"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        if self.save_every < 0:
            out.append(f"--save-every={self.save_every} must be >= 0")
        if self.lr <= 0:
            out.append(f"--lr={self.lr} must be > 0")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            out.append(f"--max-grad-norm={self.max_grad_norm} must be > 0")
        if self.mixed_precision not in (None, "bf16", "bfloat16", "fp16", "float16"):
            out.append(f"--mixed-precision={self.mixed_precision!r}: use bf16 or fp16")
        if self.compile:
            from hsdp.distributed import device_type
            from hsdp.engine.compile import compile_problems

            out += compile_problems(device_type())
        if self.parallel.param_dtype and self.mixed_precision:
            out.append(
                "--param-dtype and --mixed-precision both set the compute dtype; use --mixed-precision only"
            )
        if self.export_dtype is not None and self.export_dtype not in DTYPES:
            hint = did_you_mean(self.export_dtype, DTYPES)
            out.append(f"--export-dtype={self.export_dtype!r}: use one of {', '.join(sorted(DTYPES))}{hint}")
        out.extend(self._lora_problems())
        out.extend(self._export_format_problems())
        out.extend(self._export_folder_problems())
        out.extend(self._diffusion_problems())
        out.extend(schedule_problems(self.lr_scheduler, self.warmup_steps, self.steps))
        out.extend(self._eval_problems())
        out.extend(report_problems(self.report_to, self.output_dir, self.logging_dir))
        if (self.save_every or self.resume) and not self.output_dir:
            out.append("--save-every / --resume need --output-dir (where checkpoints live)")
        out.extend(self._folder_problems())
        for pattern in self.freeze:
            try:
                re.compile(pattern)
            except re.error as exc:
                out.append(f"--freeze {pattern!r} is not a regular expression ({exc})")
        try:
            parallel = self.effective_parallel()
        except ValueError as exc:
            return [*out, str(exc)]
        out.extend(_layout_problems(parallel))
        dp = parallel.data_parallel_size // parallel.sequence_parallel_size  # a sequence group shares its rows
        if self.batch_size % dp:
            out.append(
                f"--batch-size={self.batch_size} must be a multiple of the data-parallel size {dp} "
                f"({parallel.describe()}); use --batch-size {dp * max(1, self.batch_size // dp)}"
            )
        return out

    def _folder_problems(self) -> list[str]:
        """Folders the run writes into that are files: found now, not when training first writes there."""
        folders = {
            "--output-dir": self.output_dir,
            "--export": self.export,
            "--export-merged": self.export_merged,
            "--logging-dir": self.logging_dir,
        }
        return [
            f"{flag} {path} is a file; it names a folder (pass a folder path, or remove the file)"
            for flag, path in folders.items()
            if path and Path(path).is_file()
        ]

    def _diffusion_problems(self) -> list[str]:
        out = []
        if self.timestep_sampling not in ("uniform", "logit_normal", "mode"):
            out.append(f"--timestep-sampling={self.timestep_sampling!r}: use uniform, logit_normal or mode")
        if not 0 <= self.caption_dropout < 1:
            out.append(f"--caption-dropout={self.caption_dropout} must be in [0, 1)")
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            out.append(f"--max-sequence-length={self.max_sequence_length} must be >= 1")
        if self.flow_shift is not None and self.flow_shift <= 0:
            out.append(f"--flow-shift={self.flow_shift} must be > 0")
        if self.frames is not None and self.frames < 1:
            out.append(f"--frames={self.frames} must be >= 1")
        if self.cache_latents and not self.output_dir:
            out.append("--cache-latents keeps the cache in --output-dir; set --output-dir")
        return out

    def _eval_problems(self) -> list[str]:
        out = []
        if not 0 <= self.eval_split < 1:
            out.append(f"--eval-split={self.eval_split} must be a fraction in [0, 1), e.g. 0.05")
        if self.eval_split and self.eval_data:
            out.append("--eval-split and --eval-data both pick eval data; use one")
        if self.eval_every < 0:
            out.append(f"--eval-every={self.eval_every} must be >= 0")
        if self.eval_every and not (self.eval_split or self.eval_data):
            out.append("--eval-every needs eval data: add --eval-data FILE or --eval-split 0.05")
        if self.validation_every < 0:
            out.append(f"--validation-every={self.validation_every} must be >= 0")
        if self.validation_every and not self.validation_prompts:
            out.append("--validation-every needs prompts: add --validation-prompt TEXT")
        if self.validation_prompts and not self.output_dir:
            out.append("--validation-prompt writes samples under --output-dir: give one")
        for flag, value in (
            ("--validation-negative-prompt", self.validation_negative_prompt),
            ("--validation-cfg-scale", self.validation_cfg_scale),
        ):
            if value is not None and not self.validation_prompts:
                out.append(f"{flag} sets the validation samples': add --validation-prompt TEXT")
        return out

    def _export_format_problems(self) -> list[str]:
        from hsdp.lora_formats import FORMATS

        if self.export_format is None:
            return []
        formats = self.export_formats(diffusers=True)
        unknown = [f for f in formats if f not in FORMATS]
        if unknown:
            hints = "".join(did_you_mean(f, FORMATS) for f in unknown)
            return [
                f"--export-format={self.export_format!r}: {', '.join(map(repr, unknown))} is not a format; use one "
                f"or several (comma-separated) of {', '.join(FORMATS)}{hints}"
            ]
        if len(set(formats)) < len(formats):
            return [f"--export-format={self.export_format!r} names a format twice"]
        if not self.use_lora:
            return [
                f"--export-format {self.export_format} writes a LoRA; without --lora-r (or --lora-adapter) --export "
                "writes the whole model as a safetensors folder: drop --export-format"
            ]
        return []

    def _export_folder_problems(self) -> list[str]:
        """Export folders that would take or lose what is not theirs: one inside ``--output-dir`` (or holding it),
        the two exports in one folder, or a folder holding anything but an earlier export of this run."""
        from hsdp.exports import export_problem

        exports = [(flag, Path(f)) for flag, f in (("--export", self.export), ("--export-merged", self.export_merged)) if f]
        out = []
        places = [(flag, f.resolve()) for flag, f in exports]
        if self.output_dir:
            places.append(("--output-dir", Path(self.output_dir).resolve()))
        for i, (flag, here) in enumerate(places):
            for other_flag, there in places[i + 1 :]:
                if here == there or there in here.parents or here in there.parents:
                    out.append(
                        f"{flag} {here} and {other_flag} {there} overlap (one is, or holds, the other): the export "
                        "would take or replace the other's files; choose separate folders"
                    )
        if out:
            return out
        run = self.run_name()
        for flag, folder in exports:
            folders = [folder]
            if flag == "--export" and self.use_lora and len(self.export_formats(diffusers=True)) > 1:
                folders = list(self.export_folders(diffusers=True).values())
                names = {f.name for f in folders}
                foreign = sorted(p.name for p in folder.iterdir() if p.name not in names) if folder.is_dir() else []
                if foreign:
                    out.append(
                        f"--export {folder} holds {', '.join(foreign)}, and several formats go into its subfolders "
                        f"{', '.join(sorted(names))} only; choose another folder (nothing was overwritten)"
                    )
            out += [p for p in (export_problem(f, run, flag) for f in folders) if p]
        return out

    def _lora_problems(self) -> list[str]:
        out = []
        if self.lora_r < 0:
            out.append(f"--lora-r={self.lora_r} must be >= 0 (0: full fine-tuning)")
        if not 0 <= self.lora_dropout < 1:
            out.append(f"--lora-dropout={self.lora_dropout} must be in [0, 1)")
        if self.export_merged and not self.use_lora:
            out.append(
                "--export-merged needs LoRA (--lora-r N or --lora-adapter); use --export for a full model"
            )
        if not self.use_lora:
            if self.lora_target_modules:
                out.append(
                    "--lora-target-modules has no effect without --lora-r; set --lora-r 8 (for example)"
                )
            return out
        if self.freeze:
            out.append(
                "--freeze with LoRA: the base is frozen already and only adapters train; drop --freeze"
            )
        if self.parallel.tensor_parallel_size > 1:
            out.append(
                f"--tensor-parallel-size={self.parallel.tensor_parallel_size} with LoRA is not supported (the TP "
                "plans shard nn.Linear layers, which LoRA wraps); use --tensor-parallel-size 1"
            )
        return out


def _layout_problems(parallel: ParallelConfig) -> list[str]:
    """The inference-only axes of a layout: training runs one branch of one request at a time."""
    out = []
    if parallel.cfg_parallel_size > 1:
        out.append(
            f"--cfg-parallel-size={parallel.cfg_parallel_size} splits sampling's two guidance branches; training "
            "computes one branch: drop it"
        )
    if parallel.request_parallel:
        out.append("--request-parallel splits requests at inference; training splits rows already: drop it")
    if parallel.ring_degree > 1:
        out.append(
            f"--ring-degree={parallel.ring_degree}: ring attention does not train here yet; use --ulysses-degree"
        )
    if parallel.sequence_parallel_size > 1 and parallel.tensor_parallel_size > 1:
        out.append("--ulysses-degree with --tensor-parallel-size: train with one of them")
    return out


_PRECISION = {"bfloat16": "bf16", "float16": "fp16"}


def _file_digest(path: str) -> str:
    """``sha256:<first 16 hex digits>`` of a data file's bytes: a resumed run must read the same records (the
    path may differ)."""
    root = Path(path)
    try:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        parts = [_digest(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    except OSError:
        return "unreadable"  # preflight names the missing --data file itself
    if not root.is_dir():
        return parts[0]
    listing = "".join(f"{f.relative_to(root)}={d}" for f, d in zip(files, parts, strict=True))  # a media folder
    return f"sha256:{hashlib.sha256(listing.encode()).hexdigest()[:16]}"


@functools.lru_cache(maxsize=8)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """Cached by size and modification time: preflight and every save ask again, an edited file is read again."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()[:16]}"


def model_fingerprint(model_dir: Path) -> dict[str, Any]:
    """The architecture fields of a model folder's config.json: a checkpoint only resumes into the same ones."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TrainConfigError(f"--model {model_dir}: config.json is missing or invalid ({exc})") from exc
    return {k: config[k] for k in _FINGERPRINT_KEYS if k in config}


@dataclass(frozen=True)
class Preflight:
    """What the checks found: the model folder and the checkpoint to resume from (if any)."""

    model_dir: Path
    fingerprint: dict[str, Any]
    resume_from: Path | None


def resume_target(cfg: TrainConfig, fingerprint: dict[str, Any]) -> Path | None:
    # Here, not at the top: the command line imports this module to build its parser, and hsdp.checkpoint brings
    # torch's DCP and DTensor (~1 s of CPU) into every hsdp command.
    from hsdp.checkpoint import complete_checkpoints, latest_checkpoint, read_trainer_state

    root = Path(cfg.output_dir) if cfg.output_dir else None
    if cfg.resume is None:
        if root is not None and complete_checkpoints(root):
            raise TrainConfigError(
                f"--output-dir {root} already holds checkpoints ({latest_checkpoint(root).name}); pass --resume "
                "to continue from the latest (--resume auto in a command that also makes the first start), or "
                "choose an empty --output-dir (nothing was overwritten)"
            )
        return None
    if cfg.resume in ("latest", RESUME_AUTO):
        target = latest_checkpoint(root)
        if target is None and cfg.resume == RESUME_AUTO:
            logger.info("--resume auto: no complete checkpoint in %s; starting at step 0", root)
            return None
        if target is None:
            raise TrainConfigError(
                f"--resume: no complete checkpoint in --output-dir {root}; pass --resume auto to start at step 0 "
                "when there is none"
            )
    else:
        target = Path(cfg.resume)
    state = read_trainer_state(target)
    saved = state.get("model", {})
    if saved != fingerprint:
        diff = sorted(k for k in {*fingerprint, *saved} if fingerprint.get(k) != saved.get(k))
        raise TrainConfigError(
            f"--resume {target} was saved from another model (differs in: {', '.join(diff)}); resume with the "
            f"--model it was trained from, or start in a new --output-dir"
        )
    _check_settings(cfg, target, state)
    # --resume auto restarting a run that was killed after its last checkpoint: nothing to train, export again.
    finished = cfg.resume == RESUME_AUTO and state["step"] == cfg.steps
    if state["step"] >= cfg.steps and not finished:
        raise TrainConfigError(
            f"--resume {target} is already at step {state['step']}; raise --steps above it"
        )
    return target


def _check_settings(cfg: TrainConfig, target: Path, state: dict[str, Any]) -> None:
    """Refuse a resume whose math-changing settings differ from the checkpoint's, naming each flag and both values;
    warn when only the layout differs (DCP reshards: the same math in another summation order)."""
    saved = state.get("settings")
    if saved is None:
        logger.warning(
            "--resume %s: the checkpoint predates stored settings; its --lr, --data, ... are not checked", target
        )
        return
    now = cfg.resume_settings()
    differ = [k for k in saved if k in now and saved[k] != now[k]]
    if "--steps" in differ and now["--lr-scheduler"] == "constant" and saved.get("--lr-scheduler") == "constant":
        differ.remove("--steps")  # a constant schedule has no horizon: extending the run is free
    layout = [k for k in differ if k in _LAYOUT_FLAGS]
    if layout:
        logger.warning(
            "--resume %s was saved at %s, this run is %s: DCP reshards it, and the steps after resume follow the "
            "uninterrupted run within fp32 summation order, not bit for bit (resume with --strategy %s and the "
            "same --hsdp-* sizes to continue exactly)",
            target,
            saved.get("layout"),
            now["layout"],
            saved.get("--strategy"),
        )
    problems = [
        f"{k}: the checkpoint has {_shown(saved[k])}, this run {_shown(now[k])}"
        for k in differ
        if k not in _LAYOUT_FLAGS
    ]
    if problems:
        raise TrainConfigError(
            f"--resume {target} was saved with other settings that change the training math:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nresume with the checkpoint's values (the --steps horizon of a linear or cosine schedule too), "
            "or start in a new --output-dir"
        )


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    return str(value)


def _is_diffusers_folder(model_dir: Path) -> bool:
    """A diffusers pipeline or component (``config.json`` with ``_diffusers_version``)."""
    if is_pipeline(model_dir):
        return True
    try:
        return "_diffusers_version" in json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False


def check_export_formats(cfg: TrainConfig, denoiser_dir: Path, lora=None) -> None:
    """Refuse a LoRA format the trained denoiser cannot be written in (a single-file layout diffusers' converters
    would not read back, :func:`hsdp.lora_formats.format_problem` on a probe of ``lora``'s target modules) before
    any rank starts, not after training."""
    from hsdp.lora_formats import format_problem

    if not (cfg.export and cfg.use_lora):
        return
    model_class = class_for_folder(denoiser_dir).__name__
    for fmt in cfg.export_formats(diffusers=True):
        problem = format_problem(fmt, model_class, denoiser_dir, lora)
        if problem:
            raise TrainConfigError(problem)


def _check_tensor_parallel(cfg: TrainConfig, model_dir: Path) -> None:
    """Refuse tensor parallel for a model without a usable plan here, before any rank starts (issue 13)."""
    tp = cfg.parallel.tensor_parallel_size
    if tp <= 1 or not cfg.parallel.use_hsdp:
        return
    from transformers import AutoConfig

    from hsdp.shard_rules.hf_tensor_parallel import tp_plan_problem

    problem = tp_plan_problem(AutoConfig.from_pretrained(model_dir), tp)
    if problem:
        raise TrainConfigError(f"--model {model_dir}: {problem}")


def _check_lora(cfg: TrainConfig, model_dir: Path) -> None:
    """``--lora-adapter`` fits the base model; ``--lora-target-modules`` matches a layer of it."""
    from hsdp.lora import adapter_config, check_targets

    try:
        if cfg.lora_adapter:
            adapter_config(cfg.lora_adapter, model_dir, "--lora-adapter")
        else:
            check_targets(cfg.lora_config(str(model_dir)), model_dir, "--lora-target-modules")
    except ValueError as exc:
        raise TrainConfigError(str(exc)) from exc


def check_attention_backend(cfg: TrainConfig, kind: str) -> None:
    """``--attention-backend`` against what the model's library and this machine run (:mod:`hsdp.attention`)."""
    if cfg.attention_backend is None:
        return
    from hsdp.attention import attention_backend_problems
    from hsdp.distributed import device_type

    problems = attention_backend_problems(
        cfg.attention_backend, kind, device_type(), cfg.parallel.sequence_parallel_size > 1
    )
    if problems:
        raise TrainConfigError("; ".join(problems))


def _records_file_problem(flag: str, path: Path) -> str | None:
    """A causal LM's data file that is another kind of file than its name says (a picture named .txt, a
    checkpoint named .json), named from its first bytes, before a rank fails decoding it."""
    from hsdp.file_kinds import describe

    what = describe(path)
    if path.suffix == ".parquet" or what in ("a text file", "a JSON file", "an empty file"):
        return None
    return (
        f"{flag} {path}: {what}, not text; a causal LM trains on one .txt, .jsonl, .json or .parquet file (a "
        "diffusers pipeline trains on a folder of images or videos with captions)"
    )


def preflight(cfg: TrainConfig) -> Preflight:
    """Check settings and inputs without loading the model; raise :class:`TrainConfigError` on any problem."""
    from hsdp.models.builtin import resolve_model

    problems = cfg.problems()
    if problems:
        raise TrainConfigError("invalid training settings:\n" + "\n".join(f"  - {p}" for p in problems))
    try:
        model_dir = resolve_model(cfg.model)
    except FileNotFoundError as exc:
        raise TrainConfigError(f"--model: {exc}") from exc
    if Path(cfg.data).is_dir():
        raise TrainConfigError(
            f"--data {cfg.data} is a folder (a media folder of images or videos with captions?), and --model "
            f"{cfg.model} is a causal LM, which trains on one .txt, .jsonl, .json or .parquet file: this is a media "
            f"folder; pass --model with a diffusers pipeline (a folder with {INDEX_FILE}, or tiny-wan, tiny-flux, "
            "tiny-sdxl) to fine-tune it on the folder"
        )
    if not Path(cfg.data).is_file():
        raise TrainConfigError(f"--data {cfg.data}: no such file")
    if cfg.eval_data and not Path(cfg.eval_data).is_file():
        raise TrainConfigError(f"--eval-data {cfg.eval_data}: no such file")
    for flag, path in (("--data", cfg.data), ("--eval-data", cfg.eval_data)):
        if path and (problem := _records_file_problem(flag, Path(path))):
            raise TrainConfigError(problem)
    if cfg.validation_prompts:
        raise TrainConfigError("--validation-prompt: validation samples are for diffusion pipelines")
    if cfg.export_format and cfg.export_formats(diffusers=False) != ("peft",) and not _is_diffusers_folder(model_dir):
        raise TrainConfigError(
            f"--export-format {cfg.export_format} writes a diffusers pipeline LoRA, but --model {cfg.model} is not a "
            "diffusers model; use --export-format peft"
        )
    if cfg.parallel.ulysses_degree > 1:
        raise TrainConfigError(
            f"--ulysses-degree={cfg.parallel.ulysses_degree}: sequence-parallel training splits a diffusers "
            "denoiser's sequence (its _cp_plan); a causal LM trains with --hsdp-shard-size or --tensor-parallel-size"
        )
    check_attention_backend(cfg, "causal_lm")
    fingerprint = model_fingerprint(model_dir)
    _check_tensor_parallel(cfg, model_dir)
    if cfg.use_lora:
        _check_lora(cfg, model_dir)
    return Preflight(model_dir, fingerprint, resume_target(cfg, fingerprint))
