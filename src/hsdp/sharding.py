"""Apply FSDP2 to a model from a :class:`~hsdp.config.ParallelConfig` and a shard plan.

Small appliers, composed by :func:`apply_hsdp_to_model` in this order (torchtitan's ``parallelize`` shape):
:func:`apply_tensor_parallel` over the ``tp`` mesh, :func:`apply_weight_dtype` (8-bit weight shards),
:func:`apply_fsdp`, :func:`apply_prefetch`, and :func:`shard_report`. Each can be called alone by code that
composes its own layout.

``fully_shard`` is applied leaf-first to every module the plan selects, then to the root, so each block's
all-gather frees the block before the next one gathers. Parameters FSDP2 cannot shard (integer or 0-d) and the
plan's ignored modules stay replicated. NO_SHARD uses FSDP2's composable ``replicate``.

FSDP2 gathers the root's own parameters only around ``forward``, but pipelines call other methods of their
components (an autoencoder's ``encode`` / ``decode``, which reach the decoder's convolutions without ``forward``).
:func:`register_entry_points` makes every method the component's own class defines gather them the same way
(torch's ``register_fsdp_forward_method``), once per outermost call; for inference (training calls ``forward``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from hsdp.config import ParallelConfig, ShardingStrategy
from hsdp.distributed import local_device
from hsdp.mesh import ParallelMeshes, build_meshes
from hsdp.shard_rules import ShardPlan, resolve_plan

if TYPE_CHECKING:
    from hsdp.stored_quant import StoredFormat

logger = logging.getLogger("hsdp")

__all__ = [
    "apply_hsdp_to_model",
    "apply_tensor_parallel",
    "apply_weight_dtype",
    "apply_fsdp",
    "apply_prefetch",
    "register_entry_points",
    "entry_point_names",
    "shard_targets",
    "shard_report",
    "ShardReport",
    "parameter_bytes",
    "fsdp_units",
    "unwrapped_class",
    "offloaded_blocks",
    "host_params",
]


def unwrapped_class(module: nn.Module) -> type:
    """The module's own class: ``fully_shard`` swaps it for a generated ``FSDP<Name>`` subclass, which no library's
    class registry or key map knows."""
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


@dataclass
class ShardReport:
    """What :func:`apply_hsdp_to_model` did on this rank."""

    rank: int
    world_size: int
    replicate_size: int
    shard_size: int
    strategy: str
    plan_source: str
    sharded_modules: list[str] = field(default_factory=list)
    replicated_params: list[str] = field(default_factory=list)
    local_param_bytes: int = 0
    total_param_bytes: int = 0
    offloaded_modules: list[str] = field(default_factory=list)
    """Units whose shards live in host memory (``--offload-layers``: the blocks after the first K)."""
    host_param_bytes: int = 0
    """Of ``local_param_bytes``, those FSDP2 keeps in host memory (``--cpu-offload``, ``--offload-layers``)."""

    @property
    def num_sharded(self) -> int:
        return len(self.sharded_modules)

    @property
    def fraction(self) -> float:
        return self.local_param_bytes / max(1, self.total_param_bytes)


def parameter_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the whole model) over unique parameters."""
    local = total = 0
    for param in model.parameters():  # parameters() already skips tied duplicates
        size = param.element_size()
        held = param.to_local() if isinstance(param, DTensor) else param
        # 8-bit weight shards (hsdp.quantize) hold fewer bytes than their compute dtype says
        local += getattr(held, "stored_bytes", held.numel() * size)
        total += param.numel() * size
    return local, total


