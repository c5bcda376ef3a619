"""The one parallel configuration: every parallel dimension, validated in one place.

Field names follow vLLM-Omni's ``DiffusionParallelConfig`` (``use_hsdp``, ``hsdp_shard_size``, ...), so its
users can move over without renaming flags. The layout rules:

* **Compute-parallel degree** ``C = cfg_parallel_size * ulysses_degree * ring_degree``: ranks that split one
  request's work (the two guidance branches, the sequence).
* **HSDP** shards weights over ``hsdp_replicate_size x hsdp_shard_size`` ranks.
  - *Standalone* (``C == 1``): the HSDP ranks are the whole world and ``hsdp_shard_size`` must be given.
  - *Combined* (``C > 1``): HSDP overlays the compute-parallel ranks, so ``replicate x shard == C``;
    ``hsdp_shard_size=-1`` resolves to ``C / hsdp_replicate_size``.
* **Tensor parallel** multiplies the world: ``world_size = tp x max(C, replicate x shard)``; FSDP then shards
  over the data-parallel axes only (the 2-D "FSDP + TP" layout).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import torch

from hsdp.suggest import did_you_mean

__all__ = ["ParallelConfig", "ShardingStrategy", "ConfigError", "DTYPES"]


class ConfigError(ValueError):
    """One or more problems with a :class:`ParallelConfig`; the message lists all of them."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"Invalid parallel configuration ({len(problems)} problem(s)):\n{lines}")


class ShardingStrategy(str, enum.Enum):
    """How parameters, gradients and optimizer state are split (FSDP1's names, mapped onto FSDP2)."""

    FULL_SHARD = "FULL_SHARD"
    """Params, grads and optimizer state sharded; params resharded after forward (least memory)."""
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    """Like FULL_SHARD, but params stay gathered from forward to backward (one all-gather fewer)."""
    NO_SHARD = "NO_SHARD"
    """Every rank holds everything; gradients are all-reduced (DDP-like, FSDP2's composable replicate)."""
    HYBRID_SHARD = "HYBRID_SHARD"
    """Shard inside each group of ``hsdp_shard_size`` ranks, replicate across ``hsdp_replicate_size`` groups."""

    @classmethod
    def parse(cls, value: str | ShardingStrategy) -> ShardingStrategy:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            choices = ", ".join(s.value for s in cls)
            hint = did_you_mean(str(value).upper(), [s.value for s in cls])
            raise ConfigError(
                [f"--strategy / sharding_strategy={value!r} is unknown; choose one of {choices}{hint}"]
            ) from None


DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _dtype_problem(flag: str, value: str | None) -> str | None:
    if value is None or value in DTYPES:
        return None
    return f"{flag}={value!r} is not a dtype; use one of {', '.join(sorted(DTYPES))}{did_you_mean(value, DTYPES)}"


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Every parallel dimension of a run. Construct it, then call :meth:`resolved` (done by all entry points)."""

    use_hsdp: bool = False
    """Shard weights with FSDP2 (``--use-hsdp``)."""
    hsdp_shard_size: int = -1
    """Ranks one copy of the weights is sharded over (``--hsdp-shard-size``); -1 = auto (combined mode only)."""
    hsdp_replicate_size: int = 1
    """Groups that each hold a full sharded copy (``--hsdp-replicate-size``)."""
    ulysses_degree: int = 1
    """Ulysses (all-to-all) sequence-parallel degree (``--ulysses-degree`` / ``--usp``)."""
    ring_degree: int = 1
    """Ring-attention sequence-parallel degree (``--ring-degree``)."""
    cfg_parallel_size: int = 1
    """1 or 2: run the conditional and unconditional guidance branches on two rank groups."""
    tensor_parallel_size: int = 1
    """Tensor-parallel degree (``--tensor-parallel-size``); FSDP then shards over the data-parallel axes only."""
    request_parallel: bool = False
    """In standalone HSDP, each rank serves a different request in lockstep instead of all ranks the same one."""
    sharding_strategy: ShardingStrategy | None = None
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD; None = derived from the sizes."""
    reshard_after_forward: bool | None = None
    """Free gathered weights after each block's forward; None = derived from the strategy."""
    param_dtype: str | None = None
    """Compute dtype for gathered params (mixed precision), e.g. ``bf16``; None = the stored dtype."""
    reduce_dtype: str | None = None
    """Dtype of gradient reduce-scatter / all-reduce; None = ``param_dtype``."""
    cpu_offload: bool = False
    """Keep sharded params (and grads, optimizer state) in host memory between uses."""
    offload_layers: int | None = None
    """Layerwise offload (``--offload-layers K``): the first ``K`` repeated blocks of the model sharded for compute
    (a pipeline's denoisers, a causal LM) keep their shards on the device; the blocks after them keep theirs (and, in
    training, their gradients and optimizer state) in pinned host memory, each copied in one block ahead of its use
    by FSDP2's prefetch. ``K`` at or above the model's block count offloads nothing. None = no layerwise offload."""
    frozen_whole: bool = False
    """Training: parameters that train nothing (a LoRA's frozen base) stay whole on every rank, outside FSDP, at the
    compute dtype: never gathered, while what trains is sharded as the strategy says (``--frozen-whole``; always so
    under NO_SHARD). For a frozen base that fits a device: its all-gathers were most of a LoRA step's traffic."""
    _resolved: bool = field(default=False, repr=False, compare=False)

    # -- derived sizes -------------------------------------------------------------------------------------
    @property
    def sequence_parallel_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def compute_parallel_size(self) -> int:
        return self.cfg_parallel_size * self.sequence_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that share the weights of one tensor-parallel slice (the FSDP mesh size)."""
        if not self.use_hsdp:
            return 1
        return self.hsdp_replicate_size * self.hsdp_shard_size

    @property
    def world_size(self) -> int:
        self._require_resolved()
        return self.tensor_parallel_size * max(self.compute_parallel_size, self.data_parallel_size)

    @property
    def standalone_hsdp(self) -> bool:
        return self.use_hsdp and self.compute_parallel_size == 1

    @property
    def param_torch_dtype(self) -> torch.dtype | None:
        return DTYPES[self.param_dtype] if self.param_dtype else None

    @property
    def reduce_torch_dtype(self) -> torch.dtype | None:
        return DTYPES[self.reduce_dtype] if self.reduce_dtype else None

    def _require_resolved(self) -> None:
        if not self._resolved:
            raise RuntimeError("call ParallelConfig.resolved() first (it validates and fills auto sizes)")

    # -- validation ----------------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every problem with this configuration, as messages that name the flag, the numbers and the fix."""
        out: list[str] = []
        for flag, value in [
            ("--hsdp-replicate-size", self.hsdp_replicate_size),
            ("--ulysses-degree", self.ulysses_degree),
            ("--ring-degree", self.ring_degree),
            ("--cfg-parallel-size", self.cfg_parallel_size),
            ("--tensor-parallel-size", self.tensor_parallel_size),
        ]:
            if not isinstance(value, int) or value < 1:
                out.append(f"{flag}={value} must be an integer >= 1")
        if not isinstance(self.hsdp_shard_size, int) or (
            self.hsdp_shard_size < 1 and self.hsdp_shard_size != -1
        ):
            out.append(f"--hsdp-shard-size={self.hsdp_shard_size} must be >= 1, or -1 for auto")
        if self.cfg_parallel_size not in (1, 2) and self.cfg_parallel_size >= 1:
            out.append(
                f"--cfg-parallel-size={self.cfg_parallel_size}: classifier-free guidance has two branches; use 1 or 2"
            )
        for flag, value in [("--param-dtype", self.param_dtype), ("--reduce-dtype", self.reduce_dtype)]:
            if (p := _dtype_problem(flag, value)) is not None:
                out.append(p)
        if out:  # sizes below are meaningless when basic values are wrong
            return out
        out += self._hsdp_problems()
        if self.frozen_whole and self.cpu_offload:
            out.append("--frozen-whole keeps the frozen weights on the device, --cpu-offload in host memory: drop one")
        out += self._offload_layers_problems()
        out += self._strategy_problems()
        out += self._needs_hsdp_problems()
        if self.tensor_parallel_size > 1 and self.compute_parallel_size > 1:
            out.append(
                f"--tensor-parallel-size={self.tensor_parallel_size} with sequence/CFG parallel "
                f"(degree {self.compute_parallel_size}) is not supported; drop one of them"
            )
        if self.request_parallel and not self.standalone_hsdp:
            out.append(
                "--request-parallel needs standalone HSDP (--use-hsdp with --hsdp-shard-size, and no "
                "--ulysses-degree/--ring-degree/--cfg-parallel-size): each rank takes its own request"
            )
        if self.request_parallel and self.tensor_parallel_size > 1:
            out.append("--request-parallel cannot be combined with --tensor-parallel-size > 1")
        return out

    def _hsdp_problems(self) -> list[str]:
        c, r, s = self.compute_parallel_size, self.hsdp_replicate_size, self.hsdp_shard_size
        if not self.use_hsdp:
            if s != -1 or r != 1:
                return [
                    f"--hsdp-shard-size={s} / --hsdp-replicate-size={r} have no effect without --use-hsdp; "
                    "add --use-hsdp or drop them"
                ]
            return []
        if c == 1:
            if s == -1:
                return [
                    "standalone HSDP (no sequence or CFG parallel) needs an explicit --hsdp-shard-size: "
                    "set it to the number of devices to shard the weights over, e.g. --hsdp-shard-size 2"
                ]
            return []
        if s == -1:
            if c % r:
                return [
                    f"--hsdp-replicate-size={r} does not divide the sequence x CFG parallel degree {c} that HSDP "
                    f"overlays; use a divisor of {c}"
                ]
            return []
        if r * s != c:
            return [
                f"HSDP overlays the {c} sequence/CFG-parallel ranks, but --hsdp-replicate-size={r} x "
                f"--hsdp-shard-size={s} = {r * s}; set --hsdp-shard-size={c // r if c % r == 0 else -1} "
                "(or -1 for auto)"
            ]
        return []

    def _needs_hsdp_problems(self) -> list[str]:
        """Settings that only the sharding step (``apply_hsdp_to_model``) applies; without ``--use-hsdp`` every
        consumer (engine, training, ``load_pretrained``) loads the model whole and would silently ignore them."""
        if self.use_hsdp:
            return []
        if self.compute_parallel_size > 1:
            fix = f"add --use-hsdp (HSDP then overlays the {self.compute_parallel_size} sequence/CFG-parallel ranks)"
        else:
            fix = "add --use-hsdp --hsdp-shard-size N (the weights sharded over N ranks; 1 keeps them whole)"
        out = []
        if self.tensor_parallel_size > 1:
            out.append(
                f"--tensor-parallel-size={self.tensor_parallel_size} is applied only with sharding on, so the run "
                f"would use {self.tensor_parallel_size} ranks without splitting any weight; {fix}, or drop it"
            )
        given = {
            "--cpu-offload": self.cpu_offload or None,
            "--offload-layers": self.offload_layers,
            "--frozen-whole": self.frozen_whole or None,
            "--param-dtype": self.param_dtype,
            "--reduce-dtype": self.reduce_dtype,
            "--reshard-after-forward": self.reshard_after_forward,
        }
        out += [
            f"{flag}={value} has no effect without --use-hsdp; {fix}, or drop it"
            for flag, value in given.items()
            if value is not None
        ]
        return out

    def _offload_layers_problems(self) -> list[str]:
        k = self.offload_layers
        if k is None:
            return []
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            return [
                f"--offload-layers={k} must be an integer >= 0: the number of blocks kept on the device (the "
                "blocks after them stream from host memory); e.g. --offload-layers 4"
            ]
        out = []
        if self.cpu_offload:
            out.append(
                f"--offload-layers {k} keeps the first {k} blocks on the device and offloads the rest, but "
                "--cpu-offload offloads every block: drop one of them"
            )
        if self.frozen_whole:
            out.append(
                f"--offload-layers {k} offloads the blocks after the first {k}, but --frozen-whole keeps the frozen "
                "weights whole on the device: drop one of them"
            )
        return out

    def _strategy_problems(self) -> list[str]:
        if self.sharding_strategy is None:
            return []
        strategy = self.sharding_strategy
        if not self.use_hsdp:
            return [f"--strategy {strategy.value} needs sharding on: add --use-hsdp with --hsdp-shard-size"]
        r = self.hsdp_replicate_size
        s = self.hsdp_shard_size
        if strategy is ShardingStrategy.NO_SHARD and s not in (1, -1):
            return [
                f"--strategy NO_SHARD replicates the weights, but --hsdp-shard-size={s}; set --hsdp-shard-size 1 "
                f"and --hsdp-replicate-size to the number of ranks ({r * s})"
            ]
        if strategy is ShardingStrategy.HYBRID_SHARD and r == 1:
            return [
                "--strategy HYBRID_SHARD needs --hsdp-replicate-size > 1 (shard inside a group, replicate across "
                "groups); use FULL_SHARD for a single group"
            ]
        if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) and r > 1:
            return [
                f"--strategy {strategy.value} shards over one group, but --hsdp-replicate-size={r}; use "
                "HYBRID_SHARD, or set --hsdp-replicate-size 1"
            ]
        return []

    def resolved(self) -> ParallelConfig:
        """Validate, fill auto sizes and derived settings; raises :class:`ConfigError` listing every problem.

        Idempotent, and it always re-validates, so a ``dataclasses.replace`` of a resolved config is checked again.
        """
        config = self
        if isinstance(self.sharding_strategy, str) and not isinstance(
            self.sharding_strategy, ShardingStrategy
        ):
            config = dataclasses.replace(
                config, sharding_strategy=ShardingStrategy.parse(self.sharding_strategy)
            )
        problems = config.problems()
        if problems:
            raise ConfigError(problems)
        changes: dict = {"_resolved": True}
        if config.use_hsdp and config.hsdp_shard_size == -1:
            changes["hsdp_shard_size"] = config.compute_parallel_size // config.hsdp_replicate_size
        out = dataclasses.replace(config, **changes)
        if out.use_hsdp and out.sharding_strategy is None:
            object.__setattr__(out, "sharding_strategy", _default_strategy(out))
        if out.use_hsdp and out.reshard_after_forward is None:
            object.__setattr__(
                out, "reshard_after_forward", out.sharding_strategy is not ShardingStrategy.SHARD_GRAD_OP
            )
        if out.reduce_dtype is None and out.param_dtype is not None:
            object.__setattr__(out, "reduce_dtype", "fp32")
        return out

    def describe(self) -> str:
        """One line for logs and summaries."""
        parts = [f"world_size={self.world_size}"]
        if self.use_hsdp:
            parts.append(
                f"hsdp={self.hsdp_replicate_size}x{self.hsdp_shard_size} ({self.sharding_strategy.value})"
            )
        for name, value in [
            ("ulysses", self.ulysses_degree),
            ("ring", self.ring_degree),
            ("cfg", self.cfg_parallel_size),
            ("tp", self.tensor_parallel_size),
        ]:
            if value > 1:
                parts.append(f"{name}={value}")
        if self.request_parallel:
            parts.append("request-parallel")
        return ", ".join(parts)


def _default_strategy(config: ParallelConfig) -> ShardingStrategy:
    if config.hsdp_shard_size == 1:
        return ShardingStrategy.NO_SHARD
    if config.hsdp_replicate_size > 1:
        return ShardingStrategy.HYBRID_SHARD
    return ShardingStrategy.FULL_SHARD
