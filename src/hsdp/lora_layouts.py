"""The single-file LoRA layouts of ComfyUI and the kohya-based trainers, derived from diffusers' own readers.

A layout is a way of keying one adapter pair: ``<prefix><module>.lora_down.weight`` (A), ``.lora_up.weight`` (B)
and ``.alpha``, where the module is named as the original model's code names it (the family's
:attr:`hsdp.families.Family.original_names`, when its names differ from diffusers') or as diffusers does, with
dots kept (ComfyUI's ``diffusion_model.``) or turned into ``_`` (kohya's ``lora_unet_``, OneTrainer's
``lora_transformer_``). hsdp keeps no per-family layout: for a format it tries each candidate of
:data:`CANDIDATES` in order and writes the first one the pipeline's own ``lora_state_dict`` (diffusers' converters
for the family, what ``load_lora_weights(file)`` runs) reads back into the same ``scale * B @ A`` for every
adapted module; a format no candidate passes is refused, with the formats that do. ``alpha`` is written as the
adapter's ``alpha / r * rank``; a converter that reads no ``alpha`` for some layers (Wan outside its blocks) is
met by the second variant, the scale multiplied into ``lora_up`` and no ``alpha`` (read as ``alpha = rank``).

Before training, :func:`layout_problem` runs the same derivation on a probe adapter of the denoiser's target
modules (random rank-1 pairs, built from its config on the meta device), so a format is refused before any rank
starts.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from peft import LoraConfig

__all__ = ["LAYOUT_FORMATS", "CANDIDATES", "Layout", "single_file_lora", "layout_problem", "readback_problem", "converted_state", "probe_adapter", "sample"]

logger = logging.getLogger("hsdp")

LAYOUT_FORMATS = ("comfyui", "kohya")


@dataclass(frozen=True)
class Layout:
    prefix: str
    original: bool
    """Module names as the original model's code (the family's map), else diffusers'."""
    underscores: bool
    """kohya: the module name's dots become ``_``."""
    folded: bool = False
    peft_pairs: bool = False
    """``lora_A`` / ``lora_B`` (ai-toolkit's ``diffusion_model.`` files) rather than ``lora_down`` / ``lora_up``."""
    """The scale multiplied into ``lora_up`` and no ``alpha`` (readers take ``alpha = rank``), rather than carried
    by ``alpha``."""

    def describe(self) -> str:
        name = "<original layer>" if self.original else "<diffusers module>"
        pairs = "lora_A / lora_B" if self.peft_pairs else "lora_down / lora_up"
        alpha = " (scale in the up weights)" if self.folded else " / alpha"
        return f"{self.prefix}{name.replace('.', '_') if self.underscores else name}.{pairs}{alpha}"


def _both(prefix: str, original: bool, underscores: bool) -> list[Layout]:
    return [Layout(prefix, original, underscores), Layout(prefix, original, underscores, folded=True)]


CANDIDATES: dict[str, list[Layout]] = {
    # ComfyUI's own LoRA files (and ai-toolkit's, musubi-tuner's converted ones): the original layer names.
    "comfyui": [*_both("diffusion_model.", True, False), Layout("diffusion_model.", False, False, True, True)],
    # kohya sd-scripts / musubi-tuner (original names, underscored), then OneTrainer's diffusers names (FLUX).
    "kohya": [*_both("lora_unet_", True, True), *_both("lora_transformer_", False, True)],
}


