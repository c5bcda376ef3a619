"""``hsdp`` command line: one ``{subcommand: module}`` map over the library.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; the shared parallel flags
(vLLM-Omni's names) are added by :func:`add_parallel_arguments` and turned into a validated
:class:`~hsdp.config.ParallelConfig` by :func:`parallel_config_from_args`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Literal, NoReturn, get_args

from hsdp.suggest import closest, did_you_mean

# Nothing here imports torch at module level: the first line a command prints comes before those imports.
if TYPE_CHECKING:
    from hsdp.config import ParallelConfig

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
        "fine-tune a causal LM or a diffusers pipeline's denoiser with FSDP2 (checkpoints, resume, export)",
    ),
    "plan": (
        "hsdp.planning.cli",
        "will it fit, and how fast: per-rank memory and traffic of every layout, from the config",
    ),
    "download": (
        "hsdp.models.cli",
        "fetch a Hugging Face Hub model (org/name) into the Hugging Face cache ahead of time",
    ),
}


ParallelGroup = Literal["sharding", "ulysses", "ring", "cfg", "tensor", "request"]
"""A set of parallel flags a subcommand can offer: FSDP2 sharding (with its strategy, dtypes and offload),
Ulysses and ring sequence parallel (apart: training has no ring attention), CFG parallel, tensor parallel, request
parallel."""

ALL_PARALLEL_GROUPS: frozenset[ParallelGroup] = frozenset(get_args(ParallelGroup))

_RESHARD = {"true": True, "false": False, None: None}


def _add_sharding_flags(group: argparse._ArgumentGroup) -> None:
    from hsdp.config import ShardingStrategy

    group.add_argument("--use-hsdp", action="store_true", help="shard weights with FSDP2")
    group.add_argument("--hsdp-shard-size", type=int, default=-1, help="ranks to shard over (-1: auto)")
    group.add_argument("--hsdp-replicate-size", type=int, default=1, help="replica groups of the shards")
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
    group.add_argument(
        "--offload-layers",
        type=int,
        default=None,
        metavar="K",
        help="keep the first K blocks of the denoiser / LM on the device; the rest stay in pinned host memory "
        "and are copied in one block ahead of use (docs/performance.md)",
    )


def _add_ulysses_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--ulysses-degree", "--usp", type=int, default=1, help="Ulysses sequence parallel")


def _add_ring_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--ring-degree", type=int, default=1, help="ring-attention sequence parallel")


def _add_cfg_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--cfg-parallel-size", type=int, default=1, help="1 or 2 (guidance branches)")


def _add_tensor_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--tensor-parallel-size", type=int, default=1, help="tensor parallel degree")


def _add_request_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--request-parallel", action="store_true", help="each HSDP rank takes its own request")


_GROUP_ADDERS: dict[ParallelGroup, Callable[[argparse._ArgumentGroup], None]] = {
    "sharding": _add_sharding_flags,
    "ulysses": _add_ulysses_flags,
    "ring": _add_ring_flags,
    "cfg": _add_cfg_flags,
    "tensor": _add_tensor_flags,
    "request": _add_request_flags,
}


def add_parallel_arguments(parser: argparse.ArgumentParser, *, groups: Collection[ParallelGroup]) -> None:
    """Add the parallel flags of ``groups`` only, so ``--help`` lists just what the subcommand can use (each
    command names its groups: a new group is offered nowhere until a command says it runs it)."""
    unknown = set(groups) - ALL_PARALLEL_GROUPS
    assert not unknown, f"unknown parallel flag groups {sorted(unknown)}"
    group = parser.add_argument_group("parallelism (see docs/parallel-config.md)")
    for name, add in _GROUP_ADDERS.items():  # the map's order, so --help reads the same for every command
        if name in groups:
            add(group)


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    """Build and validate the config; raises :class:`ConfigError` listing every problem. Flags the subcommand
    does not offer keep :class:`ParallelConfig`'s defaults."""
    from hsdp.config import ParallelConfig, ShardingStrategy

    fields = {f.name for f in dataclasses.fields(ParallelConfig) if f.init and not f.name.startswith("_")}
    values = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    if "sharding_strategy" in values:
        strategy = values["sharding_strategy"]
        values["sharding_strategy"] = ShardingStrategy.parse(strategy) if strategy else None
    if "reshard_after_forward" in values:
        values["reshard_after_forward"] = _RESHARD[values["reshard_after_forward"]]
    return ParallelConfig(**values).resolved()


