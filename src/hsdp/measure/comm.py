"""Communication accounting: collectives and bytes per forward / training step, against the minimum.

:class:`CommCounter` sees what torch's ``CommDebugMode`` sees (FSDP2's c10d collectives and DTensor's
functional ones) at the dispatcher, and adds up the bytes each call moves per rank, by the usual bus-traffic rules: an all-gather or
reduce-scatter over ``N`` ranks moves ``(N - 1) / N`` of the full tensor, an all-reduce twice that, an
all-to-all ``(N - 1) / N`` of its input.

:func:`minimum_bytes` is the floor for the same step, read from the sharded model: every FSDP unit that must be
gathered moves ``(N - 1) / N`` of its *unpadded* parameters in the compute dtype, once per all-gather it needs
(forward, and backward again when it was resharded), and training reduce-scatters every gradient once (plus
the replica all-reduce of HSDP). ``measured / minimum`` is 1.00 when nothing is gathered twice and padding is
negligible. :func:`measure_comm` runs one step under the counter and returns a :class:`CommReport` the engine
and trainer print in their summaries.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "CommAccounting",
    "CommCounter",
    "CommReport",
    "minimum_bytes",
    "measure_comm",
    "collective_traffic",
]

T = TypeVar("T")

_c10d = torch.ops.c10d
_funcol = torch.ops._c10d_functional


def _group_size(obj: Any) -> int:
    """Size of a process group passed to a c10d op (boxed ``ScriptObject``) or a functional one (name)."""
    if isinstance(obj, str):
        return dist.distributed_c10d._resolve_process_group(obj).size()
    return dist.ProcessGroup.unbox(obj).size()


def _nbytes(tensors: Any) -> int:
    flat, _ = tree_flatten(tensors)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


def collective_traffic(packet: Any, args: tuple) -> tuple[str, int] | None:
    """``(kind, bytes this rank sends)`` for one collective call, or None if ``packet`` is not one we count."""
    if packet in (_c10d._allgather_base_, _c10d.allgather_into_tensor_coalesced_):
        out, inp = _nbytes(args[0]), _nbytes(args[1])
        return "all_gather", out - inp  # (N - 1) / N of the output: everything but this rank's own shard
    if packet in (_c10d._reduce_scatter_base_, _c10d.reduce_scatter_tensor_coalesced_):
        out, inp = _nbytes(args[0]), _nbytes(args[1])
        return "reduce_scatter", inp - out
    if packet in (_c10d.allreduce_, _c10d.allreduce_coalesced_):
        n = _group_size(args[1])
        return "all_reduce", int(2 * (n - 1) / n * _nbytes(args[0]))
    if packet is _c10d.alltoall_base_:
        n = _group_size(args[2])
        return "all_to_all", int((n - 1) / n * _nbytes(args[1]))
    if packet is _c10d.broadcast_:
        return "broadcast", _nbytes(args[0])
    if packet is _funcol.all_gather_into_tensor:
        return "all_gather", (args[1] - 1) * _nbytes(args[0])
    if packet is _funcol.reduce_scatter_tensor:
        n = args[2]
        return "reduce_scatter", int((n - 1) / n * _nbytes(args[0]))
    if packet is _funcol.all_reduce:
        n = _group_size(args[2])
        return "all_reduce", int(2 * (n - 1) / n * _nbytes(args[0]))
    if packet is _funcol.all_to_all_single:
        n = _group_size(args[3])
        return "all_to_all", int((n - 1) / n * _nbytes(args[0]))
    return None


class CommCounter(TorchDispatchMode):
    """Counts the collectives dispatched while active, and the bytes each moves per rank, by kind.

    The same dispatch-level view as torch's ``CommDebugMode`` (FSDP2's c10d collectives and DTensor's
    functional ones), without its per-module tracker, whose global module hooks break on some pipelines'
    nested calls (diffusers' text encoders).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into collectives, which come back through here
        out = func(*args, **kwargs)
        traffic = collective_traffic(func._overloadpacket, args)
        if traffic is not None:
            self.calls[traffic[0]] += 1
            self.bytes[traffic[0]] += traffic[1]
        return out


def _groups(model: nn.Module):
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group  # private: FSDP2 keeps the unit's params here
            if group is not None:
                yield group


def minimum_bytes(model: nn.Module, *, training: bool = False, warm: bool = True) -> dict[str, int]:
    """The least each kind of collective must move per rank for one step of a sharded ``model``.

    With ``warm`` (a step after the first), units that keep their weights gathered between steps
    (``reshard_after_forward=False`` in inference) need no all-gather.
    """
    need: dict[str, int] = defaultdict(int)
    for group in _groups(model):
        info = group.mesh_info
        n = getattr(info, "shard_mesh_size", 1)
        replicas = getattr(info, "replicate_mesh_size", 1)
        unpadded = sum(
            p._orig_size.numel() * (p.param_dtype or p.orig_dtype).itemsize for p in group.fsdp_params
        )
        resharded = group.post_forward_mesh_info is not None
        if n > 1:
            if training:
                need["all_gather"] += int((n - 1) / n * unpadded * (2 if resharded else 1))
            elif resharded or not warm:
                need["all_gather"] += int((n - 1) / n * unpadded)
        if training:
            grads = sum(
                p._orig_size.numel() * (p.reduce_dtype or p.param_dtype or p.orig_dtype).itemsize
                for p in group.fsdp_params
            )
            if n > 1:
                need["reduce_scatter"] += int((n - 1) / n * grads)
            if replicas > 1:
                need["all_reduce"] += int(2 * (replicas - 1) / replicas * grads / n)
    return dict(need)


@dataclass
class CommReport:
    """Collectives of one step: calls and bytes per kind, the minimum, and their ratio."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    minimum: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def minimum_total(self) -> int:
        return sum(self.minimum.values())

    @property
    def ratio(self) -> float:
        """Measured / minimum bytes of the collectives FSDP needs (1.0 when nothing is needed nor moved)."""
        fsdp = sum(v for k, v in self.bytes.items() if k in ("all_gather", "reduce_scatter", "all_reduce"))
        return fsdp / self.minimum_total if self.minimum_total else (1.0 if fsdp == 0 else float("inf"))

    def to_dict(self) -> dict:
        return dict(
            calls=self.calls, bytes=self.bytes, minimum=self.minimum, total=self.total, ratio=self.ratio
        )

    def summary(self) -> str:
        calls = ", ".join(f"{n} {k}" for k, n in sorted(self.calls.items())) or "no collectives"
        mib = self.total / 2**20
        return f"comm per step: {calls}, {mib:.2f} MiB per rank ({self.ratio:.3f}x the minimum)"


def measure_comm(model: nn.Module, step: Callable[[], T], *, training: bool = False) -> tuple[T, CommReport]:
    """Run ``step()`` once under :class:`CommCounter`; returns its result and the report against the minimum.

    Call it on a warm model (after one step) to see steady-state traffic: the minimum assumes resident units
    are already gathered.
    """
    with CommCounter() as counter:
        result = step()
    report = CommReport(dict(counter.calls), dict(counter.bytes), minimum_bytes(model, training=training))
    return result, report


class CommAccounting:
    """Count collectives over a whole call (e.g. one ``generate``) and the minimum for the forwards it ran.

    The minimum is taken per root FSDP module: its first forward in the call is cold (every unit gathers),
    later ones warm (units kept gathered need nothing). Opt-in, since the counter sees every dispatched op.
    """

    def __init__(self, models: list[nn.Module]):
        self.models = [m for m in models if isinstance(m, FSDPModule)]
        self.forwards = [0] * len(self.models)
        self._counter = CommCounter()
        self._hooks: list = []

    def __enter__(self) -> CommAccounting:
        for i, model in enumerate(self.models):
            self._hooks.append(model.register_forward_pre_hook(lambda *_, i=i: self._count(i)))
        self._counter.__enter__()
        return self

    def _count(self, index: int) -> None:
        self.forwards[index] += 1

    def __exit__(self, *exc: object) -> None:
        self._counter.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()

    def report(self) -> CommReport:
        minimum: dict[str, int] = defaultdict(int)
        for model, count in zip(self.models, self.forwards, strict=True):
            if count == 0:
                continue
            for kind, value in minimum_bytes(model, warm=False).items():
                minimum[kind] += value
            for kind, value in minimum_bytes(model, warm=True).items():
                minimum[kind] += value * (count - 1)
        return CommReport(dict(self._counter.calls), dict(self._counter.bytes), dict(minimum))
