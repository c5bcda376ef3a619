"""LoRA with ``peft`` on a sharded base model: inject, initialise, check, export.

Shared by training (``hsdp.train``) and inference (``hsdp.engine``, ``hsdp.serve``), so it sits below both and
knows neither: configs come in as peft objects or plain values, never as a command line's settings.

The adapters are injected with ``peft.inject_adapter_in_model`` into the empty (meta) model before FSDP2 shards
it, so each adapter lives in the FSDP unit of the layer it adapts. The base stays frozen in its checkpoint dtype;
adapters are fp32 (only trainable parameters must share a dtype in an FSDP2 unit, and peft casts a layer's input
to the adapter's dtype, so the update is computed in fp32 as ``get_peft_model`` does with
``autocast_adapter_dtype``).

Initialisation is peft's (``lora_A`` Kaiming-uniform with ``a=sqrt(5)``, ``lora_B`` zero) drawn on the full tensor
from one CPU generator seeded with ``--seed``, in parameter order; each rank keeps its own slice, so the start is
the same at every world size (:func:`init_adapters`; the parity tests give a one-process peft model the same start).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hsdp.file_kinds import describe
from hsdp.loading import local_slices
from hsdp.lora_formats import as_peft_folder
from hsdp.lora_state import ADAPTER, ADAPTER_WEIGHTS, LORA_KEY, adapter_state, full_tensor, peft_key

if TYPE_CHECKING:
    from peft import LoraConfig

__all__ = [
    "ADAPTER_WEIGHTS",
    "lora_config",
    "injector",
    "check_targets",
    "adapter_config",
    "adapter_injector",
    "init_adapters",
    "adapter_state",
    "merged_state",
    "peft_key",
]



def lora_config(
    *,
    r: int,
    alpha: float,
    dropout: float,
    targets: list[str] | str,
    adapter: str | None = None,
    base: str = "",
    task_type: str | None = None,
) -> LoraConfig:
    """A ``peft.LoraConfig``: from the adapter folder ``adapter`` when given (to continue training it), else from
    the values (``targets`` a list of module names or peft's ``"all-linear"``)."""
    from peft import LoraConfig

    if adapter:
        config = LoraConfig.from_pretrained(_peft_folder(adapter))
        config.inference_mode = False
        config.base_model_name_or_path = base or config.base_model_name_or_path
        return config
    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(targets) if not isinstance(targets, str) else targets,
        base_model_name_or_path=base or None,
        task_type=task_type,
    )


def injector(config) -> Callable[[nn.Module], None]:
    """A ``load_pretrained(prepare=...)`` hook: inject the adapters on meta, fp32, trainable; freeze the rest."""

    def inject(model: nn.Module) -> None:
        from peft import inject_adapter_in_model

        inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=True)
        for name, param in model.named_parameters():
            is_adapter = LORA_KEY.search(name) is not None
            param.requires_grad_(is_adapter)
            if is_adapter and param.dtype != torch.float32:
                param.data = param.data.float()

    return inject


def adapter_injector(folder: str | Path) -> Callable[[nn.Module], None]:
    """:func:`injector` for the saved adapter of ``folder`` applied at inference (``--lora``; fill the adapters
    with :func:`init_adapters` after loading).

    The adapters stay unmerged, sharded with the layer they adapt, as in training: the base is used exactly as
    stored, and merging would rewrite every adapted weight on every rank for a small saving. They are held in
    fp32 whatever the base's dtype (``injector`` casts them), because ``PeftModel.from_pretrained`` does the same by
    default (``autocast_adapter_dtype`` upcasts bf16 / fp16 adapters), so outputs equal peft's; the adapters are a
    small fraction of the weights. ``lora_dropout`` is inactive: the loaded model is in eval mode.
    """
    from peft import LoraConfig

    return injector(LoraConfig.from_pretrained(_peft_folder(folder)))


def _peft_folder(folder: str | Path, flag: str = "--lora", model_dir: Path | None = None) -> Path:
    """``folder``, or the peft adapter folder converted from it when it holds diffusers' LoRA format, or from a
    LoRA file for the denoiser in ``model_dir`` (:func:`hsdp.lora_formats.as_peft_folder`)."""
    return as_peft_folder(folder, flag, model_dir)


def _meta_model(model_dir: Path) -> nn.Module:
    """The model of ``model_dir`` (a causal LM or a diffusers component folder) on meta."""
    from hsdp.loading import build_empty_model, model_class_for

    return build_empty_model(model_class_for(model_dir), model_dir, None)


def _linear_names(model: nn.Module) -> str:
    return ", ".join(
        sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    )


