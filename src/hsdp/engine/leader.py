"""One engine over ranks started by ``torchrun`` on several nodes, driven by global rank 0 alone (``hsdp serve``).

``hsdp generate`` under torchrun is SPMD: every rank makes the same calls. A server cannot be: only rank 0 takes
requests. So rank 0 holds :class:`LeaderRanks`, which has :class:`hsdp.launch.WorkerGroup`'s ``run`` interface
(``hsdp.Engine(workers=LeaderRanks())``): ``run(fn, *args)`` broadcasts the call, pickled, to every other rank,
which waits for it in :func:`follow`; then every rank runs it in lockstep and rank 0 gathers the results. The calls
travel on a CPU (gloo) group of their own beside the device's, so the same code runs over NCCL.

Every step waits with a deadline (the call's timeout; 1.5 s for the engine's idle ping), so a rank or node that
died (gloo reports the closed connection at once) or hangs makes ``run`` raise :class:`hsdp.launch.WorkerError`
within that bound. The group is then broken for good: its peers are gone and torchrun owns the processes, so the
recovery is torchrun's (``--max-restarts``): the caller exits and the agents restart every rank. Rank 0's own
events (denoising steps, tokens) reach the caller as they happen; other ranks' events are not forwarded.

A call that raises an ordinary exception (the pipeline refusing a request, alike on every rank) is not such a
failure: every rank came back, so, as :class:`hsdp.launch.WorkerGroup` does on one host, a barrier over the
device group proves the model's collectives are still in step and ``run`` raises
:class:`hsdp.launch.WorkerRaised`: that call fails, the group serves on. Only a communication error, or a barrier
that does not pass, breaks it.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hsdp import distributed
from hsdp.launch import WorkerDiedError, WorkerError, WorkerRaised, WorkerTimeout, error_report, event_sink

logger = logging.getLogger("hsdp")

__all__ = ["LeaderRanks", "follow"]

_STOP = None
"""The command that ends :func:`follow`."""

RESTART_GRACE_S = 30.0
"""How long a rank that lost a peer waits for torchrun to stop it before it exits as failed. The dead rank's agent
restarts it and rendezvouses again; the other agents then restart their ranks as a membership change. A rank that
exits on its own instead makes its agent restart too, and the agents' restarts race into several rendezvous rounds,
each failing ranks (and spending --max-restarts) until they agree."""


def _wait(work: dist.Work, timeout_s: float) -> None:
    work.wait(timeout=datetime.timedelta(seconds=timeout_s))


def _broadcast(group: dist.ProcessGroup, payload: bytes | None, timeout_s: float) -> bytes:
    """Rank 0's ``payload`` on every rank (length, then bytes), each step bounded by ``timeout_s``."""
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    _wait(dist.broadcast(size, src=0, group=group, async_op=True), timeout_s)
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload is not None
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    _wait(dist.broadcast(data, src=0, group=group, async_op=True), timeout_s)
    return data.numpy().tobytes()


def _gather(group: dist.ProcessGroup, payload: bytes, timeout_s: float) -> list[bytes]:
    """Every rank's ``payload`` on rank 0 (an empty list elsewhere), bounded by ``timeout_s`` per step."""
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    _wait(
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=group, async_op=True),
        timeout_s,
    )
    longest = max(int(s.item()) for s in sizes)
    data = torch.zeros(longest, dtype=torch.uint8)
    data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else data[:0]
    leader = dist.get_rank(group) == 0
    slots = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)] if leader else None
    _wait(dist.gather(data, slots, dst=0, group=group, async_op=True), timeout_s)
    if not leader:
        return []
    return [slot[: int(size.item())].numpy().tobytes() for slot, size in zip(slots, sizes, strict=True)]


def _call(fn: Callable[..., Any], args: tuple, on_event: Callable[[Any], None] | None) -> bytes:
    """``fn(*args)`` on this rank, as a pickled ``("ok", result)`` or ``("err", report)`` (the traceback, the
    exception line, and whether it is ordinary: :func:`hsdp.launch.error_report`)."""
    try:
        with event_sink(on_event or (lambda payload: None)):
            return pickle.dumps(("ok", fn(*args)))
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        return pickle.dumps(("err", error_report(exc)))


GROUP_CHECK_S = 10.0
"""How long the barrier after an ordinary exception may take before the group counts as broken."""


def _group_check() -> None:
    """After ranks raised: a barrier over the device group (the model's collectives), bounded in time, proving
    that no rank was left inside a collective the others skipped."""
    _wait(dist.barrier(async_op=True), GROUP_CHECK_S)


def _max_restarts() -> int:
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)


