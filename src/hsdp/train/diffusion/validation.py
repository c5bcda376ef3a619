"""Validation samples (``--validation-prompt``, ``--validation-every``): the model being trained, generating.

Before the first step, every ``--validation-every`` steps and at the end, every rank puts the trained denoiser,
still sharded on the training layout, into the unchanged diffusers pipeline (as the engine's
:class:`hsdp.engine.diffusion.DiffusionRunner` runs inference: the pipeline's own ``__call__`` and scheduler, the
engine's generation defaults for the model, a CPU generator seeded with ``--seed`` for every prompt, so successive
samples differ only by training) and rank 0 writes each prompt's video or image with the engine's writers to
``<output_dir>/samples/step-<N>/<i>-<prompt>.mp4`` (``.png`` for image pipelines).

The trainer frees the text encoders before the first step, so each prompt's encoding is taken once, up front:
the pipeline's own ``__call__`` runs with the encoders loaded until its ``encode_prompt`` returns, and that return
value (whatever the family's pipeline returns: negative embeddings for guidance, pooled embeddings, ...) is
replayed at every validation in place of ``encode_prompt``. The VAE and scheduler are loaded for each validation
and dropped after it, so the training peak does not hold them.
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

__all__ = ["ValidationPrompts", "capture_encodings", "generation_kwargs", "generate_samples", "sample_paths"]


class _Encoded(Exception):
    """Stops a pipeline call once its ``encode_prompt`` has returned (the capture needs nothing after it)."""


@dataclass
class ValidationPrompts:
    prompts: tuple[str, ...]
    encodings: list
    """Per prompt, what the pipeline's ``encode_prompt`` returned inside its ``__call__`` (on the CPU)."""
    kwargs: dict
    """The pipeline's ``__call__`` arguments (:func:`generation_kwargs`)."""


def generation_kwargs(model_dir: Path) -> dict:
    """The ``__call__`` arguments the engine generates this model with by default (``hsdp_defaults.json`` or the
    pipeline's signature: size, frames, steps, guidance), and numpy output."""
    from hsdp.engine.model_info import inspect_model

    info = inspect_model(model_dir)
    return {**{k: v for k, v in info.defaults.items() if k in info.call_params}, "output_type": "np"}


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def capture_encodings(pipe, model_dir: Path, prompts: tuple[str, ...]) -> ValidationPrompts:
    """Run ``pipe`` (encoders loaded, denoisers not) on each prompt until ``encode_prompt`` has returned."""
    from hsdp.planning.profile import build_meta_model
    from hsdp.train.diffusion.trainer import DENOISERS

    kwargs = generation_kwargs(model_dir)
    original = pipe.encode_prompt
    # ``__call__`` may read its denoisers' configs before encoding (Wan's patch size): give it them on meta.
    absent = [n for n in DENOISERS if (model_dir / n / "config.json").is_file() and getattr(pipe, n, None) is None]
    pipe.register_modules(**{name: build_meta_model(model_dir / name)[0] for name in absent})
    encodings = []
    for prompt in prompts:

        def record(*args, **kw):
            encodings.append(original(*args, **kw))
            raise _Encoded

        pipe.encode_prompt = record
        try:
            pipe(prompt=prompt, generator=torch.Generator().manual_seed(0), **kwargs)
        except _Encoded:
            pass
        finally:
            del pipe.encode_prompt  # the instance attribute: the class's method again
    pipe.register_modules(**dict.fromkeys(absent))
    return ValidationPrompts(prompts, encodings, kwargs)


def _replay(encoded, device: torch.device):
    """An ``encode_prompt`` that returns ``encoded`` (on ``device``), whatever it is asked."""

    def encode_prompt(*args, **kwargs):
        moved = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in _as_tuple(encoded))
        return moved if isinstance(encoded, tuple) else moved[0]

    return encode_prompt


def sample_paths(output_dir: str | Path, step: int, prompts: tuple[str, ...], video: bool) -> list[Path]:
    """Where step ``step``'s samples go: ``samples/step-<N>/<i>-<prompt, shortened>.<mp4|png>``."""
    folder = Path(output_dir) / "samples" / f"step-{step}"
    suffix = ".mp4" if video else ".png"
    names = [re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-")[:40] or "prompt" for p in prompts]
    return [folder / f"{i}-{name}{suffix}" for i, name in enumerate(names)]


@torch.no_grad()
def generate_samples(trainer, validation: ValidationPrompts) -> list[np.ndarray]:
    """Every prompt generated with ``trainer``'s sharded denoiser in the pipeline (collective: every rank runs
    it); rank 0 writes the files. Returns the samples (frames ``[F, H, W, 3]`` or images ``[N, H, W, 3]``)."""
    from hsdp.engine.outputs import save_frames, save_images
    from hsdp.train.diffusion.trainer import encoder_components

    text_parts = [name for name in encoder_components(trainer.model_dir) if name != "vae"]  # freed: replayed
    pipe = trainer.pipeline_class.from_pretrained(
        trainer.model_dir, **dict.fromkeys(text_parts), **{trainer.component: trainer.model}, torch_dtype=torch.float32
    )
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module) and name != trainer.component:
            module.to(trainer.device)
    pipe.set_progress_bar_config(disable=True)
    trainer.model.eval()
    samples = []
    for encoded in validation.encodings:
        pipe.encode_prompt = _replay(encoded, trainer.device)
        out = pipe(prompt="", generator=torch.Generator().manual_seed(trainer.cfg.seed), **validation.kwargs)
        samples.append(out.frames[0] if hasattr(out, "frames") else out.images)
    trainer.model.train()
    if trainer.rank == 0:
        video = hasattr(out, "frames")
        paths = sample_paths(trainer.cfg.output_dir, trainer.step, validation.prompts, video)
        for sample, path in zip(samples, paths, strict=True):
            if video:
                save_frames(sample, path)
            else:
                save_images(sample, path)
        logger.info("validation samples at step %d: %s", trainer.step, paths[0].parent)
    del pipe
    gc.collect()
    return samples
