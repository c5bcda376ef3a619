"""What :class:`hsdp.Engine` refuses or plans from the model's files and its arguments, before any rank starts: the
layout against what the model supports (CFG parallel, Ulysses, request-parallel, ...), 8-bit weight shards, LoRA
adapters against the model they adapt, and ``--device-memory``'s residency plan."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hsdp import distributed
from hsdp.config import ParallelConfig
from hsdp.engine import adapters
from hsdp.engine.model_info import ModelInfo

if TYPE_CHECKING:
    from hsdp.engine.device_memory import DeviceMemoryPlan

logger = logging.getLogger("hsdp")

__all__ = [
    "LoraArg",
    "layout_problems",
    "weight_dtype_problems",
    "memory_plan",
    "load_options",
    "lora_target",
    "check_lora",
    "vae_problems",
    "vae_parallel_default",
]


def layout_problems(info: ModelInfo, config: ParallelConfig) -> list[str]:
    """Layout x model problems, found before any process starts."""
    problems = []
    if config.frozen_whole:
        problems.append(
            "frozen_whole (--frozen-whole) is a training setting (frozen weights whole beside sharded trained ones); "
            "inference trains nothing, so it would keep the whole model on every rank: drop it, or run without "
            "--use-hsdp to hold the model whole"
        )
    if info.kind == "causal_lm" and config.compute_parallel_size > 1:
        problems.append(
            "causal LMs run with HSDP (--use-hsdp, --hsdp-shard-size, --hsdp-replicate-size, --request-parallel) "
            "only; drop --ulysses-degree/--ring-degree/--cfg-parallel-size"
        )
    if info.kind == "diffusion" and config.ring_degree > 1 and distributed.device_type() == "cpu":
        problems.append(
            "--ring-degree: diffusers' ring attention has no CPU kernel; use --ulysses-degree on CPU"
        )
    if info.kind == "diffusion":
        problems += _diffusion_layout_problems(info, config)
    if (
        info.kind == "diffusion"
        and config.ulysses_degree > 1
        and info.num_heads
        and info.num_heads % config.ulysses_degree
    ):
        problems.append(
            f"--ulysses-degree {config.ulysses_degree} must divide the transformer's {info.num_heads} attention heads"
        )
    devices = distributed.available_devices()
    # Spawned ranks all live on this host; under torchrun only this node's ranks do.
    local_ranks = config.world_size
    if distributed.launched_by_torchrun():
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size))
    if devices is not None and local_ranks > devices:
        problems.append(
            f"the layout ({config.describe()}) needs {local_ranks} ranks on this host, one per device, but it has "
            f"{devices} {distributed.device_type()} device(s); reduce --hsdp-shard-size/--hsdp-replicate-size/"
            "--ulysses-degree/--cfg-parallel-size"
        )
    return problems


def _diffusion_layout_problems(info: ModelInfo, config: ParallelConfig) -> list[str]:
    """Parallel features the pipeline cannot use, read from diffusers' own code and metadata."""
    problems = []
    name = f"{info.family} ({info.class_name})" if info.family != info.class_name else info.class_name
    if config.cfg_parallel_size == 2 and not info.separate_uncond_pass:
        problems.append(
            f"--cfg-parallel-size 2: {name} does not run guidance as a separate unconditional pass (it batches "
            "both branches into one denoiser call, or has no classifier-free guidance), so there is nothing to "
            "split off; use --cfg-parallel-size 1"
        )
    if config.sequence_parallel_size > 1 and not info.ulysses:
        problems.append(
            f"--ulysses-degree/--ring-degree: the denoiser of {name} {info.ulysses_problem}, so its attention "
            "cannot be split across ranks; use --ulysses-degree 1 and --ring-degree 1 (HSDP and --request-parallel "
            "still apply)"
        )
    return problems


