"""Fine-tune a diffusers pipeline's denoiser with the shared training loop (:class:`hsdp.train.trainer.Trainer`).

The denoiser (``transformer``, ``transformer_2`` or ``unet``, as the pipeline names it) loads sharded with
the same plan rules and ``load_pretrained`` as inference, with peft LoRA adapters injected before sharding when
``--lora-r`` is set. The frozen VAE and text encoders load once, encode every item's latents and caption
encodings (every tensor the pipeline's ``encode_prompt`` returns that the denoiser takes: embeddings, pooled
embeddings, text ids), and are freed before the first step, so the training peak holds only the denoiser, its
gradients, optimizer state and activations. Those that inference shards (:func:`frozen_sharded`: the engine's size
rule, e.g. T5-XXL beside FLUX, UMT5 beside Wan) load sharded on the training mesh with the engine's loader, the
others whole, all on this rank's device (:func:`frozen_pipeline`). With ``--cache-latents`` they go through
:class:`hsdp.train.diffusion.latent_cache.LatentCache`: each rank encodes its share of the missing items, then
every rank reads every item (``--eval-data`` items too). What the run learns from the loaded pipeline besides the
items (its :class:`PromptLayout`, the empty caption's encodings, the validation prompts' encodings) is kept beside
them, so a later run that finds all it needs there (every rank agreeing) loads neither VAE nor text encoders: the
sizes come from the pipeline built on meta (:func:`meta_pipeline`), as the denoiser's call does.

The denoiser's call is the pipeline's own (:mod:`hsdp.train.diffusion.pipeline_call`): its ``__call__`` is run
with the batch's stored caption encodings and a stand-in denoiser that records how it is called (packed latents,
ids, rotary embeddings, masks, guidance, list inputs, the timestep as the pipeline transforms it), and the
recorded call is made on the trained denoiser with the noised latents and sampled timesteps in place. No family
has training code.

Several denoisers (Wan 2.2's two experts, ``--train-component transformer,transformer_2``) load and shard each on
its own and train in turn, one a step (:meth:`DiffusionTrainer.expert_at`), each on its side of the pipeline's
``boundary_ratio`` (:func:`timestep_ranges`), with one AdamW whose other expert has no gradients that step.

Noise and timesteps come from one CPU generator seeded by (seed, step, micro-batch) and drawn for the whole
global micro-batch; each data-parallel rank takes its rows. A run therefore sees the same noise at every world
size and layout, which is what the parity tests compare with one process running diffusers + peft.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import inspect
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hsdp.checkpoint import export_pipeline
from hsdp.config import DTYPES
from hsdp.context_parallel import enable_ulysses, has_cp_plan
from hsdp.distributed import copy_ahead
from hsdp.families import family_for, family_of_model
from hsdp.lora_formats import save_lora
from hsdp.models import description
from hsdp.models.description import describe
from hsdp.train.config import (
    Preflight,
    TrainConfig,
    TrainConfigError,
    check_attention_backend,
    check_export_formats,
    model_fingerprint,
    resume_target,
)
from hsdp.train.data import DatasetError
from hsdp.train.diffusion import evaluation, validation
from hsdp.train.diffusion.frozen import (
    DENOISERS,
    audio_spec,
    encode_items,
    encoder_components,
    frozen_pipeline,
    frozen_sharded,
    load_call_modules,
    media_spec,
    meta_pipeline,
)
from hsdp.train.diffusion.latent_cache import (
    LatentCache,
    agreed_indices,
    all_agree,
    encoder_fingerprint,
    fill_cache,
)
from hsdp.train.diffusion.media import MediaDataset
from hsdp.train.diffusion.objective import Objective, objective_for
from hsdp.train.diffusion.pipeline_call import (
    DenoiserBatch,
    DenoiserCalls,
    PaddingMask,
    PromptLayout,
    Rows,
    batch_prompts,
    encode_captions,
    prompt_layout,
    set_call_settings,
    size_problem,
)
from hsdp.train.trainer import Trainer, TrainResult

logger = logging.getLogger("hsdp")

__all__ = [
    "DiffusionTrainer",
    "DEFAULT_LORA_TARGETS",
    "is_pipeline",
    "diffusion_preflight",
    "check_trainable",
    "EncodedData",
    "frozen_sharded",
    "frozen_pipeline",
    "media_spec",
    "meta_pipeline",
    "encode_items",
    "CONDITIONS",
]

DEFAULT_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
"""The attention projections diffusers' training scripts adapt; every diffusers denoiser has them."""
CONDITIONS = ("image", "images", "video", "mask_image", "control_image", "control_video", "reference_images")
"""``__call__`` parameters of conditioned pipelines (image-to-video, editing, inpainting, refining, control): their
denoiser takes an encoded input besides the caption, which the trainer has no data for."""


