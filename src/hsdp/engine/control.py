"""Cancelling a request while the ranks generate it, without leaving any rank waiting in a collective.

The caller marks a request cancelled in the rendezvous store its ranks already share with it
(:class:`CancelBoard`, keys under a prefix of :attr:`hsdp.launch.WorkerGroup.store`: one store per engine). Every rank checks before each forward of a sharded model
(:class:`CancelWatch`, a forward pre-hook placed ahead of FSDP's own, so nothing is gathered yet), and the ranks
agree with one all-reduce (MIN over "my request is cancelled") so they all stop at the same forward. In
same-request layouts every rank runs the one request, so agreement delays the stop by at most one forward. In
request-parallel lockstep, or in a batch of several requests, a round stops when all its requests are cancelled;
a cancelled request that shares its round with a live one runs on and its output is dropped by the caller.
"""

from __future__ import annotations

import uuid

import torch
import torch.distributed as dist
from torch import nn

from hsdp.distributed import local_device

__all__ = ["RequestCancelled", "CancelBoard", "CancelWatch"]



class RequestCancelled(Exception):
    """Raised on every rank at the same forward once the request(s) it runs are cancelled."""


def _key(call_id: int, request_id: int) -> str:
    return f"cancel/{call_id}/{request_id}"


class CancelBoard:
    """Caller side: where cancellations are written."""

    def __init__(self, store: dist.Store) -> None:
        # A group outlives its engines (``workers=``): each board writes under its own prefix, so that no engine
        # reads an earlier one's cancellations of the same call and request numbers.
        self.prefix = f"hsdp-cancel/{uuid.uuid4().hex}"
        self._store = dist.PrefixStore(self.prefix, store)

    def cancel(self, call_id: int, request_id: int) -> None:
        self._store.set(_key(call_id, request_id), "1")


class CancelWatch:
    """Rank side: checks the board before every forward of the watched modules while a request is active."""

    def __init__(self, store: dist.Store, prefix: str, modules: list[nn.Module]):
        self._store = dist.PrefixStore(prefix, store)
        self._device = local_device()
        self.active: list[tuple[int, int]] = []
        """(call id, request id) of the requests this rank is generating (one batch), empty between them."""
        for module in modules:
            module.register_forward_pre_hook(self._check, prepend=True)

    def _check(self, module: nn.Module, args: tuple) -> None:
        if not self.active:
            return
        mine = 1 if all(self._store.check([_key(*active)]) for active in self.active) else 0
        flag = torch.tensor([mine], dtype=torch.int32, device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            raise RequestCancelled(f"request(s) {', '.join(str(a[1]) for a in self.active)} cancelled")
