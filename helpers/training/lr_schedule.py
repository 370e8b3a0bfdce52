"""Learning-rate schedules as pure functions of the optimizer step, so a resumed run continues the same curve.

Warm-up ramps the rate up while Adam's second-moment estimates are still noisy (large early updates would
otherwise blow the loss up); the decay (cosine, linear) lowers it so the last steps settle into a minimum.
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "linear", "constant")


def check_schedule(name: str, max_lr: float, total_steps: int, warmup_steps: int, min_lr: float) -> None:
    """Refuse settings that would silently give a meaningless schedule."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    if max_lr <= 0:
        raise ValueError(f"the learning rate must be positive, got {max_lr}")
    if not 0 <= min_lr <= max_lr:
        raise ValueError(f"min_lr must be in [0, max_lr = {max_lr}], got {min_lr}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be 1 or more, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be in [0, total_steps = {total_steps}], got {warmup_steps}")


def learning_rate(step: int, max_lr: float, total_steps: int, warmup_steps: int = 0, min_lr: float = 0.0,
                  schedule: str = "cosine") -> float:
    """The learning rate of optimizer step `step` (0-based): linear warm-up to `max_lr` over `warmup_steps`,
    then `schedule` from `max_lr` down to `min_lr` at `total_steps` (and `min_lr` after it)."""
    check_schedule(schedule, max_lr, total_steps, warmup_steps, min_lr)
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return max_lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_lr + (max_lr - min_lr) * shape