def _keyed(tensors: dict[str, torch.Tensor], scaling: float, layout: Layout, original: Callable[[str], str]):
    """``<module>.lora_A.weight`` / ``lora_B.weight`` (diffusers names) -> the file's tensors in ``layout``."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        module, part = key.rsplit(".lora_", 1)
        name = original(module) if layout.original else module
        name = layout.prefix + (name.replace(".", "_") if layout.underscores else name)
        down, up = ("lora_A", "lora_B") if layout.peft_pairs else ("lora_down", "lora_up")
        if part == "A.weight":
            out[f"{name}.{down}.weight"] = tensor
            if not layout.folded:  # folded: no alpha, which every reader takes as alpha = rank (scale 1)
                out[f"{name}.alpha"] = torch.tensor(float(scaling * tensor.shape[0]))
        elif part == "B.weight":
            out[f"{name}.{up}.weight"] = tensor * scaling if layout.folded else tensor
        else:
            raise ValueError(f"the adapter holds {key}, which is no lora_A / lora_B weight")
    return out


def converted_state(
    source: str | dict[str, torch.Tensor], pipeline: type, component: str, flag: str
) -> tuple[dict[str, torch.Tensor], LoraConfig]:
    """``<module>.lora_X.weight`` tensors and the ``LoraConfig`` of the LoRA file (or tensors) ``source`` for the
    pipeline's ``component``, as diffusers' ``load_lora_weights`` reads it: ``lora_state_dict`` (the family's
    converters: kohya, musubi-tuner, ComfyUI...), peft key names, then ``get_peft_kwargs`` (ranks from the tensors,
    the file's network alphas, else alpha = rank). Keys of other components (a text encoder's) are named in a
    warning and not applied; a file with none for ``component`` is refused with the keys it has and the keys
    expected."""
    from diffusers.utils import convert_unet_state_dict_to_peft
    from diffusers.utils.peft_utils import get_peft_kwargs
    from peft import LoraConfig

    try:
        out = pipeline.lora_state_dict(source)
    except Exception as exc:  # noqa: BLE001 - diffusers' converters raise many kinds on keys they do not know
        raise ValueError(
            f"{flag} {_named(source)}: diffusers' {pipeline.__name__}.lora_state_dict does not read this file "
            f"({exc!r}); pass a LoRA file of this model family (kohya, ComfyUI or diffusers keys) or a peft adapter "
            "folder"
        ) from exc
    state, alphas = (out[0], out[1] if len(out) > 1 else None) if isinstance(out, tuple) else (out, None)
    prefix = f"{component}."
    mine = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    if not mine:
        raise ValueError(
            f"{flag} {_named(source)}: none of its {len(state)} LoRA keys (as diffusers' {pipeline.__name__} "
            f"converters read them) is for the {component}: found {sample(state)}; expected keys like "
            f"{prefix}<module>.lora_A.weight. Pass a LoRA trained for this model family"
        )
    others = sorted(set(state) - {prefix + k for k in mine})
    if others:
        logger.warning(
            "%s %s: %d LoRA keys for other components than the %s are not applied (%s)",
            flag, _named(source), len(others), component, sample(others),
        )  # fmt: skip
    if not any(".lora_A." in k for k in mine):
        mine = convert_unet_state_dict_to_peft(mine)
    ranks = {f"^{k}": v.shape[1] for k, v in mine.items() if ".lora_B." in k and v.ndim > 1}
    if not ranks:  # LoKr, LoHa, ...: other factorizations than B @ A
        raise ValueError(
            f"{flag} {_named(source)}: no LoRA pair (lora_A / lora_B, lora_down / lora_up) among its keys for the "
            f"{component}: found {sample(mine)}; hsdp applies LoRA adapters only"
        )
    alphas = {k.removeprefix(prefix): v for k, v in (alphas or {}).items() if k.startswith(prefix)} or None
    return mine, LoraConfig(**get_peft_kwargs(ranks, network_alpha_dict=alphas, peft_state_dict=mine))


def _named(source) -> str:
    return source if isinstance(source, str) else "(the converted adapter)"


def sample(keys: Iterable[str], count: int = 3) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:count]) + (f" ... ({len(keys)} in all)" if len(keys) > count else "")


def _scale_of(config: LoraConfig, module: str) -> float:
    """``lora_alpha / r`` that ``config`` gives ``module`` (its rank / alpha patterns, as peft matches them)."""

    def pick(pattern: dict, default):
        for key, value in pattern.items():
            if re.fullmatch(rf"(.*\.)?(?:{key.lstrip('^')})", module):
                return value
        return default

    r = pick(config.rank_pattern or {}, config.r)
    alpha = pick(config.alpha_pattern or {}, config.lora_alpha)
    return alpha / (r**0.5 if config.use_rslora else r)


def readback_problem(
    pipeline: type, component: str, written: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], scaling: float
) -> str | None:
    """Read ``written`` as diffusers' ``pipeline.load_lora_weights`` reads a file (``lora_state_dict``, then
    ``get_peft_kwargs``; :func:`hsdp.lora_formats.converted_state`): None when every module of ``tensors`` comes
    back with the same ``scale * B @ A`` (and no other), else what differs."""
    try:  # on copies: some converters scale or pop their input in place
        back, config = converted_state({k: v.clone() for k, v in written.items()}, pipeline, component, "export")
    except Exception as exc:  # noqa: BLE001 - diffusers' converters raise many kinds on keys they do not know
        cause = exc.__cause__ or exc
        said = " ".join(str(cause).split())[:160]
        return f"{pipeline.__name__}.lora_state_dict does not read it ({type(cause).__name__}: {said})"
    modules = {k.rsplit(".lora_", 1)[0] for k in tensors}
    found = {k.rsplit(".lora_", 1)[0] for k in back if ".lora_A." in k or ".lora_B." in k}
    if found != modules:
        differ = sorted(found ^ modules)
        return f"{pipeline.__name__}.lora_state_dict reads back other modules ({len(differ)} differ, e.g. {differ[:3]})"
    for module in sorted(modules):
        a, b = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
        a2, b2 = back[f"{module}.lora_A.weight"], back[f"{module}.lora_B.weight"]
        want = scaling * (b.double() @ a.double())
        got = _scale_of(config, module) * (b2.double() @ a2.double())
        if want.shape != got.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item()):
            return f"{pipeline.__name__}.lora_state_dict reads {module} back as another update (scale * B @ A)"
    return None


def single_file_lora(
    fmt: str,
    tensors: dict[str, torch.Tensor],
    scaling: float,
    pipeline: type,
    component: str,
    original: Callable[[str], str] | None,
) -> dict[str, torch.Tensor]:
    """The ``fmt`` file of the adapter ``tensors`` (diffusers module names) of ``pipeline``'s ``component``: the
    first of :data:`CANDIDATES` diffusers reads back; ``ValueError`` naming each candidate's problem otherwise."""
    problems = []
    for layout in CANDIDATES[fmt]:
        try:
            written = _keyed(tensors, scaling, layout, original or str)
        except ValueError as exc:
            problems.append(f"{layout.describe()}: {exc}")
            continue
        problem = readback_problem(pipeline, component, written, tensors, scaling)
        if problem is None:
            return written
        problems.append(f"{layout.describe()}: {problem}")
    raise ValueError(f"no {fmt} layout of {pipeline.__name__}'s LoRA reads back in diffusers (tried " + "; ".join(problems) + ")")


def probe_adapter(model_class: type, config_dict: dict, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """Random rank-1 pairs for the modules ``lora`` targets in a ``model_class`` built from ``config_dict`` on the
    meta device (no weights read): what :func:`layout_problem` converts."""
    from peft.tuners.tuners_utils import check_target_module_exists

    with torch.device("meta"):
        model = model_class.from_config(config_dict)
    generator = torch.Generator().manual_seed(0)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and check_target_module_exists(lora, name):
            out[f"{name}.lora_A.weight"] = torch.randn(1, module.in_features, generator=generator)
            out[f"{name}.lora_B.weight"] = torch.randn(module.out_features, 1, generator=generator)
    return out


def layout_problem(fmt: str, pipeline: type, component: str, probe: dict[str, torch.Tensor], original) -> str | None:
    """Why ``fmt`` cannot be written for ``pipeline``'s ``component`` (its probe adapter, :func:`probe_adapter`),
    or None."""
    try:
        single_file_lora(fmt, probe, 2.0, pipeline, component, original)
    except ValueError as exc:
        return str(exc)
    return None
