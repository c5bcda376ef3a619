"""The memory and layout planner: will a model fit, and how fast, answered from its config alone.

* :mod:`~hsdp.planning.profile`: the model as FSDP units and parameter shapes, built on the meta device.
* :mod:`~hsdp.planning.estimate`: per-rank memory, bytes moved and a roofline step time of one layout.
* :mod:`~hsdp.planning.search`: the candidate layouts, budgeted residency and the recommendation.
* :mod:`~hsdp.planning.simulate`: the real sharding code on a fake world of any size, to check the estimate.
* :mod:`~hsdp.planning.training`: the layout ``hsdp train`` takes when its command names none.
* :mod:`~hsdp.planning.cli`: the ``hsdp plan`` command.
"""

from hsdp.planning.cli import command_line
from hsdp.planning.estimate import Estimate, Hardware, Layout, Workload, estimate
from hsdp.planning.profile import (
    ModelProfile,
    PlanError,
    UnitProfile,
    build_meta_model,
    component_folders,
    format_size,
    main_component,
    model_kind,
    parse_size,
    profile_model,
    profile_module,
)
from hsdp.planning.search import Plan, ResidencyPolicy, candidate_layouts, plan, residency_for_budget
from hsdp.planning.simulate import SimulatedRank, allocated_bytes, simulate, simulate_comm

__all__ = [
    "PlanError",
    "parse_size",
    "format_size",
    "UnitProfile",
    "ModelProfile",
    "model_kind",
    "main_component",
    "profile_module",
    "profile_model",
    "build_meta_model",
    "component_folders",
    "Workload",
    "Hardware",
    "Layout",
    "Estimate",
    "estimate",
    "candidate_layouts",
    "Plan",
    "plan",
    "ResidencyPolicy",
    "residency_for_budget",
    "command_line",
    "SimulatedRank",
    "simulate",
    "simulate_comm",
    "allocated_bytes",
]