def is_pipeline(model_dir: Path) -> bool:
    return description.is_pipeline(model_dir)


def pipeline_denoisers(cfg: TrainConfig, model_dir: Path) -> list[str]:
    """The denoisers of the pipeline in ``model_dir`` (those its index names, in diffusers' order)."""
    model = describe(model_dir)
    present = [n for n in DENOISERS if n in model.components]
    if not present:
        raise TrainConfigError(
            f"--model {cfg.model}: {model.class_name} has no trainable denoiser "
            f"(none of {', '.join(DENOISERS)} among its components)"
        )
    return present


def trained_components(cfg: TrainConfig, model_dir: Path) -> list[str]:
    """The denoisers ``cfg`` trains, in the pipeline's order: ``--train-component`` (one name, several
    comma-separated, or ``all``) or the pipeline's first denoiser."""
    present = pipeline_denoisers(cfg, model_dir)
    if not cfg.train_component:
        return present[:1]
    named = present if cfg.train_component == "all" else [n.strip() for n in cfg.train_component.split(",")]
    unknown = [n for n in named if n not in present]
    if unknown or len(set(named)) != len(named) or not named:
        raise TrainConfigError(
            f"--train-component {cfg.train_component}: {describe(model_dir).class_name} has "
            f"{', '.join(present)}; name one, several comma-separated (each once), or all"
        )
    return [n for n in present if n in named]


def trained_component(cfg: TrainConfig, model_dir: Path) -> str:
    """The first denoiser ``cfg`` trains (:func:`trained_components`): the one whose media sizes and LoRA targets
    the checks read (the experts of one pipeline share its VAE and class)."""
    return trained_components(cfg, model_dir)[0]


def timestep_ranges(model_dir: Path, components: list[str]) -> dict[str, tuple[float, float]]:
    """The fraction of the timesteps each denoiser of ``components`` denoises: all of them, except under the
    pipeline's ``boundary_ratio`` (Wan 2.2's two experts), where ``transformer`` takes ``t >= boundary`` (high
    noise) and ``transformer_2`` the rest, as the pipeline's ``__call__`` switches."""
    boundary = describe(model_dir).index.get("boundary_ratio")
    if boundary is None:
        return dict.fromkeys(components, (0.0, 1.0))
    return {c: (boundary, 1.0) if c == "transformer" else (0.0, boundary) for c in components}


def diffusion_preflight(cfg: TrainConfig, model_dir: Path) -> Preflight:
    """Check a diffusion run's settings and inputs without loading the model."""
    if not Path(cfg.data).exists():
        raise TrainConfigError(f"--data {cfg.data}: no such folder or metadata file")
    lm_only = [
        flag
        for flag, used in (
            ("--eval-split", cfg.eval_split),
            ("--export-merged", cfg.export_merged),
            ("--tensor-parallel-size", cfg.parallel.tensor_parallel_size > 1),
        )
        if used
    ]
    if lm_only:
        raise TrainConfigError(f"{', '.join(lm_only)}: not available for diffusion training yet")
    check_trainable(cfg, model_dir)
    components = trained_components(cfg, model_dir)
    for component in components:
        _check_sequence_parallel(cfg, model_dir, component)
        lora = cfg.lora_config(str(model_dir / component), default_targets=DEFAULT_LORA_TARGETS) if cfg.use_lora else None
        check_export_formats(cfg, model_dir / component, lora)
    check_attention_backend(cfg, "diffusion")
    if len(components) > 1:
        _check_experts(cfg, components)
    fingerprints = {c: model_fingerprint(model_dir / c) for c in components}
    # One denoiser: its own fingerprint, as checkpoints written before several could be trained hold.
    fingerprint = fingerprints[components[0]] if len(components) == 1 else fingerprints
    return Preflight(model_dir, fingerprint, resume_target(cfg, fingerprint))


