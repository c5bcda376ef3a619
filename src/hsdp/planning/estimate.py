"""Per-rank memory, bytes moved and a roofline step time of one layout, from a :class:`ModelProfile`.

Weights, gradients, optimizer state and collective bytes are exact (padded shard shapes). Gather buffers follow
FSDP2's buffer lifetimes (measured against ``MemTracker`` in ``benchmarks/plan_accuracy.py``). Activations
use a transformer-shaped formula per token, and time a roofline over ``Hardware``'s figures: estimates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from hsdp.config import DTYPES, ParallelConfig, ShardingStrategy
from hsdp.planning.profile import ModelProfile, main_component

__all__ = ["StepTrace", "Workload", "Hardware", "Layout", "Estimate", "estimate"]


@dataclass(frozen=True)
class StepTrace:
    """One training step's activations over time, traced on fake tensors (:mod:`hsdp.planning.trace`), in the
    phases of what FSDP2 holds: the estimate adds to each phase the gathered blocks, live buffers and gradients
    of a layout and takes the phase that holds the most. Free of any layout: one trace serves every shard size."""

    phases: tuple[tuple[int, tuple[str, ...], str | None, bool, int], ...]
    """Per phase, in step order: (peak bytes of the activations and temporaries live in it, the blocks gathered
    (in the order they were gathered), the block whose all-gather buffer is live (``""``: the root's; None: none),
    whether it is in the backward, how many of ``reduced`` have reduce-scattered their gradients before it)."""
    reduced: tuple[str, ...]
    """Blocks in the order their backward ended (FSDP2's post-backward: their gradients reduce-scattered)."""

    @property
    def peak(self) -> int:
        return max((phase[0] for phase in self.phases), default=0)


@dataclass(frozen=True)
class Workload:
    training: bool = False
    batch: int = 1
    """Samples per rank group (per rank in training)."""
    seq_len: int = 1024
    """Tokens per sample (for a DiT: latent patches per frame stack)."""
    guidance: bool = True
    """Diffusion inference runs two guidance branches (classifier-free guidance) per step."""
    activation_bytes: int | None = None
    """Activations of the ``batch`` samples of one rank, traced (:mod:`hsdp.planning.diffusion`) instead of the
    transformer-shaped per-token formula."""
    activation_trace: StepTrace | None = None
    """Training: those activations phase by phase; the peak is then the phase holding the most beside them."""


@dataclass(frozen=True)
class Hardware:
    device_memory: int
    device_tflops: float = 300.0
    """Sustained dense TFLOP/s of one device at the compute dtype."""
    link_gbps: float = 100.0
    """Collective bandwidth per rank in GB/s (NVLink-class inside a node, far less across nodes)."""
    host_gbps: float = 25.0
    """Host <-> device copy bandwidth in GB/s (CPU offload)."""


@dataclass(frozen=True)
class Layout:
    config: ParallelConfig
    prefetch: int = 0
    """Blocks all-gathered ahead of the one computing (FSDP2 explicit forward prefetch)."""
    resident: int = 0
    """Blocks kept gathered between steps (inference with ``reshard_after_forward=False``)."""
    weight_dtype: str | None = None
    """``int8`` / ``fp8``: ``nn.Linear`` weights of the sharded units stored and all-gathered in 8 bits
    (:mod:`hsdp.quantize`; inference)."""

    @property
    def label(self) -> str:
        c = self.config
        parts = []
        if c.use_hsdp:
            parts.append(f"hsdp {c.hsdp_replicate_size}x{c.hsdp_shard_size}")
            if c.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP:
                parts.append("grad-op")
        else:
            parts.append("replicated")
        for flag, value in (
            ("cfg", c.cfg_parallel_size),
            ("usp", c.ulysses_degree),
            ("tp", c.tensor_parallel_size),
        ):
            if value > 1:
                parts.append(f"{flag}{value}")
        if c.cpu_offload:
            parts.append("offload")
        if c.offload_layers is not None:
            parts.append(f"offload-layers {c.offload_layers}")
        if c.frozen_whole:
            parts.append("frozen-whole")
        if self.weight_dtype:
            parts.append(self.weight_dtype)
        if self.resident:
            parts.append(f"resident {self.resident}")
        if self.prefetch:
            parts.append(f"prefetch {self.prefetch}")
        return " ".join(parts)


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    weights: int
    gather: int
    grads: int
    optimizer: int
    activations: int
    host: int
    allgather_bytes: int
    reduce_scatter_bytes: int
    allreduce_bytes: int
    step_s: float
    samples_per_s: float
    device_memory: int
    copy_out: int = 0
    """Inference: gathered weights and buffers while a unit's all-gather is copied out, when no block's
    activations are live (``gather`` is while a block computes, beside ``activations``)."""
    early_grads: int = 0
    """Training with a traced step: the part of ``grads`` already reduce-scattered (the blocks whose backward
    ended) in the phase where the step peaks, held beside that phase's ``gather`` and ``activations``."""
    host_copy_bytes: int = 0
    """``--offload-layers``: bytes copied between host and device per step and rank (the offloaded blocks' shards
    in, per forward and again per backward when they are resharded in between; their gradient shards out)."""

    @property
    def total(self) -> int:
        """Peak bytes per device: the phase that holds the most. Gradients fill in as backward frees the
        activations and gathered weights (a traced step says how far: ``early_grads``); in inference a copy-out
        holds two all-gather buffers and a block's weights as they are allocated, a block's compute its weights,
        fewer buffers and its activations."""
        peak = self.gather + self.activations + self.early_grads
        return self.weights + self.optimizer + max(self.grads, peak, self.copy_out)

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory

    def to_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "layout"}
        c = self.layout.config
        out.update(
            layout=self.layout.label,
            total=self.total,
            fits=self.fits,
            prefetch=self.layout.prefetch,
            resident_blocks=self.layout.resident,
            weight_dtype=self.layout.weight_dtype,
            config={f.name: getattr(c, f.name) for f in dataclasses.fields(c) if not f.name.startswith("_")},
        )
        out["config"]["sharding_strategy"] = c.sharding_strategy.value if c.sharding_strategy else None
        return out


def _shard_size(config: ParallelConfig) -> int:
    return config.hsdp_shard_size if config.use_hsdp else 1


def _forward_window(p: ModelProfile, shard: int, elem: int | None, layout: Layout) -> tuple[int, int]:
    """(gathered bytes while a block computes, gathered bytes while a unit's all-gather is copied out), each at
    the block where it peaks, besides the root's weights and the resident blocks' (the caller counts those).

    FSDP2 (``FSDPParamGroup.wait_for_unshard``) keeps a unit's all-gather output buffer until the next unit's
    copy-out has finished, and explicit prefetch issues the next ``prefetch`` all-gathers as a block starts:

    * computing block ``i`` (beside its activations): its unsharded weights unless it is resident, its buffer
      and the buffers of the ``prefetch`` blocks after it;
    * copying block ``i`` out (no block's activations live): the previous unit's buffer (the root's for the
      first block), its own, and its gathered weights as they are allocated (a resident block's are counted by
      the caller), with 8-bit weights' dequantization (:meth:`UnitProfile.copy_out_bytes`).
    """
    order = [p.root, *p.blocks]
    wd = layout.weight_dtype
    buffers = [u.gathered_bytes(shard, elem, wd) for u in order]
    # The root's own copy-out, before any block: its buffer and what its dequantization holds beyond its weights.
    copy_out = buffers[0] + p.root.copy_out_bytes(shard, elem, wd) - p.root.unsharded_bytes(elem)
    compute = 0
    for i in range(1, len(order)):
        full = order[i].unsharded_bytes(elem)
        held = full if i - 1 < layout.resident else 0
        compute = max(compute, full - held + sum(buffers[i : i + 1 + layout.prefetch]))
        copy_out = max(
            copy_out, buffers[i - 1] + buffers[i] + order[i].copy_out_bytes(shard, elem, wd) - held
        )
    return compute, copy_out


def _weights_and_comm(p: ModelProfile, layout: Layout, work: Workload, main: bool = True) -> dict[str, int]:
    """Exact per-rank bytes of one component: sharded storage, gather buffers, grads, optimizer, comm.
    ``main``: the component ``--offload-layers`` offloads the blocks of (the denoiser, the LM)."""
    c = layout.config
    s, r = _shard_size(c), (c.hsdp_replicate_size if c.use_hsdp else 1)
    ce = DTYPES[c.param_dtype].itemsize if c.param_dtype else None
    re_ = DTYPES[c.reduce_dtype].itemsize if c.reduce_dtype else ce
    training = work.training
    whole_frozen = c.frozen_whole or c.sharding_strategy is ShardingStrategy.NO_SHARD
    if training and not c.cpu_offload and c.offload_layers is None and whole_frozen:
        p = p.with_frozen_whole(ce)  # as hsdp.sharding lays it out: never gathered
    wd = None if training else layout.weight_dtype
    shards = sum(u.shard_bytes(s, weight_dtype=wd) for u in p.units)
    # --offload-layers K: the blocks after the first K keep their shards (and trained state) in host memory.
    offloaded = p.blocks[c.offload_layers :] if main and c.offload_layers is not None else ()
    host_shards = sum(u.shard_bytes(s, weight_dtype=wd) for u in offloaded)
    out = dict(
        weights=p.replicated_bytes, host=0, gather=0, copy_out=0, grads=0, optimizer=0, ag=0, rs=0, ar=0, h2d=0
    )
    out["host" if c.cpu_offload else "weights"] += shards - host_shards
    out["host"] += host_shards
    # A whole model in its stored dtype computes in place; otherwise units are gathered (or copied in) per use.
    gathers = s > 1 or ce is not None or c.cpu_offload or wd is not None or bool(offloaded)
    # FSDP2 copies an offloaded unit's shards to the device before its all-gather: one such copy per unit in
    # flight (the computing one and those prefetched).
    staged = max((u.shard_bytes(s, weight_dtype=wd) for u in offloaded), default=0) * (1 + layout.prefetch)
    frac = (s - 1) / s
    if not training:
        if c.reshard_after_forward is False:  # every unit keeps its weights gathered between steps
            layout = dataclasses.replace(layout, resident=len(p.blocks))
        resident, moving = p.blocks[: layout.resident], [*p.blocks[layout.resident :], p.root]
        if gathers:
            held = sum(u.unsharded_bytes(ce) for u in resident) + p.root.unsharded_bytes(ce)
            compute, copy_out = _forward_window(p, s, ce, layout)
            out["gather"], out["copy_out"] = held + compute + staged, held + copy_out + staged
            moving = moving if c.reshard_after_forward is not False else []
            out["ag"] = int(frac * sum(u.gathered_bytes(s, ce, wd) for u in moving))
            out["h2d"] = host_shards if moving else 0
        return out

    # Training: sharded grads (param dtype) and two AdamW states per sharded trained value (LoRA: the adapters).
    trained = [u.trained() for u in p.units]
    state = sum(u.shard_bytes(s) for u in trained) + p.replicated_trained_bytes
    host_state = sum(u.trained().shard_bytes(s) for u in offloaded)
    out["host" if c.cpu_offload else "grads"] += state - host_state
    out["host" if c.cpu_offload else "optimizer"] += 2 * (state - host_state)
    out["host"] += 3 * host_state
    if gathers:
        # Backward of the largest unit, with every activation still saved: its gathered weights, the next unit's
        # (FSDP2 prefetches it in backward) unless every unit stayed gathered from forward, and its unsharded
        # gradients (the reduce-scatter buffer replaces them as that layer's activations are freed).
        biggest = max(p.blocks or p.units, key=lambda u: u.unsharded_bytes(ce))
        root = p.root.unsharded_bytes(ce)
        if work.activation_bytes is None:  # a traced step holds the root's gradients as backward makes them
            root += p.root.trained().gathered_bytes(s, re_)
        grads = biggest.trained().gathered_bytes(s, re_)
        if c.reshard_after_forward is False:  # SHARD_GRAD_OP
            out["gather"] = sum(u.unsharded_bytes(ce) for u in p.blocks) + root + grads
        else:
            out["gather"] = root + biggest.unsharded_bytes(ce) + biggest.gathered_bytes(s, ce) + grads
        passes = 1 if c.reshard_after_forward is False else 2
        out["ag"] = int(passes * frac * sum(u.gathered_bytes(s, ce) for u in p.units))
        out["gather"] += staged
        out["h2d"] = passes * host_shards + host_state  # shards in (each pass), gradient shards out
        out["rs"] = int(frac * sum(u.gathered_bytes(s, re_) for u in trained))
    if work.activation_trace is not None:
        out["phases"] = _traced_phases(p, work.activation_trace, c, gathers, ce, re_)
    if r > 1:  # HSDP: the reduce-scattered shards are all-reduced across the replica groups
        out["ar"] = int(2 * (r - 1) / r * sum(u.shard_bytes(s, re_) for u in trained))
    return out


def _traced_phases(
    p: ModelProfile, trace: StepTrace, c: ParallelConfig, gathers: bool, ce: int | None, re_: int | None
) -> list[tuple[int, int]]:
    """Per phase of a traced step: (gathered bytes, reduce-scattered gradient bytes) FSDP2 holds in it beside the
    phase's activations. ``gathers``: whether units are gathered at all; ``ce``, ``re_``: the compute and reduce
    dtypes' bytes per value (None: as stored).

    The root stays gathered from its forward to the end of the backward (a block too, from its forward to its
    post-backward, with ``reshard_after_forward=False``); the phase's gathered blocks and live all-gather buffer as traced (the
    gathered blocks' unsharded gradients are in the trace); in the backward the reduce-scatter input of the block
    reduced last (FSDP2 frees it at the next block's reduce-scatter). The sharded gradients of the blocks reduced
    so far are on the device, or on the host with CPU offload.
    """
    units = {u.name: u for u in p.blocks}
    s = _shard_size(c)
    kept = c.reshard_after_forward is False
    host = {u.name for u in p.blocks[c.offload_layers :]} if c.offload_layers is not None else set()
    sharded = [0]  # cumulative, in the order the blocks are reduced
    for name in trace.reduced:
        unit = None if c.cpu_offload or name in host else units.get(name)
        sharded.append(sharded[-1] + (unit.trained().shard_bytes(s) if unit else 0))
    out = []
    resident: dict[str, int] = {}  # kept: the blocks gathered so far and not yet resharded by their post-backward
    for _, gathered, buffer, backward, count in trace.phases:
        held = p.root.unsharded_bytes(ce) if gathers else 0
        if gathers:
            blocks = [units[name] for name in gathered if name in units]
            if kept:
                resident.update((u.name, u.unsharded_bytes(ce)) for u in blocks)
                for name in trace.reduced[:count]:
                    resident.pop(name, None)
                held += sum(resident.values())
            else:
                held += sum(u.unsharded_bytes(ce) for u in blocks)
            buffered = p.root if buffer == "" else units.get(buffer)
            if buffered is not None and not (kept and backward):
                held += buffered.gathered_bytes(s, ce)
            if backward and count and trace.reduced[count - 1] in units:
                held += units[trace.reduced[count - 1]].trained().gathered_bytes(s, re_)
        out.append((held, sharded[count]))
    return out


def _activation_elem(p: ModelProfile, config: ParallelConfig) -> int:
    """Bytes per activation value: the compute dtype's, else the dtype most weights are stored in."""
    if config.param_dtype:
        return DTYPES[config.param_dtype].itemsize
    params = [prm for u in p.units for prm in u.params]
    return max(params, key=lambda prm: prm[0] * prm[1])[2] if params else 4


def _activations(p: ModelProfile, layout: Layout, work: Workload) -> tuple[int, float]:
    """(activation bytes per rank, tokens this rank computes per step). Estimated, transformer-shaped."""
    c = layout.config
    elem = _activation_elem(p, c)
    branches = 2 if p.kind == "diffusion" and work.guidance and not work.training else 1
    tokens = work.batch * work.seq_len * branches / c.compute_parallel_size
    if work.activation_bytes is not None:
        return int(work.activation_bytes * branches / c.compute_parallel_size), tokens
    per_token = (4 * p.hidden + 2 * p.ffn) * elem
    if work.training:
        per_token = p.layers * (12 * p.hidden + 4 * p.ffn) * elem
    if p.kind == "causal_lm":
        per_token += p.vocab * (elem + 8 if work.training else elem)
    return int(tokens * per_token), tokens


def estimate(profiles: Sequence[ModelProfile], layout: Layout, work: Workload, hw: Hardware) -> Estimate:
    """Per-rank memory, bytes moved and a roofline step time for one layout.

    Components of a pipeline all hold their shards; they run one at a time, so gather buffers are the largest
    one's. Activations, collectives and time are those of the main component (the diffusion transformer, else
    the largest), which runs every step.
    """
    main = main_component(profiles)
    parts = {
        p.name: _weights_and_comm(p, layout if p is main else Layout(layout.config), work, main=p is main)
        for p in profiles
    }
    m = parts[main.name]
    c = layout.config
    acts, tokens = _activations(main, layout, work)
    gather, early_grads = max(x["gather"] for x in parts.values()), 0
    if work.activation_trace is not None:  # the phase that holds the most
        scale = acts / work.activation_bytes if work.activation_bytes else 0
        held = [
            (int(phase[0] * scale) + g + e, int(phase[0] * scale), g, e)
            for phase, (g, e) in zip(work.activation_trace.phases, m["phases"], strict=True)
        ]
        _, acts, gather, early_grads = max(held, default=(0, 0, 0, 0))
    flops = (
        (6 if work.training else 2)
        * tokens
        * (main.num_params + 2 * work.seq_len * main.hidden * main.layers)
    )
    compute = flops / (hw.device_tflops * 1e12)
    # --offload-layers' copies run ahead of use like the all-gathers they feed (FSDP2's prefetch).
    fsdp_comm = (m["ag"] + m["rs"] + m["ar"]) / (hw.link_gbps * 1e9) + m["h2d"] / (hw.host_gbps * 1e9)
    u = c.sequence_parallel_size
    # Ulysses: four all-to-alls of the activations per layer, on the critical path.
    a2a = (
        4
        * main.layers
        * tokens
        * main.hidden
        * _activation_elem(main, c)
        * (u - 1)
        / u
        / (hw.link_gbps * 1e9)
    )
    # CPU offload copies the shards in every step (and the gradients back in training).
    offload = sum(x["host"] for x in parts.values()) / (hw.host_gbps * 1e9) * (2 if work.training else 1)
    offload = offload if c.cpu_offload else 0.0  # --offload-layers' copies are in fsdp_comm
    overlap = layout.prefetch > 0 or work.training  # FSDP2 overlaps backward's all-gathers by default
    step = (max(compute, fsdp_comm) if overlap else compute + fsdp_comm) + a2a + offload
    groups = c.data_parallel_size if (c.request_parallel or work.training) else 1
    return Estimate(
        layout=layout,
        weights=sum(x["weights"] for x in parts.values()),
        gather=gather,
        early_grads=early_grads,
        copy_out=max(x["copy_out"] for x in parts.values()),
        grads=m["grads"],
        optimizer=m["optimizer"],
        activations=acts,
        host=sum(x["host"] for x in parts.values()),
        allgather_bytes=m["ag"],
        reduce_scatter_bytes=m["rs"],
        allreduce_bytes=m["ar"],
        host_copy_bytes=m["h2d"],
        step_s=step,
        samples_per_s=work.batch * max(1, groups) / step if step else 0.0,
        device_memory=hw.device_memory,
    )
