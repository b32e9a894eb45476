"""The learner's inner learning-rate schedule: linear warm-up, then cosine decay to a tenth of the
peak at ``max_steps``; and where a joining learner starts on it (``learner.follow_run``: the run's
progress, read from the newest merge records, so a restarted or newly joined learner does not
restart its warm-up at full rate while the others are near the end of theirs)."""

from __future__ import annotations

import math

from ddiloco_geo.codec import Header


def lr_schedule(step: int, lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup, then cosine decay to a tenth of ``lr`` at ``max_steps``."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def run_progress(header: Header) -> int:
    """The largest learner step in a global's merge record (0 if none is readable)."""
    steps = [e.get("step") for e in header.extra.get("merged", []) if isinstance(e, dict)] \
        if isinstance(header.extra.get("merged"), list) else []
    return max((s for s in steps if isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**40), default=0)
