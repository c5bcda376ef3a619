"""Several LoRA adapters on one sharded base, chosen per call: adapter slots, their contents, and an LRU over them.

peft holds several adapters in one model (``inject_adapter_in_model(..., adapter_name=...)``) and each LoRA layer
adds only its active ones. Adapters injected after FSDP2 has sharded the base would not be sharded, so the engine
injects ``--max-loras`` empty *slots* on meta before ``fully_shard`` (:meth:`SlotSpec.inject`): one peft adapter per
slot, rank ``--max-lora-rank``. Each slot lives in the FSDP unit of the layer it adapts, sharded as that layer is.
The slots cover every linear layer of the denoiser or causal LM (peft's ``all-linear``) or the layers
``--lora-target-modules`` names, and the layers of the adapters given at start, so an adapter loaded at run time
may adapt any of them (:func:`slot_spec` says what a slot costs). Filling a slot from a peft adapter folder (:func:`fill`) copies each
rank's slice of the zero-padded ``lora_A`` (rows past the adapter's rank are zero) and ``lora_B`` (columns past it
are zero): ``B_pad @ A_pad == B @ A``, so any adapter of rank <= the slot's fits; no communication, no re-sharding,
the base is never reloaded. Before each call :func:`activate` makes the call's slots active, each with its
adapter's own per-layer ``lora_alpha / r`` (peft's, rsLoRA and rank/alpha patterns included) times the request's
scale for it, and layers no active adapter adapts run the base alone; no adapter means every slot is off, the base
exactly. Several adapters at once are peft's multi-adapter forward (each active adapter's ``B @ A`` term added in
the order given), which is what diffusers' ``set_adapters([a, b], adapter_weights=[wa, wb])`` activates.

A padded slot computes the same sum as peft with the adapter alone, with zeros added: equal to peft exactly when
the adapter's rank is the slot's, and within float rounding (measured: relative 1e-6) when it is smaller, because
the matmul kernels group a longer inner dimension differently.

A pipeline with several denoisers (Wan 2.2's two experts) has slots in each, and an adapter may adapt several of
them: an export of both experts (one subfolder per denoiser, :func:`hsdp.lora_formats.adapter_parts`) fills each
denoiser's slot from its own part, and an adapter of one denoiser leaves the others' layers off (the base).

The caller side (:class:`AdapterCache`) keeps which adapter sits in which slot, evicts the least recently used
when a new one is needed (never one the same call uses), and counts loads and switches; a call uses one
adapter, or several composed, each with its scale.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hsdp.lora import ADAPTER_WEIGHTS, adapter_config
from hsdp.lora_formats import adapter_parts, as_peft_folder

__all__ = [
    "SlotSpec",
    "AdapterSpec",
    "ActiveAdapter",
    "AdapterCache",
    "UnknownAdapter",
    "describe_adapter",
    "slot_spec",
    "parse_adapters",
    "fill",
    "activate",
]

_UNSUPPORTED = ("use_dora", "lora_bias", "modules_to_save", "trainable_token_indices", "target_parameters")
"""peft LoRA options that change more than ``B @ A`` on the adapted layers; a slot holds only that."""


class UnknownAdapter(ValueError):
    """An adapter name that is not served; the message lists the names that are."""

    def __init__(self, name: str, served: Iterable[str]):
        self.name, self.served = name, sorted(served)
        super().__init__(
            f"no adapter named {name!r}; the adapters served are: {', '.join(self.served) or 'none'}"
        )


def slot_name(slot: int) -> str:
    return f"slot{slot}"


@dataclass(frozen=True)
class AdapterSpec:
    """A peft LoRA adapter folder as the slots need it, read on the caller side from small files only."""

    name: str
    path: Path
    """The folder or LoRA file given (``--lora``)."""
    layers: dict[tuple[str, str], tuple[int, float]]
    """(adapted model, module's qualified name in it) -> (rank, peft's scaling ``lora_alpha / r``); the adapted
    models are named as :func:`hsdp.engine.checks.lora_target` names them (a pipeline's denoisers by component)."""
    weights: dict[str, Path]
    """Adapted model -> the peft adapter folder holding its tensors (a diffusers folder's or LoRA file's conversion,
    :func:`hsdp.lora_formats.as_peft_folder`)."""

    @property
    def given(self) -> Path:
        return self.path

    @property
    def rank(self) -> int:
        return max(r for r, _ in self.layers.values())

    @property
    def modules(self) -> set[str]:
        """The adapted modules' qualified names, whichever model they are in."""
        return {module for _, module in self.layers}


@dataclass(frozen=True)
class SlotSpec:
    """The empty adapter slots injected into the base before sharding (sent to the ranks)."""

    count: int
    rank: int
    targets: tuple[str, ...]
    """Qualified module names; each is a peft target matching exactly that module."""

    def inject(self, model: nn.Module) -> None:
        """A ``load_pretrained(prepare=...)`` hook: ``count`` zero-able adapters on meta, fp32, all off."""
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(r=self.rank, lora_alpha=self.rank, target_modules=list(self.targets))
        for slot in range(self.count):
            inject_adapter_in_model(config, model, adapter_name=slot_name(slot), low_cpu_mem_usage=True)
        for name, param in model.named_parameters():
            is_slot = ".lora_A." in name or ".lora_B." in name
            # Trainable like ``hsdp.lora.injector``'s adapters: FSDP2 needs one dtype among trainable parameters
            # only, so fp32 slots sit beside a bf16 base in one unit.
            param.requires_grad_(is_slot)
            if is_slot and param.dtype != torch.float32:
                param.data = param.data.float()
        activate({"": model}, ())

    def problem(self, adapter: AdapterSpec, flag: str) -> str | None:
        """Why ``adapter`` does not fit these slots (rank or layers), or None."""
        if adapter.rank > self.rank:
            return (
                f"{flag} {adapter.given}: rank {adapter.rank} exceeds the adapter slots' rank {self.rank}; restart "
                f"the server with --max-lora-rank {adapter.rank} (or more)"
            )
        outside = sorted(adapter.modules - set(self.targets))
        if outside:
            return (
                f"{flag} {adapter.given} adapts {len(outside)} layer(s) the adapter slots do not cover "
                f"({', '.join(outside[:3])}...); the slots cover the layers --lora-target-modules selects (default "
                "all-linear with --lora-root) and those of the --lora adapters; restart the server with "
                "--lora-target-modules naming these layers too"
            )
        return None


@dataclass(frozen=True)
class ActiveAdapter:
    """A slot a call uses and each layer's scaling there (the adapter's ``lora_alpha / r`` x the scale)."""

    slot: int
    scaling: dict[tuple[str, str], float]
    """(adapted model, module) -> scaling, as :attr:`AdapterSpec.layers` keys them."""


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """peft's LoRA layers by qualified name (found by their adapter dicts, so a model without any, run once per
    call, does not import peft)."""
    return {
        name: m for name, m in model.named_modules() if isinstance(getattr(m, "lora_A", None), nn.ModuleDict)
    }


Targets = Path | Mapping[str, Path]
"""The models an adapter may adapt: name -> model folder (:func:`hsdp.engine.checks.lora_target`); one folder is
the model ``model``."""


def _targets(targets: Targets) -> dict[str, Path]:
    return dict(targets) if isinstance(targets, Mapping) else {"model": Path(targets)}


def describe_adapter(name: str, folder: str | Path, targets: Targets, flag: str, owner: str = "the model") -> AdapterSpec:
    """Check ``folder`` against the models it adapts (its parts, :func:`hsdp.lora_formats.adapter_parts`, each
    checked by :func:`hsdp.lora.adapter_config`: a peft LoRA folder, a diffusers one or a LoRA file, whose tensors
    are exactly that model's adapter tensors) and read its adapted layers, ranks and scalings by injecting each part
    into its model on meta, as peft would. ``ValueError`` naming ``flag`` otherwise."""
    from peft import inject_adapter_in_model

    from hsdp.loading import build_empty_model, model_class_for

    targets = _targets(targets)
    layers: dict[tuple[str, str], tuple[int, float]] = {}
    weights: dict[str, Path] = {}
    for target, part in adapter_parts(folder, list(targets), owner, flag).items():
        model_dir = targets[target]
        config = adapter_config(part, model_dir, flag, lora_file=True)
        used = [f for f in _UNSUPPORTED if getattr(config, f, None)]
        if used:
            raise ValueError(
                f"{flag} {part}: {', '.join(used)} is set in its adapter_config.json; adapter slots hold plain "
                "LoRA (B @ A on the adapted layers) only; merge it into the base (peft's merge_and_unload) instead"
            )
        model = build_empty_model(model_class_for(model_dir), model_dir, None)
        inject_adapter_in_model(config, model, low_cpu_mem_usage=True)
        for n, m in _lora_layers(model).items():
            layers[target, n] = (m.r["default"], float(m.scaling["default"]))
        # A diffusers-format folder or a LoRA file is read from its peft conversion (as_peft_folder).
        weights[target] = as_peft_folder(part, flag, model_dir).resolve()
    return AdapterSpec(name=name, path=Path(folder).resolve(), layers=layers, weights=weights)


def slot_spec(
    adapters: Iterable[AdapterSpec],
    targets: Targets,
    count: int,
    rank: int | None,
    modules: str | Sequence[str] | None = None,
) -> SlotSpec:
    """Slots covering the layers of ``adapters`` and the layers ``modules`` selects in the first of ``targets``
    (peft's ``target_modules``: ``"all-linear"``, module names or a regex; ``--lora-target-modules``), so that any
    adapter of those layers loads later; with neither, every linear layer (``all-linear``). Of rank ``rank``
    (default: the largest adapter's, 16 without adapters, as vLLM's ``--max-lora-rank``). Every model of ``targets``
    gets the slots (a pipeline's denoisers share a class).

    What a slot costs: ``rank x (in + out)`` fp32 values per covered layer, sharded as the layer is: at most
    ``2 rank / d`` of the layer's weights for layers at least ``d`` wide. A rank-16 slot over ``all-linear``
    (diffusers' default configs, on meta): FLUX.1 (502 layers) 86.6 M values, 330 MiB, 0.73 % of its linear
    weights; Wan 2.1 14B (406 layers) 77.9 M, 297 MiB, 0.55 % (beside 22 / 27 GiB of bf16 weights), divided over
    the ranks that shard them. A layer no active adapter adapts runs the base alone (no extra matmul)."""
    adapters = list(adapters)
    if count < 1:
        raise ValueError(f"--max-loras {count} must be >= 1")
    largest = max((a.rank for a in adapters), default=0)
    if rank is None:
        rank = largest or 16
    if rank < max(largest, 1):
        raise ValueError(
            f"--max-lora-rank {rank} is below the rank {largest} of an adapter given with --lora"
        )
    covered = set().union(*(a.modules for a in adapters))
    if modules is not None or not adapters:
        covered |= _selected_layers(next(iter(_targets(targets).values())), modules or "all-linear")
    return SlotSpec(count=count, rank=rank, targets=tuple(sorted(covered)))


def _selected_layers(model_dir: Path, modules: str | Sequence[str]) -> set[str]:
    """The qualified names of the layers peft adapts in the model of ``model_dir`` (built on meta) for
    ``target_modules=modules``; ``ValueError`` naming ``--lora-target-modules`` when none or not a LoRA layer."""
    from peft import LoraConfig, inject_adapter_in_model

    from hsdp.loading import build_empty_model, model_class_for

    model = build_empty_model(model_class_for(model_dir), model_dir, None)
    given = modules if isinstance(modules, str) else list(modules)
    if given == ["all-linear"]:  # as the command line gives it: peft reads the word only as a string
        given = "all-linear"
    try:
        inject_adapter_in_model(LoraConfig(target_modules=given), model, low_cpu_mem_usage=True)
    except ValueError as exc:  # peft: no module matched, or one of a kind LoRA does not adapt
        raise ValueError(
            f"--lora-target-modules {modules if isinstance(modules, str) else ' '.join(modules)}: {exc}; name "
            "linear layers of the model by name (e.g. to_q ff.net.2) or all-linear"
        ) from None
    return set(_lora_layers(model))


def parse_adapters(values: Iterable[str | Path], flag: str = "--lora") -> dict[str, Path]:
    """``NAME=PATH`` or ``PATH`` (named after its folder, or a LoRA file's stem) -> {name: path}; duplicate names
    are an error."""
    adapters: dict[str, Path] = {}
    for value in values:
        text = str(value)
        name, sep, path = text.partition("=")
        if not sep or not name or "/" in name:  # a bare path (which may itself hold an "=")
            given = Path(text).resolve()
            name, path = given.stem if given.suffix == ".safetensors" else given.name, text
        if name in adapters:
            raise ValueError(
                f"{flag} {text}: the name {name!r} is given twice; name them apart with NAME=PATH"
            )
        adapters[name] = Path(path)
    return adapters


# -- rank side ---------------------------------------------------------------------------------------------------
def _reshard(modules: Iterable[nn.Module]) -> None:
    """Drop the gathered copies FSDP2 keeps after a no-grad forward (the root's, kept-gathered blocks'), so that the
    sharded parameters are the module's parameters again and the next forward gathers what :func:`fill` wrote."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()


@torch.no_grad()
def fill(models: Mapping[str, nn.Module], slot: int, adapter: AdapterSpec) -> int:
    """Copy ``adapter`` into ``slot`` of the LoRA layers in ``models`` (by name, as the adapter's layers name them):
    each rank writes its slice of the zero-padded tensors (layers the adapter does not adapt get zeros). Returns
    the adapter parameters copied."""
    from safetensors import safe_open

    from hsdp.loading import local_slices

    _reshard(models.values())
    name = slot_name(slot)
    copied = 0
    for target, model in models.items():
        with contextlib.ExitStack() as stack:
            weights = adapter.weights.get(target)
            handle = stack.enter_context(safe_open(weights / ADAPTER_WEIGHTS, framework="pt")) if weights else None
            for module_name, layer in _lora_layers(model).items():
                if name not in layer.lora_A:
                    continue
                for part in ("lora_A", "lora_B"):
                    param = getattr(layer, part)[name].weight
                    full = torch.zeros(param.shape, dtype=torch.float32)
                    if (target, module_name) in adapter.layers:
                        stored = handle.get_tensor(f"base_model.model.{module_name}.{part}.weight")
                        full[: stored.shape[0], : stored.shape[1]] = stored
                        copied += stored.numel()
                    local, region = local_slices(param)
                    local.copy_(full[region].reshape(local.shape))
    return copied


def activate(models: Mapping[str, nn.Module], active: Sequence[ActiveAdapter]) -> None:
    """Make ``active``'s slots, in that order, the adapters of every LoRA layer they adapt (each with its scaling);
    a layer none of them adapts, and every layer when ``active`` is empty, runs the base alone."""
    for target, model in models.items():
        for module_name, layer in _lora_layers(model).items():
            names = []
            for adapter in active:
                scaling = adapter.scaling.get((target, module_name))
                if scaling is not None:
                    names.append(slot_name(adapter.slot))
                    layer.scaling[names[-1]] = scaling
            layer._active_adapter = names
            layer._disable_adapters = False


# -- caller side -------------------------------------------------------------------------------------------------
class AdapterCache:
    """Which adapter sits in which slot, least recently used first; counts loads (slot fills) and switches (calls
    whose adapters, none for the base, differ from the previous call's). Thread-safe: adapters are added and removed
    from request handlers while the engine's thread runs calls."""

    def __init__(self, slots: SlotSpec, adapters: Iterable[AdapterSpec] = (), flag: str = "--lora"):
        self.slots = slots
        self.known: dict[str, AdapterSpec] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()
        self.current: tuple[str, ...] = ()
        self.loads = 0
        self.switches = 0
        self.evictions = 0
        self._lock = threading.RLock()
        for adapter in adapters:  # slots made for these adapters fit them; slots given may not
            self._add(adapter, flag)

    def add(self, adapter: AdapterSpec, flag: str) -> None:
        with self._lock:
            self._add(adapter, flag)

    def _add(self, adapter: AdapterSpec, flag: str) -> None:
        if adapter.name in self.known:
            raise ValueError(f"{flag}: an adapter named {adapter.name!r} is already loaded; unload it first")
        problem = self.slots.problem(adapter, flag)
        if problem:
            raise ValueError(problem)
        self.known[adapter.name] = adapter

    def remove(self, name: str) -> None:
        with self._lock:
            self.spec(name)
            del self.known[name]
            self.resident.pop(name, None)

    def spec(self, name: str) -> AdapterSpec:
        with self._lock:
            if name not in self.known:
                raise UnknownAdapter(name, self.known)
            return self.known[name]

    def lookup(self, name: str) -> int | None:
        """The slot holding ``name`` (now the most recently used), or None."""
        with self._lock:
            self.spec(name)
            if name in self.resident:
                self.resident.move_to_end(name)
                return self.resident[name]
            return None

    def free_slot(self, keep: Iterable[str] = ()) -> int:
        """An empty slot, or the least recently used one (evicted) whose adapter is not in ``keep`` (the others
        the same call uses; callers check that the call's adapters fit the slots)."""
        with self._lock:
            used = set(self.resident.values())
            empty = [s for s in range(self.slots.count) if s not in used]
            if empty:
                return empty[0]
            victim = next(name for name in self.resident if name not in set(keep))
            self.evictions += 1
            return self.resident.pop(victim)

    def loaded(self, name: str, slot: int) -> None:
        with self._lock:
            self.resident[name] = slot
            self.loads += 1

    def use(self, chosen: Sequence[tuple[str, int, float]]) -> tuple[ActiveAdapter, ...]:
        """Count the switch (if any) and the per-layer scalings for a call with each ``(name, slot, scale)`` of
        ``chosen`` (none: the base)."""
        with self._lock:
            layers = [self.spec(name).layers for name, _, _ in chosen]  # removed meanwhile: refused
            current = tuple(name for name, _, _ in chosen)
            if current != self.current:
                self.switches += 1
                self.current = current
        return tuple(
            ActiveAdapter(slot, {m: scaling * scale for m, (_, scaling) in adapter.items()})
            for (_, slot, scale), adapter in zip(chosen, layers, strict=True)
        )

    def stats(self) -> dict:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        return {
            "adapters": sorted(self.known),
            "resident": list(self.resident),
            "slots": self.slots.count,
            "rank": self.slots.rank,
            "loads": self.loads,
            "switches": self.switches,
            "evictions": self.evictions,
        }
