"""Rank-side glue for the layouts: overlap of FSDP all-gathers, Ulysses through diffusers, CFG parallel.

* **Forward prefetch**: each FSDP unit starts the next unit's all-gather before its own compute, so the weights
  of block ``i + 1`` travel while block ``i`` runs (applied by :func:`hsdp.sharding.apply_hsdp_to_model`).
  Keeping weights gathered across denoising steps is ``ParallelConfig(reshard_after_forward=False)``: every
  unit, root included, stays unsharded after its first forward, so later steps do no all-gather.
* **Ulysses**: diffusers' ``enable_parallelism(ContextParallelConfig(..., mesh=...))`` on our ``compute`` mesh,
  whose ``ring`` / ``ulysses`` axes it slices itself; HSDP overlays the same ranks.
* **CFG parallel**: :class:`CFGParallelTransformer` stands in for the transformer inside the unchanged diffusers
  pipeline. On the conditional call, cfg rank 0 computes the conditional branch and cfg rank 1 the
  unconditional one; the two results are all-gathered, the conditional one returned and the unconditional one
  handed back on the pipeline's following unconditional call, which therefore costs nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hsdp.config import ParallelConfig, ShardingStrategy
from hsdp.mesh import ParallelMeshes

__all__ = ["overlap_options", "enable_ulysses", "CFGParallelTransformer"]


def overlap_options(config: ParallelConfig, *, forward_prefetch: bool) -> dict:
    """Sharding options for :func:`hsdp.loading.load_pretrained`: explicit forward prefetch one unit ahead
    (nothing to prefetch when weights are replicated)."""
    prefetch = forward_prefetch and config.sharding_strategy is not ShardingStrategy.NO_SHARD
    return {"forward_prefetch": 1 if prefetch else 0}


@contextlib.contextmanager
def _accelerator_count_at_least_one() -> Iterator[None]:
    """diffusers computes ``rank % torch.accelerator.device_count()``, which divides by zero on a CPU-only build;
    report one device for the duration of the call only."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def enable_ulysses(model: nn.Module, config: ParallelConfig, meshes: ParallelMeshes) -> None:
    """Sequence-parallel attention for a diffusers transformer over the layout's ring x ulysses axes."""
    from diffusers import ContextParallelConfig

    cp_config = ContextParallelConfig(
        ulysses_degree=config.ulysses_degree, ring_degree=config.ring_degree, mesh=meshes.compute
    )
    with _accelerator_count_at_least_one():
        model.enable_parallelism(config=cp_config)


class CFGParallelTransformer(nn.Module):
    """The transformer's interface, with the two guidance branches computed on two rank groups at once."""

    def __init__(self, transformer: nn.Module, cfg_mesh: DeviceMesh):
        super().__init__()
        self.transformer = transformer
        self._group = cfg_mesh.get_group()
        self._branch_index = cfg_mesh.get_local_rank()
        self._negative_embeds: torch.Tensor | None = None
        self._pending_uncond: torch.Tensor | None = None
        self._branch = "cond"

    @property
    def config(self):
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    def set_negative_embeds(self, embeds: torch.Tensor) -> None:
        """The unconditional text embeddings of the current request (cfg rank 1 computes with them)."""
        self._negative_embeds = embeds

    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs) -> Iterator[None]:
        """The pipeline names the branch of each call ("cond" / "uncond"); remember it, then delegate."""
        self._branch = name
        with self.transformer.cache_context(name, **kwargs):
            yield

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, **kwargs) -> tuple:
        if self._branch == "uncond":
            if self._pending_uncond is None:
                raise RuntimeError(
                    "CFG parallel: an unconditional call came without a conditional one before it"
                )
            out, self._pending_uncond = self._pending_uncond, None
            return (out,)
        if self._negative_embeds is None:
            raise RuntimeError("CFG parallel: set_negative_embeds() was not called for this request")
        embeds = (
            encoder_hidden_states
            if self._branch_index == 0
            else self._negative_embeds.to(encoder_hidden_states)
        )
        kwargs["return_dict"] = False
        local = self.transformer(hidden_states=hidden_states, encoder_hidden_states=embeds, **kwargs)[
            0
        ].contiguous()
        both = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(both, local, group=self._group)
        self._pending_uncond = both[1]
        return (both[0],)
