"""``hsdp train``: fine-tune a causal LM on a text or JSONL file, sharded as the parallel flags say.

    hsdp train --model tiny-llama --data notes.txt --use-hsdp --hsdp-shard-size 2 --strategy FULL_SHARD \\
        --steps 20 --output-dir runs/demo --save-every 10 --export runs/demo/model
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

from hsdp.checkpoint import latest_checkpoint
from hsdp.cli import (
    add_parallel_arguments,
    add_single_file_arguments,
    add_source_arguments,
    parallel_config_from_args,
    resolve_model_argument,
)
from hsdp.distributed import rank
from hsdp.launch import WorkerError
from hsdp.lora_formats import FORMATS
from hsdp.measure.comm import CommReport
from hsdp.signals import STOP_EXIT, Stopped
from hsdp.train.config import TrainConfig, TrainConfigError
from hsdp.train.page_server import serve_run_page
from hsdp.train.report import REPORTERS, write_summary
from hsdp.train.run import run_training
from hsdp.train.run_page import PAGE_NAME, end_live_page
from hsdp.train.schedule import SCHEDULERS
from hsdp.train.trainer import TrainResult

__all__ = ["add_arguments", "run", "config_from_args"]

logger = logging.getLogger("hsdp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny-llama",
        help="model folder, Hugging Face Hub name (org/name) or built-in name (default tiny-llama)",
    )
    add_source_arguments(parser)
    add_single_file_arguments(parser)
    parser.add_argument(
        "--data",
        required=True,
        help="a causal LM: .txt, or .jsonl / .json / .parquet records with 'text', 'prompt' + 'completion', or "
        "'messages'; a diffusers pipeline: a folder of images or videos (.wav / .flac files for an audio pipeline) "
        "with same-name .txt captions, or a metadata.jsonl / .csv with file_name and text columns "
        "(docs/training-diffusion.md)",
    )
    parser.add_argument("--text-key", default="text", help="field holding plain text")
    parser.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pack records into --seq-len blocks, attention masked per record (default); --no-packing pads",
    )
    parser.add_argument("--eval-data", default=None, help="held-out file (any --data format)")
    parser.add_argument("--eval-split", type=float, default=0.0, help="hold out this fraction of --data")
    parser.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (and at the end)")
    parser.add_argument(
        "--validation-prompt",
        action="append",
        default=[],
        help="diffusion: generate this prompt with the model being trained (repeatable; <output-dir>/samples)",
    )
    parser.add_argument(
        "--validation-every", type=int, default=0, help="validation samples every N steps (and at 0 and the end)"
    )
    parser.add_argument("--validation-negative-prompt", default=None, help="the validation samples' negative prompt")
    parser.add_argument(
        "--validation-cfg-scale",
        type=float,
        default=None,
        help="the validation samples' guidance: true_cfg_scale (FLUX, Qwen-Image) or guidance_scale",
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to reach")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch over all ranks")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument(
        "--lr-scheduler", choices=SCHEDULERS, default="constant", help="learning-rate schedule after warmup"
    )
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warmup from 0 to --lr")
    parser.add_argument("--max-grad-norm", type=float, default=None, help="clip to this global gradient norm")
    parser.add_argument(
        "--mixed-precision", choices=["bf16"], default=None, help="bf16 compute, fp32 master/reduce"
    )
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute blocks in backward"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each repeated block (regional; forward and backward fused, FSDP hooks outside), once "
        "per input shape; needs inductor's compiler (g++ on CPU, Triton on GPU)",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        metavar="NAME",
        help="the trained model's attention kernel: a diffusers backend (native, _native_math, flex, flash, sage, "
        "...) or a transformers implementation (sdpa, eager, flex_attention, flash_attention_2, ...)",
    )
    parser.add_argument("--freeze", nargs="+", default=[], metavar="REGEX", help="freeze matching parameters")
    parser.add_argument(
        "--frozen-whole",
        action="store_true",
        help="keep frozen weights (a LoRA's base, --freeze) whole on every rank, never gathered; what trains is "
        "sharded as --strategy says (default under NO_SHARD)",
    )
    parser.add_argument(
        "--lora-r",
        type=int,
        default=0,
        help="train peft LoRA adapters of this rank on a frozen base (0: off)",
    )
    parser.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA scale numerator (alpha / r)")
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=[],
        metavar="NAME",
        help="layers to adapt (default: a causal LM's every linear layer but the output head; a diffusers "
        "denoiser's attention projections to_q to_k to_v to_out.0)",
    )
    parser.add_argument(
        "--lora-adapter",
        default=None,
        metavar="DIR",
        help="continue from a peft adapter folder (implies LoRA)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None, help="checkpoint folder")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (and at the end)")
    parser.add_argument("--keep-last", type=int, default=2, help="complete checkpoints to keep")
    parser.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="resume from the newest complete checkpoint in --output-dir (or PATH); 'auto': from the newest if "
        "any, else start at step 0 (one command for the first start and every restart under torchrun)",
    )
    parser.add_argument(
        "--export",
        default=None,
        metavar="DIR",
        help="write a safetensors model folder at the end (with LoRA: a peft adapter folder)",
    )
    parser.add_argument(
        "--export-merged", default=None, metavar="DIR", help="with LoRA: write the merged model folder"
    )
    parser.add_argument(
        "--export-dtype", default=None, help="dtype of the exported model or LoRA tensors (default fp32, as trained)"
    )
    parser.add_argument(
        "--export-format",
        default=None,
        metavar="|".join(FORMATS),
        help="with LoRA: peft (adapter folder; the default for a causal LM), diffusers (pytorch_lora_weights."
        "safetensors for pipe.load_lora_weights; the default for a pipeline), comfyui (diffusion_model. keys) or kohya "
        "(lora_unet_ keys), the last two in a layout diffusers' own converters read back; several comma-separated "
        "(diffusers,comfyui) go into --export's subfolders of those names",
    )
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument(
        "--report-to", choices=REPORTERS, default="none", help="experiment tracker for per-step figures"
    )
    parser.add_argument("--logging-dir", default=None, help="tracker folder (default OUTPUT_DIR/runs)")
    parser.add_argument("--summary-json", default=None, help="write per-step figures here")
    parser.add_argument(
        "--serve-report",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the run page <output-dir>/report.html and its samples over HTTP on PORT while the run goes "
        "(0: a free port; the URL is printed); it stops with the run",
    )
    parser.add_argument(
        "--serve-report-host",
        default="127.0.0.1",
        help="the address --serve-report binds (default 127.0.0.1, this machine only; 0.0.0.0 for the network, "
        "with no authentication)",
    )
    parser.add_argument(
        "--comm-stats", action="store_true", help="count the last step's collectives against the minimum"
    )
    diffusion = parser.add_argument_group("diffusion pipelines (docs/training-diffusion.md)")
    diffusion.add_argument("--resolution", type=int, default=256, help="side of the training area in pixels")
    diffusion.add_argument("--frames", type=int, default=None, help="most frames per video clip (k*t+1 kept)")
    diffusion.add_argument(
        "--timestep-sampling",
        choices=("uniform", "logit_normal", "mode"),
        default="uniform",
        help="flow matching: how sigmas are drawn (diffusers' density sampling)",
    )
    diffusion.add_argument("--flow-shift", type=float, default=None, help="default: the scheduler's shift")
    diffusion.add_argument("--caption-dropout", type=float, default=0.0, help="train on the empty caption")
    diffusion.add_argument(
        "--max-sequence-length",
        type=int,
        default=None,
        help="caption tokens the text encoder pads to (the pipeline's __call__ argument; default: the pipeline's)",
    )
    diffusion.add_argument(
        "--train-component",
        default=None,
        help="the denoiser(s) to train: transformer, transformer_2, unet, several comma-separated (Wan 2.2's two "
        "experts: transformer,transformer_2, in turn, one a step) or all (default: the pipeline's first)",
    )
    diffusion.add_argument(
        "--cache-latents", action="store_true", help="encode once into OUTPUT_DIR/latent-cache and reuse"
    )
    add_parallel_arguments(parser, groups=("sharding", "ulysses", "tensor"))  # no CFG, ring or request ranks


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=args.model,
        data=args.data,
        parallel=parallel_config_from_args(args),
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        grad_accum=args.grad_accum,
        lr=args.lr,
        weight_decay=args.weight_decay,
        lr_scheduler=args.lr_scheduler,
        warmup_steps=args.warmup_steps,
        max_grad_norm=args.max_grad_norm,
        mixed_precision=args.mixed_precision,
        activation_checkpointing=args.activation_checkpointing,
        compile=args.compile,
        attention_backend=args.attention_backend,
        freeze=tuple(args.freeze),
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        lora_target_modules=tuple(args.lora_target_modules),
        lora_adapter=args.lora_adapter,
        export_merged=args.export_merged,
        seed=args.seed,
        text_key=args.text_key,
        packing=args.packing,
        eval_data=args.eval_data,
        eval_split=args.eval_split,
        eval_every=args.eval_every,
        validation_prompts=tuple(args.validation_prompt),
        validation_every=args.validation_every,
        validation_negative_prompt=args.validation_negative_prompt,
        validation_cfg_scale=args.validation_cfg_scale,
        output_dir=args.output_dir,
        save_every=args.save_every,
        keep_last=args.keep_last,
        async_save=args.async_save,
        resume=args.resume,
        export=args.export,
        export_dtype=args.export_dtype,
        export_format=args.export_format,
        log_every=args.log_every,
        report_to=args.report_to,
        logging_dir=args.logging_dir,
        comm_stats=args.comm_stats,
        summary_json=args.summary_json,
        resolution=args.resolution,
        frames=args.frames,
        timestep_sampling=args.timestep_sampling,
        flow_shift=args.flow_shift,
        caption_dropout=args.caption_dropout,
        max_sequence_length=args.max_sequence_length,
        train_component=args.train_component,
        cache_latents=args.cache_latents,
    )


def _stopped(args: argparse.Namespace) -> str:
    """What a stopped run leaves: its last complete checkpoint and the figures of the steps it made."""
    last = latest_checkpoint(args.output_dir) if args.output_dir else None
    hint = f"last complete checkpoint: {last} (rerun with --resume)" if last else "no complete checkpoint"
    if args.summary_json and Path(args.summary_json).is_file():
        hint += f"\nthe steps made so far: {args.summary_json}"
    return hint


def _report_stop(args: argparse.Namespace, result: TrainResult) -> int:
    """A run stopped by a scheduler's signal (:mod:`hsdp.train.stop`): where it stopped and how to go on."""
    if rank() != 0:
        return STOP_EXIT
    made = f"after step {result.steps[-1].step}" if result.steps else "before its first step"
    print(f"hsdp train: stopped by {result.stopped_by} {made}\n{_stopped(args)}", file=sys.stderr)
    if args.summary_json and result.steps:
        write_summary(args.summary_json, result.steps)
    return STOP_EXIT