class _Parser(argparse.ArgumentParser):
    """argparse with messages a user can act on: a value out of a set names the closest one, and an error is one
    line saying where the full list is (argparse printed the whole usage, ~50 lines for ``hsdp train``)."""

    def _check_value(self, action: argparse.Action, value) -> None:
        if action.choices is not None and value not in action.choices:
            names = ", ".join(map(str, action.choices))
            hint = did_you_mean(str(value), map(str, action.choices))
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {names}){hint}")

    def error(self, message: str) -> NoReturn:
        from hsdp.errors import USAGE_EXIT

        self.exit(USAGE_EXIT, f"{self.prog}: error: {message} ({self.prog} --help lists every flag)\n")


class _SubcommandParser(_Parser):
    """A subcommand reports its own unknown flags, each with its closest known flag: argparse hands them to the
    top-level parser, whose usage lists only the subcommands (``usage: hsdp [-h] {demo,...}``)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(_unrecognized(extras, [k for k in self._option_string_actions if k.startswith("--")]))
        return namespace, extras


def _unrecognized(extras: list[str], known: list[str]) -> str:
    """``unrecognized arguments: --max-batch-sise 2; did you mean --max-batch-size?``"""
    flags = [a.split("=", 1)[0] for a in extras if a.startswith("--")]
    matches = {flag: match for flag in flags if (match := closest(flag, known))}
    hint = ", ".join(m if len(flags) == 1 else f"{m} for {f}" for f, m in matches.items())
    return f"unrecognized arguments: {' '.join(extras)}" + (f"; did you mean {hint}?" if hint else "")


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """``--revision`` of a Hugging Face Hub name (the model argument as ``org/name``) and ``--variant``."""
    parser.add_argument(
        "--revision",
        default=None,
        help="with a Hugging Face Hub name (org/name): the branch, tag or commit to load (default: main)",
    )
    parser.add_argument(
        "--variant",
        default=None,
        help="load the weights of this variant where a component has them (fp16: diffusion_pytorch_model.fp16"
        ".safetensors), as from_pretrained(variant=...) does; a hub download fetches only those (default: the "
        "default weights)",
    )


def add_single_file_arguments(parser: argparse.ArgumentParser) -> None:
    """``--transformer FILE`` / ``--transformer-2 FILE`` / ``--vae FILE``: single-file checkpoints over the model."""
    from hsdp.models.single_file import SINGLE_FILE_FLAGS

    group = parser.add_argument_group("single-file checkpoints (docs/loading.md; converted by diffusers' converters)")
    for component, flag in SINGLE_FILE_FLAGS.items():
        group.add_argument(
            flag,
            dest=f"single_file_{component}",
            default=None,
            metavar="FILE",
            help=f"a single .safetensors file (original / ComfyUI key layout) for the pipeline's {component}",
        )


def resolve_model_argument(args: argparse.Namespace, *, headers_only: bool = False) -> None:
    """Resolve ``args.model`` once, before any rank needs it: a Hugging Face Hub name becomes its local snapshot
    (downloaded once per node; ``headers_only``: configs and safetensors headers only, for planning), kept as
    given in ``args.model_name``. A path or a built-in name is left as it is (resolved where it is used). With
    single-file checkpoints (``--transformer FILE``...), the model becomes the pipeline folder with those converted
    (:func:`hsdp.models.single_file.with_single_files`); with ``--variant``, a folder whose weights are that
    variant's (:func:`hsdp.models.variant.with_variant`)."""
    args.model_name = args.model
    files = {k.removeprefix("single_file_"): v for k, v in vars(args).items() if k.startswith("single_file_") and v}
    variant = getattr(args, "variant", None)
    _resolve_name(args, headers_only=headers_only and not files)
    if variant:
        from hsdp.models.builtin import resolve_model
        from hsdp.models.variant import with_variant

        args.model = str(with_variant(resolve_model(args.model), variant))
    if files:
        from hsdp.models.builtin import resolve_model
        from hsdp.models.single_file import with_single_files

        args.model = str(with_single_files(resolve_model(args.model), files))


