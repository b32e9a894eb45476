"""The learner's inner learning-rate schedule: linear warm-up, then cosine decay to a tenth of the
peak at ``max_steps``."""

from __future__ import annotations

import math


def lr_schedule(step: int, lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup, then cosine decay to a tenth of ``lr`` at ``max_steps``."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