def fsdp_units(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    """Every module FSDP manages, leaf-first order as applied, root last."""
    return [(n, m) for n, m in reversed(list(model.named_modules())) if isinstance(m, FSDPModule)]


def host_params(model: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters FSDP2 keeps in host memory: those of every unit with a ``CPUOffloadPolicy``."""
    out = []
    for _, unit in fsdp_units(model):
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is not None and isinstance(group.offload_policy, CPUOffloadPolicy):
            out += [fsdp_param.sharded_param for fsdp_param in group.fsdp_params]
    return out


def offloaded_blocks(targets: list[tuple[str, nn.Module]], config: ParallelConfig) -> list[str]:
    """The units ``--offload-layers K`` keeps in host memory: the plan's blocks after the first K in forward order
    (the reverse of ``targets``' leaf-first order; the root, with the embeddings and norms, stays on the device)."""
    k = config.offload_layers
    if k is None:
        return []
    order = [name for name, _ in reversed(targets)]
    if k >= len(order):
        logger.warning(
            "--offload-layers %d: the model has %d blocks, so all of them stay on the device and nothing is "
            "offloaded; use --offload-layers %d or less to offload",
            k,
            len(order),
            max(0, len(order) - 1),
        )
    return order[k:]


def _dominant_dtype(model: nn.Module, trainable_only: bool = False) -> torch.dtype | None:
    counts: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if param.is_floating_point() and (param.requires_grad or not trainable_only):
            counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def _unshardable_params(
    model: nn.Module, plan: ShardPlan, training: bool, frozen_whole: bool = False
) -> dict[str, nn.Parameter]:
    """Parameters kept whole on every rank: those of ignored modules, those FSDP2 cannot shard (integer, 0-d),
    and, for inference, those the model keeps in another dtype (diffusers keeps norms and time embedders in fp32
    inside bf16 models; one FSDP unit needs one dtype, and these are small). For training, FSDP2 needs one dtype
    only among the trainable parameters of a unit: a frozen bf16 base with fp32 LoRA adapters is sharded as is.
    ``frozen_whole`` (training under NO_SHARD, :func:`_frozen_whole`) keeps the frozen parameters too."""
    keep: dict[str, nn.Parameter] = {}
    ignored_prefixes = [name for name, mod in model.named_modules() if name and plan.is_ignored(name, mod)]
    dominant = _dominant_dtype(model)
    trainable = _dominant_dtype(model, trainable_only=True) if training else None
    for name, param in model.named_parameters():
        in_ignored = any(name.startswith(prefix + ".") for prefix in ignored_prefixes)
        floating = param.is_floating_point() or param.is_complex()
        if in_ignored or param.dim() == 0 or not floating:
            keep[name] = param
        elif training and trainable is not None and not param.requires_grad:
            if frozen_whole:
                keep[name] = param
            continue
        elif param.dtype != (trainable or dominant):
            if training:
                raise ValueError(
                    f"parameter {name} is {param.dtype} but most of the model is {dominant}: FSDP2 needs one dtype "
                    "per unit for training; load the model in one dtype and use --param-dtype for mixed precision"
                )
            keep[name] = param
    return keep


def _frozen_whole(config: ParallelConfig, training: bool) -> bool:
    """Whether training keeps the frozen parameters (a LoRA's base) out of FSDP, plain and whole on every rank:
    ``config.frozen_whole``, and always under NO_SHARD, where they never communicate but FSDP2's ``replicate`` would
    still copy each unit into an unsharded buffer at every forward and hold it to the backward (a second whole copy
    of the base per rank, and the time of copying it). Not with CPU or layerwise offload, which keep them (or the
    offloaded blocks' share) on the host."""
    wanted = config.frozen_whole or config.sharding_strategy is ShardingStrategy.NO_SHARD
    return training and wanted and not config.cpu_offload and config.offload_layers is None


def _cast_frozen(keep: Collection[nn.Parameter], config: ParallelConfig) -> None:
    """Frozen parameters kept out of FSDP compute in the layout's ``param_dtype``, as FSDP would gather them (the
    same cast of the same values; they have no fp32 master to keep)."""
    if config.param_dtype is None:
        return
    dtype = config.param_torch_dtype
    for param in keep:
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def _policies(config: ParallelConfig, device: torch.device, offload: bool) -> dict:
    """``fully_shard`` policies of one unit; ``offload``: its shards in host memory (whole or layerwise offload)."""
    kwargs: dict = {}
    if config.param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=config.param_torch_dtype, reduce_dtype=config.reduce_torch_dtype
        )
    if offload:
        # Pinned host memory needs an accelerator; pinning on a CPU-only host fails. FSDP2 copies a unit's shards in
        # as part of its all-gather, so the forward prefetch that starts the next unit's all-gather copies it too.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type != "cpu")
    else:
        kwargs["offload_policy"] = OffloadPolicy()
    return kwargs


def _guard_inference_mode(model: nn.Module) -> None:
    def pre_hook(module: nn.Module, args: tuple) -> None:
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "an FSDP2-sharded model cannot run under torch.inference_mode() (torch <= 2.13 corrupts the "
                "all-gather buffers for every later call); use torch.no_grad() instead"
            )

    model.register_forward_pre_hook(pre_hook)


def _keep_output_capture(model: nn.Module) -> None:
    """transformers 5 records hidden states / attentions only for classes registered by name at init; FSDP2
    swaps each wrapped module's class for a ``FSDP<Name>`` subclass, so ``output_hidden_states=True`` would
    silently return None (diffusers' Wan image encoder and Qwen-Image / HunyuanVideo text encoders read them).
    Register the swapped classes too."""
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # no transformers, or a version that records outputs differently
        return
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and getattr(module, "_can_record_outputs", None):
            _CAN_RECORD_REGISTRY[module] = module._can_record_outputs


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: ShardPlan) -> None:
    """Tensor parallelism from the plan over the 1-D ``tp`` mesh; runs before FSDP, which then shards the DTensors
    over the data-parallel mesh."""
    if plan.tensor_parallel is None:
        raise ValueError(
            f"--tensor-parallel-size={tp_mesh.size()}: no tensor-parallel plan is known for {type(model).__name__}; "
            "use --tensor-parallel-size 1 or register one in hsdp.shard_rules"
        )
    plan.tensor_parallel(model, tp_mesh)


