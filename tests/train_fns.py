"""Rank-side functions for the training tests (module level, so WorkerGroup can send them by name)."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hsdp.train import TrainConfig, Trainer


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def _layout(param) -> tuple | None:
    """(mesh axis names, placements) of a DTensor parameter; None for a plain tensor."""
    if not isinstance(param, DTensor):
        return None
    return tuple(param.device_mesh.mesh_dim_names), tuple(
        (type(p).__name__, getattr(p, "dim", None)) for p in param.placements
    )


def measured_bytes(trainer: Trainer) -> dict[str, int]:
    """This rank's bytes of parameter shards, of parameters held gathered between forward and backward, of
    gradient shards (after one more backward) and of optimizer state."""
    params = list(trainer.model.parameters())
    batch = trainer.data.micro_batch(
        0,
        0,
        batch_size=trainer.cfg.batch_size,
        grad_accum=1,
        dp_rank=trainer.dp_rank,
        dp_size=trainer.dp_size,
    ).to(trainer.device)
    loss = trainer.model(input_ids=batch, labels=batch, use_cache=False).loss
    # Between forward and backward FSDP2 puts gathered (plain) parameters on the modules it keeps unsharded.
    gathered = _local_bytes(p for p in trainer.model.parameters() if not isinstance(p, DTensor))
    loss.backward()
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"]
    out = {
        "params": _local_bytes(params),
        "gathered": gathered,
        "grads": _local_bytes(grads),
        "optimizer": _local_bytes(state),
    }
    trainer.optimizer.zero_grad(set_to_none=True)
    return out


def _live_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0


def train_configs(configs: list[TrainConfig], measure: bool = False) -> list[dict]:
    """Train each config in turn; return losses, grad norms, rank 0's full weights and (optionally) bytes."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = []
    for cfg in configs:
        groups_before = _live_groups()
        with Trainer(cfg) as trainer:  # collectives (full_state, measured_bytes) before it closes its groups
            result = trainer.fit()
            full = trainer.full_state()
            measured = measured_bytes(trainer) if measure else None
        entry = {
            "losses": result.losses,
            "norms": [s.grad_norm for s in result.steps],
            "lrs": [s.lr for s in result.steps],
            "evals": [s.eval_loss for s in result.steps],
            "state": full if rank == 0 else None,
            "checkpoint": result.checkpoint,
            "peaks": result.steps[-1].peak_memory,
            "q_proj": _layout(trainer.model.model.layers[0].self_attn.q_proj.weight),
            "layer0": {
                n: _layout(p) for n, p in trainer.model.named_parameters() if n.startswith("model.layers.0.")
            },
            "checkpointing": any(
                getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules()
            ),
        }
        if measure:
            entry["bytes"] = measured
        entry["leaked_groups"] = _live_groups() - groups_before  # the trainer destroys the groups it created
        out.append(entry)
        del trainer
        gc.collect()
    return out


def train_and_die(cfg: TrainConfig, victim: int, at_step: int) -> None:
    """Train, and kill rank ``victim`` right after step ``at_step`` (the others are then stuck in a collective)."""
    rank = dist.get_rank()

    def on_step(step) -> None:
        if rank == victim and step.step == at_step:
            os._exit(17)

    Trainer(cfg).fit(on_step=on_step)


def train_lora(configs: list[TrainConfig]) -> list[dict]:
    """Train each LoRA config; return losses, rank 0's adapter (peft keys) and this rank's trainable, optimizer and
    base parameter bytes."""
    from hsdp.lora import adapter_state

    rank = dist.get_rank() if dist.is_initialized() else 0
    out = []
    for cfg in configs:
        trainer = Trainer(cfg)
        result = trainer.fit()
        params = list(trainer.model.parameters())
        adapters = adapter_state(trainer.model)
        report = getattr(trainer.model, "hsdp_report", None)
        out.append(
            {
                "losses": result.losses,
                "adapter": adapters if rank == 0 else None,
                "trainable_bytes": _local_bytes(p for p in params if p.requires_grad),
                "base_bytes": _local_bytes(p for p in params if not p.requires_grad),
                "optimizer_bytes": _local_bytes(
                    v for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"
                ),
                "checkpoint": result.checkpoint,
                "offloaded": report.offloaded_modules if report else [],
                "host_bytes": report.host_param_bytes if report else 0,
            }
        )
        del trainer
        gc.collect()
    return out


class SizePlanModel(torch.nn.Module):
    """A custom model with neither _hsdp_shard_conditions nor _no_split_modules: the size-based plan applies."""

    _hsdp_min_num_params = 1000

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.body = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
            for _ in range(3)
        )
        self.head = torch.nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.body:
            x = x + block(x)
        return self.head(x)


def size_plan_step() -> dict:
    """One forward/backward of :class:`SizePlanModel` sharded by the size-based plan, against the same model whole
    on this rank: the loss, the largest gradient difference and the units."""
    import copy

    from hsdp.config import ParallelConfig
    from hsdp.sharding import apply_hsdp_to_model

    torch.manual_seed(0)
    whole = SizePlanModel()
    sharded = copy.deepcopy(whole)
    ids = torch.randint(50, (4, 8), generator=torch.Generator().manual_seed(1))
    config = ParallelConfig(
        use_hsdp=True, hsdp_shard_size=dist.get_world_size(), sharding_strategy="FULL_SHARD"
    )
    report = apply_hsdp_to_model(sharded, config, training=True)
    losses = []
    for model in (whole, sharded):
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        losses.append(loss.item())
    worst = max(
        (p.grad - q.grad.full_tensor()).abs().max().item()
        for p, q in zip(whole.parameters(), sharded.parameters(), strict=True)
    )
    return {
        "losses": losses,
        "worst_grad": worst,
        "units": report.sharded_modules,
        "source": report.plan_source,
    }


def train_signalled(cfg: TrainConfig, signalled_rank: int, after_step: int) -> dict:
    """Train ``cfg`` as ``hsdp train``'s ranks do (stop signals recorded), SIGTERM sent to this process by itself
    after step ``after_step`` on rank ``signalled_rank`` only: what each rank made and why it stopped."""
    import signal

    from hsdp.train.run import trainer_class
    from hsdp.train.stop import stop_requests

    rank = dist.get_rank() if dist.is_initialized() else 0

    def on_step(step) -> None:
        if rank == signalled_rank and step.step == after_step:
            os.kill(os.getpid(), signal.SIGTERM)

    with stop_requests(), trainer_class(cfg)(cfg) as trainer:  # an LM's or a pipeline's
        result = trainer.fit(on_step=on_step)
    return {"steps": [s.step for s in result.steps], "losses": result.losses, "stopped_by": result.stopped_by,
            "checkpoint": result.checkpoint}  # fmt: skip
