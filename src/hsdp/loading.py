"""Sharded loading: build on meta, shard, then fill each rank's shards straight from safetensors.

No rank ever holds the whole model: parameters are created on the meta device (buffers are created for real,
since non-persistent ones such as rotary ``inv_freq`` are computed in ``__init__`` and are not in checkpoints),
FSDP2 shards the empty model, ``to_empty`` allocates only this rank's shards, and each shard is read with
``safe_open(...).get_slice`` so only this rank's rows leave the file. Every problem with the checkpoint
(missing file, corrupt header, missing or unexpected key, wrong shape) is found from the file headers before
anything is allocated, on every rank alike, so no rank waits for another that failed. Checkpoints that transformers
converts while loading (legacy key names, mixture-of-experts tensors stored per expert) are mapped with transformers'
own conversions (:mod:`hsdp.conversions`), and a rank reads only the experts of its rows of a fused parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hsdp.config import DTYPES, ParallelConfig
from hsdp.distributed import local_device
from hsdp.mesh import ParallelMeshes
from hsdp.models.description import ModelDescription, class_for_folder
from hsdp.safetensors_index import CheckpointError, CheckpointIndex, read_checkpoint_index
from hsdp.shard_rules import ShardPlan
from hsdp.sharding import apply_hsdp_to_model, fsdp_units, host_params, parameter_bytes
from hsdp.stored_quant import StoredFormat, StoredQuantWeight, decode_rows, read_layout

if TYPE_CHECKING:
    from hsdp.conversions import FusedParam, KeyPlan

logger = logging.getLogger("hsdp")

__all__ = [
    "load_pretrained",
    "CheckpointError",
    "CheckpointIndex",
    "read_checkpoint_index",
    "model_class_for",
    "build_empty_model",
    "build_component",
]

def model_class_for(folder: Path) -> type[nn.Module]:
    """The model class of a component or model folder, as every command resolves it
    (:func:`hsdp.models.description.class_for_folder`: a pipeline's own entry, else ``config.json``'s class)."""
    return class_for_folder(folder)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device while buffers are created for real (they are small and some are
    computed, not loaded)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _build_empty(cls: type[nn.Module], folder: Path, config: Mapping[str, Any]) -> nn.Module:
    with _parameters_on_meta():
        if hasattr(cls, "from_config") and not hasattr(cls, "_from_config"):  # diffusers
            return cls.from_config({**cls.load_config(folder), **config})
        if config:
            raise ValueError(f"config overrides {sorted(config)} are for diffusers models, not {cls.__name__}")
        from transformers import AutoConfig

        return cls._from_config(AutoConfig.from_pretrained(folder))


def build_empty_model(
    cls: type[nn.Module], folder: Path, dtype: torch.dtype | None, config: Mapping[str, Any] | None = None
) -> nn.Module:
    """``cls`` as ``folder``'s config describes it (``config``'s fields set over it, as ``from_pretrained``'s keyword
    arguments set them), parameters on meta in ``dtype`` (None: as built), tied weights still tied. The one build
    both loading and ``hsdp plan`` use, so the planner counts what loading makes."""
    model = _build_empty(cls, folder, config or {})
    if dtype is not None:
        _cast(model, dtype)
    return model


def build_component(
    description: ModelDescription, name: str, dtype: torch.dtype | None = None, *, empty: bool = True
) -> Any:
    """Component ``name`` of a described pipeline, as every command builds it: with a ``config.json``, on meta
    (``empty``; :func:`build_empty_model`, no weights read) or loaded whole by its class's ``from_pretrained`` in
    ``dtype``; without one (tokenizers, processors, a guider), loaded as saved. The class is the description's
    (diffusers, transformers or the pipeline's own module)."""
    component = description.components[name]
    cls = component.cls()
    if component.has_config and empty:
        return build_empty_model(cls, component.folder, dtype)
    if component.has_config and dtype is not None:
        return cls.from_pretrained(component.folder, torch_dtype=dtype)
    return cls.from_pretrained(component.folder)


def _cast(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters to ``dtype``, except those the model keeps in fp32 (norms, time embedders), matched
    on the dotted name's parts as diffusers and transformers do."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    cast: dict[nn.Parameter, nn.Parameter] = {}  # tied parameters are cast once and stay tied
    for module_name, module in model.named_modules(remove_duplicate=False):
        for pname, param in list(module._parameters.items()):
            full_name = f"{module_name}.{pname}" if module_name else pname
            if param is None or keep.intersection(full_name.split(".")):
                continue
            if not param.is_floating_point() or param.dtype == dtype:
                continue
            if param not in cast:
                cast[param] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
            setattr(module, pname, cast[param])


def _resolve_dtype(dtype: torch.dtype | str | None, index: CheckpointIndex) -> torch.dtype | None:
    if dtype is None or dtype == "auto":
        return index.floating_dtype
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of auto, {', '.join(sorted(DTYPES))}")
        return DTYPES[dtype]
    return dtype


def _key_plan(model: nn.Module, index: CheckpointIndex) -> KeyPlan:
    """Map checkpoint keys to model keys through transformers' load-time conversions (renamed and fused keys);
    raise naming every missing, unexpected or misshapen key, and the file it is in."""
    from hsdp.conversions import plan_keys

    plan = plan_keys(model, index.tensors)
    state = model.state_dict(keep_vars=True)
    # A conversion that failed is reported as such, not also as its parameter missing.
    produced = set(plan.direct).union(*(p.shapes for p in plan.fused), (p.first_target for p in plan.fused))
    missing = _missing(model, state, produced)
    unexpected = _unexpected(model, plan, state)
    wrong = [
        f"{key} in {index.tensors[stored].file.name}: checkpoint {list(index.tensors[stored].shape)}, "
        f"model {list(state[key].shape)}"
        for key, stored in plan.direct.items()
        if tuple(state[key].shape) != index.tensors[stored].shape
    ]
    failed = [
        f"{_fused_origin(f.first_target, f, index)}: {f.error}" for f in plan.fused if f.error is not None
    ]
    for fused in plan.fused:
        wrong.extend(
            f"{_fused_origin(key, fused, index)}: checkpoint {list(shape)}, model {list(state[key].shape)}"
            for key, shape in fused.shapes.items()
            if key in state and shape != state[key].shape
        )
    problems = []
    if missing:
        problems.append(f"missing keys (in the model, not in the checkpoint): {', '.join(missing[:10])}")
    if unexpected:
        files = sorted({index.tensors[k].file.name for k in unexpected})
        named = [k if r == k else f"{k} (renamed {r})" for k, r in list(unexpected.items())[:10]]
        problems.append(f"unexpected keys in {', '.join(files)}: {', '.join(named)}")
    if wrong:
        problems.append("shape mismatch: " + "; ".join(wrong[:10]))
    if failed:
        problems.append("transformers' load-time conversion failed: " + "; ".join(failed[:10]))
    if problems:
        raise CheckpointError(
            f"checkpoint {index.folder} does not match {type(model).__name__}:\n  " + "\n  ".join(problems)
        )
    return plan


def _missing(model: nn.Module, state: dict[str, torch.Tensor], produced: set[str]) -> list[str]:
    """Model keys the checkpoint does not produce; a tied alias produced under another name is fine."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    return [
        key
        for key, tensor in state.items()
        if key not in produced and not any(alias in produced for alias in aliases.get(id(tensor), ()))
    ]


def _unexpected(model: nn.Module, plan: KeyPlan, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Stored keys that fill nothing in the model -> the name they were renamed to, less those the model ignores."""
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unexpected = {
        key: renamed
        for key, renamed in plan.unexpected.items()
        if not any(p.search(key) or p.search(renamed) for p in ignore)
    }
    for fused in plan.fused:  # a conversion with several outputs may make some the model does not have
        if extra := [key for key in fused.shapes if key not in state]:
            unexpected[fused.stored_keys[0]] = ", ".join(extra)
    return unexpected


def _fused_origin(key: str, fused: FusedParam, index: CheckpointIndex) -> str:
    """A model key one transformers conversion builds, with the stored keys and files it is built from."""
    keys = fused.stored_keys
    files = ", ".join(sorted({index.tensors[k].file.name for k in keys}))
    return f"{key} (fused from {len(keys)} keys such as {keys[0]} in {files})"


def stored_view(index: CheckpointIndex) -> tuple[CheckpointIndex, dict[str, StoredFormat]]:
    """``index`` with each tensor kept in its stored bytes (GGUF, fp8-scaled: the files' ``__metadata__``,
    :mod:`hsdp.stored_quant`) shown in its own shape and as no floating dtype (``dtype="auto"`` takes the
    checkpoint's plain tensors' dtype, the compute dtype), and those tensors' formats."""
    layout: dict[str, StoredFormat] = {}
    for file in sorted({e.file for e in index.tensors.values()}):
        with safe_open(file, framework="pt") as handle:
            layout.update(read_layout(handle.metadata()))
    if not layout:
        return index, layout
    tensors = {k: dataclasses.replace(e, shape=layout[k].shape, dtype=torch.uint8) if k in layout else e
               for k, e in index.tensors.items()}  # fmt: skip
    return CheckpointIndex(index.folder, tensors), layout


def local_slices(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's storage for ``tensor`` and the region of the full tensor it holds."""
    if isinstance(tensor, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        return tensor.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    return tensor, tuple(slice(0, n) for n in tensor.shape)


def _read_slice(handle: Any, key: str, region: tuple[slice, ...]) -> torch.Tensor:
    """Read ``region`` of one stored tensor; every read of tensor data goes through here (tests count them)."""
    return handle.get_slice(key)[region] if region else handle.get_tensor(key)


class _Reader:
    """Reads stored tensors by key and counts the bytes read. Files stay open until :meth:`close`, which the
    callers do after each group of reads so that no more of the checkpoint than that group stays mapped."""

    def __init__(self, index: CheckpointIndex) -> None:
        self.index = index
        self.bytes_read = 0
        self._files = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}

    def read(self, key: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """``region`` of ``key`` (the whole tensor when None)."""
        entry = self.index.tensors[key]
        if entry.file not in self._handles:
            self._handles[entry.file] = self._files.enter_context(safe_open(entry.file, framework="pt"))
        if region is None:
            region = tuple(slice(0, n) for n in entry.shape)
        chunk = _read_slice(self._handles[entry.file], key, region)
        self.bytes_read += chunk.numel() * chunk.element_size()
        return chunk

    def close(self) -> None:
        self._files.close()
        self._handles.clear()


def _fill_direct(
    targets: dict[str, torch.Tensor], plan: KeyPlan, reader: _Reader, layout: Mapping[str, StoredFormat]
) -> None:
    """Read each model key stored as is (or only renamed), one file at a time, only this rank's region. A weight
    kept in its stored bytes (``layout``, :mod:`hsdp.stored_quant`) is read as the stored bytes of this rank's
    rows: copied as they are into a :class:`~hsdp.stored_quant.StoredQuantWeight`, dequantized into any other."""
    by_file: dict[Path, list[str]] = {}
    for key, stored in plan.direct.items():
        by_file.setdefault(reader.index.tensors[stored].file, []).append(key)
    for keys in by_file.values():
        for key in keys:
            local, region = local_slices(targets[key])
            if local.numel() == 0:
                continue
            stored = plan.direct[key]
            if stored in layout:
                chunk = reader.read(stored, (region[0], slice(None)))  # whole stored rows: a row is whole blocks
                local.copy_(chunk if isinstance(local, StoredQuantWeight)
                            else decode_rows(chunk, layout[stored], local.dtype, region).reshape(local.shape))  # fmt: skip
                continue
            local.copy_(reader.read(stored, region).reshape(local.shape))
        reader.close()


def _fill_fused(
    model: nn.Module, fused: FusedParam, targets: dict[str, torch.Tensor], reader: _Reader
) -> None:
    """Convert stored tensors into this rank's shards of the parameters one transformers conversion builds.

    When row ``i`` of the parameter comes from the ``i``-th stored tensor (experts stacked along dim 0, which is
    the dim FSDP2 shards), only the stored tensors of this rank's rows are read. Any other conversion reads all
    its stored tensors, converts them, and keeps this rank's region.
    """
    if fused.stacks_rows():
        (key,) = fused.shapes
        local, region = local_slices(targets[key])
        if local.numel() == 0:
            return
        rows, inner = region[0], (slice(None), *region[1:])
        tensors = {p: [reader.read(k) for k in keys[rows]] for p, keys in fused.sources.items()}
        local.copy_(fused.convert(model, tensors)[key][inner].reshape(local.shape))
        return
    tensors = {p: [reader.read(k) for k in keys] for p, keys in fused.sources.items()}
    for key, full in fused.convert(model, tensors).items():
        local, region = local_slices(targets[key])
        if local.numel():
            local.copy_(full[region].reshape(local.shape))


@torch.no_grad()
def _fill(
    model: nn.Module, plan: KeyPlan, index: CheckpointIndex, moved: dict[str, str],
    layout: Mapping[str, StoredFormat] | None = None,
) -> int:  # fmt: skip
    """Fill this rank's shards from the checkpoint; returns the bytes read. ``moved`` maps the keys the plan
    knows to the keys a ``prepare`` hook moved them to."""
    targets = model.state_dict(keep_vars=True)
    targets.update({old: targets[new] for old, new in moved.items()})
    reader = _Reader(index)
    try:
        _fill_direct(targets, plan, reader, layout or {})
        for fused in plan.fused:
            _fill_fused(model, fused, targets, reader)
            reader.close()
    finally:
        reader.close()
    return reader.bytes_read


def _move_unsharded_state(model: nn.Module, device: torch.device) -> None:
    """Move buffers and the parameters FSDP2 does not manage (plain tensors) to ``device``."""
    with torch.no_grad():
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
            for param in module._parameters.values():
                if param is not None and not isinstance(param, DTensor):
                    param.data = param.data.to(device)


def _run_prepare(model: nn.Module, prepare: Callable[[nn.Module], None]) -> dict[str, str]:
    """Run ``prepare`` on the empty model; return old -> new state-dict key of every tensor it moved (LoRA
    injection puts each adapted layer's weight under ``<layer>.base_layer``)."""

    def keys_by_tensor() -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for key, tensor in model.state_dict(keep_vars=True).items():
            out.setdefault(id(tensor), []).append(key)
        return out

    before = keys_by_tensor()
    prepare(model)
    after = keys_by_tensor()
    return {
        old: new
        for tensor_id, olds in before.items()
        for old, new in zip(olds, after.get(tensor_id, olds), strict=False)
        if old != new
    }


def _allocate(model: nn.Module, device: torch.device, host: Collection[nn.Parameter] = ()) -> None:
    """Give the empty model real (uninitialised) storage on ``device``, keeping what it computed at build time;
    the ``host`` parameters (the shards of layerwise-offloaded blocks) in host memory, so the device never holds
    them, not even while loading."""
    computed_buffers = {n: b for n, b in model.named_buffers() if not b.is_meta}  # e.g. rotary inv_freq
    if host:
        _to_empty_split(model, device, {id(p) for p in host})
    else:
        model.to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # to_empty gives each alias of a tied parameter its own storage
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in computed_buffers:
                buffer.copy_(computed_buffers[name])


def _to_empty_split(model: nn.Module, device: torch.device, host: set[int]) -> None:
    """``model.to_empty(device=device)``, except the parameters whose ids are in ``host``, which go to host memory:
    module by module (``to_empty`` swaps each parameter for a new one, as here), then FSDP2 re-reads every unit's
    new shards (what ``FSDPModule._apply`` does after ``to_empty``; it also pins the host ones where it should)."""
    cpu = torch.device("cpu")
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                target = cpu if id(param) in host else device
                module._parameters[key] = nn.Parameter(torch.empty_like(param, device=target), param.requires_grad)
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = torch.empty_like(buffer, device=device)
    for _, unit in fsdp_units(model):
        group = unit._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            fsdp_param.reset_sharded_param()


def _local_folder(path: str | Path, revision: str | None, subfolder: str | None, variant: str | None) -> Path:
    """``path``, or a hub name's snapshot (:func:`hsdp.models.builtin.resolve_model`), then its ``subfolder``,
    with ``variant``'s weights (:func:`hsdp.models.variant.with_variant`)."""
    from hsdp.models.hub import is_hub_name

    folder = Path(path)
    # A missing folder that is no hub name stays as given: the checkpoint checks name it (CheckpointError).
    if (not folder.exists() and is_hub_name(str(path))) or revision is not None:
        from hsdp.models.builtin import resolve_model

        folder = resolve_model(path, revision=revision, variant=variant)
    folder = folder / subfolder if subfolder else folder
    if variant:
        from hsdp.models.variant import with_variant

        folder = with_variant(folder, variant)
    return folder


def load_pretrained(
    path: str | Path,
    parallel_config: ParallelConfig | None = None,
    *,
    model_class: type[nn.Module] | None = None,
    dtype: torch.dtype | str | None = "auto",
    meshes: ParallelMeshes | None = None,
    training: bool = False,
    resident_modules: Collection[str] = (),
    forward_prefetch: int = 0,
    prepare: Callable[[nn.Module], None] | None = None,
    weight_dtype: str | None = None,
    plan: ShardPlan | Callable[[nn.Module], ShardPlan] | None = None,
    model_config: Mapping[str, Any] | None = None,
    revision: str | None = None,
    subfolder: str | None = None,
    variant: str | None = None,
) -> nn.Module:
    """Load a Hugging Face model folder or a diffusers component folder, sharded as ``parallel_config`` says.

    ``dtype="auto"`` keeps the checkpoint's floating dtype; pass ``torch.float32`` (or ``"bf16"``) to convert.
    The model is returned in eval mode (call ``.train()`` for training) and carries the :class:`ShardReport` as
    ``model.hsdp_report`` when sharded. ``resident_modules`` and ``forward_prefetch`` are passed to
    :func:`~hsdp.sharding.apply_hsdp_to_model`. ``prepare(model)`` runs on the empty (meta) model after the
    checkpoint is validated and before sharding, e.g. to inject LoRA adapters; parameters it adds are left
    uninitialised for the caller to fill. ``plan`` overrides the shard plan
    :func:`~hsdp.shard_rules.resolve_plan` would pick: a plan, or a function of the empty model that returns one
    (e.g. ``lambda m: resolve_plan(m).with_ignored(["lm_head"])``). ``path`` may be a Hugging Face Hub name
    (``org/name`` at ``revision``; ``subfolder``: a pipeline's component, e.g. ``transformer``): every rank resolves
    it, one per node downloads (:mod:`hsdp.models.hub`); ``variant`` (``fp16``) reads that variant's weights. ``model_config`` sets fields over a diffusers model's
    ``config.json`` (:func:`build_empty_model`). ``weight_dtype`` (``int8``, ``fp8``) stores the Linear weights in 8 bits,
    each rank quantizing its rows as it reads them (:mod:`hsdp.quantize`; needs ``use_hsdp``). Needs the process
    group to be initialised when the layout has more than one rank.
    """
    started = time.perf_counter()
    folder = _local_folder(path, revision, subfolder, variant)
    config = (parallel_config or ParallelConfig()).resolved()
    cls = model_class or model_class_for(folder)
    if weight_dtype is not None and not config.use_hsdp:
        raise ValueError(
            f"--weight-dtype {weight_dtype} stores 8-bit weight shards, which needs --use-hsdp with "
            "--hsdp-shard-size 2 or more"
        )
    index, layout = stored_view(read_checkpoint_index(folder))
    if weight_dtype is not None and layout:
        raise ValueError(
            f"--weight-dtype {weight_dtype}: {folder} is a GGUF / fp8-scaled checkpoint, already quantized and kept in "
            "its stored bytes; drop --weight-dtype"
        )
    model = build_empty_model(cls, folder, _resolve_dtype(dtype, index), model_config)
    keys = _key_plan(model, index)  # validate before any allocation
    moved = _run_prepare(model, prepare) if prepare is not None else {}
    if keys.converted:
        logger.info(
            "%s: transformers' load-time conversions rename %d keys and build %d parameters from several keys",
            folder,
            sum(model_key != stored for model_key, stored in keys.direct.items()),
            len(keys.fused),
        )
    device = local_device()
    report = None
    if config.use_hsdp:
        report = apply_hsdp_to_model(
            model,
            config,
            meshes=meshes,
            plan=plan(model) if callable(plan) else plan,
            training=training,
            resident_modules=resident_modules,
            forward_prefetch=forward_prefetch,
            weight_dtype=weight_dtype,
            stored_layout={moved.get(k, k): v for k, v in layout.items()},  # LoRA's base_layer, where it moved
        )
    # With CPU offload FSDP2 keeps the sharded parameters in host memory; buffers and replicated parameters
    # still belong on the device (moved after filling). Layerwise offload allocates each parameter where it lives.
    offload = config.use_hsdp and config.cpu_offload and device.type != "cpu"
    if report is not None and report.offloaded_modules:
        _allocate(model, device, host=host_params(model))
    else:
        _allocate(model, torch.device("cpu") if offload else device)
    read = _fill(model, keys, index, moved, layout)
    if offload:
        _move_unsharded_state(model, device)
    model.eval()
    model.hsdp_report = report
    local, total = parameter_bytes(model)
    logger.info(
        "Loaded %s from %s: read %.1f MiB, holding %.1f of %.1f MiB of parameters on this rank (%.2fs)",
        cls.__name__,
        folder,
        read / 2**20,
        local / 2**20,
        total / 2**20,
        time.perf_counter() - started,
    )
    return model