def shard_targets(model: nn.Module, plan: ShardPlan) -> list[tuple[str, nn.Module]]:
    """The modules the plan makes FSDP units, leaf-first (the order ``fully_shard`` is applied in)."""
    targets = [(n, m) for n, m in reversed(list(model.named_modules())) if n and plan.should_shard(n, m)]
    if not targets:
        candidates = sorted(
            {type(m).__name__ for n, m in model.named_modules() if n and len(list(m.children()))}
        )
        raise ValueError(
            f"the shard plan ({plan.source}) matched no module of {type(model).__name__}. Add "
            f"_hsdp_shard_conditions to the model, or _no_split_modules naming one of its block classes: "
            f"{', '.join(candidates[:20])}"
        )
    return targets


def _check_resident(model: nn.Module, resident: set[str], targets: list[tuple[str, nn.Module]]) -> None:
    if unknown := resident - {n for n, _ in targets} - {""}:
        raise ValueError(
            f"resident_modules {sorted(unknown)[:5]} are not FSDP units of {type(model).__name__}; name modules the "
            f"shard plan selects, e.g. {targets[-1][0]!r}"
        )


def apply_weight_dtype(
    model: nn.Module,
    weight_dtype: str,
    config: ParallelConfig,
    *,
    keep: Collection[nn.Parameter],
    training: bool,
) -> None:
    """Store the Linear weights FSDP will shard in 8 bits (:mod:`hsdp.quantize`); before ``fully_shard``, which
    then shards and all-gathers the 8-bit tensors."""
    from hsdp.quantize import quantize_linear_weights, weight_dtype_problem

    if problem := weight_dtype_problem(weight_dtype, local_device().type, training=training):
        raise ValueError(problem)
    if config.sharding_strategy is ShardingStrategy.NO_SHARD or config.tensor_parallel_size > 1:
        raise ValueError(
            f"--weight-dtype {weight_dtype} stores FSDP shards in 8 bits, so it needs weights sharded over 2 "
            f"or more ranks (--hsdp-shard-size >= 2) and no tensor parallelism; got {config.describe()}"
        )
    quantize_linear_weights(model, weight_dtype, shard_size=config.hsdp_shard_size, skip=set(keep))


def apply_fsdp(
    model: nn.Module,
    targets: list[tuple[str, nn.Module]],
    mesh: DeviceMesh,
    config: ParallelConfig,
    *,
    keep: Collection[nn.Parameter] = (),
    resident: Collection[str] = (),
    offloaded: Collection[str] = (),
) -> None:
    """``fully_shard`` each target leaf-first, then the root (NO_SHARD: FSDP2's composable ``replicate``).
    ``resident`` units (``""`` for the root) keep their gathered weights between forwards; ``offloaded`` units
    (``--offload-layers``) keep their shards in host memory, as ``--cpu-offload`` keeps every unit's."""
    device = local_device()
    ignored = set(keep)

    def kwargs(name: str) -> dict:
        return {**_policies(config, device, config.cpu_offload or name in offloaded), "ignored_params": ignored}

    if config.sharding_strategy is ShardingStrategy.NO_SHARD:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate_mesh = mesh["replicate"] if mesh.ndim == 2 else mesh
        for name, module in targets:
            replicate(module, mesh=replicate_mesh, **kwargs(name))
        replicate(model, mesh=replicate_mesh, **kwargs(""))
        return
    for name, module in targets:
        reshard = False if name in resident else config.reshard_after_forward
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, **kwargs(name))
    # Passed explicitly: left as None, FSDP2 keeps the root gathered after forward, and inference wants the
    # memory back unless the layout asks to keep weights gathered (reshard_after_forward=False).
    root_reshard = False if "" in resident else config.reshard_after_forward
    fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard, **kwargs(""))


