"""hsdp: run and train PyTorch models too large for one accelerator with FSDP2 / HSDP, from one config."""

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ParallelConfig",
    "ShardingStrategy",
    "ParallelMeshes",
    "ShardReport",
    "apply_hsdp_to_model",
    "build_meshes",
    "destroy_distributed",
    "init_distributed",
    "load_pretrained",
    "Engine",
    "SamplingParams",
    "GenerationOutput",
]
__version__ = "0.1.0"

_LAZY = {
    "ConfigError": "hsdp.config",
    "ParallelConfig": "hsdp.config",
    "ShardingStrategy": "hsdp.config",
    "destroy_distributed": "hsdp.distributed",
    "init_distributed": "hsdp.distributed",
    "CheckpointError": "hsdp.loading",
    "load_pretrained": "hsdp.loading",
    "ParallelMeshes": "hsdp.mesh",
    "build_meshes": "hsdp.mesh",
    "ShardReport": "hsdp.sharding",
    "apply_hsdp_to_model": "hsdp.sharding",
    "Engine": "hsdp.engine",
    "SamplingParams": "hsdp.engine",
    "GenerationOutput": "hsdp.engine",
}
"""Where each public name lives: imported on first use, so ``import hsdp`` (and every ``hsdp.*`` module, the
command line's included) pays only for what it uses (``hsdp.loading`` alone brings in torch's DTensor and
sympy)."""


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hsdp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