def _check_experts(cfg: TrainConfig, components: list[str]) -> None:
    """What training several denoisers in one run does not take yet, refused before any rank starts."""
    unsupported = [
        flag for flag, used in (("--lora-adapter", cfg.lora_adapter), ("--eval-data", cfg.eval_data)) if used
    ]
    if unsupported:
        raise TrainConfigError(
            f"{', '.join(unsupported)} with --train-component {cfg.train_component}: not available when several "
            f"denoisers ({', '.join(components)}) train in one run yet; train them one at a time"
        )


def check_trainable(cfg: TrainConfig, model_dir: Path) -> str:
    """The denoiser ``cfg`` trains, once the pipeline is known to be one the trainer builds inputs for (its
    family's training call, latents as the VAE gives them or packed as the family packs them), with a scheduler
    that gives an objective and LoRA targets that match; refused with a :class:`TrainConfigError` otherwise. It
    reads configs only (no data, no weights): ``hsdp plan --train`` refuses with the same check."""
    import diffusers

    from hsdp.lora import adapter_config, check_targets

    components = trained_components(cfg, model_dir)
    pipeline_class = describe(model_dir).class_name
    cls = getattr(diffusers, pipeline_class, None)
    if cls is None:
        raise TrainConfigError(f"--model {cfg.model}: diffusers has no pipeline class {pipeline_class!r}")
    taken = [name for name in CONDITIONS if name in inspect.signature(cls.__call__).parameters]
    if taken:
        raise TrainConfigError(
            f"--model {cfg.model}: training {pipeline_class} needs inputs besides latents, timestep and caption "
            f"(its __call__ takes {', '.join(taken)}: a reference image, video, mask or control), which hsdp's "
            "diffusion trainer does not build yet (text-to-image and text-to-video pipelines train)"
        )
    try:
        audio_spec(model_dir)  # an audio pipeline trains on waveforms its VAE takes, cut to a length it makes
    except ValueError as exc:
        raise TrainConfigError(f"--model {cfg.model}: {exc}") from exc
    objective_for(model_dir)  # a pipeline without a usable scheduler fails here
    for component in components if cfg.use_lora else ():
        try:
            if cfg.lora_adapter:
                adapter_config(cfg.lora_adapter, model_dir / component, "--lora-adapter")
            else:
                config = cfg.lora_config(str(model_dir / component), default_targets=DEFAULT_LORA_TARGETS)
                check_targets(config, model_dir / component, "--lora-target-modules")
        except ValueError as exc:
            raise TrainConfigError(str(exc)) from exc
    return components[0]


def check_diffusion_run(cfg: TrainConfig) -> None:
    """Everything that can be checked before ranks start: settings, model, LoRA targets, and the media (every
    file readable, captioned, of a size the VAE takes)."""
    from hsdp.models.builtin import resolve_model

    problems = cfg.problems()
    if problems:
        raise TrainConfigError("invalid training settings:\n" + "\n".join(f"  - {p}" for p in problems))
    model_dir = resolve_model(cfg.model)
    diffusion_preflight(cfg, model_dir)
    component = trained_component(cfg, model_dir)
    pipe = meta_pipeline(model_dir)
    _check_call_settings(cfg, pipe)
    spec = media_spec(model_dir, component)
    try:
        dataset = MediaDataset.from_source(cfg.data, spec, resolution=cfg.resolution, frames=cfg.frames)
    except DatasetError as exc:
        raise TrainConfigError(str(exc)) from exc
    _check_bucket_sizes(cfg, pipe, dataset)
    if os.environ.get("RANK", "0") == "0":  # once, also under torchrun (every process checks before joining)
        logger.info("%s", dataset.summary(cfg.data))
    if cfg.eval_data:
        evaluation.open_eval_media(cfg, spec)


def _call_settings(cfg: TrainConfig) -> dict:
    """The pipeline ``__call__`` arguments this run sets on every recording pass (:func:`set_call_settings`)."""
    return {"max_sequence_length": cfg.max_sequence_length}


