"""Rank-side functions and the one-process reference for the diffusion training tests."""

from __future__ import annotations

import time

import torch
from torch.distributed.tensor import DTensor

from hsdp.train import TrainConfig
from hsdp.train.diffusion import DiffusionTrainer


def write_media(folder) -> None:
    """Four captioned images of different shapes (two buckets at resolution 32), the diffusion tests' data."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(40, 56), (37, 91), (64, 48), (48, 64)]):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"a cat number {i}")


def train_diffusion(configs: list[TrainConfig], grad_share: bool = False) -> list[dict]:
    """Train each config; return the losses, the trained parameters (whole, rank 0's copy), when it started, how
    many times it loaded the frozen encoders (``encoder_loads``) and the eval losses; with ``grad_share`` (one process) also what
    :func:`assert_trained_like` needs of a reference: ``grad_share``, ``lr``, ``steps``."""
    from unittest import mock

    from hsdp.train.diffusion import trainer as module

    out = []
    for cfg in configs:
        started = time.time_ns()
        loads = mock.patch.object(module, "frozen_pipeline", wraps=module.frozen_pipeline)
        with loads as frozen_pipeline, DiffusionTrainer(cfg) as trainer:
            shares = _record_grad_share(trainer) if grad_share else None
            result = trainer.fit()
            state = {n: t for n, t in trainer.full_state().items() if trainer.model.get_parameter(n).requires_grad}
            frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
            frozen_sharded = sum(isinstance(p, DTensor) for p in frozen)
            frozen_dtypes = {str(p.dtype) for p in frozen}
            trained = [p for p in trainer.model.parameters() if p.requires_grad]
            held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in trained)
            trained_share = held / sum(p.numel() for p in trained)
        out.append({"losses": result.losses, "state": state, "checkpoint": result.checkpoint, "started": started,
                    "frozen_sharded": frozen_sharded, "frozen_dtypes": frozen_dtypes, "trained_share": trained_share,
                    "encoder_loads": frozen_pipeline.call_count, "eval": [s.eval_loss for s in result.steps]})
        if shares is not None:
            out[-1] |= {"grad_share": shares, "lr": cfg.lr, "steps": cfg.steps}
    return out


def _record_grad_share(trainer) -> dict[str, torch.Tensor]:
    """Each trained element's smallest gradient over the steps as a share of its tensor's largest (filled in as
    the optimizer steps), as :func:`reference_run` keeps it."""
    trained = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    names = {id(p): n for n, p in trained}
    shares = {n: torch.ones(p.shape) for n, p in trained}

    def before_step(optimizer, args, kwargs):
        grads = {names[id(p)]: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for p in trainer.params if p.grad is not None}  # fmt: skip
        for name, share in _shares(grads).items():
            shares[name] = torch.minimum(shares[name], share.cpu())

    trainer.optimizer.register_step_pre_hook(before_step)
    return shares


def reference_run(cfg: TrainConfig, model_dir) -> dict:
    """One process running the plain libraries: the diffusers pipeline encodes, peft adapts the denoiser, AdamW
    steps. Rows come from the same media order; noise and timesteps are drawn as the docs say (one CPU generator
    per step and micro-batch: the caption-dropout draw, noise, then the timesteps). The denoiser's call is written
    per pipeline as diffusers' training scripts write it (:data:`FORWARDS`)."""
    import json

    import diffusers
    from peft import LoraConfig, inject_adapter_in_model

    from hsdp.lora import init_adapters
    from hsdp.train.diffusion.media import MediaDataset
    from hsdp.train.diffusion.trainer import media_spec

    torch.manual_seed(cfg.seed)
    index = json.loads((model_dir / "model_index.json").read_text())
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(model_dir, torch_dtype=torch.float32)
    components = ["unet" if "unet" in index else "transformer"]
    if cfg.train_component:  # Wan 2.2's experts: high noise (sigma >= boundary_ratio) and low noise
        components = cfg.train_component.split(",")
    experts = {c: getattr(pipe, c) for c in components}
    # One expert is the model itself; several are keyed by component, as hsdp's trainer holds them.
    model = experts[components[0]] if len(components) == 1 else torch.nn.ModuleDict(experts)
    if cfg.lora_r:
        targets = list(cfg.lora_target_modules) or ["to_q", "to_k", "to_v", "to_out.0"]
        for expert in experts.values():
            config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=targets)
            inject_adapter_in_model(config, expert)
        for name, param in model.named_parameters():
            param.requires_grad_(".lora_" in name)
        init_adapters(model, cfg.seed)  # peft's init drawn from the seed, as hsdp does
    model.train()
    # An optimizer per expert: a step moves the expert it trains and no other.
    optimizers = {c: torch.optim.AdamW([p for p in e.parameters() if p.requires_grad], lr=cfg.lr,
                                       weight_decay=cfg.weight_decay) for c, e in experts.items()}  # fmt: skip
    boundary = index.get("boundary_ratio")
    data = MediaDataset.from_source(cfg.data, media_spec(model_dir, components[0]), resolution=cfg.resolution,
                                    frames=cfg.frames)  # fmt: skip
    forward = FORWARDS[index["_class_name"]]
    losses = []
    grad_share = {n: torch.ones_like(p) for n, p in model.named_parameters() if p.requires_grad}
    for step in range(cfg.steps):
        expert = components[step % len(components)]  # the experts in turn, one a step
        span = {"transformer": (boundary, 1.0), "transformer_2": (0.0, boundary)}[expert] if boundary else None
        optimizers[expert].zero_grad()
        total = 0.0
        for micro in range(cfg.grad_accum):
            number = step * cfg.grad_accum + micro
            rows = data.micro_batch(number, cfg.batch_size, cfg.seed)
            generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + number)
            drop = (torch.rand(len(rows), generator=generator) < cfg.caption_dropout).tolist()  # the dropout draw
            pixels = torch.stack([data.media(i) for i in rows])  # waveforms for an audio pipeline
            captions = ["" if d else data.items[i].caption for i, d in zip(rows, drop, strict=True)]
            extra = {"sigma_span": span} if span else {}
            if data.audio is not None:
                extra["seconds"] = [data.items[i].seconds for i in rows]
            pred, target = forward(pipe, experts[expert], pixels, captions, generator, **extra)
            loss = torch.nn.functional.mse_loss(pred, target) / cfg.grad_accum
            loss.backward()
            total += loss.item()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
        for name, share in _shares(grads).items():
            grad_share[name] = torch.minimum(grad_share[name], share)
        optimizers[expert].step()
        losses.append(total)
    state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "state": state, "grad_share": grad_share, "lr": cfg.lr, "steps": cfg.steps}


