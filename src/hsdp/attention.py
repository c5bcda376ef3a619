"""``--attention-backend``: the attention kernel of the model that runs every step, through the libraries' own
dispatchers: diffusers' (``ModelMixin.set_attention_backend``: native, flash, sage, flex, xformers, ...) for a
pipeline's denoisers, transformers' (``set_attn_implementation``: eager, sdpa, flex_attention,
flash_attention_2, ...) for a causal LM. Inference and training take it alike.

A backend is checked before any process starts against what the dispatcher itself knows: the name, its package
(diffusers' own requirement check), the device its constraints ask for, and, with Ulysses or ring attention,
whether diffusers' backend supports context parallelism.
"""

from __future__ import annotations

from torch import nn

from hsdp.suggest import did_you_mean

__all__ = ["attention_backend_problems", "set_attention_backend"]

_TORCH_SDPA_DEVICE = {"_native_cudnn": "cuda", "_native_flash": "cuda", "_native_efficient": "cuda",
                      "_native_npu": "npu", "_native_xla": "xla"}  # fmt: skip
"""torch's SDPA kernels that exist on one device type only (diffusers' constraints check the device at call time,
not which one)."""


def _diffusers_problems(name: str, device_type: str, context_parallel: bool) -> list[str]:
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _AttentionBackendRegistry,
        _check_attention_backend_requirements,
    )

    names = sorted(b.value for b in _AttentionBackendRegistry.list_backends())
    if name not in names:
        return [f"--attention-backend {name}: diffusers has no such backend{did_you_mean(name, names)}; it has "
                f"{', '.join(names)}"]  # fmt: skip
    backend = AttentionBackendName(name)
    problems = []
    try:
        _check_attention_backend_requirements(backend)
    except (RuntimeError, ImportError) as exc:
        problems.append(f"--attention-backend {name}: {exc}")
    constraints = {getattr(c, "__name__", "") for c in _AttentionBackendRegistry._constraints[backend]}
    needs = _TORCH_SDPA_DEVICE.get(name) or ("cuda" if any("cuda" in c for c in constraints) else None)
    if needs is not None and needs != device_type:
        problems.append(
            f"--attention-backend {name}: its kernels run on {needs} devices and this machine computes on "
            f"{device_type}; use native (or _native_math, flex there)"
        )
    if context_parallel and not _AttentionBackendRegistry._is_context_parallel_available(backend):
        supported = sorted(_AttentionBackendRegistry._supports_context_parallel)
        problems.append(
            f"--attention-backend {name} with --ulysses-degree / --ring-degree: diffusers' {name} backend has no "
            f"context-parallel support; use one that has ({', '.join(supported)}) or drop the sequence split"
        )
    return problems


def _transformers_problems(name: str, device_type: str) -> list[str]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    names = sorted({"eager", *(k for k in ALL_ATTENTION_FUNCTIONS if "|" not in k)})
    if name not in names:
        return [f"--attention-backend {name}: transformers has no such attention implementation"
                f"{did_you_mean(name, names)}; it has "
                f"{', '.join(names)}"]  # fmt: skip
    if name.startswith("flash_attention") and device_type != "cuda":
        return [f"--attention-backend {name}: FlashAttention runs on CUDA devices and this machine computes on "
                f"{device_type}; use sdpa, eager or flex_attention"]  # fmt: skip
    if name == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            return [f"--attention-backend {name}: the flash-attn package is not installed; pip install flash-attn"]
    return []


def attention_backend_problems(name: str, kind: str, device_type: str, context_parallel: bool) -> list[str]:
    """Why ``name`` cannot run for a model of ``kind`` (``diffusion`` / ``causal_lm``) here (empty when it can)."""
    if kind == "diffusion":
        return _diffusers_problems(name, device_type, context_parallel)
    return _transformers_problems(name, device_type)


def set_attention_backend(model: nn.Module, name: str) -> None:
    """Use ``name`` in every attention layer of ``model`` (a diffusers model or a transformers model). For a
    sequence-parallel denoiser call this before diffusers' ``enable_parallelism``."""
    if hasattr(model, "set_attention_backend"):  # diffusers
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        default = _AttentionBackendRegistry._active_backend
        model.set_attention_backend(name)
        # diffusers also makes ``name`` the process-wide default; keep it to this model's layers, since a rank
        # loads other models later (a swapped model, a test's next engine) that asked for no backend.
        _AttentionBackendRegistry.set_active_backend(default)
    else:
        model.set_attn_implementation(name)