def _check_call_settings(cfg: TrainConfig, pipe) -> None:
    """Each set ``__call__`` argument is one the pipeline takes (a CLIP-only pipeline has no ``max_sequence_length``:
    its encoders' length is fixed); then ``pipe`` calls with them."""
    params = inspect.signature(type(pipe).__call__).parameters
    for name, value in _call_settings(cfg).items():
        if value is not None and name not in params:
            flag = "--" + name.replace("_", "-")
            raise TrainConfigError(
                f"{flag}={value}: {type(pipe).__name__}.__call__ takes no {name} (its text encoders' length is "
                f"fixed); leave {flag} out"
            )
    set_call_settings(pipe, **_call_settings(cfg))


def _check_bucket_sizes(cfg: TrainConfig, pipe, dataset: MediaDataset) -> None:
    """Every size bucket is one the pipeline's own ``check_inputs`` takes (:func:`size_problem`): a size it checks in
    code (LTX: multiples of 32) is refused here with its message, not by each rank after loading."""
    sizes = dict.fromkeys((b.frames, b.height, b.width) for b in dataset.buckets)
    for frames, height, width in sizes:
        problem = size_problem(pipe, (height, width), frames)
        if problem is not None:
            count = sum((b.frames, b.height, b.width) == (frames, height, width) for b in dataset.buckets)
            raise TrainConfigError(
                f"--data {cfg.data}: the {frames} x {height} x {width} size bucket (frames x height x width, "
                f"{count} item(s)) is refused by {type(pipe).__name__}: {problem.rstrip('.')}; resize those files or pick a "
                "--resolution it takes"
            )


def _check_sequence_parallel(cfg: TrainConfig, model_dir: Path, component: str) -> None:
    """``--ulysses-degree`` needs the denoiser's ``_cp_plan`` (where diffusers splits and gathers the sequence)."""
    if cfg.parallel.ulysses_degree <= 1:
        return
    cls = describe(model_dir).components[component].cls()
    name = cls.__name__
    if not has_cp_plan(cls):
        raise TrainConfigError(
            f"--ulysses-degree={cfg.parallel.ulysses_degree}: {component} ({name}) has no _cp_plan, so diffusers "
            "cannot split its sequence; train it with --hsdp-shard-size instead"
        )
    if problem := family_of_model(name).ulysses_problem:
        raise TrainConfigError(
            f"--ulysses-degree={cfg.parallel.ulysses_degree}: {component} ({name}) {problem}; train it with "
            "--hsdp-shard-size instead"
        )


def _call_configs(model_dir: Path) -> str:
    """A digest of the configs the pipeline's ``__call__`` reads besides the encoders' (the pipeline's index, the
    denoisers' ``config.json``), which the cached :class:`PromptLayout` was recorded with."""
    digest = hashlib.sha256()
    for path in [model_dir / description.INDEX_FILE, *(model_dir / n / "config.json" for n in DENOISERS)]:
        digest.update(path.read_bytes() if path.is_file() else b"-")
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class _MicroBatch:
    """This rank's rows of one micro-batch, on its device: what the denoiser takes, and what the loss compares its
    prediction with and weights the rows by."""

    batch: DenoiserBatch
    target: torch.Tensor
    weights: torch.Tensor
    expert: str
    """The denoiser this micro-batch trains (:meth:`DiffusionTrainer.expert_at`)."""


@dataclass
class EncodedData:
    """Latents and caption encodings of every item, encoded once (the frozen encoders are gone)."""

    dataset: MediaDataset
    latents: list[torch.Tensor]
    prompts: list[dict[str, torch.Tensor]]
    """Per item, what ``encode_prompt`` returns for its caption that varies per caption (:class:`PromptLayout`)."""
    empty_prompt: dict[str, torch.Tensor] | None
    """The encodings of the empty caption (caption dropout; None without it)."""


