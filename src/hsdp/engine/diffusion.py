"""Video diffusion on one rank: the unchanged diffusers pipeline around sharded transformers.

The transformer(s) (and the text encoder, when it has a shard plan) are loaded sharded straight from their
component folders with :func:`hsdp.loading.load_pretrained`; the small parts (tokenizer, VAE, scheduler) load
normally. Generation calls the pipeline itself, so every layout runs diffusers' own denoising loop and scheduler
and stays comparable with the single-process pipeline number for number.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from hsdp.config import ParallelConfig
from hsdp.distributed import local_device
from hsdp.engine.model_info import TRANSFORMER_COMPONENTS
from hsdp.engine.outputs import Timings
from hsdp.engine.parallel import CFGParallelTransformer, enable_ulysses, overlap_options
from hsdp.engine.params import Request, SamplingParams
from hsdp.loading import load_pretrained
from hsdp.mesh import ParallelMeshes

logger = logging.getLogger("hsdp")

__all__ = ["DiffusionRunner"]


def _has_shard_plan(folder: Path) -> bool:
    from hsdp.loading import model_class_for

    cls = model_class_for(folder)
    return bool(getattr(cls, "_hsdp_shard_conditions", None) or getattr(cls, "_no_split_modules", None))


class DiffusionRunner:
    kind = "diffusion"

    def __init__(
        self,
        folder: Path,
        config: ParallelConfig,
        meshes: ParallelMeshes,
        *,
        dtype: str | None = None,
        forward_prefetch: bool = True,
    ):
        import diffusers

        self.config = config
        self.device = local_device()
        index = json.loads((folder / "model_index.json").read_text())
        components: dict = {}
        self.sharded: list[str] = []
        for name in (*TRANSFORMER_COMPONENTS, "text_encoder"):
            if not (index.get(name) or [None])[0]:
                continue
            shard = config.use_hsdp and (name != "text_encoder" or _has_shard_plan(folder / name))
            model = load_pretrained(
                folder / name,
                config if shard else ParallelConfig(),
                meshes=meshes if shard else None,
                dtype=dtype or "auto",
                **(overlap_options(config, forward_prefetch=forward_prefetch) if shard else {}),
            )
            if shard:
                self.sharded.append(name)
            components[name] = model
        pipeline_cls = getattr(diffusers, index["_class_name"])
        self.pipe = pipeline_cls.from_pretrained(folder, **components)
        for name, module in self.pipe.components.items():
            if isinstance(module, torch.nn.Module) and name not in components:
                module.to(self.device)
        self.cfg_wrappers: list[CFGParallelTransformer] = []
        for name in TRANSFORMER_COMPONENTS:
            model = components.get(name)
            if model is None:
                continue
            if config.sequence_parallel_size > 1:
                enable_ulysses(model, config, meshes)
            if config.cfg_parallel_size == 2:
                wrapper = CFGParallelTransformer(model, meshes.axis("cfg"))
                setattr(self.pipe, name, wrapper)
                self.cfg_wrappers.append(wrapper)
        logger.info(
            "Pipeline %s ready; sharded components: %s",
            type(self.pipe).__name__,
            ", ".join(self.sharded) or "none",
        )

    def modules(self) -> list[torch.nn.Module]:
        return [m for m in self.pipe.components.values() if isinstance(m, torch.nn.Module)]

    def generate(self, request: Request, params: SamplingParams, *, decode: bool, progress: bool) -> dict:
        """Run one request; ``decode=False`` skips the VAE on ranks whose output is not returned."""
        pipe = self.pipe
        pipe.set_progress_bar_config(disable=not progress, desc=f"request {request.request_id} denoising")
        started = time.perf_counter()
        prompt_embeds, negative_embeds = pipe.encode_prompt(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            do_classifier_free_guidance=params.guidance_scale > 1.0,
            max_sequence_length=params.max_sequence_length,
            device=self.device,
        )
        for wrapper in self.cfg_wrappers:
            wrapper.set_negative_embeds(negative_embeds)
        encoded = time.perf_counter()
        stamps: list[float] = [encoded]

        def on_step_end(pipeline, step, timestep, callback_kwargs) -> dict:
            stamps.append(time.perf_counter())
            return {}

        extra = {"guidance_scale_2": params.guidance_scale_2} if params.guidance_scale_2 is not None else {}
        # The initial noise comes from a CPU generator, so it is the same on every device type and layout.
        result = pipe(
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_embeds,
            height=params.height,
            width=params.width,
            num_frames=params.num_frames,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            generator=torch.Generator(device="cpu").manual_seed(request.seed),
            max_sequence_length=params.max_sequence_length,
            output_type="np" if decode else "latent",
            callback_on_step_end=on_step_end,
            **extra,
        )
        finished = time.perf_counter()
        steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        timings = Timings(
            total_s=finished - started,
            encode_s=encoded - started,
            decode_s=finished - stamps[-1],
            step_s=steps,
        )
        frames = result.frames[0] if decode else None
        return {"frames": frames, "timings": timings}
