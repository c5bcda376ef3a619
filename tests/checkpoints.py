"""Tiny checkpoints on disk for tests: real ``save_pretrained`` safetensors folders, fp32 and bf16."""

from __future__ import annotations

from pathlib import Path

import torch

from hsdp.models.tiny import build_tiny_llama, build_tiny_wan_transformer


def write_tiny_checkpoints(root: Path) -> dict[str, Path]:
    paths = {}
    for dtype_name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
        llama = build_tiny_llama().to(dtype)
        paths[f"llama-{dtype_name}"] = root / f"llama-{dtype_name}"
        llama.save_pretrained(paths[f"llama-{dtype_name}"])
        wan = build_tiny_wan_transformer().to(dtype)
        # A diffusers pipeline folder keeps the transformer in its own component folder.
        paths[f"wan-{dtype_name}"] = root / f"wan-{dtype_name}"
        wan.save_pretrained(paths[f"wan-{dtype_name}"] / "transformer")
    # A sharded checkpoint with an index file, as large models ship.
    paths["llama-sharded"] = root / "llama-sharded"
    build_tiny_llama().save_pretrained(paths["llama-sharded"], max_shard_size="200KB")
    return paths