def _control_group(timeout_s: float) -> dist.ProcessGroup:
    """A CPU group for the calls, created by every rank in the same order (a collective)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


class LeaderRanks:
    """Global rank 0's handle on every rank of this torchrun job (the others run :func:`follow`)."""

    def __init__(self, call_timeout_s: float | None = None) -> None:
        distributed.init_distributed()
        call_timeout_s = call_timeout_s or distributed.collective_timeout_s()
        assert distributed.rank() == 0, "LeaderRanks runs on global rank 0; the other ranks run follow()"
        self.world_size = distributed.world_size()
        self.call_timeout_s = call_timeout_s
        self._group = _control_group(call_timeout_s)
        self.broken = False
        self.closed = False
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and _max_restarts() > 0:
            logger.warning(
                "torchrun shares its rendezvous store across restarts, where a restarted group can read a dead "
                "round's addresses and fail to start; launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                "(docs/serving.md, multi-node)"
            )

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float | None = None,
        on_event: Callable[[int, Any], None] | None = None,
    ) -> list[Any]:
        """``fn(*args)`` on every rank in lockstep; the results by rank. An ordinary exception that leaves the
        ranks in step raises :class:`~hsdp.launch.WorkerRaised`; a failed, dead or silent rank raises
        :class:`~hsdp.launch.WorkerError` (and breaks the group)."""
        if self.broken or self.closed:
            raise WorkerError(
                "the torchrun ranks are broken or closed; torchrun restarts them (--max-restarts)"
            )
        timeout_s = timeout_s or self.call_timeout_s
        what = getattr(fn, "__name__", "call")
        try:
            _broadcast(self._group, pickle.dumps((fn, args)), timeout_s)
            mine = _call(fn, args, (lambda payload: on_event(0, payload)) if on_event else None)
            replies = [pickle.loads(r) for r in _gather(self._group, mine, timeout_s)]
        except RuntimeError as exc:  # gloo: a closed connection (a rank died) or the deadline passed
            self.broken = True
            cls = WorkerTimeout if "timed out" in str(exc).lower() else WorkerDiedError
            raise cls(f"{what}: a torchrun rank stopped answering ({str(exc).splitlines()[0]})") from exc
        errors = {rank: report for rank, (status, report) in enumerate(replies) if status == "err"}
        if errors:
            self._raise_for(errors, what)
        return [result for _, result in replies]

    def _raise_for(self, errors: dict[int, dict], what: str) -> None:
        """Ranks raised (every rank came back). Ordinary exceptions and a barrier that passes leave the group
        intact: :class:`~hsdp.launch.WorkerRaised`. Otherwise the ranks may disagree on where they are in the
        model's collectives: the group is broken."""
        first = min(errors)
        report = errors[first]
        message = f"{what} failed on rank {first}:\n{report['traceback']}"
        if all(e["ordinary"] for e in errors.values()) and self._still_connected():
            raise WorkerRaised(message, first, report["error"])
        self.broken = True
        raise WorkerError(message, rank=first)

    def _still_connected(self) -> bool:
        try:
            self.run(_group_check, timeout_s=2 * GROUP_CHECK_S)
        except WorkerError:  # a failed check breaks the group itself
            return False
        return True

    def close(self) -> None:
        """Let the other ranks return from :func:`follow` (idempotent; nothing to tell a broken group)."""
        if self.closed:
            return
        self.closed = True
        if not self.broken:
            try:
                _broadcast(self._group, pickle.dumps(_STOP), 10.0)
            except RuntimeError:
                logger.warning("the other torchrun ranks did not take the stop; they end with the job")


def follow(idle_timeout_s: float | None = None) -> int:
    """Run rank 0's calls on this rank until it stops them (0) or is gone or silent for ``idle_timeout_s``
    (1, so torchrun counts a failure and restarts the group). Rank 0 pings every rank while idle."""
    distributed.init_distributed()
    idle_timeout_s = idle_timeout_s or distributed.collective_timeout_s()
    group = _control_group(idle_timeout_s)
    while True:
        try:
            command = pickle.loads(_broadcast(group, None, idle_timeout_s))
            if command is _STOP:
                logger.info("rank 0 stopped serving; this rank ends")
                return 0
            fn, args = command
            _gather(group, _call(fn, args, None), idle_timeout_s)
        except RuntimeError as exc:
            logger.error(
                "rank 0 is gone or silent (%s); waiting up to %.0fs for torchrun to restart this rank",
                str(exc).splitlines()[0],
                RESTART_GRACE_S,
            )
            time.sleep(RESTART_GRACE_S)
            return 1
