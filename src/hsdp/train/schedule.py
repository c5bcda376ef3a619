"""Learning-rate schedules: transformers' ``get_scheduler`` (what HF Trainer's ``--lr_scheduler_type`` uses).

The schedule is a multiplier of ``--lr`` per optimizer step, stepped after each optimizer step: step ``s``
(0-based) runs at ``lr * f(s)``. With ``--warmup-steps W`` the multiplier rises linearly from 0 (step 0) to 1
(step ``W``); ``linear`` then decays to 0 at ``--steps``, ``cosine`` follows half a cosine to 0. The scheduler's
state (the step it is at) is saved in ``trainer_state.json`` of each checkpoint; the multiplier itself is rebuilt
from the flags, so a resumed run must keep ``--steps`` to follow the same curve.
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["SCHEDULERS", "build_scheduler", "schedule_problems"]

SCHEDULERS = ("constant", "linear", "cosine")
# transformers' "constant" has no warmup; "constant_with_warmup" with 0 steps is the same constant.
_HF_NAMES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def schedule_problems(name: str, warmup_steps: int, steps: int) -> list[str]:
    """What is wrong with a schedule, as messages that name the flag and the fix."""
    out = []
    if name not in SCHEDULERS:
        out.append(f"--lr-scheduler={name!r}: use one of {', '.join(SCHEDULERS)}")
    if warmup_steps < 0:
        out.append(f"--warmup-steps={warmup_steps} must be >= 0")
    elif warmup_steps >= steps and warmup_steps > 0:
        out.append(
            f"--warmup-steps={warmup_steps} is not shorter than the run (--steps {steps}): the learning rate would "
            f"never reach --lr; use --warmup-steps {max(0, steps // 10)} (10% of the run) or raise --steps"
        )
    return out


def build_scheduler(optimizer: torch.optim.Optimizer, name: str, warmup_steps: int, steps: int) -> LambdaLR:
    from transformers import get_scheduler

    return get_scheduler(_HF_NAMES[name], optimizer, num_warmup_steps=warmup_steps, num_training_steps=steps)
