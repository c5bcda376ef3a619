"""hsdp: run and train PyTorch models too large for one accelerator with FSDP2 / HSDP, from one config."""

from hsdp.config import ConfigError, ParallelConfig, ShardingStrategy
from hsdp.distributed import destroy_distributed, init_distributed
from hsdp.loading import CheckpointError, load_pretrained
from hsdp.mesh import ParallelMeshes, build_meshes
from hsdp.sharding import ShardReport, apply_hsdp_to_model

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

_LAZY = {"Engine": "hsdp.engine", "SamplingParams": "hsdp.engine", "GenerationOutput": "hsdp.engine"}


def __getattr__(name: str):
    """``hsdp.Engine`` and friends, imported on first use so ``import hsdp`` stays light."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hsdp' has no attribute {name!r}")