def apply_prefetch(model: nn.Module, targets: list[tuple[str, nn.Module]], depth: int) -> None:
    """All-gather ``depth`` units ahead in forward order. Forward order is the reverse of leaf-first; the root
    starts the first block's all-gather so it overlaps the root's own work (embeddings)."""
    order = [model, *(module for _, module in reversed(targets))]
    for i, module in enumerate(order[:-1]):
        module.set_modules_to_forward_prefetch(order[i + 1 : i + 1 + depth])


_LIBRARY_BASES = ("ModelMixin", "PreTrainedModel", "Module")
"""Base classes whose methods are library plumbing (saving, configs, adapters), not entry points of a model."""


def entry_point_names(model: nn.Module) -> list[str]:
    """Methods a caller may use instead of ``forward``: every plain function the model's own classes define (those
    in its MRO before diffusers' ``ModelMixin`` / transformers' ``PreTrainedModel`` / ``nn.Module``), dunders,
    ``forward`` and static or class methods aside. For ``AutoencoderKL``: ``encode``, ``_encode``, ``decode``,
    ``_decode``, ``tiled_encode``, ``tiled_decode``, ``blend_h``, ``blend_v``, ..."""
    names: set[str] = set()
    for cls in type(model).__mro__:
        if cls.__name__ in _LIBRARY_BASES:
            break
        if cls.__module__.startswith("torch."):  # FSDP's own FSDP<Name> subclass and FSDPModule
            continue
        for name, value in vars(cls).items():
            if inspect.isfunction(value) and name != "forward" and not name.startswith("__"):
                names.add(name)
    return sorted(names)


def register_entry_points(model: nn.Module) -> list[str]:
    """Make each of :func:`entry_point_names` gather the root's weights before it runs and free them after, as
    ``forward`` does; returns the names. Only the outermost call gathers and frees: ``decode`` calling ``_decode``,
    or ``forward`` calling ``encode``, would otherwise free the weights while the caller still uses them."""
    if not isinstance(model, FSDPModule):
        return []
    names = entry_point_names(model)
    model._hsdp_entry_depth = 0

    def enter(module: nn.Module, *_: object) -> None:
        module._hsdp_entry_depth += 1

    def leave(module: nn.Module, *_: object) -> None:
        module._hsdp_entry_depth -= 1

    # Registered after fully_shard's own hooks: forward counts as an outer call once its weights are gathered.
    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    for name in names:
        plain = getattr(model, name)
        register_fsdp_forward_method(model, name)
        setattr(model, name, _outermost_only(model, plain, getattr(model, name)))
    return names


def _outermost_only(model: nn.Module, plain, gathering):
    def call(*args, **kwargs):
        if model._hsdp_entry_depth:  # inside forward or another entry point: weights are already gathered
            return plain(*args, **kwargs)
        model._hsdp_entry_depth += 1
        try:
            return gathering(*args, **kwargs)
        finally:
            model._hsdp_entry_depth -= 1

    return call


def _move_replicated(keep: Collection[nn.Parameter]) -> None:
    device = local_device()
    for param in keep:
        if not param.is_meta and param.device != device:
            param.data = param.data.to(device)


def shard_report(
    model: nn.Module,
    config: ParallelConfig,
    rank: int,
    plan: ShardPlan,
    targets: list[tuple[str, nn.Module]],
    keep: dict[str, nn.Parameter],
    offloaded: list[str],
) -> ShardReport:
    local, total = parameter_bytes(model)
    host = sum(p.to_local().numel() * p.element_size() for p in host_params(model))
    return ShardReport(
        rank=rank,
        world_size=config.world_size,
        replicate_size=config.hsdp_replicate_size,
        shard_size=config.hsdp_shard_size,
        strategy=config.sharding_strategy.value,
        plan_source=plan.source,
        sharded_modules=[n for n, _ in targets],
        replicated_params=sorted(keep),
        local_param_bytes=local,
        total_param_bytes=total,
        offloaded_modules=offloaded,
        host_param_bytes=host,
    )


