"""``hsdp`` command line: one ``{subcommand: module}`` map over the library.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; the shared parallel flags
(vLLM-Omni's names) are added by :func:`add_parallel_arguments` and turned into a validated
:class:`~hsdp.config.ParallelConfig` by :func:`parallel_config_from_args`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hsdp.config import ConfigError, ParallelConfig, ShardingStrategy

# subcommand -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("hsdp.demo", "shard a built-in model across local ranks and compare with one process"),
    "generate": ("hsdp.engine.cli", "generate videos or text with a model sharded across local ranks"),
    "serve": (
        "hsdp.serve.cli",
        "serve a sharded model over an OpenAI-style HTTP API (videos, images, completions)",
    ),
    "train": (
        "hsdp.train.cli",
        "fine-tune a causal LM on a text/JSONL file with FSDP2 (checkpoints, resume, export)",
    ),
    "plan": (
        "hsdp.planner",
        "will it fit, and how fast: per-rank memory and traffic of every layout, from the config",
    ),
}


def add_parallel_arguments(parser: argparse.ArgumentParser, *, training: bool = False) -> None:
    group = parser.add_argument_group("parallelism (see docs/parallel-config.md)")
    group.add_argument("--use-hsdp", action="store_true", help="shard weights with FSDP2")
    group.add_argument("--hsdp-shard-size", type=int, default=-1, help="ranks to shard over (-1: auto)")
    group.add_argument("--hsdp-replicate-size", type=int, default=1, help="replica groups of the shards")
    group.add_argument("--ulysses-degree", "--usp", type=int, default=1, help="Ulysses sequence parallel")
    group.add_argument("--ring-degree", type=int, default=1, help="ring-attention sequence parallel")
    group.add_argument("--cfg-parallel-size", type=int, default=1, help="1 or 2 (guidance branches)")
    group.add_argument("--tensor-parallel-size", type=int, default=1, help="tensor parallel degree")
    group.add_argument("--request-parallel", action="store_true", help="each HSDP rank takes its own request")
    group.add_argument(
        "--strategy",
        dest="sharding_strategy",
        default=None,
        help=f"sharding strategy: {', '.join(s.value for s in ShardingStrategy)} (default: from the sizes)",
    )
    group.add_argument(
        "--reshard-after-forward",
        default=None,
        choices=["true", "false"],
        help="free gathered weights after each block (default: from the strategy)",
    )
    group.add_argument(
        "--param-dtype", default=None, help="compute dtype of gathered weights (bf16, fp16, fp32)"
    )
    group.add_argument(
        "--reduce-dtype", default=None, help="gradient reduction dtype (default fp32 with mixed precision)"
    )
    group.add_argument("--cpu-offload", action="store_true", help="keep sharded weights in host memory")


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    """Build and validate the config; raises :class:`ConfigError` listing every problem."""
    reshard = {"true": True, "false": False, None: None}[args.reshard_after_forward]
    config = ParallelConfig(
        use_hsdp=args.use_hsdp,
        hsdp_shard_size=args.hsdp_shard_size,
        hsdp_replicate_size=args.hsdp_replicate_size,
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        cfg_parallel_size=args.cfg_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        request_parallel=args.request_parallel,
        sharding_strategy=ShardingStrategy.parse(args.sharding_strategy) if args.sharding_strategy else None,
        reshard_after_forward=reshard,
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
        cpu_offload=args.cpu_offload,
    )
    return config.resolved()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hsdp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from hsdp.distributed import destroy_distributed
    from hsdp.logging_utils import configure_logging

    configure_logging()
    args = build_parser().parse_args(argv)
    joined_here = not dist.is_initialized()
    try:
        return int(args._run(args) or 0)
    except ConfigError as exc:
        print(f"hsdp {args.command}: {exc}", file=sys.stderr)
        return 2
    finally:
        # Under torchrun the command joins the process group itself; leave it explicitly, since gloo can
        # abort at interpreter exit otherwise (a finished run would then exit non-zero).
        if joined_here:
            destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
