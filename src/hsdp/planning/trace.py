"""A training step traced on fake tensors, phase by phase as FSDP2 would run it (for :func:`hsdp.planning.estimate`).

The model runs one forward and backward in torch's ``FakeTensorMode`` (shapes and dtypes, no memory, no
arithmetic) under torch's ``MemTracker``, unsharded. Hooks on the shard plan's blocks follow FSDP2's own
(``FSDPParamGroup``): a block is gathered from its pre-forward to its post-forward and again from its
pre-backward (the first gradient of one of its outputs, before any recomputation of it) to its post-backward (the
gradients of all its inputs; a block whose inputs need none is reduced only after the backward), its pre-backward
prefetches the block before it in post-forward order, and its post-backward reduce-scatters its gradients. Every
time what FSDP2 would hold changes, a new phase starts; each phase keeps the peak of what the step itself holds
then (saved activations, the backward's temporaries, the root unit's gradients: FSDP2 reduces them last). The
blocks' gradients are dropped as they are made: the estimate counts them per layout, unsharded while their block
computes its backward and sharded once it is reduced. So a recomputed block (activation checkpointing) is seen
where it runs, beside the sharded gradients of the blocks after it, and a UNet's layers outside the blocks
(samplers, time embedding, ``conv_in``/``conv_out``) where theirs run.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from hsdp.planning.estimate import StepTrace
from hsdp.planning.profile import parameter_units

__all__ = ["memory_tracker", "trace_training_step"]


def memory_tracker(on_update: Callable | None = None):
    """torch's ``MemTracker`` without gradient hooks (LoRA's frozen base refuses them): gradients count as the
    tensors they are, from their allocation. ``on_update(tracker)`` runs after every operation it tracks."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

        def _update_peak_stats(self, peak_state):
            # torch's keeps each module's own peak too, walking every tracked module after every operation (most
            # of a planner trace's time); hsdp reads only the global peak (get_tracker_snapshot("peak")) and the
            # current snapshot, kept here as torch keeps them.
            peak, peak_snap = getattr(self, "_peak_mem", None), getattr(self, "_peak_mem_snap", None)
            if peak is None or peak_snap is None:  # another torch's internals: its own update
                super()._update_peak_stats(peak_state)
            else:
                for dev, dev_snap in self._curr_mem_snap.items():
                    if peak.get(dev, 0) < dev_snap["Total"]:
                        peak[dev] = dev_snap["Total"]
                        peak_snap[dev] = deepcopy(dev_snap)
            if on_update is not None:
                on_update(self)

    return Tracker()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _PostBackward(torch.autograd.Function):
    """FSDP2's ``RegisterPostBackwardFunction``: its backward runs once the gradients of all a block's inputs
    are made."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class _Blocks:
    """Which blocks FSDP2 would hold gathered, which all-gather buffer is live, which blocks are reduced."""

    def __init__(self, model: nn.Module, owner: dict[str, str]):
        names = set(owner.values()) - {""}
        self._trained: dict[str, list[nn.Parameter]] = {name: [] for name in names}
        for pname, param in model.named_parameters():
            if param.requires_grad and owner[pname]:
                self._trained[owner[pname]].append(param)
                param.register_post_accumulate_grad_hook(partial(self._made_grad, owner[pname]))
        self.gathered: list[str] = []
        """Blocks gathered now, in the order they were gathered (an enclosing block before the ones inside)."""
        self.buffer: str | None = ""
        """The block whose all-gather output is live ("": the root's, None: none): in the forward the last one
        gathered (kept until the next copy-out, freed at the root's post-forward), in the backward the one
        prefetched (freed at its own pre-backward's copy-out)."""
        self.reduced: list[str] = []
        self._order: list[str] = []  # post-forward order, FSDP2's backward prefetch order
        self._recomputed: set[str] = set()
        self._backward: set[str] = set()  # pre-backward ran
        self.handles = []
        for name, module in model.named_modules():
            if name in names:
                pre = module.register_forward_pre_hook(partial(self._pre_forward, name), with_kwargs=True)
                self.handles += [pre, module.register_forward_hook(partial(self._post_forward, name))]
        self.handles.append(model.register_forward_hook(self._root_post_forward))

    def _pre_forward(self, name, module, args, kwargs):
        if _in_backward():  # recomputation: FSDP2 gathered the block at its pre-backward
            if name not in self.gathered:
                self.gathered.append(name)
                self._recomputed.add(name)
            return None
        self.gathered.append(name)
        self.buffer = name
        leaves, spec = tree_flatten((args, kwargs))
        needs = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not torch.is_grad_enabled() or not needs:
            return None
        outs = _PostBackward.apply(partial(self._post_backward, name), *(leaves[i] for i in needs))
        for i, t in zip(needs, outs, strict=True):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _post_forward(self, name, module, args, output):
        if _in_backward():
            if name in self._recomputed:
                self._recomputed.discard(name)
                self.gathered.remove(name)
            return None
        self.gathered.remove(name)
        self._order.append(name)
        index = len(self._order) - 1
        leaves, _ = tree_flatten(output)
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, n=name, i=index: self._pre_backward(n, i))
        return None

    def _root_post_forward(self, module, args, output):
        if not _in_backward():
            self.buffer = None
            leaves, _ = tree_flatten(output)
            for t in leaves:
                if isinstance(t, torch.Tensor) and t.requires_grad:  # the root's pre-backward
                    t.register_hook(lambda grad: self._pre_backward("", len(self._order)))
        return None

    def _pre_backward(self, name: str, index: int) -> None:
        """Once per block (and the root, ``""``): it is gathered and prefetches the one before it in post-forward
        order (``index``: its place there)."""
        if name in self._backward:
            return
        self._backward.add(name)
        if name:
            self.gathered.append(name)
        target = self._order[index - 1] if index > 0 else None
        self.buffer = target if target not in self._backward else None

    def _made_grad(self, name: str, param: nn.Parameter) -> None:
        if name in self.reduced:  # made after its block's post-backward: FSDP2 reduces it at once
            param.grad = None

    def _post_backward(self, name: str) -> None:
        """The block's gradients leave for the reduce-scatter: the estimate counts them from here per layout."""
        if name in self.gathered:
            self.gathered.remove(name)
            self.reduced.append(name)
            for param in self._trained[name]:
                param.grad = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def trace_training_step(
    model: nn.Module,
    inputs: Callable[[], dict[str, torch.Tensor]],
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
    compute: torch.dtype | None = None,
) -> StepTrace:
    """One training forward and backward of ``model`` on fake tensors, phase by phase (module docstring).

    ``model``: on the meta device, in its stored dtypes (``compute``: the dtype the step computes in, FSDP2's
    ``param_dtype``). ``inputs()`` makes what the trainer holds before the step (called in the fake mode, not
    tracked); ``loss(model, inputs)`` is the step's forward and loss, whose backward runs too.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import _MemRefType

    from hsdp.distributed import local_device

    device = local_device()
    owner = parameter_units(model)
    if compute is not None:
        model.to(compute)
    phases: list[list] = []
    with FakeTensorMode(allow_non_fake_inputs=True):  # buffers a model computes at init are real
        model.to_empty(device=device)
        held = inputs()
        blocks = _Blocks(model, owner)

        def record(tracker) -> None:
            now = tracker._curr_mem_snap.get(device)
            if now is None:
                return
            # Every parameter and buffer is tracked by the first forward: the rest is the step's own.
            step = now["Total"] - now[_MemRefType.PARAM] - now[_MemRefType.BUFFER]
            key = (tuple(blocks.gathered), blocks.buffer, _in_backward(), len(blocks.reduced))
            if phases and tuple(phases[-1][1:]) == key:
                phases[-1][0] = max(phases[-1][0], step)
            else:
                phases.append([step, *key])

        try:
            with memory_tracker(record):
                loss(model, held).backward()
        finally:
            blocks.remove()
    return StepTrace(tuple(tuple(phase) for phase in phases), tuple(blocks.reduced))