CANCELLED = 1e-6
"""A tensor whose largest gradient is below this share of the model's largest has a gradient that is zero in exact
arithmetic, left by fp32 rounding of terms that cancel (fp32's epsilon is 1.2e-7): tiny LTX-2's cross-attention
queries (identical text keys make the softmax's gradient vanish) measured 3e-8. Its signs are noise, so AdamW may
step any of its elements either way (:func:`assert_trained_like`)."""


def _shares(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each element's gradient as a share of its tensor's largest, or of the model's largest where the whole tensor
    is rounding (:data:`CANCELLED`)."""
    largest = {name: grad.abs().max() for name, grad in grads.items()}
    model = max(largest.values(), default=torch.tensor(0.0))
    return {name: grad.abs() / torch.where(largest[name] < CANCELLED * model, model, largest[name]).clamp_min(1e-30)
            for name, grad in grads.items()}  # fmt: skip


# How far a gradient summed in another order (ranks' partial sums, another batch split) may be off, as a share of
# its tensor's largest gradient: fp32 sums of n terms err by about sqrt(n) * 6e-8 of their largest terms, up to
# n * 6e-8 in the worst case; these tests sum up to a few thousand terms per element.
GRAD_ROUNDING = 1e-4


def assert_trained_like(run: dict, ref: dict, tol: float, rounding: float = GRAD_ROUNDING) -> None:
    """Losses within ``tol``, and each trained weight within what AdamW makes of a rounding difference in its
    gradient (``ref`` is :func:`reference_run`'s, which keeps each element's smallest gradient over the steps as a
    share of its tensor's largest). AdamW steps by lr * m_hat / sqrt(v_hat), which does not depend on the
    gradient's scale: a gradient off by a relative e moves that step by <= 2 * e * lr, and whatever the
    gradients, |m_hat / sqrt(v_hat)| <= 1.01 for the first three steps (Cauchy-Schwarz with beta1 0.9, beta2
    0.999). So an element whose gradient share was s differs by <= tol + 2 * lr * steps * min(1.01,
    GRAD_ROUNDING / s): within ``tol`` where the gradient was large, and by up to 2 lr per step where it was at
    rounding level and AdamW could step it either way (3.6e-5 seen at lr 1e-4 on another CPU), as in a tensor
    whose whole gradient cancels (its share is of the model's largest gradient then: :data:`CANCELLED`). ``rounding``: the
    gradients' relative rounding difference (:data:`GRAD_ROUNDING` unless a model's gradients pass through longer
    reductions)."""
    import numpy as np

    assert np.allclose(run["losses"], ref["losses"], atol=tol, rtol=0), (run["losses"], ref["losses"])
    assert run["state"].keys() == ref["state"].keys()
    for name, want in ref["state"].items():
        diff = (run["state"][name].cpu() - want).abs()
        share = ref["grad_share"][name]
        allowed = tol + 2 * ref["lr"] * ref["steps"] * (rounding / share.clamp_min(1e-30)).clamp(max=1.01)
        worst = (diff - allowed).argmax()
        assert (diff <= allowed).all(), (name, diff.flatten()[worst].item(), allowed.flatten()[worst].item())


def _flow_sigmas(rows: int, shift: float, generator: torch.Generator, span=(0.0, 1.0)) -> torch.Tensor:
    """Uniform draws shifted, within ``span`` of the shifted sigmas: the draws are spread over the part of [0, 1]
    that the shift takes into ``span`` (its inverse at the ends)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    low, high = (s / (shift - (shift - 1) * s) for s in span)
    u = low + (high - low) * compute_density_for_timestep_sampling("uniform", rows, generator=generator)
    return shift * u / (1 + (shift - 1) * u)


def wan_forward(pipe, model, pixels, captions, generator, sigma_span=(0.0, 1.0)):
    """Wan text-to-video: per-channel latent statistics, flow matching with the scheduler's flow_shift; Wan 2.2's
    experts each on their ``sigma_span`` (the pipeline switches experts at sigma = boundary_ratio)."""
    with torch.no_grad():
        vae = pipe.vae
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        x0 = (vae.encode(pixels).latent_dist.mode() - mean) / std
        # 512 tokens, as WanPipeline.__call__ encodes (encode_prompt's own default is 226)
        prompt = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=512,
                                    device=torch.device("cpu"))[0]
    noise = torch.randn(x0.shape, generator=generator)
    sigma = _flow_sigmas(len(x0), pipe.scheduler.config.flow_shift, generator, sigma_span).view(-1, 1, 1, 1, 1)
    assert sigma.min() >= sigma_span[0] - 1e-6 and sigma.max() <= sigma_span[1] + 1e-6
    pred = model(hidden_states=(1 - sigma) * x0 + sigma * noise, timestep=sigma.flatten() * 1000,
                 encoder_hidden_states=prompt, return_dict=False)[0]
    return pred, noise - x0


def flux_forward(pipe, model, pixels, captions, generator):
    """FLUX.1 as diffusers' train_dreambooth_lora_flux.py calls it: packed latents, image / text ids, pooled CLIP
    embedding, guidance embedding at the pipeline's default 3.5, timestep in [0, 1]; the prediction unpacked."""
    with torch.no_grad():
        vae = pipe.vae
        x0 = (vae.encode(pixels[:, :, 0]).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
        prompt, pooled, text_ids = pipe.encode_prompt(captions, prompt_2=None, device=torch.device("cpu"))
    noise = torch.randn(x0.shape, generator=generator)
    sigma = _flow_sigmas(len(x0), pipe.scheduler.config.shift, generator).view(-1, 1, 1, 1)
    rows, channels, height, width = x0.shape
    noisy = (1 - sigma) * x0 + sigma * noise
    cls = type(pipe)
    pred = model(
        hidden_states=cls._pack_latents(noisy, rows, channels, height, width),
        timestep=sigma.flatten(),
        guidance=torch.full((rows,), 3.5),
        pooled_projections=pooled,
        encoder_hidden_states=prompt,
        txt_ids=text_ids,
        img_ids=cls._prepare_latent_image_ids(rows, height // 2, width // 2, x0.device, x0.dtype),
        return_dict=False,
    )[0]
    scale = pipe.vae_scale_factor
    return cls._unpack_latents(pred, height * scale, width * scale, scale), noise - x0


def sdxl_forward(pipe, model, pixels, captions, generator):
    """SDXL as diffusers' train_text_to_image_lora_sdxl.py calls its UNet: DDPM noise at integer timesteps, the
    epsilon target, added conditioning from the second encoder's pooled embedding and the size micro-conditioning
    (original size = target size = the bucket, crop corner 0, 0)."""
    from diffusers import DDPMScheduler

    with torch.no_grad():
        x0 = pipe.vae.encode(pixels[:, :, 0]).latent_dist.mode() * pipe.vae.config.scaling_factor
        prompt, _, pooled, _ = pipe.encode_prompt(captions, device=torch.device("cpu"),
                                                  do_classifier_free_guidance=False)
    noise = torch.randn(x0.shape, generator=generator)
    timesteps = torch.randint(0, 1000, (len(x0),), generator=generator)
    scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    height, width = pixels.shape[-2:]
    time_ids = torch.tensor([[height, width, 0, 0, height, width]], dtype=torch.float32).repeat(len(x0), 1)
    pred = model(scheduler.add_noise(x0, noise, timesteps), timesteps, encoder_hidden_states=prompt,
                 added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}, return_dict=False)[0]
    return pred, noise


def stable_audio_forward(pipe, model, waves, captions, generator, seconds):
    """Stable Audio as stable-audio-tools trains its DiT (the ``v`` objective: ``t`` uniform, ``alpha, sigma =
    cos(t pi / 2), sin(t pi / 2)``, input ``alpha x0 + sigma noise``, target ``alpha noise - sigma x0``) with ``t``
    over the span of the scheduler's sigmas (its timestep is ``atan(sigma) 2 / pi``), conditioned as diffusers'
    StableAudioPipeline conditions it: the projected T5 embeddings with the start (0) and end (the clip's kept
    seconds) projections appended, those two side by side as the global state, its rotary embedding. Written for
    ``sigma_data`` 1 (tiny-stable-audio's, as Stable Audio Open's)."""
    import math

    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    assert pipe.scheduler.config.sigma_data == 1.0
    cpu = torch.device("cpu")
    with torch.no_grad():
        x0 = pipe.vae.encode(waves).latent_dist.mode()
        prompt = pipe.encode_prompt(captions, cpu, False)
        start, end = pipe.encode_duration(0.0, seconds, cpu, False, len(captions))
    text, durations = torch.cat([prompt, start, end], dim=1), torch.cat([start, end], dim=2)
    rotary = get_1d_rotary_pos_embed(pipe.rotary_embed_dim, x0.shape[2] + durations.shape[1], use_real=True,
                                     repeat_interleave_real=False)  # fmt: skip
    noise = torch.randn(x0.shape, generator=generator)
    u = torch.rand(len(x0), generator=generator).double()
    low, high = (math.atan(pipe.scheduler.config[k]) * 2 / math.pi for k in ("sigma_min", "sigma_max"))
    t = low + (high - low) * u
    alpha, sigma = (f(t * math.pi / 2).view(-1, 1, 1) for f in (torch.cos, torch.sin))
    noisy, target = alpha * x0.double() + sigma * noise.double(), alpha * noise.double() - sigma * x0.double()
    pred = model(noisy.float(), t.float(), encoder_hidden_states=text, global_hidden_states=durations,
                 rotary_embedding=rotary, return_dict=False)[0]  # fmt: skip
    return pred, target.float()


FORWARDS = {"WanPipeline": wan_forward, "FluxPipeline": flux_forward, "StableDiffusionXLPipeline": sdxl_forward,
            "StableAudioPipeline": stable_audio_forward}  # fmt: skip


def sharded_encoders(cfg: TrainConfig, fraction: float) -> dict:
    """The frozen components of ``cfg``'s pipeline with the engine's size rule at ``fraction``
    (``TEXT_ENCODER_SHARD_FRACTION``): which load sharded on the training layout, whether their parameters are
    DTensors and the bytes this rank holds of them (local, whole), every item's latents and caption encodings, and
    the losses of training ``cfg`` with them."""
    from torch.distributed.tensor import DTensor

    import hsdp.models.description as description
    from hsdp.models.builtin import resolve_model
    from hsdp.train.diffusion.frozen import encode_items, frozen_pipeline, frozen_sharded, media_spec
    from hsdp.train.diffusion.media import MediaDataset
    from hsdp.train.diffusion.pipeline_call import prompt_layout

    saved = description.TEXT_ENCODER_SHARD_FRACTION
    description.TEXT_ENCODER_SHARD_FRACTION = fraction
    try:
        model_dir = resolve_model(cfg.model)
        sharded = frozen_sharded(model_dir)
        pipe = frozen_pipeline(model_dir, cfg.effective_parallel())
        modules = {name: getattr(pipe, name) for name in sharded}
        data = MediaDataset.from_source(cfg.data, media_spec(model_dir, "transformer"), resolution=cfg.resolution)
        first = data.buckets[0]
        layout = prompt_layout(pipe, model_dir, (first.height, first.width), first.frames)
        items = encode_items(pipe, model_dir, layout, data, range(len(data)))
        del pipe
        losses = train_diffusion([cfg])[0]["losses"]
    finally:
        description.TEXT_ENCODER_SHARD_FRACTION = saved
    return {
        "sharded": sharded,
        "dtensor": {n: all(isinstance(p, DTensor) for p in m.parameters()) for n, m in modules.items()},
        "bytes": {
            n: (sum(p.to_local().nbytes for p in m.parameters()), sum(p.nbytes for p in m.parameters()))
            for n, m in modules.items()
        },
        "items": items,
        "losses": losses,
    }
