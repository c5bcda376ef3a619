"""Fine-tuning a diffusers pipeline's denoiser: media data, the objective from its scheduler, the trainer."""

from hsdp.train.diffusion.trainer import DEFAULT_LORA_TARGETS, DiffusionTrainer

__all__ = ["DiffusionTrainer", "DEFAULT_LORA_TARGETS"]
