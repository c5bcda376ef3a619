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

__all__ = ["Workload", "Hardware", "Layout", "Estimate", "estimate"]


@dataclass(frozen=True)
class Workload:
    training: bool = False
    batch: int = 1
    """Samples per rank group (per rank in training)."""
    seq_len: int = 1024
    """Tokens per sample (for a DiT: latent patches per frame stack)."""
    guidance: bool = True
    """Diffusion inference runs two guidance branches (classifier-free guidance) per step."""


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

    @property
    def total(self) -> int:
        """Peak bytes per device. Gradients fill in as backward frees the activations and gathered weights,
        so a training step peaks in whichever phase holds more."""
        return self.weights + self.optimizer + max(self.grads, self.gather + self.activations)

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
            config={f.name: getattr(c, f.name) for f in dataclasses.fields(c) if not f.name.startswith("_")},
        )
        out["config"]["sharding_strategy"] = c.sharding_strategy.value if c.sharding_strategy else None
        return out


def _shard_size(config: ParallelConfig) -> int:
    return config.hsdp_shard_size if config.use_hsdp else 1


def _forward_window(p: ModelProfile, shard: int, elem: int | None, prefetch: int) -> int:
    """Peak gathered bytes around one block in forward, besides the root's weights.

    FSDP2 frees an all-gather's output buffer only after the *next* unit's copy-out (so the copy-out can overlap
    the next all-gather), and explicit prefetch issues the next all-gathers before that. Around block ``i``:
    its unsharded weights, the previous unit's buffer (the root's for the first block), its own buffer and the
    buffers of the ``prefetch - 1`` further blocks already in flight.
    """
    order = [p.root, *p.blocks]
    buffers = [u.gathered_bytes(shard, elem) for u in order]
    return max(
        (
            order[i].unsharded_bytes(elem) + buffers[i - 1] + sum(buffers[i : i + max(1, prefetch)])
            for i in range(1, len(order))
        ),
        default=0,
    )


def _weights_and_comm(p: ModelProfile, layout: Layout, training: bool) -> dict[str, int]:
    """Exact per-rank bytes of one component: sharded storage, gather buffers, grads, optimizer, comm."""
    c = layout.config
    s, r = _shard_size(c), (c.hsdp_replicate_size if c.use_hsdp else 1)
    ce = DTYPES[c.param_dtype].itemsize if c.param_dtype else None
    re_ = DTYPES[c.reduce_dtype].itemsize if c.reduce_dtype else ce
    shards = sum(u.shard_bytes(s) for u in p.units)
    out = dict(weights=p.replicated_bytes, host=0, gather=0, grads=0, optimizer=0, ag=0, rs=0, ar=0)
    out["host" if c.cpu_offload else "weights"] += shards
    # A whole model in its stored dtype computes in place; otherwise units are gathered (or copied in) per use.
    gathers = s > 1 or ce is not None or c.cpu_offload
    frac = (s - 1) / s
    if not training:
        if c.reshard_after_forward is False:  # every unit keeps its weights gathered between steps
            resident, moving = p.blocks, []
        else:
            resident, moving = p.blocks[: layout.resident], [*p.blocks[layout.resident :], p.root]
        if gathers:
            out["gather"] = (
                sum(u.unsharded_bytes(ce) for u in resident)
                + p.root.unsharded_bytes(ce)
                + _forward_window(p, s, ce, layout.prefetch)
            )
            out["ag"] = int(frac * sum(u.gathered_bytes(s, ce) for u in moving))
        return out
    # Training: sharded grads (param dtype) and two AdamW states per sharded value.
    out["host" if c.cpu_offload else "grads"] += shards + p.replicated_bytes
    out["host" if c.cpu_offload else "optimizer"] += 2 * (shards + p.replicated_bytes)
    if gathers:
        # Backward of the largest unit, with every activation still saved: its gathered weights, the next unit's
        # (FSDP2 prefetches it in backward) unless every unit stayed gathered from forward, and its unsharded
        # gradients (the reduce-scatter buffer replaces them as that layer's activations are freed).
        biggest = max(p.blocks or p.units, key=lambda u: u.unsharded_bytes(ce))
        root = p.root.unsharded_bytes(ce) + p.root.gathered_bytes(s, re_)
        grads = biggest.gathered_bytes(s, re_)
        if c.reshard_after_forward is False:  # SHARD_GRAD_OP
            out["gather"] = sum(u.unsharded_bytes(ce) for u in p.blocks) + root + grads
        else:
            out["gather"] = root + biggest.unsharded_bytes(ce) + biggest.gathered_bytes(s, ce) + grads
        passes = 1 if c.reshard_after_forward is False else 2
        out["ag"] = int(passes * frac * sum(u.gathered_bytes(s, ce) for u in p.units))
        out["rs"] = int(frac * sum(u.gathered_bytes(s, re_) for u in p.units))
    if r > 1:  # HSDP: the reduce-scattered shards are all-reduced across the replica groups
        out["ar"] = int(2 * (r - 1) / r * sum(u.shard_bytes(s, re_) for u in p.units))
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
        p.name: _weights_and_comm(p, layout if p is main else Layout(layout.config), work.training)
        for p in profiles
    }
    m = parts[main.name]
    c = layout.config
    acts, tokens = _activations(main, layout, work)
    flops = (
        (6 if work.training else 2)
        * tokens
        * (main.num_params + 2 * work.seq_len * main.hidden * main.layers)
    )
    compute = flops / (hw.device_tflops * 1e12)
    fsdp_comm = (m["ag"] + m["rs"] + m["ar"]) / (hw.link_gbps * 1e9)
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
    overlap = layout.prefetch > 0 or work.training  # FSDP2 overlaps backward's all-gathers by default
    step = (max(compute, fsdp_comm) if overlap else compute + fsdp_comm) + a2a + offload
    groups = c.data_parallel_size if (c.request_parallel or work.training) else 1
    return Estimate(
        layout=layout,
        weights=sum(x["weights"] for x in parts.values()),
        gather=max(x["gather"] for x in parts.values()),
        grads=m["grads"],
        optimizer=m["optimizer"],
        activations=acts,
        host=sum(x["host"] for x in parts.values()),
        allgather_bytes=m["ag"],
        reduce_scatter_bytes=m["rs"],
        allreduce_bytes=m["ar"],
        step_s=step,
        samples_per_s=work.batch * max(1, groups) / step if step else 0.0,
        device_memory=hw.device_memory,
    )
