"""HiDream-I1: its transformer in training mode returns its prediction patchified (``[B, C, tokens, patch²]``, not
the ``[B, C, H, W]`` latents it returns in eval mode) and routes its mixture of experts another way, unless built with
``force_inference_output=True``, which diffusers' ``train_dreambooth_lora_hidream.py`` passes when it loads it
(L1101-1109). A config field's value that only the training script knows, so the trainer loads it so too; the
inputs are recorded from the pipeline as for any family (:mod:`hsdp.train.diffusion.pipeline_call`)."""

from __future__ import annotations

from hsdp.families.family import Family, register_family

HIDREAM = register_family(Family("HiDream", pipelines=r"HiDreamImage\w*Pipeline",
                                 training_config=(("force_inference_output", True),)))  # fmt: skip
