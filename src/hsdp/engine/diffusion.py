"""Any diffusers pipeline on one rank: the unchanged pipeline around sharded denoisers and text encoders.

The components that :func:`hsdp.engine.model_info.inspect_model` marked shardable (every denoiser, and text
encoders large enough to matter) load sharded straight from their component folders with
:func:`hsdp.loading.load_pretrained`; the small parts (VAE, CLIP, tokenizers, scheduler) load normally.
Generation calls the pipeline itself with the arguments its ``__call__`` accepts, so every layout runs
diffusers' own denoising loop and scheduler and stays comparable with the single-process pipeline number for
number. The step callback times each step and reports progress to the caller; every module's forward also
sends a (rate-limited) :func:`hsdp.launch.heartbeat`, so a long prompt encoding or VAE decode shows life too.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
import torch.distributed as dist

from hsdp.attention import set_attention_backend
from hsdp.context_parallel import enable_ulysses
from hsdp.distributed import local_device
from hsdp.engine.cache import StepCache, agreement_group
from hsdp.engine.compile import compile_blocks
from hsdp.engine.components import LoadSpec, load_component, loading_part
from hsdp.engine.model_info import ModelInfo, inspect_model
from hsdp.engine.outputs import Timings
from hsdp.engine.parallel import CFGParallelTransformer
from hsdp.engine.params import PIPELINE_ARGS, Request, SamplingParams
from hsdp.launch import emit_event, heartbeat
from hsdp.mesh import ParallelMeshes
from hsdp.vae_parallel import enable_exact_split, enable_vae_parallel, vae_memory_options

logger = logging.getLogger("hsdp")

__all__ = ["DiffusionRunner", "call_kwargs", "sample_rate"]


def _heartbeat_hook(module: torch.nn.Module, args: tuple) -> None:
    if not torch.compiler.is_compiling():  # inside a --compile'd block: the block's own (eager) call beats
        heartbeat()


def _own_memory(module: torch.nn.Module) -> None:
    """Copy the weights ``from_pretrained`` left mapped from the safetensors file into allocated memory (CPU).

    A mapped weight sits at whatever offset the file gives it; an unaligned one changes CPU BLAS rounding (~1e-6
    through a tiny SDXL's CLIP), so the whole components would compute differently from the sharded ones, which
    always live in allocated buffers, and from the same pipeline run once its weights were copied."""
    for param in module.parameters():
        if param.device.type == "cpu":
            param.data = param.data.clone()


def _numpy(values) -> np.ndarray:
    """A waveform batch as float32 numpy (pipelines return tensors for audio whatever ``output_type`` says)."""
    if isinstance(values, torch.Tensor):
        return values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=np.float32)


def call_kwargs(info: ModelInfo, requests: list[Request], params: SamplingParams) -> dict:
    """The pipeline arguments for a group of requests run as one batch: the set fields it accepts, the per-request
    inputs (one each, as lists when the group has several), and any extra kwargs. Besides these, a call passes the
    prompts, one CPU generator per request seeded with its seed, and the output type (:meth:`DiffusionRunner.generate`;
    the diffusion trainer's validation samples call the pipeline the same way)."""
    kwargs = {name: getattr(params, name) for name in PIPELINE_ARGS if getattr(params, name) is not None}
    for name in ("negative_prompt", "image", "mask_image"):
        values = [getattr(r, name) for r in requests]
        if any(v is not None for v in values):
            kwargs[name] = values[0] if len(values) == 1 else values
    if params.audio_seconds is not None and info.audio_length_param is not None:
        kwargs[info.audio_length_param] = params.audio_seconds
    kwargs.update(params.pipeline_kwargs)
    return {k: v for k, v in kwargs.items() if k in info.call_params}


def sample_rate(pipe) -> int | None:
    """Samples per second of the audio a pipeline makes: its own ``sample_rate`` (ACE-Step, LongCat), else the
    config of the component that writes the waveform (the vocoder, else the audio or plain VAE)."""
    if isinstance(getattr(pipe, "sample_rate", None), int):
        return pipe.sample_rate
    for name in ("vocoder", "audio_vae", "vae"):
        config = getattr(getattr(pipe, name, None), "config", None) or {}
        for key in ("output_sampling_rate", "sampling_rate", "sample_rate"):
            if config.get(key):
                return int(config[key])
    return None


class DiffusionRunner:
    kind = "diffusion"

    def __init__(self, spec: LoadSpec, meshes: ParallelMeshes):
        import diffusers

        self.config = config = spec.config
        self.device = local_device()
        self.info = inspect_model(spec.path)
        self.sharded = list(self.info.shardable) if config.use_hsdp else []
        # Decoding with a sharded autoencoder all-gathers its weights: every rank decodes, not only the reporter.
        self.decode_everywhere = any(name in self.sharded for name in self.info.autoencoders)
        # --lora adapts the denoisers (both of Wan 2.2's experts): each holds the slots (the engine checked the
        # adapters against them).
        parts = len(self.info.shardable) + 1
        components = {}
        for index, name in enumerate(self.info.shardable, 1):
            with loading_part(name, index, parts):
                components[name] = load_component(
                    spec,
                    meshes,
                    name,
                    lora=spec.lora if name in self.info.denoisers else None,
                    denoiser=name in self.info.denoisers,
                )
        with loading_part("the other components (whole on each rank)", parts, parts):
            self.pipe = getattr(diffusers, self.info.class_name).from_pretrained(spec.path, **components)
            for name, module in self.pipe.components.items():
                if isinstance(module, torch.nn.Module) and name not in components:
                    _own_memory(module.to(self.device))
        self._vae_options(spec)
        self.cfg_wrappers: list[CFGParallelTransformer] = []
        for component in self.modules():
            for module in component.modules():
                module.register_forward_pre_hook(_heartbeat_hook)
        self._first_denoiser_call: float | None = None
        self.denoisers = [getattr(self.pipe, name) for name in self.info.denoisers]
        for name, model in zip(self.info.denoisers, self.denoisers, strict=True):
            model.register_forward_pre_hook(self._mark_denoising_start)
            if spec.attention_backend is not None:  # before the sequence split, which wraps its processors
                set_attention_backend(model, spec.attention_backend)
            if config.sequence_parallel_size > 1:
                enable_ulysses(model, config, meshes)
            if spec.compile:
                compile_blocks(model)
            if config.cfg_parallel_size == 2:
                wrapper = CFGParallelTransformer(model, meshes.axis("cfg"))
                setattr(self.pipe, name, wrapper)
                self.cfg_wrappers.append(wrapper)
        self.step_cache = StepCache(self.denoisers, agreement_group(config, meshes))
        logger.info(
            "Pipeline %s (%s) ready; sharded components: %s",
            self.info.class_name,
            self.info.family,
            ", ".join(self.sharded) or "none",
        )

    def _vae_options(self, spec: LoadSpec) -> None:
        """``--vae-tiling`` / ``--vae-slicing`` on the autoencoders that have them. ``--vae-parallel``: the whole
        decode's rows split over the ranks (:func:`hsdp.vae_parallel.enable_exact_split`; a class it cannot keep
        exact decodes whole, on rank 0), or with ``--vae-tiling`` the tiles, every rank decoding."""
        for name in self.info.autoencoders:
            options, vae = self.info.vae_options[name], getattr(self.pipe, name)
            vae_memory_options(vae, tiling=spec.vae_tiling and "tiling" in options,
                               slicing=spec.vae_slicing and "slicing" in options)  # fmt: skip
            if not spec.vae_parallel:
                continue
            if spec.vae_tiling and "tiling" in options and name not in self.info.vae_unsplittable:
                enable_vae_parallel(vae, dist.group.WORLD)
                self.decode_everywhere = True
                logger.info("%s: tiled decode and encode split over %d ranks", name, dist.get_world_size())
            elif not spec.vae_tiling:
                if (whole := enable_exact_split(vae, dist.group.WORLD)) is None:
                    self.decode_everywhere = True
                    logger.info("%s: decode split over %d ranks by rows", name, dist.get_world_size())
                else:
                    logger.warning("--vae-parallel: %s decodes whole on rank 0: %s", name, whole)

    def modules(self) -> list[torch.nn.Module]:
        """The pipeline's models, each as loaded: a denoiser that CFG parallel wraps is listed itself, so its
        layers keep their own names (LoRA slots are filled and switched by them)."""
        wrapped = {id(w): w.transformer for w in self.cfg_wrappers}
        return [
            wrapped.get(id(m), m) for m in self.pipe.components.values() if isinstance(m, torch.nn.Module)
        ]

    def adapted(self) -> dict[str, torch.nn.Module]:
        """The models with LoRA slots (the denoisers, unwrapped), named as :func:`hsdp.engine.checks.lora_target`
        names them."""
        return dict(zip(self.info.denoisers, self.denoisers, strict=True))

    def watched_modules(self) -> list[torch.nn.Module]:
        """The modules a cancellation is checked before: the denoisers, once per denoising forward."""
        return list(self.denoisers)

    def _mark_denoising_start(self, module: torch.nn.Module, args: tuple) -> None:
        if self._first_denoiser_call is None:
            self._first_denoiser_call = time.perf_counter()

    def call_kwargs(self, requests: list[Request], params: SamplingParams) -> dict:
        return call_kwargs(self.info, requests, params)

    def generate(
        self, requests: list[Request], params: SamplingParams, *, decode: bool, progress: bool
    ) -> list[dict]:
        """Run a group of requests as one batch (each with its own seed, so its own initial noise); returns one
        payload per request. ``decode=False`` skips the VAE on ranks whose outputs are not returned."""
        pipe = self.pipe
        ids = ", ".join(str(r.request_id) for r in requests)
        pipe.set_progress_bar_config(disable=not progress, desc=f"request {ids} denoising")
        for wrapper in self.cfg_wrappers:
            wrapper.reset()
        self._first_denoiser_call = None
        started = time.perf_counter()
        stamps: list[float] = []

        def on_step_end(pipeline, step: int, timestep, callback_kwargs: dict) -> dict:
            stamps.append(time.perf_counter())
            if decode:  # the rank that reports these requests also reports their progress
                total = getattr(pipeline, "num_timesteps", None) or params.num_inference_steps or step + 1
                for request in requests:
                    if not request.filler:  # its original reports from its own rank
                        emit_event({"request_id": request.request_id, "step": step + 1, "total": total})
            return {}

        if "callback_on_step_end" in self.info.call_params:
            extra = {"callback_on_step_end": on_step_end}
        elif "callback" in self.info.call_params:  # the older per-step callback (Stable Audio, AudioLDM 2)
            extra = {"callback": lambda step, timestep, latents: on_step_end(pipe, step, timestep, {}),
                     "callback_steps": 1}  # fmt: skip
        else:
            extra = {}
        # The initial noise comes from CPU generators, so it is the same on every device type and layout, and a
        # request's noise is the same alone or in a batch (the pipeline draws each sample from its generator).
        generators = [torch.Generator(device="cpu").manual_seed(r.seed) for r in requests]
        kwargs = self.call_kwargs(requests, params)
        cache = None if params.cache == "none" else params.cache
        self.step_cache.prepare(
            cache,
            params.cache_config,
            pipe,
            params.num_inference_steps,
            requests=len(requests),
        )
        result = pipe(
            prompt=[r.prompt for r in requests] if len(requests) > 1 else requests[0].prompt,
            generator=generators if len(requests) > 1 else generators[0],
            output_type="np" if decode or self.decode_everywhere else "latent",
            **kwargs,
            **extra,
        )
        finished = time.perf_counter()
        first = self._first_denoiser_call or started
        timings = Timings(
            total_s=finished - started,
            encode_s=first - started,
            decode_s=finished - stamps[-1] if stamps else 0.0,
            step_s=[b - a for a, b in zip([first, *stamps], stamps, strict=False)],
        )
        common = {"timings": timings}
        if self.step_cache.stats is not None:
            common["cache"] = self.step_cache.stats.to_dict()
        if not decode:
            return [dict(common) for _ in requests]
        sound = getattr(result, "audios", None)
        if sound is None:
            sound = getattr(result, "audio", None)
        if sound is not None:
            common["sample_rate"] = sample_rate(pipe)
            sound = _numpy(sound)
        if hasattr(result, "frames"):
            # A video pipeline that makes the sound too (LTX-2) gives one waveform per video.
            return [
                {"frames": result.frames[i], **({"audio": sound[i]} if sound is not None else {}), **common}
                for i in range(len(requests))
            ]
        if sound is not None:
            # One waveform per request, or several (num_waveforms_per_prompt): (n, channels, samples).
            per_request = len(sound) // len(requests)
            return [
                {"audios": sound[i * per_request : (i + 1) * per_request], **common} for i in range(len(requests))
            ]
        per_request = len(result.images) // len(requests)
        return [
            {"images": result.images[i * per_request : (i + 1) * per_request], **common}
            for i in range(len(requests))
        ]