def weight_dtype_problems(weight_dtype: str | None, config: ParallelConfig) -> list[str]:
    """``--weight-dtype`` x device and layout problems, found before any process starts."""
    from hsdp.quantize import weight_dtype_problem

    if weight_dtype is None:
        return []
    problem = weight_dtype_problem(weight_dtype, distributed.device_type())
    if problem:
        return [problem]
    if not config.use_hsdp or config.hsdp_shard_size < 2 or config.tensor_parallel_size > 1:
        return [
            f"--weight-dtype {weight_dtype} stores FSDP shards in 8 bits: add --use-hsdp with --hsdp-shard-size 2 "
            f"or more (and no --tensor-parallel-size); the layout is {config.describe()}"
        ]
    return []


def memory_plan(
    info: ModelInfo,
    config: ParallelConfig,
    device_memory: int | str | None,
    dtype: str | None,
    weight_dtype: str | None,
    forward_prefetch: bool = True,
) -> DeviceMemoryPlan | None:
    """``--device-memory``: plan residency from the budget before any process starts (and log the choice); with
    ``forward_prefetch=False`` (``--no-prefetch``) the plan prefetches nothing either."""
    if device_memory is None:
        return None
    from hsdp.engine.device_memory import engine_profiles, plan_device_memory
    from hsdp.planning import Workload, parse_size

    if not config.use_hsdp or config.hsdp_shard_size < 2:
        raise ValueError(
            "--device-memory plans which sharded blocks stay gathered between forwards: add --use-hsdp with "
            f"--hsdp-shard-size 2 or more (the layout is {config.describe()})"
        )
    if config.offload_layers is not None:
        raise ValueError(
            f"--device-memory keeps blocks gathered on the device, --offload-layers {config.offload_layers} streams "
            "the blocks after the first K from host memory: drop one (hsdp plan recommends --offload-layers when the "
            "model does not fit otherwise)"
        )
    budget = parse_size(device_memory, "--device-memory")
    # One request at the planner's default length (1,024 tokens). Pipelines that batch both guidance branches
    # into one denoiser call hold twice the activations; those that run them as separate passes do not.
    work = Workload(guidance=info.kind == "diffusion" and not info.separate_uncond_pass)
    profiles = engine_profiles(info.path, dtype, info.shardable)
    plan = plan_device_memory(profiles, config, budget, work, weight_dtype, prefetch=forward_prefetch)
    logger.info("%s (planned for %d tokens per request)", plan.describe(), work.seq_len)
    return plan


def load_options(info: ModelInfo, plan: DeviceMemoryPlan | None) -> dict[str, dict] | None:
    """The runner's component name -> sharding options of the plan (a causal LM's one component is ``model``)."""
    if plan is None:
        return None
    options = plan.load_options()
    return {"model": options[plan.component]} if info.kind == "causal_lm" else options


def lora_target(info: ModelInfo) -> dict[str, Path]:
    """The models a ``--lora`` adapter may adapt, by name -> folder: a causal LM (``model``), or a pipeline's
    denoisers by component (both of Wan 2.2's experts)."""
    if info.kind == "diffusion":
        return {name: info.path / name for name in info.denoisers}
    return {"model": info.path}


LoraArg = str | os.PathLike | Mapping[str, str | os.PathLike] | None


def check_lora(
    info: ModelInfo, config: ParallelConfig, weight_dtype: str | None, lora: LoraArg
) -> dict[str, adapters.AdapterSpec]:
    """``--lora``: peft LoRA adapter folders (one path, or names -> paths; an empty mapping for slots filled at
    run time) that fit the model and layout, checked before any process starts (reads the adapters' configs and
    safetensors headers and the model's config only)."""
    if lora is None:
        return {}
    named = dict(lora) if isinstance(lora, Mapping) else {Path(lora).resolve().name: lora}
    if config.tensor_parallel_size > 1:
        raise ValueError(
            f"--lora with --tensor-parallel-size {config.tensor_parallel_size}: the TP plans shard nn.Linear "
            "layers, which LoRA wraps; use --tensor-parallel-size 1 (HSDP shards the base and the adapters)"
        )
    if weight_dtype is not None:
        raise ValueError(
            f"--lora with --weight-dtype {weight_dtype}: the 8-bit path would quantize the adapters' own Linear "
            "layers too; drop --weight-dtype, or merge the adapter into the base first (peft's merge_and_unload, "
            "then save_pretrained) and pass that folder without --lora"
        )
    return {
        name: adapters.describe_adapter(name, path, lora_target(info), "--lora", info.class_name)
        for name, path in named.items()
    }