class DiffusionTrainer(Trainer):
    """:class:`Trainer` for a diffusers pipeline's denoiser (see the module docstring)."""

    unit = "samples"

    def _preflight(self) -> Preflight:

        from hsdp.models.builtin import resolve_model

        problems = self.cfg.problems()
        if problems:
            raise TrainConfigError("invalid training settings:\n" + "\n".join(f"  - {p}" for p in problems))
        model_dir = resolve_model(self.cfg.model)
        self.components = trained_components(self.cfg, model_dir)
        self.component = self.components[0]
        checks = diffusion_preflight(self.cfg, model_dir)
        self.pipeline_class = describe(model_dir).pipeline_class()
        return checks

    def _model_config(self) -> dict:
        return dict(family_for(self.pipeline_class.__name__).training_config)

    def _weights_dir(self) -> Path:
        return self.model_dir / self.component

    def _load_model(self) -> torch.nn.Module:
        """The denoiser; several (Wan 2.2's experts, ``--train-component transformer,transformer_2``) in a
        ``ModuleDict`` by component name, each loaded and sharded on its own, so a step gathers only the expert it
        trains and checkpoints key each expert's state by its name."""
        if len(self.components) == 1:
            return self._load_weights(self._weights_dir())
        return torch.nn.ModuleDict({c: self._load_weights(self.model_dir / c) for c in self.components})

    @property
    def experts(self) -> dict[str, torch.nn.Module]:
        """The trained denoisers by component name (one, unless several experts train)."""
        if len(self.components) == 1:
            return {self.component: self.model}
        return dict(self.model.items())

    def _models(self) -> list[torch.nn.Module]:
        return list(self.experts.values())

    def expert_at(self, step: int) -> str:
        """The denoiser step ``step`` (0-based) trains: the experts in turn, one a step (ai-toolkit's switching
        for Wan 2.2), decided by the step alone so that every rank gathers and reduces the same one."""
        return self.components[step % len(self.components)]

    def _step_note(self, step: int) -> str:
        return f"; trained {self.expert_at(step)}" if len(self.components) > 1 else ""

    def _prepare_optimizer(self) -> None:
        """With several experts, a step leaves the others' gradients at None, so AdamW leaves them and their
        moments alone. Their optimizer state is made now (zero moments, step 0: what AdamW's first step of each
        makes), so that a checkpoint holds every expert's state from the first step on (DCP's save would
        otherwise give an expert not yet stepped a state of its own making, with its step count advanced)."""
        if len(self.components) == 1:
            return
        groups = self.optimizer.param_groups
        lrs = [g["lr"] for g in groups]
        for group in groups:
            group["lr"] = 0.0  # AdamW with lr 0 and zero gradients changes no weight (decay is lr * wd)
        for param in self.params:
            param.grad = torch.zeros_like(param)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for group, lr in zip(groups, lrs, strict=True):
            group["lr"] = lr
        for state in self.optimizer.state.values():
            state["step"].zero_()

    def _lora_config(self):
        return self.cfg.lora_config(str(self._weights_dir()), default_targets=DEFAULT_LORA_TARGETS)

    def _enable_activation_checkpointing(self) -> None:
        """diffusers' per-block gradient checkpointing (its ``_supports_gradient_checkpointing`` flag, not the
        ``supports_gradient_checkpointing`` property transformers models have)."""
        for model in self._models():
            if not getattr(model, "_supports_gradient_checkpointing", False):
                raise TrainConfigError(f"--activation-checkpointing: {type(model).__name__} does not support it")
            model.enable_gradient_checkpointing()

    def _enable_sequence_parallel(self) -> None:
        for model in self._models():
            enable_ulysses(model, self.parallel, self.meshes)

    def _items_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.grad_accum

    def _data_state(self) -> dict:
        cfg = self.cfg
        return {"path": str(cfg.data), "resolution": cfg.resolution, "frames": cfg.frames, "seed": cfg.seed}

    def _load_data(self) -> tuple:
        cfg = self.cfg
        self.objectives: dict[str, Objective] = {
            c: objective_for(self.model_dir, sampling=cfg.timestep_sampling, shift=cfg.flow_shift, timestep_range=r)
            for c, r in timestep_ranges(self.model_dir, self.components).items()
        }
        self.objective: Objective = self.objectives[self.component]
        meta = meta_pipeline(self.model_dir)  # configs only: the sizes the VAE and denoiser take
        set_call_settings(meta, **_call_settings(cfg))
        spec = media_spec(self.model_dir, self.component)
        try:
            dataset = MediaDataset.from_source(cfg.data, spec, resolution=cfg.resolution, frames=cfg.frames)
        except DatasetError as exc:
            raise TrainConfigError(str(exc)) from exc
        held_out = evaluation.open_eval_media(cfg, spec) if cfg.eval_data else None
        first = dataset.buckets[0]
        size, frames = (first.height, first.width), first.frames
        records = {"pipeline": f"pipeline-{frames}x{size[0]}x{size[1]}-{_call_configs(self.model_dir)}"}
        calls = validation.validation_calls(cfg, self.model_dir) if cfg.validation_prompts else None
        if calls:  # the prompts' encodings, keyed by the calls hsdp generate would make
            key = hashlib.sha256(json.dumps(calls, sort_keys=True, default=str).encode()).hexdigest()[:12]
            records["validation"] = f"validation-{key}"
        datasets = [dataset] if held_out is None else [dataset, held_out]
        cache = self._latent_cache() if cfg.cache_latents else None
        cached = self._read_cache(cache, datasets, records) if cache is not None else None
        if cached is None:
            encoded, stored = self._encode(datasets, size, frames, cache, records)
        else:
            logger.info("every item is in the latent cache: the VAE and text encoders are not loaded")
            encoded, stored = cached
        self.layout = stored["pipeline"]["layout"]
        prompts = tuple(cfg.validation_prompts)
        self.validation = validation.ValidationPrompts(prompts, stored["validation"], calls) if calls else None
        load_call_modules(meta, self.model_dir, self.device)  # LTX-2's connectors run in the denoiser's call
        self.calls = DenoiserCalls(meta, self.model_dir, self.layout, self.device)
        eval_data = evaluation.encoded(held_out, encoded[1]) if held_out is not None else None
        items = encoded[0]
        latents = [item.pop("latents") for item in items]
        empty = stored["pipeline"]["empty_prompt"] if cfg.caption_dropout else None
        return EncodedData(dataset, latents, items, empty), eval_data

    def _encode(self, datasets: list[MediaDataset], size: tuple[int, int], frames: int, cache: LatentCache | None,
                records: dict[str, str]) -> tuple[list[list[dict]], dict]:  # fmt: skip
        """Load the frozen pipeline and encode with it: each dataset's items (through ``cache`` with
        ``--cache-latents``), and what ``records`` name: the pipeline's :class:`PromptLayout` and the empty
        caption's encodings (``pipeline``), the validation prompts' ``encode_prompt`` returns (``validation``).
        With a cache these are stored beside the items, for a later run to read instead of loading the pipeline,
        which is freed on return."""
        cfg = self.cfg
        pipe = frozen_pipeline(self.model_dir, self.parallel)
        set_call_settings(pipe, **_call_settings(self.cfg))
        layout = prompt_layout(pipe, self.model_dir, size, frames)
        encode = functools.partial(encode_items, pipe, self.model_dir, layout)
        encoded = [
            self._through_cache(cache, d, functools.partial(encode, d)) if cache is not None else encode(d, range(len(d)))
            for d in datasets
        ]
        wanted = cache is not None or cfg.caption_dropout  # a cache keeps it for runs with --caption-dropout
        empty = encode_captions(pipe, self.model_dir, layout, [""], size, frames)[0] if wanted else None
        stored: dict = {"pipeline": {"layout": layout, "empty_prompt": empty}}
        if "validation" in records:
            stored["validation"] = validation.capture_encodings(pipe, self.model_dir, cfg).encodings
        if cache is not None and self.rank == 0:
            for kind, name in records.items():
                cache.put_record(name, stored[kind])
        del pipe, encode  # the frozen encoders are not needed again: free them before the first step
        gc.collect()
        return encoded, stored

    def _latent_cache(self) -> LatentCache:
        """``<output-dir>/latent-cache``, keyed by the encoders' fingerprint."""
        fingerprint = encoder_fingerprint(
            self.model_dir,
            encoder_components(self.model_dir),
            pipeline=self.pipeline_class.__name__,
            # set only when given: the caches of runs at the pipeline's default keep their key
            **{k: v for k, v in _call_settings(self.cfg).items() if v is not None},
        )
        return LatentCache(Path(self.cfg.output_dir or ".") / "latent-cache", fingerprint)

    def _read_cache(self, cache: LatentCache, datasets: list[MediaDataset], records: dict[str, str]) -> tuple | None:
        """``(each dataset's items, what each of records holds)`` when every rank finds all of them whole in
        ``cache`` (a collective decision), else None: the encoders then load and encode what is missing or
        damaged, as on a first run."""
        stored = {kind: cache.get_record(name, safe=[PromptLayout, Rows, PaddingMask]) for kind, name in records.items()}
        pairs = [list(zip(d.items, d.buckets, strict=True)) for d in datasets]
        present = all(cache.has(item.cache_key, bucket) for p in pairs for item, bucket in p)
        if not all_agree(present and all(value is not None for value in stored.values())):
            return None
        encoded = [[cache.get(item.cache_key, bucket) for item, bucket in p] for p in pairs]
        if not all_agree(all(tensors is not None for items in encoded for tensors in items)):  # damaged (get warns)
            return None
        return encoded, stored

    def _through_cache(self, cache: LatentCache, dataset: MediaDataset, encode) -> list[dict[str, torch.Tensor]]:
        """``--cache-latents``: each rank encodes its share of the items missing from ``cache``, then every rank
        reads every item."""
        fill_cache(dataset, cache, encode, self.rank, self.world_size)
        items = [cache.get(item.cache_key, bucket) for item, bucket in zip(dataset.items, dataset.buckets, strict=True)]
        # An item damaged since it was written (get warns) is encoded again here rather than failing the run, and
        # written again so that the next run reads it; every rank encodes the same ones (sharded encoders are
        # collective), whichever rank found them damaged.
        for index in agreed_indices([i for i, tensors in enumerate(items) if tensors is None]):
            encoded = encode([index])[0]
            if items[index] is None:
                items[index] = encoded
                cache.put(dataset.items[index].cache_key, dataset.buckets[index], encoded)
        return items

    def _micro_inputs(self, number: int) -> _MicroBatch:
        cfg = self.cfg
        rows = self.data.dataset.micro_batch(number, cfg.batch_size, cfg.seed)
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + number)
        drop = torch.rand(len(rows), generator=generator) < cfg.caption_dropout
        latents = torch.stack([self.data.latents[i] for i in rows])
        expert = self.expert_at(number // cfg.grad_accum)
        noised = self.objectives[expert].noise(latents, generator)
        prompts = [self._dropped(self.data.prompts[i]) if d else self.data.prompts[i]
                   for i, d in zip(rows, drop.tolist(), strict=True)]  # fmt: skip
        per_rank = cfg.batch_size // self.dp_size
        mine = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        bucket = self.data.dataset.buckets[rows[0]]  # one bucket per micro-batch
        ahead = functools.partial(copy_ahead, device=self.device)
        batch = DenoiserBatch(
            noisy=ahead(noised.noisy[mine]), timesteps=ahead(noised.timesteps[mine]),
            prompts={name: [ahead(t) for t in v] if isinstance(v, list) else ahead(v)
                     for name, v in self.batch_prompts(prompts[mine]).items()},
            size=(bucket.height, bucket.width), frames=bucket.frames,
        )  # fmt: skip
        return _MicroBatch(batch, target=ahead(noised.target[mine]), weights=ahead(noised.weights[mine]), expert=expert)

    def _dropped(self, item: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``item``'s encodings with its caption dropped (``--caption-dropout``): what ``encode_prompt`` gave for it
        replaced by the empty caption's; what other encoding methods gave (Stable Audio's seconds conditioning, the
        clip's own length) kept."""
        empty = self.data.empty_prompt
        return {**item, **{name: empty[name] for name in self.layout.caption_names(empty)}}

    def _micro_loss(self, inputs: _MicroBatch) -> torch.Tensor:
        prediction = self._predict(inputs.batch, inputs.expert)
        per_row = F.mse_loss(prediction.float(), inputs.target.float(), reduction="none").flatten(1).mean(1)
        return (per_row * inputs.weights).mean() / self.cfg.grad_accum

    def batch_prompts(self, items: list[dict[str, torch.Tensor]]) -> dict:
        """Items' caption encodings as one batch (:func:`hsdp.train.diffusion.pipeline_call.batch_prompts`)."""
        return batch_prompts(self.layout, items)

    def denoise(self, noisy: torch.Tensor, timesteps: torch.Tensor, prompts: dict, size: tuple[int, int],
                frames: int = 1) -> torch.Tensor:  # fmt: skip
        """The denoiser's prediction for one batch of this rank (training and ``--eval-data``), as latents;
        ``prompts``: batched (:meth:`batch_prompts`)."""
        on = {n: [t.to(self.device) for t in v] if isinstance(v, list) else v.to(self.device) for n, v in prompts.items()}
        batch = DenoiserBatch(noisy.to(self.device), timesteps.to(self.device), on, size, frames)
        return self._predict(batch, self.component)

    def _predict(self, batch: DenoiserBatch, expert: str) -> torch.Tensor:
        """Denoiser ``expert``'s prediction for a batch already on this rank's device, as latents."""
        kwargs, to_latents = self.calls.kwargs(batch)
        with self._autocast():
            return to_latents(self.experts[expert](**kwargs, return_dict=False)[0])

    def sample(self) -> list:
        """Validation samples of the model as it is now (collective; rank 0 writes them): :mod:`.validation`."""
        return validation.generate_samples(self, self.validation)

    def _validate(self) -> bool:
        cfg, every = self.cfg, self.cfg.validation_every
        due = self.validation and (self.step == 0 or (every and self.step % every == 0) or self.step == cfg.steps)
        if due:
            self.sample()
        return bool(due)

    def data_table(self) -> dict:
        dataset = self.data.dataset
        if dataset.audio is not None:
            audio = dataset.audio
            return {
                "source": str(self.cfg.data),
                "items": len(dataset),
                "unit": "(audio files)",
                "buckets": [[f"{audio.samples} samples ({audio.seconds:g} s at {audio.sampling_rate} Hz, "
                             f"{audio.channels} channels)", len(dataset)]],
                "skipped": [[str(path), why] for path, why in dataset.skipped],
                "upscaled": [],
            }  # fmt: skip
        groups: dict[str, int] = {}
        for bucket in dataset.buckets:
            label = f"{bucket.frames} x {bucket.height} x {bucket.width}"
            groups[label] = groups.get(label, 0) + 1
        clips = sum(b.frames > 1 for b in dataset.buckets)
        upscaled = [
            [str(dataset.items[i].path), f"{h} x {w} is below its bucket {dataset.buckets[i].height} x "
             f"{dataset.buckets[i].width} on a side"]
            for i, h, w in dataset.enlarged
        ]  # fmt: skip (lists: the table travels as JSON in the page)
        return {
            "source": str(self.cfg.data),
            "items": len(dataset),
            "unit": f"({len(dataset) - clips} images, {clips} clips)",
            "buckets": [[f"{label} (frames x height x width)", count] for label, count in groups.items()],
            "skipped": [[str(path), why] for path, why in dataset.skipped],
            "upscaled": upscaled,
        }

    def evaluate(self) -> tuple[float, None]:
        """(loss at fixed timesteps on ``--eval-data``, no perplexity): :mod:`hsdp.train.diffusion.evaluation`."""
        return evaluation.evaluate(self), None

    def _export(self, result: TrainResult) -> None:
        cfg = self.cfg
        if not cfg.export:
            return
        if self.lora:
            result.export = str(self._export_lora(self.component, diffusers=True))
            return
        # Full fine-tuning: the pipeline folder with the trained denoisers (save_pretrained layout).
        dtype = DTYPES[cfg.export_dtype] if cfg.export_dtype else None
        out = export_pipeline(self.experts, self.model_dir, cfg.export, dtype=dtype, run=cfg.run_name())
        result.export = str(out)

    def _export_lora(self, component: str = "transformer", diffusers: bool = False) -> Path:
        """The adapters in each ``--export-format``; on a pipeline with several denoisers (Wan 2.2) one subfolder
        per trained denoiser, named by its component, each keyed as diffusers' loader reads it: ``transformer.``
        for every expert, since ``load_lora_weights(folder, load_into_transformer_2=True)`` puts the file's
        ``transformer.`` keys into ``transformer_2``."""
        cfg = self.cfg
        if len(pipeline_denoisers(cfg, self.model_dir)) == 1:
            return super()._export_lora(component, diffusers, pipeline=self.pipeline_class)
        dtype = DTYPES[cfg.export_dtype] if cfg.export_dtype else None
        for fmt, folder in cfg.export_folders(diffusers).items():
            save_lora(self.experts, self.lora, folder, format=fmt, component=self.pipeline_class.transformer_name,
                      dtype=dtype, run=cfg.run_name(), pipeline=self.pipeline_class)  # fmt: skip
        return Path(cfg.export)
