"""Rank-side functions and the one-process reference for the diffusion training tests."""

from __future__ import annotations

import torch

from hsdp.train import TrainConfig
from hsdp.train.diffusion import DiffusionTrainer


def train_diffusion(configs: list[TrainConfig]) -> list[dict]:
    """Train each config; return the losses and the trained parameters (whole, rank 0's copy)."""
    out = []
    for cfg in configs:
        with DiffusionTrainer(cfg) as trainer:
            result = trainer.fit()
            state = {n: t for n, t in trainer.full_state().items() if trainer.model.get_parameter(n).requires_grad}
        out.append({"losses": result.losses, "state": state, "checkpoint": result.checkpoint})
    return out


def reference_run(cfg: TrainConfig, model_dir) -> dict:
    """One process running the plain libraries: the diffusers pipeline encodes, peft adapts the denoiser, AdamW
    steps. Rows come from the same media order; noise and sigmas are drawn as the docs say (one CPU generator per
    step and micro-batch: noise, then diffusers' density sampling, then the scheduler's shift)."""
    import json

    import diffusers
    from diffusers.training_utils import compute_density_for_timestep_sampling
    from peft import LoraConfig, inject_adapter_in_model

    from hsdp.lora import init_adapters
    from hsdp.train.diffusion.media import MediaDataset
    from hsdp.train.diffusion.trainer import media_spec

    torch.manual_seed(cfg.seed)
    index = json.loads((model_dir / "model_index.json").read_text())
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(model_dir, torch_dtype=torch.float32)
    model = pipe.transformer
    if cfg.lora_r:
        targets = list(cfg.lora_target_modules) or ["to_q", "to_k", "to_v", "to_out.0"]
        inject_adapter_in_model(LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=targets), model)
        for name, param in model.named_parameters():
            param.requires_grad_(".lora_" in name)
        init_adapters(model, cfg.seed)  # peft's init drawn from the seed, as hsdp does
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = MediaDataset.from_source(cfg.data, media_spec(pipe, model_dir, "transformer"), resolution=cfg.resolution,
                                    frames=cfg.frames)
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    shift = pipe.scheduler.config.flow_shift
    losses = []
    for step in range(cfg.steps):
        optimizer.zero_grad()
        total = 0.0
        for micro in range(cfg.grad_accum):
            number = step * cfg.grad_accum + micro
            rows = data.micro_batch(number, cfg.batch_size, cfg.seed)
            with torch.no_grad():
                x0 = torch.cat([(vae.encode(data.pixels(i)[None]).latent_dist.mode() - mean) / std for i in rows])
                prompt = pipe.encode_prompt([data.items[i].caption for i in rows], do_classifier_free_guidance=False,
                                            device=torch.device("cpu"))[0]
            generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + number)
            torch.rand(len(rows), generator=generator)  # the caption-dropout draw (dropout 0 here)
            noise = torch.randn(x0.shape, generator=generator)
            u = compute_density_for_timestep_sampling("uniform", len(rows), generator=generator)
            sigma = (shift * u / (1 + (shift - 1) * u)).view(-1, 1, 1, 1, 1)
            pred = model(hidden_states=(1 - sigma) * x0 + sigma * noise, timestep=sigma.flatten() * 1000,
                         encoder_hidden_states=prompt, return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(pred, noise - x0) / cfg.grad_accum
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "state": state}
