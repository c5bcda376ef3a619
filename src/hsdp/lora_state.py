"""What a LoRA adapter is on a model and in a peft folder: peft's adapter name and key pattern, the weights file's
name, each adapter tensor's key as ``PeftModel.save_pretrained`` writes it, and the adapters gathered whole.

Below both :mod:`hsdp.lora` (inject, init, check, merge) and :mod:`hsdp.lora_formats` (the peft, diffusers and
ComfyUI files), which each need them, so neither imports the other for them.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ADAPTER", "ADAPTER_WEIGHTS", "LORA_KEY", "peft_key", "full_tensor", "adapter_state"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER = "default"  # peft's adapter name inside the model; dropped from the keys of a saved adapter
LORA_KEY = re.compile(r"\.lora_(A|B)\." + ADAPTER + r"\.")


def peft_key(name: str) -> str:
    """The key of an adapter tensor in a saved peft adapter (``PeftModel.save_pretrained``)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param


@torch.no_grad()
def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter tensor gathered whole, on the CPU, under its peft key; collective."""
    return {
        peft_key(name): full_tensor(param).detach().cpu().clone()
        for name, param in model.named_parameters()
        if LORA_KEY.search(name)
    }
