"""Shard plans: which modules of a model become FSDP units, which stay replicated, and (per family) TP.

Where a plan comes from, first match wins:

1. the model's own ``_hsdp_shard_conditions`` (list of ``(qualified_name, module) -> bool``, OR-ed) and
   ``_hsdp_ignored_modules`` (qualified names or predicates);
2. a family plan registered here with :func:`register_plan` (keyed by the model's class name) for knowledge the
   model does not carry, such as a tensor-parallel plan;
3. Hugging Face's ``_no_split_modules``: the class names ``transformers`` / ``diffusers`` keep whole on one
   device, matched by exact class, so an unmodified model shards by its blocks;
4. diffusers' ``_repeated_blocks`` (its list for regional compilation), else the classes of the model's block
   lists (an ``nn.ModuleList`` of two or more modules of one class, such as Stable Audio's
   ``transformer_blocks``): the blocks a model repeats are the units that gather one block at a time;
5. for a model with none of these, a size-based plan (torch's ``size_based_auto_wrap_policy``): bottom-up, a
   module becomes a unit once the parameters under it not already in a unit reach ``min_num_params``
   (``_hsdp_min_num_params`` on the model, default 100M as torch's FSDP docs use). Logged as a warning, since
   units that follow the model's blocks are better (they gather exactly one block at a time).

Tensor parallelism comes from a registered plan when it has one, else from transformers' own plan
(``config.base_model_tp_plan``, :mod:`hsdp.shard_rules.hf_tensor_parallel`) for every family that ships one.

The core never names a model family; family files in this package call :func:`register_plan`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger("hsdp")

DEFAULT_MIN_NUM_PARAMS = 100_000_000
"""Size-based plan threshold when the model sets no ``_hsdp_min_num_params`` (torch's FSDP docs use 1e8)."""

ShardCondition = Callable[[str, nn.Module], bool]
TensorParallelFn = Callable[[nn.Module, DeviceMesh], None]

__all__ = [
    "ShardPlan",
    "ShardCondition",
    "register_plan",
    "resolve_plan",
    "classes_condition",
    "size_condition",
    "repeated_block_lists",
]


@dataclass(frozen=True)
class ShardPlan:
    conditions: Sequence[ShardCondition]
    """A module (other than the root) becomes its own FSDP unit if any condition is true."""
    ignored: Sequence[ShardCondition] = ()
    """Modules whose parameters stay replicated on every rank."""
    tensor_parallel: TensorParallelFn | None = None
    """Applies tensor parallelism over a 1-D ``tp`` mesh, before FSDP."""
    source: str = ""
    """Where the plan came from, for logs and errors."""

    def should_shard(self, name: str, module: nn.Module) -> bool:
        return any(cond(name, module) for cond in self.conditions)

    def is_ignored(self, name: str, module: nn.Module) -> bool:
        return any(cond(name, module) for cond in self.ignored)

    def with_ignored(self, modules: Sequence[str | ShardCondition]) -> ShardPlan:
        """This plan with more modules kept replicated (qualified names or predicates, as
        ``_hsdp_ignored_modules`` takes)."""
        return dataclasses.replace(self, ignored=(*self.ignored, *(_name_or_predicate(m) for m in modules)))


_REGISTRY: dict[str, Callable[[nn.Module], ShardPlan]] = {}


def register_plan(
    *class_names: str,
) -> Callable[[Callable[[nn.Module], ShardPlan]], Callable[[nn.Module], ShardPlan]]:
    """Register a plan factory for models whose class (or a base class) has one of ``class_names``."""

    def decorator(factory: Callable[[nn.Module], ShardPlan]) -> Callable[[nn.Module], ShardPlan]:
        for name in class_names:
            _REGISTRY[name] = factory
        return factory

    return decorator


def classes_condition(class_names: Sequence[str]) -> ShardCondition:
    """A condition that matches modules whose exact class name is listed (not subclasses by name parsing)."""
    names = frozenset(class_names)

    def condition(name: str, module: nn.Module) -> bool:
        return type(module).__name__ in names

    condition.__name__ = f"classes({', '.join(sorted(names))})"
    return condition


def _name_or_predicate(item: str | ShardCondition) -> ShardCondition:
    if callable(item):
        return item
    prefix = str(item)
    return lambda name, module: name == prefix or name.startswith(prefix + ".")


def _registered_factory(model: nn.Module) -> Callable[[nn.Module], ShardPlan] | None:
    for cls in type(model).__mro__:
        if cls.__name__ in _REGISTRY:
            return _REGISTRY[cls.__name__]
    return None


def _load_family_plans() -> None:
    """Import every family module in this package once; each registers its plans on import."""
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def _transformers_tp(model: nn.Module) -> TensorParallelFn | None:
    from hsdp.shard_rules.hf_tensor_parallel import hf_tensor_parallel, tp_plan_of

    return hf_tensor_parallel if tp_plan_of(getattr(model, "config", None)) else None


def resolve_plan(model: nn.Module) -> ShardPlan:
    """The shard plan for ``model`` (see the module docstring for the order)."""
    plan = _resolve_units(model)
    if plan.tensor_parallel is None and (tp := _transformers_tp(model)) is not None:
        plan = dataclasses.replace(plan, tensor_parallel=tp)
    return plan


def _resolve_units(model: nn.Module) -> ShardPlan:
    _load_family_plans()
    ignored = tuple(_name_or_predicate(i) for i in getattr(model, "_hsdp_ignored_modules", None) or ())
    conditions = getattr(model, "_hsdp_shard_conditions", None)
    factory = _registered_factory(model)
    if conditions:
        plan = ShardPlan(conditions=tuple(conditions), ignored=ignored, source="_hsdp_shard_conditions")
        if factory is not None:
            plan = ShardPlan(
                conditions=plan.conditions,
                ignored=plan.ignored,
                tensor_parallel=factory(model).tensor_parallel,
                source=plan.source,
            )
        return plan
    if factory is not None:
        plan = factory(model)
        return ShardPlan(
            conditions=plan.conditions,
            ignored=(*plan.ignored, *ignored),
            tensor_parallel=plan.tensor_parallel,
            source=plan.source or f"registered plan for {type(model).__name__}",
        )
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    if no_split:
        return ShardPlan(
            conditions=(classes_condition(no_split),), ignored=ignored, source=f"_no_split_modules={no_split}"
        )
    repeated = list(getattr(model, "_repeated_blocks", None) or []) or repeated_block_lists(model)
    if repeated:
        return ShardPlan(
            conditions=(classes_condition(repeated),), ignored=ignored, source=f"repeated blocks {repeated}"
        )
    min_num_params = int(getattr(model, "_hsdp_min_num_params", None) or DEFAULT_MIN_NUM_PARAMS)
    logger.warning(
        "%s has neither _hsdp_shard_conditions nor _no_split_modules: FSDP units by size (min_num_params=%d; "
        "set _hsdp_min_num_params on the model to change it, or _no_split_modules to shard by block class)",
        type(model).__name__,
        min_num_params,
    )
    return ShardPlan(
        conditions=(size_condition(model, min_num_params),),
        ignored=ignored,
        source=f"size-based (min_num_params={min_num_params}; set _hsdp_min_num_params or _no_split_modules)",
    )


def repeated_block_lists(model: nn.Module) -> list[str]:
    """Class names of the entries of ``model``'s block lists: ``nn.ModuleList`` s holding two or more modules,
    all of one class that the model's library defines (torch's own containers and layers, such as a list of
    ``nn.Sequential`` or ``nn.Linear``, are no blocks); sorted, none when the model has no such list."""
    found = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            classes = {_own_class(child) for child in module}
            block = next(iter(classes))
            if len(classes) == 1 and not block.__module__.startswith("torch."):
                found.add(block.__name__)
    return sorted(found)


def _own_class(module: nn.Module) -> type:
    """The module's class before ``fully_shard``, which swaps in a subclass (``FSDP<name>``, defined in torch) of
    it: the blocks of a sharded model are still the model's blocks (``--compile`` looks for them after sharding)."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


def size_condition(model: nn.Module, min_num_params: int) -> ShardCondition:
    """torch's ``size_based_auto_wrap_policy`` as a condition: walking bottom-up, a module (not the root) is a unit
    when the parameters under it that no smaller unit took reach ``min_num_params``."""
    units: set[int] = set()

    def remaining(module: nn.Module) -> int:
        count = sum(p.numel() for p in module.parameters(recurse=False))
        count += sum(remaining(child) for child in module.children())
        if module is not model and count >= min_num_params:
            units.add(id(module))
            return 0
        return count

    remaining(model)

    def condition(name: str, module: nn.Module) -> bool:
        return id(module) in units

    condition.__name__ = f"size(min_num_params={min_num_params})"
    return condition
