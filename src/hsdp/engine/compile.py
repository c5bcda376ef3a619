"""``--compile``: regional compilation of a denoiser's repeated blocks, with FSDP2's hooks outside the graph.

As diffusers' ``compile_repeated_blocks`` and torchtitan do, each repeated block is compiled on its own (the
blocks share one graph, so compiling costs one block, not the model). Unlike ``nn.Module.compile``, only the
block's ``forward`` is compiled: FSDP2's all-gather and reshard run in hooks of the block's ``__call__``, which
stay eager and outside the compiled region, as do the step caches' hooks (diffusers wraps ``forward`` around the
compiled function, so a skipped block never enters the graph). Graphs are specialised per input shape
(``dynamic=False``) and live as long as the worker: a server compiles each request shape once and reuses it.

Which blocks: the model's ``_repeated_blocks`` (diffusers' own list for regional compilation), else its
``_no_split_modules``, else the classes of its block lists (:func:`hsdp.shard_rules.repeated_block_lists`, such as
Stable Audio's ``transformer_blocks``, which names neither): the same blocks FSDP shards by.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil

import torch
from torch import nn

logger = logging.getLogger("hsdp")

__all__ = ["compile_problems", "compile_blocks", "COMPILABLE_CACHES"]

COMPILABLE_CACHES = frozenset({"first-block", "magcache"})
"""Caches whose hooks sit on whole blocks, around the compiled ``forward``. TaylorSeer, Pyramid Attention
Broadcast and FasterCache hook the attention layers inside a block, so their per-step Python state would be
traced into the graph and recompile it every step."""


def compile_problems(device_type: str, cache: str | None = None) -> list[str]:
    """Why ``--compile`` cannot run here (empty when it can): inductor needs a C++ compiler for CPU kernels and
    Triton for GPU kernels; a cache that hooks inside the blocks is refused (see :data:`COMPILABLE_CACHES`)."""
    problems = []
    if device_type == "cpu":
        from torch._inductor import cpp_builder
        from torch._inductor.exc import InvalidCxxCompiler

        try:
            compiler = cpp_builder.get_cpp_compiler()
        except InvalidCxxCompiler as exc:
            compiler = str(exc)
        if shutil.which(compiler) is None:
            problems.append(
                f"--compile: torch.compile's CPU backend (inductor) needs a C++ compiler, and none works here "
                f"({compiler}); install g++ (or set CXX to one) or drop --compile"
            )
    elif importlib.util.find_spec("triton") is None:
        problems.append(
            f"--compile: torch.compile's {device_type} backend (inductor) needs Triton, which is not installed; "
            "pip install triton (the version your torch names) or drop --compile"
        )
    if cache is not None and cache != "none" and cache not in COMPILABLE_CACHES:
        problems.append(
            f"--compile with --cache {cache}: that cache hooks the attention layers inside each compiled block, "
            f"and its per-step state would recompile the block every step; use --cache "
            f"{' or '.join(sorted(COMPILABLE_CACHES))} with --compile, or drop one of them"
        )
    return problems


def repeated_block_classes(model: nn.Module) -> set[str]:
    from hsdp.shard_rules import repeated_block_lists

    named = getattr(model, "_repeated_blocks", None) or getattr(model, "_no_split_modules", None)
    return set(named or repeated_block_lists(model))


def compile_blocks(model: nn.Module) -> int:
    """Compile the ``forward`` of each repeated block of ``model`` in place; returns how many. ``ValueError``
    when the model names no repeated block class and has no block list, or none is found."""
    classes = repeated_block_classes(model)
    if not classes:
        raise ValueError(
            f"--compile: {type(model).__name__} names no repeated blocks (_repeated_blocks or _no_split_modules) "
            "and has no block list (an nn.ModuleList of one block class); drop --compile"
        )
    blocks = [m for m in model.modules() if type(m).__name__ in classes or _fsdp_base_name(m) in classes]
    if not blocks:
        raise ValueError(f"--compile: no module of {type(model).__name__} is a {', '.join(sorted(classes))}")
    for block in blocks:
        block.forward = torch.compile(block.forward, dynamic=False)
    logger.info("Compiled the forward of %d %s blocks (regional)", len(blocks), type(blocks[0]).__name__)
    return len(blocks)


def _fsdp_base_name(module: nn.Module) -> str:
    """The class FSDP2 swapped out (``FSDPWanTransformerBlock`` -> ``WanTransformerBlock``)."""
    name = type(module).__name__
    return name[len("FSDP") :] if name.startswith("FSDP") else name
