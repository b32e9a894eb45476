"""The learner's inner learning-rate schedule: linear warm-up, then cosine decay to a tenth of the
peak at ``max_steps``; where a joining learner starts on it (``learner.follow_run``: the run's
progress, read from the newest merge records, so a restarted or newly joined learner does not
restart its warm-up at full rate while the others are near the end of theirs); and, with
``learner.schedule = run``, where every learner is on it at each step: the mean over the run's
learners of their latest steps (:func:`run_position`: the median), so learners of different speeds anneal
together and the run stops when its total budget of M x ``max_steps`` steps is spent."""

from __future__ import annotations

import math
import statistics

from ddiloco_geo.codec import Header


def lr_schedule(step: int, lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup, then cosine decay to a tenth of ``lr`` at ``max_steps``."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _sane(step: object) -> bool:
    return isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2**40


def merged_steps(extra: dict) -> dict[str, int]:
    """learner -> its step when it sent, from a global's merge record (``merged`` entries) or an
    update object's ``steps`` (malformed entries are skipped)."""
    entries = extra.get("merged") if isinstance(extra.get("merged"), list) else []
    pairs = [(e.get("learner"), e.get("step")) for e in entries if isinstance(e, dict)]
    if isinstance(extra.get("steps"), dict):
        pairs += list(extra["steps"].items())
    out: dict[str, int] = {}
    for learner, step in pairs:
        if isinstance(learner, str) and _sane(step):
            out[learner] = max(step, out.get(learner, 0))
    return out


def run_position(own_step: int, me: str, steps: dict[str, int]) -> int:
    """``learner.schedule = run``: the median of this learner's step and every other learner's
    latest merged step. For a symmetric mix of speeds it is the mean, and M x the mean is the run's
    total steps (its tokens / tokens per step); unlike the mean, one learner that reports an absurd
    step (a bug, or an insider) cannot move every learner to the end of the schedule."""
    return int(statistics.median([own_step, *(s for learner, s in steps.items() if learner != me)]))


def run_progress(header: Header) -> int:
    """The largest learner step in a global's merge record (0 if none is readable)."""
    steps = [e.get("step") for e in header.extra.get("merged", []) if isinstance(e, dict)] \
        if isinstance(header.extra.get("merged"), list) else []
    return max((s for s in steps if isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**40), default=0)
