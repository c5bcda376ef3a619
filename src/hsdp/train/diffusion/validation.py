"""Validation samples (``--validation-prompt``, ``--validation-every``): the model being trained, generating.

Before the first step, every ``--validation-every`` steps and at the end, every rank puts the trained denoiser,
still sharded on the training layout, into the unchanged diffusers pipeline and calls it as ``hsdp generate`` does:
the requests and parameters come from the engine's :func:`hsdp.engine.params.build_requests` (the model's
generation defaults, ``--validation-negative-prompt``, ``--validation-cfg-scale``), the pipeline arguments from the
engine's :func:`hsdp.engine.diffusion.call_kwargs`, and the initial noise from a CPU generator seeded with
``--seed`` for every prompt, so successive samples differ only by training and each equals ``hsdp generate`` of the
same weights, prompt and seed. Rank 0 writes each prompt's video or image with the engine's writers to
``<output_dir>/samples/step-<N>/<i>-<prompt>.mp4`` (``.png`` for image pipelines, ``.wav`` for audio ones).

The trainer frees the text encoders before the first step, so each prompt's encodings are taken once, up front:
the pipeline's own ``__call__`` runs with the encoders loaded (denoisers on meta) until its first denoiser call,
and every return of its encoding methods before it (``encode_prompt``, and Stable Audio's ``encode_duration``:
:func:`hsdp.train.diffusion.pipeline_call.encoding_methods`) is recorded in order (one call with the negative embeddings inside
for Wan and SDXL, a second call for the negative prompt under FLUX's true CFG). Each validation replays them in
that order in place of ``encode_prompt``. The VAE and scheduler are loaded for each validation and dropped after
it, so the training peak does not hold them.
"""

from __future__ import annotations

import gc
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger("hsdp")

__all__ = ["ValidationPrompts", "capture_encodings", "validation_calls", "generate_samples", "sample_paths"]


class _Encoded(Exception):
    """Stops a pipeline call at its first denoiser call (the capture needs nothing after the encodings)."""


@dataclass
class ValidationPrompts:
    prompts: tuple[str, ...]
    encodings: list[list]
    """Per prompt, what each ``encode_prompt`` call inside the pipeline's ``__call__`` returned, in call order."""
    calls: list[dict]
    """Per prompt, the pipeline's ``__call__`` arguments as ``hsdp generate`` passes them (:func:`validation_calls`),
    generator aside: ``seed`` is the request's seed."""


def validation_calls(cfg, model_dir: Path) -> list[dict]:
    """Per validation prompt, the ``__call__`` arguments of ``hsdp generate --prompt P --seed S`` with the run's
    ``--validation-negative-prompt`` and ``--validation-cfg-scale``: ``prompt``, ``seed`` (every prompt ``--seed``),
    ``output_type`` and what :func:`hsdp.engine.diffusion.call_kwargs` gives, ``--max-sequence-length`` over it."""
    from hsdp.config import ParallelConfig
    from hsdp.engine.diffusion import call_kwargs
    from hsdp.engine.model_info import inspect_model
    from hsdp.engine.params import SamplingParams, build_requests

    info = inspect_model(model_dir)
    prompts = list(cfg.validation_prompts)
    scale = {info.cfg_scale_param: cfg.validation_cfg_scale} if cfg.validation_cfg_scale is not None else {}
    wanted = SamplingParams(seed=[cfg.seed] * len(prompts), negative_prompt=cfg.validation_negative_prompt, **scale)
    try:
        requests, params = build_requests(info, ParallelConfig().resolved(), prompts, wanted, _flag)
    except ValueError as exc:
        from hsdp.train.config import TrainConfigError

        raise TrainConfigError(str(exc)) from exc
    # the prompts encoded as the training captions are (the trainer checked that __call__ takes it)
    length = {"max_sequence_length": cfg.max_sequence_length} if cfg.max_sequence_length is not None else {}
    return [
        {"prompt": r.prompt, "seed": r.seed, "output_type": "np", **call_kwargs(info, [r], params), **length}
        for r in requests
    ]


def _flag(name: str) -> str:
    """A generation parameter as the trainer's flag that sets it (or the model's default that set it)."""
    if name in ("negative_prompt", "true_cfg_scale", "guidance_scale"):
        return "--validation-negative-prompt" if name == "negative_prompt" else "--validation-cfg-scale"
    return f"{name} (the model's generation default)"


def _pipeline_call(pipe, call: dict):
    """The pipeline on one request's arguments, its initial noise from a CPU generator (as the engine draws it)."""
    kwargs = {k: v for k, v in call.items() if k != "seed"}
    return pipe(generator=torch.Generator(device="cpu").manual_seed(call["seed"]), **kwargs)