def check_targets(config: LoraConfig, model_dir: Path, flag: str) -> None:
    """Inject ``config``'s adapters into a meta copy of the model in ``model_dir``: its targets must match a layer;
    a ``ValueError`` naming ``flag`` and the model's linear layers otherwise. Reads only small files."""
    model = _meta_model(model_dir)
    try:
        injector(config)(model)
    except ValueError as exc:
        targets = config.target_modules
        shown = " ".join(sorted(targets)) if isinstance(targets, (set, list)) else str(targets)
        raise ValueError(
            f"{flag}: {shown} matched no layer of {type(model).__name__} ({exc}); its linear layers are named "
            f"{_linear_names(model)}"
        ) from exc


def adapter_config(folder: str | Path, model_dir: Path, flag: str, *, lora_file: bool = False) -> LoraConfig:
    """The ``peft.LoraConfig`` of a peft adapter folder, checked against the base model in ``model_dir``: the
    folder holds a LoRA ``adapter_config.json`` whose targets match the base, and its tensors are exactly the
    adapter tensors of that base, in the same shapes; an adapter that binds no layer is refused with the keys
    expected and a sample of those found. ``lora_file``: ``folder`` may be a LoRA ``.safetensors`` file for a
    pipeline's denoiser (converted by :func:`hsdp.lora_formats.as_peft_folder`; inference only). Reads only
    small files (configs and safetensors headers, a LoRA file whole); problems are ``ValueError`` naming ``flag``."""
    is_file = Path(folder).is_file() and Path(folder).suffix == ".safetensors"
    what = describe(folder)
    if Path(folder).is_file() and what != "a safetensors file":  # a picture, a checkpoint, a text: say so
        raise ValueError(
            f"{flag} {folder}: {what}, not a LoRA; pass a peft adapter folder (adapter_config.json and "
            f"{ADAPTER_WEIGHTS}), a diffusers LoRA folder (pytorch_lora_weights.safetensors)"
            + (" or a LoRA .safetensors file" if lora_file else "")
        )
    if is_file and not lora_file:
        raise ValueError(
            f"{flag} {folder}: a LoRA file; {flag} takes a peft adapter folder or a diffusers LoRA folder (hsdp "
            "generate and hsdp serve --lora read LoRA files)"
        )
    if Path(folder).is_file() and not is_file:
        raise ValueError(f"{flag} {folder}: a safetensors file; name it {Path(folder).stem}.safetensors (LoRA files "
                         "are told from folders by that suffix)")  # fmt: skip
    if not Path(folder).is_dir() and not is_file:
        raise ValueError(
            f"{flag} {folder}: no such folder (nor a .safetensors file); pass a peft adapter folder "
            f"(adapter_config.json and {ADAPTER_WEIGHTS}, as PeftModel.save_pretrained or hsdp train --export "
            "write), a diffusers LoRA folder (pytorch_lora_weights.safetensors) or, for a pipeline, a LoRA file "
            "(kohya / ComfyUI / diffusers keys, as the pipeline's load_lora_weights reads it)"
        )
    path = _peft_folder(folder, flag, model_dir)
    if not (path / "adapter_config.json").is_file():
        raise ValueError(
            f"{flag} {folder}: no adapter_config.json, so not a peft adapter folder (nor pytorch_lora_weights"
            ".safetensors, a diffusers LoRA); pass the folder that PeftModel.save_pretrained, save_lora_weights or "
            "hsdp train --export wrote"
        )
    peft_type = json.loads((path / "adapter_config.json").read_text()).get("peft_type")
    if peft_type != "LORA":
        raise ValueError(f"{flag} {folder}: a {peft_type} adapter; only peft LoRA adapters are supported")
    try:
        from peft import LoraConfig
    except ImportError as exc:
        raise ValueError(f"{flag} needs peft: pip install 'hsdp[train]'") from exc
    config = LoraConfig.from_pretrained(path)
    model = _meta_model(model_dir)
    try:
        injector(config)(model)
    except ValueError as exc:
        raise ValueError(
            f"{flag} {folder} does not fit the model {model_dir}: it binds no layer of {type(model).__name__} (an "
            f"adapter that binds nothing changes nothing): its target modules {config.target_modules} match none. "
            f"Expected keys like {_expected_keys(model_dir)} (its linear layers are named "
            f"{_linear_names(model)}); found {_found_keys(path)}. Pass the base model it was trained on "
            f"({config.base_model_name_or_path or 'unknown'})"
        ) from exc
    problem = _fit_problem(flag, str(folder), path, model, model_dir, config.base_model_name_or_path)
    if problem:
        raise ValueError(problem)
    return config


def _expected_keys(model_dir: Path, count: int = 3) -> str:
    """A sample of the adapter keys a LoRA on every linear layer of the model in ``model_dir`` has (peft's names)."""
    from peft import LoraConfig

    model = _meta_model(model_dir)
    injector(LoraConfig(target_modules="all-linear"))(model)
    keys = [peft_key(n) for n, _ in model.named_parameters() if ".lora_A." in n]
    return ", ".join(keys[:count]) + (f" ... ({len(keys)} in all)" if len(keys) > count else "")