def _vae_parallel_blocker(info: ModelInfo, config: ParallelConfig) -> str | None:
    """Why this layout cannot split the VAE's tiles over its ranks, or None when it can."""
    if config.world_size == 1:
        return "this layout has one rank"
    if config.request_parallel:
        return "--request-parallel ranks each decode their own request"
    sharded = [name for name in info.autoencoders if config.use_hsdp and name in info.shardable]
    if sharded:
        return (f"the engine shards {', '.join(sharded)} (as large as the denoiser), and a sharded VAE's every "
                "layer all-gathers on all ranks together")  # fmt: skip
    return None


def _splits(info: ModelInfo, name: str) -> bool:
    """Whether ``--vae-parallel --vae-tiling`` splits autoencoder ``name``'s tiles: it tiles, and the way hsdp
    splits it."""
    return "tiling" in info.vae_options[name] and name not in info.vae_unsplittable


def vae_parallel_default(info: ModelInfo, config: ParallelConfig, requested: bool | None) -> bool:
    """``--vae-parallel``'s value: as given, else off. The split decode is diffusers' *tiled* decode, which blends
    overlapping tiles and so differs from the whole decode one process runs by default (up to 127 levels of 255 on
    tiny-flux at 128 x 128): a default must give the one-process output, so tiles only when the user asks."""
    del info, config  # the default no longer depends on the layout or the VAE
    return bool(requested)


def vae_problems(
    info: ModelInfo, config: ParallelConfig, parallel: bool | None, tiling: bool, slicing: bool
) -> list[str]:
    """``--vae-parallel`` / ``--vae-tiling`` / ``--vae-slicing`` against the model's autoencoders and the layout."""
    flags = {"--vae-parallel": bool(parallel), "--vae-tiling": tiling, "--vae-slicing": slicing}
    given = [flag for flag, on in flags.items() if on]
    if not given:
        return []
    if info.kind != "diffusion" or not info.autoencoders:
        return [f"{', '.join(given)}: {info.path.name} has no VAE (diffusers autoencoder); drop the flag"]
    problems = []
    for flag, option in (("--vae-tiling", "tiling"), ("--vae-slicing", "slicing")):
        if flags[flag] and not any(option in info.vae_options[name] for name in info.autoencoders):
            problems.append(f"{flag}: this pipeline's autoencoder ({', '.join(info.autoencoders)}) has no diffusers "
                            f"{option} (enable_{option}); drop {flag}")  # fmt: skip
    tiled = [name for name in info.autoencoders if "tiling" in info.vae_options[name]]
    if parallel and tiling and tiled and not any(_splits(info, name) for name in tiled):
        problems += [f"--vae-parallel --vae-tiling: {info.vae_unsplittable[name]}; drop --vae-tiling (--vae-parallel "
                     "alone splits the whole decode by rows) or --vae-parallel (--vae-tiling tiles it on each rank)"
                     for name in tiled]  # fmt: skip
    if parallel and (blocker := _vae_parallel_blocker(info, config)) is not None:
        problems.append(f"--vae-parallel splits the VAE's decode over the ranks that share a request, but {blocker}; "
                        "drop --vae-parallel (or use --vae-tiling to save memory on each rank)")  # fmt: skip
    return problems