def _names_no_layout(args: argparse.Namespace) -> bool:
    """Sharded, and none of the flags that say how FSDP2 holds the model over the mesh."""
    chosen = (args.sharding_strategy, args.reshard_after_forward)
    offloads = args.cpu_offload or args.offload_layers is not None
    return args.use_hsdp and chosen == (None, None) and not (args.frozen_whole or offloads)


def _planned(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` on the planner's layout for its mesh (:func:`hsdp.planning.training.planned_layout`), said in the
    run's first log line. Not under torchrun: every node would have to read the same memory to plan alike."""
    from hsdp.distributed import launched_by_torchrun
    from hsdp.planning import PlanError
    from hsdp.planning.training import planned_layout

    if launched_by_torchrun() or cfg.problems():  # preflight names the problems
        return cfg
    try:
        planned = planned_layout(cfg)
    except (PlanError, ValueError, FileNotFoundError) as exc:  # a refusal: the trainer's own checks say it better
        logger.info("layout: as the flags give it (the planner could not plan this run: %s)", exc)
        return cfg
    except Exception as exc:  # a model the planner cannot trace still trains on the layout its flags give
        logger.warning("layout: as the flags give it (planning failed: %s: %s)", type(exc).__name__, exc)
        return cfg
    if planned is None:
        return cfg
    logger.info(
        "layout: %s, %s (%s; name --strategy or --frozen-whole to choose another)",
        planned.chosen.layout.label,
        planned.cfg.parallel.sharding_strategy.value,
        planned.reason,
    )
    return planned.cfg


def _end_page(cfg: TrainConfig | None, state: str, started: float) -> None:
    """A run whose ranks ended without writing their last page: the page stops reloading itself and says why."""
    if cfg is None or not cfg.output_dir or int(os.environ.get("RANK", "0")) != 0:
        return
    try:
        end_live_page(cfg.output_dir, cfg, state.splitlines()[0][:300], since=started)
    except (OSError, ValueError) as exc:
        logger.warning("the run page was not rewritten: %s", exc)


def _serve(args: argparse.Namespace, serving: contextlib.ExitStack) -> int | None:
    """``--serve-report``: the run page over HTTP from the process that starts the run (rank 0's under torchrun),
    until ``serving`` closes; the exit status 2 when the port cannot be bound."""
    if args.serve_report is None or int(os.environ.get("RANK", "0")) != 0:
        return None
    try:
        url = serving.enter_context(serve_run_page(args.output_dir, args.serve_report, args.serve_report_host))
    except OSError as exc:  # the port taken, or not ours to bind
        print(
            f"hsdp train: --serve-report {args.serve_report} on {args.serve_report_host}: {exc.strerror or exc}; "
            "pick another port (0: any free one) or --serve-report-host",
            file=sys.stderr,
        )
        return 2
    print(f"run page served at {url} while the run goes", flush=True)
    return None


def _serve_problem(args: argparse.Namespace) -> str | None:
    if args.serve_report is None:
        return None
    if not args.output_dir:
        return "--serve-report serves <output-dir>/report.html: set --output-dir"
    if not 0 <= args.serve_report <= 65535:
        return f"--serve-report {args.serve_report}: a port is 0 (any free one) to 65535"
    return None


def run(args: argparse.Namespace) -> int:
    if args.summary_json and Path(args.summary_json).is_dir():
        print(f"hsdp train: --summary-json {args.summary_json} is a folder; it names the file to write", file=sys.stderr)
        return 2
    if problem := _serve_problem(args):
        print(f"hsdp train: {problem}", file=sys.stderr)
        return 2
    resolve_model_argument(args)  # a hub name: downloaded (once per node) before any rank starts
    cfg, started = None, time.time() - 1  # file times are coarser than time()
    try:
        cfg = config_from_args(args)
        with contextlib.ExitStack() as serving:
            if (refused := _serve(args, serving)) is not None:
                return refused
            if _names_no_layout(args):
                cfg = _planned(cfg)
            result = run_training(cfg)
    except (TrainConfigError, ValueError) as exc:
        _end_page(cfg, f"failed: {exc}", started)
        print(f"hsdp train: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        _end_page(cfg, f"failed: {exc}", started)
        print(f"hsdp train: training failed: {exc}\n{_stopped(args)}", file=sys.stderr)
        return 1
    except Stopped as exc:  # SIGTERM in the checks or while the ranks start (:mod:`hsdp.signals`)
        print(f"hsdp train: {exc} before training started\n{_stopped(args)}", file=sys.stderr)
        return STOP_EXIT
    except KeyboardInterrupt:
        _end_page(cfg, "interrupted", started)
        print(f"hsdp train: interrupted\n{_stopped(args)}", file=sys.stderr)
        return 130
    if result.stopped_by is not None:  # on every rank: torchrun's agent sees why its ranks ended
        return _report_stop(args, result)
    if rank() != 0:  # under torchrun every process returns here; one summary is enough
        return 0
    steps = result.steps
    if steps:
        last_step = steps[-1]
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in last_step.peak_memory)
        median = sorted(s.tokens_per_s for s in steps)[len(steps) // 2]
        print(
            f"trained to step {last_step.step}: loss {steps[0].loss:.4f} -> {last_step.loss:.4f}, "
            f"median {median:.1f} {result.unit}/s, peak memory per rank {peaks} MiB ({result.memory_kind})"
        )
    if steps and steps[-1].eval_loss is not None:
        perplexity = steps[-1].eval_perplexity  # None for diffusion
        print(f"eval loss {steps[-1].eval_loss:.4f}" + ("" if perplexity is None else f", perplexity {perplexity:.2f}"))
    if result.comm:
        print(CommReport(**result.comm).summary().replace("per step", "in the last step (rank 0)"))
    if result.checkpoint:
        print(f"checkpoint: {result.checkpoint}")
    if result.export:
        print(f"exported {'adapter' if cfg.use_lora else 'model'}: {result.export}")
    if result.export_merged:
        print(f"exported merged model: {result.export_merged}")
    if args.summary_json:
        write_summary(args.summary_json, steps)
    if cfg.output_dir:  # rank 0 wrote it as the run ended
        print(f"run page: {Path(cfg.output_dir) / PAGE_NAME}")
    return 0