def capture_encodings(pipe, model_dir: Path, cfg) -> ValidationPrompts:
    """Run ``pipe`` (encoders loaded, denoisers not) on each validation call until its first denoiser call,
    recording every return of its encoding methods (``encode_prompt``, ``encode_duration``; collective when the
    encoders are sharded: every rank runs it)."""
    from hsdp.planning.profile import build_meta_model
    from hsdp.train.diffusion.frozen import DENOISERS
    from hsdp.train.diffusion.pipeline_call import recording, replaced_encoders

    calls = validation_calls(cfg, model_dir)
    # ``__call__`` reads its denoisers' configs and dtype before encoding (Wan's patch size): give it them on meta,
    # stopping the call where the first one runs.
    absent = [n for n in DENOISERS if (model_dir / n / "config.json").is_file() and getattr(pipe, n, None) is None]
    meta = {name: build_meta_model(model_dir / name)[0] for name in absent}

    def stop(module, args, kwargs):
        raise _Encoded

    hooks = [m.register_forward_pre_hook(stop, with_kwargs=True) for m in meta.values()]
    pipe.register_modules(**meta)
    encodings = []
    for call in calls:
        recorded: list = []
        try:
            with replaced_encoders(pipe, recording(recorded)):
                _pipeline_call(pipe, call)
        except _Encoded:
            pass
        encodings.append([_to(e, torch.device("cpu")) for e in recorded])
    for hook in hooks:
        hook.remove()
    pipe.register_modules(**dict.fromkeys(absent))
    return ValidationPrompts(tuple(cfg.validation_prompts), encodings, calls)


def _to(encoded, device: torch.device):
    """``encode_prompt``'s return (a tensor, or a tuple of tensors and Nones) on ``device``."""
    if isinstance(encoded, tuple):
        return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in encoded)
    return encoded.to(device) if isinstance(encoded, torch.Tensor) else encoded


def _weightless(model_dir: Path, names: list[str]) -> dict:
    """The freed encoders for the validation pipeline: those with a config on meta (no weights read; ``__call__``
    reads their configs outside the replayed encoding methods: Stable Audio's ``check_inputs`` the projection
    model's value range), the others (tokenizers) left out."""
    from hsdp.loading import build_component
    from hsdp.models.description import describe

    model = describe(model_dir)
    return {n: build_component(model, n, torch.float32) if model.components[n].has_config else None for n in names}


def _executing_on(pipe, device: torch.device) -> None:
    """``pipe`` executes on ``device`` (its ``_execution_device`` would otherwise be its first module's: a meta
    encoder's)."""
    cls = type(pipe)
    on = {"_execution_device": property(lambda self: device), "device": property(lambda self: device)}
    pipe.__class__ = type(cls.__name__, (cls,), on)


def _output(out) -> np.ndarray:
    """An image or audio pipeline's output as numpy (audio pipelines return tensors whatever ``output_type`` says)."""
    values = out.audios if hasattr(out, "audios") else out.images
    return values.detach().float().cpu().numpy() if isinstance(values, torch.Tensor) else values


def sample_paths(output_dir: str | Path, step: int, prompts: tuple[str, ...], video: bool | str) -> list[Path]:
    """Where step ``step``'s samples go: ``samples/step-<N>/<i>-<prompt, shortened>.<mp4|png|wav>``; ``video``:
    True, False (images) or the output kind (``"video"``, ``"image"``, ``"audio"``)."""
    folder = Path(output_dir) / "samples" / f"step-{step}"
    kind = video if isinstance(video, str) else "video" if video else "image"
    suffix = {"video": ".mp4", "audio": ".wav"}.get(kind, ".png")
    names = [re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-")[:40] or "prompt" for p in prompts]
    return [folder / f"{i}-{name}{suffix}" for i, name in enumerate(names)]


@torch.no_grad()
def generate_samples(trainer, validation: ValidationPrompts) -> list[np.ndarray]:
    """Every prompt generated with ``trainer``'s sharded denoiser in the pipeline (collective: every rank runs
    it); rank 0 writes the files. Returns the samples (frames ``[F, H, W, 3]``, images ``[N, H, W, 3]`` or
    waveforms ``[N, channels, samples]``)."""
    from diffusers.utils import logging as diffusers_logging

    from hsdp.engine.diffusion import sample_rate
    from hsdp.engine.outputs import save_audio, save_frames, save_images
    from hsdp.train.diffusion.frozen import call_modules, encoder_components
    from hsdp.train.diffusion.pipeline_call import replaced_encoders, replaying

    # The freed encoders are replayed, weightless; what __call__ runs itself (LTX-2's connectors) keeps its weights
    resident = {"vae", *call_modules(trainer.model_dir)}
    text_parts = [name for name in encoder_components(trainer.model_dir) if name not in resident]
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # a meta module of a pipeline's own module is "non-standard" to it
    try:
        pipe = trainer.pipeline_class.from_pretrained(
            trainer.model_dir, **_weightless(trainer.model_dir, text_parts), **trainer.experts, torch_dtype=torch.float32
        )
    finally:
        diffusers_logging.set_verbosity(verbosity)
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module) and name not in trainer.experts and name not in text_parts:
            module.to(trainer.device)
    _executing_on(pipe, trainer.device)
    pipe.set_progress_bar_config(disable=True)
    trainer.model.eval()
    samples = []
    for recorded, call in zip(validation.encodings, validation.calls, strict=True):
        with replaced_encoders(pipe, replaying(recorded, lambda value: _to(value, trainer.device))):
            out = _pipeline_call(pipe, call)
        samples.append(out.frames[0] if hasattr(out, "frames") else _output(out))
    trainer.model.train()
    if trainer.rank == 0:
        kind = "video" if hasattr(out, "frames") else "audio" if hasattr(out, "audios") else "image"
        paths = sample_paths(trainer.cfg.output_dir, trainer.step, validation.prompts, kind)
        for sample, path in zip(samples, paths, strict=True):
            if kind == "video":
                save_frames(sample, path)
            elif kind == "audio":
                save_audio(sample, sample_rate(pipe), path)
            else:
                save_images(sample, path)
        logger.info("validation samples at step %d: %s", trainer.step, paths[0].parent)
    del pipe
    gc.collect()
    return samples