def _resolve_name(args: argparse.Namespace, *, headers_only: bool) -> None:
    from pathlib import Path

    from hsdp.models.builtin import BUILTIN_MODELS, resolve_model
    from hsdp.models.hub import is_hub_name, plan_snapshot

    revision = getattr(args, "revision", None)
    hub = is_hub_name(str(args.model)) and not Path(args.model).expanduser().exists() and args.model not in BUILTIN_MODELS
    if not hub:
        if revision:
            raise ValueError(f"--revision {revision} applies to a Hugging Face Hub name (org/name); {args.model} is not one")
        return
    variant = getattr(args, "variant", None)
    args.model = str(
        plan_snapshot(args.model, revision, variant)
        if headers_only
        else resolve_model(args.model, revision=revision, variant=variant)
    )


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``only`` (the subcommand about to run), the other subcommands keep just their
    names and help lines and their modules are not imported: each brings its own stack (the engine, the trainer
    with torch's DCP, the planner), about 1 s of CPU that every ``hsdp`` command paid."""
    parser = _Parser(prog="hsdp", description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        if only in (None, name):
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            _add_log_level(sub_parser)
            sub_parser.set_defaults(_run=module.run)
    return parser


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` on a subcommand (``hsdp serve`` has its own, which sets uvicorn's level too)."""
    from hsdp.logging_utils import LOG_LEVELS

    if any("--log-level" in action.option_strings for action in parser._actions):
        return
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=None,
        help="what the caller and the ranks log (default: HSDP_LOG_LEVEL, else info); debug adds the time of each "
        "start-up phase (imports, process start, rendezvous, load, first step)",
    )


def _early_log_level(argv: list[str]) -> str | None:
    """``--log-level`` read before the parser exists (building it imports the command's modules, which the
    per-phase timer times); the parser checks the value again."""
    from hsdp.logging_utils import LOG_LEVELS

    for i, arg in enumerate(argv):
        value = arg.partition("=")[2] if arg.startswith("--log-level=") else None
        if arg == "--log-level" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None and value.lower() in LOG_LEVELS:
            return value.lower()
    return None


def main(argv: list[str] | None = None) -> int:
    """The ``hsdp`` command; SIGTERM stops it with a message wherever the command has no handling of its own
    (:mod:`hsdp.signals`). Not in a rank under torchrun (``hsdp.distributed.launched_by_torchrun``, read here
    without importing torch): its agent stops the ranks (SIGTERM, then SIGKILL), and a serving rank that took the
    signal for a failed call would wait for the next one instead of ending."""
    from hsdp.signals import sigterm_raises

    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE"} <= os.environ.keys()
    with contextlib.nullcontext() if under_torchrun else sigterm_raises():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    import logging

    from hsdp.logging_utils import configure_logging, phase

    argv = sys.argv[1:] if argv is None else argv
    level = _early_log_level(argv)
    if level:
        os.environ["HSDP_LOG_LEVEL"] = level.upper()  # the ranks log at the same level
    configure_logging(level=level)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    if command and not {"-h", "--help"} & set(argv):
        # On screen at once: what follows may import for seconds before the command says anything.
        logging.getLogger("hsdp").info("hsdp %s: starting", command)
    with phase("imports (torch and the command's modules)"):
        import torch.distributed as dist

        from hsdp.distributed import destroy_distributed
        from hsdp.errors import HANDLED, exit_code, format_problem

        parser = build_parser(command)
    args = parser.parse_args(argv)
    joined_here = not dist.is_initialized()
    try:
        return int(args._run(args) or 0)
    except HANDLED as exc:  # what a user can fix, a failed worker, Ctrl-C; anything else is a bug: traceback
        print(format_problem(args.command, exc), file=sys.stderr)
        return exit_code(exc)
    finally:
        # Under torchrun the command joins the process group itself; leave it explicitly, since gloo can
        # abort at interpreter exit otherwise (a finished run would then exit non-zero).
        if joined_here:
            destroy_distributed()


def entry_point() -> NoReturn:
    """The ``hsdp`` command (and ``python -m hsdp.cli``): :func:`main`, then exit without the final collections."""
    from hsdp.signals import STOP_EXIT, Stopped

    try:
        code = main()
    except Stopped as exc:  # SIGTERM before a subcommand runs (while the libraries import)
        print(f"hsdp: {exc}", file=sys.stderr)
        sys.exit(STOP_EXIT)
    except KeyboardInterrupt:  # Ctrl-C before a subcommand runs (while the libraries import): no traceback
        print("hsdp: interrupted", file=sys.stderr)
        sys.exit(130)
    from hsdp.distributed import skip_collection_at_exit

    skip_collection_at_exit()
    sys.exit(code)


if __name__ == "__main__":
    entry_point()