def _found_keys(peft_folder: Path, count: int = 3) -> str:
    """A sample of the tensor keys of the adapter in ``peft_folder`` (a LoRA file's as converted to peft's names)."""
    from safetensors import safe_open

    path = peft_folder / ADAPTER_WEIGHTS
    if not path.is_file():
        return f"no {ADAPTER_WEIGHTS}"
    with safe_open(path, framework="pt") as handle:
        keys = sorted(handle.keys())  # noqa: SIM118
    return ", ".join(keys[:count]) + (f" ... ({len(keys)} in all)" if len(keys) > count else "")


def _fit_problem(
    flag: str, folder: str, peft_folder: Path, model: nn.Module, model_dir: Path, trained_on: str | None
) -> str | None:
    """Why the adapter file in ``peft_folder`` (``folder`` as given, converted) does not fit the adapters injected
    into ``model``, or None."""
    from safetensors import safe_open

    path = peft_folder / ADAPTER_WEIGHTS
    if not path.is_file():
        return f"{flag} {folder}: no {ADAPTER_WEIGHTS} (not a peft adapter folder)"
    with safe_open(path, framework="pt") as handle:
        stored = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}  # noqa: SIM118
    expected = {peft_key(n): tuple(p.shape) for n, p in model.named_parameters() if LORA_KEY.search(n)}
    unmatched = sorted(stored.keys() - expected.keys())
    problems = [f"missing {k}" for k in sorted(expected.keys() - stored.keys())][:3]
    if unmatched:  # a partial binding would silently drop these tensors
        problems.append(f"{len(unmatched)} of its {len(stored)} tensors match no layer of the model")
    problems += [f"unexpected {k}" for k in unmatched][:3]
    problems += [
        f"{k}: adapter {list(stored[k])}, model {list(v)}"
        for k, v in expected.items()
        if k in stored and stored[k] != v
    ][:3]
    if not problems:
        return None
    return (
        f"{flag} {folder} does not fit the model {model_dir} (the adapter was trained on "
        f"{trained_on or 'an unknown base'}): {'; '.join(problems)}. Pass the base model it was trained on"
    )


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int, adapter_dir: str | None = None) -> int:
    """Fill this rank's slice of every adapter tensor (peft's init from ``seed``, or ``adapter_dir``'s weights);
    returns the number of adapter parameters. No communication: every rank draws the same full tensors."""
    stored: dict[str, torch.Tensor] = {}
    if adapter_dir:
        from safetensors.torch import load_file

        stored = load_file(_peft_folder(adapter_dir) / ADAPTER_WEIGHTS)
    generator = torch.Generator().manual_seed(seed)
    count = 0
    for name, param in model.named_parameters():
        if not LORA_KEY.search(name):
            continue
        full = torch.empty(param.shape, dtype=torch.float32)
        if stored:
            full.copy_(stored[peft_key(name)])
        elif ".lora_A." in name:
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
        else:
            full.zero_()
        local, region = local_slices(param)
        local.copy_(full[region].reshape(local.shape))
        count += param.numel()
    return count


def _delta_weight(layer: nn.Module) -> torch.Tensor:
    """What merging adds to the base weight of a peft LoRA ``layer``, whole and in fp32, laid out as the base
    weight: ``scaling * B @ A`` is (out, in), and layers that store their weight as (in, out) (transformers'
    ``Conv1D`` in GPT-2, peft's ``fan_in_fan_out``) take its transpose, as peft's ``get_delta_weight`` does."""
    a = full_tensor(layer.lora_A[ADAPTER].weight).float()
    b = full_tensor(layer.lora_B[ADAPTER].weight).float()
    delta = layer.scaling[ADAPTER] * (b @ a)
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


@torch.no_grad()
def merged_state(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The base model's state with every adapter merged in (``W + alpha / r * B @ A``), under the base model's keys,
    sharded as the base is (each rank adds the slice of the update that matches its shard); collective only to
    gather the small adapter tensors."""
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if LORA_KEY.search(name):
            continue
        key = name.replace(".base_layer.", ".")
        owner = name.rsplit(".base_layer.", 1)[0]
        if name.endswith(".base_layer.weight") and hasattr(modules[owner], "lora_A"):
            delta = _delta_weight(modules[owner])
            local, region = local_slices(tensor)
            merged = (local.float() + delta[region].reshape(local.shape)).to(local.dtype)
            if isinstance(tensor, DTensor):
                merged = DTensor.from_local(
                    merged, tensor.device_mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride()
                )
            tensor = merged
        out[key] = tensor.detach() if dtype is None else tensor.detach().to(dtype)
    return out