def apply_hsdp_to_model(
    model: nn.Module,
    config: ParallelConfig,
    *,
    meshes: ParallelMeshes | None = None,
    plan: ShardPlan | None = None,
    training: bool = False,
    resident_modules: Collection[str] = (),
    forward_prefetch: int = 0,
    weight_dtype: str | None = None,
    stored_layout: Mapping[str, StoredFormat] | None = None,
) -> ShardReport:
    """Shard ``model`` in place over the layout's meshes and return a report for this rank: tensor parallelism,
    8-bit weights, FSDP2 and prefetch, each by its applier above.

    ``resident_modules`` (qualified names of plan-selected modules, ``""`` for the root) keep their gathered
    weights between forwards (``reshard_after_forward=False``): memory-budgeted inference, see
    :func:`hsdp.planning.residency_for_budget`. ``forward_prefetch`` all-gathers that many units ahead in forward
    order. ``weight_dtype`` (``int8``, ``fp8``) stores the ``nn.Linear`` weights of the sharded units in 8 bits
    and all-gathers them so (:mod:`hsdp.quantize`); inference only. ``stored_layout`` (a converted GGUF or
    fp8-scaled checkpoint's formats) keeps those ``nn.Linear`` weights in their stored bytes (:mod:`hsdp.stored_quant`).

    Raises ``ValueError`` when the plan matches no module (the message lists candidate module names).
    """
    config = config.resolved()
    if not config.use_hsdp:
        raise ValueError("apply_hsdp_to_model needs use_hsdp=True (--use-hsdp) in the ParallelConfig")
    meshes = meshes or build_meshes(config)
    if meshes.fsdp is None:
        raise ValueError(
            "the meshes passed to apply_hsdp_to_model have no FSDP mesh; build them from a config with use_hsdp=True"
        )
    plan = plan or resolve_plan(model)
    if config.tensor_parallel_size > 1:
        apply_tensor_parallel(model, meshes.tp, plan)
    targets = shard_targets(model, plan)
    resident = set(resident_modules)
    _check_resident(model, resident, targets)
    frozen_whole = _frozen_whole(config, training)
    keep = _unshardable_params(model, plan, training, frozen_whole)
    if weight_dtype is not None:
        apply_weight_dtype(model, weight_dtype, config, keep=keep.values(), training=training)
    if stored_layout and not frozen_whole and config.sharding_strategy is not ShardingStrategy.NO_SHARD and config.tensor_parallel_size == 1:
        from hsdp.stored_quant import keep_stored

        keep_stored(model, stored_layout, shard_size=config.hsdp_shard_size, skip=set(keep.values()))
    logger.info(
        "HSDP %s: replicate_size=%d, shard_size=%d, world_size=%d, rank=%d",
        "Training" if training else "Inference",
        config.hsdp_replicate_size,
        config.hsdp_shard_size,
        config.world_size,
        meshes.rank,
    )
    offloaded = offloaded_blocks(targets, config)
    if overlap := resident & set(offloaded):
        raise ValueError(
            f"--offload-layers {config.offload_layers} offloads {sorted(overlap)[0]!r}, which the residency plan keeps "
            "gathered on the device: use a larger --offload-layers or drop --device-memory"
        )
    apply_fsdp(model, targets, meshes.fsdp, config, keep=keep.values(), resident=resident, offloaded=offloaded)
    # Under NO_SHARD nothing gathers, but offloaded units are still copied in per use, ahead of it with prefetch.
    moves = config.sharding_strategy is not ShardingStrategy.NO_SHARD or config.cpu_offload or bool(offloaded)
    if not moves and (resident or forward_prefetch):
        logger.warning("resident_modules / forward_prefetch have no effect with NO_SHARD (nothing gathers)")
    elif forward_prefetch > 0:
        apply_prefetch(model, targets, forward_prefetch)
    _move_replicated(keep.values())
    if frozen_whole:
        _cast_frozen(keep.values(), config)
    # Inference only: training steps call forward, and an extra gather outside the step would disturb FSDP's
    # forward/backward state machine.
    entry_points = [] if training else register_entry_points(model)
    _guard_inference_mode(model)
    _keep_output_capture(model)
    logger.info("Sharded %d modules + root", len(targets))
    logger.debug("Methods that gather like forward: %s", ", ".join(entry_points) or "none")
    if keep:
        logger.debug("Kept %d parameters replicated: %s", len(keep), ", ".join(sorted(keep)[:8]))
    if offloaded:
        logger.info(
            "--offload-layers %d: %d of %d blocks keep their shards in host memory (%s ... %s)",
            config.offload_layers,
            len(offloaded),
            len(targets),
            offloaded[0],
            offloaded[-1],
        )
    return shard_report(model, config, meshes.rank, plan, targets, keep, offloaded)
