"""Interleaved rounds: how the benchmarks measure on a machine they share.

A benchmark compares a measured phase against a baseline run in the same process. On a loaded
machine (two cores, other people's tests) one best-of or one bracketing pair says nothing: load
comes and goes in stretches longer than a run. So the phases **interleave** (baseline, measured,
baseline, measured, ...), one run each, and the rounds go on until the baseline's last ``window``
runs are within ``target`` of each other (spread = (max - min) / median) or ``budget_s`` has
passed, with at least ``window`` rounds either way. Load then hits both phases alike, the figures
are medians over the last window, and a noisy stretch shows as a spread and ``settled: false``
instead of hiding in a best-of. ``bench codec``, ``bench syncer`` and ``bench overhead`` use it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

TARGET_SPREAD = 0.05


def spread(values: Sequence[float]) -> float:
    """(max - min) / median: how far apart the runs of one phase are (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else float("inf")


def interleave(baseline: Callable[[], float], measured: Callable[[], Any], *, window: int, budget_s: float,
               target: float = TARGET_SPREAD, progress: Callable[[str], None] = lambda msg: None) -> dict[str, Any]:
    """Alternate ``baseline`` and ``measured`` until the baseline settles or the budget is spent.

    ``baseline`` returns its figure (seconds, or a rate: the spread is the same); ``measured``
    returns whatever the caller wants back per round. Returns ``{baseline, measured}`` (the last
    ``window`` rounds' values), ``rounds``, ``spread`` (the baseline's over that window), ``settled``
    (spread under ``target``) and ``elapsed_s``."""
    if window < 2:
        raise ValueError(f"window={window}: at least 2 rounds are needed for a spread")
    base: list[float] = []
    meas: list[Any] = []
    start = time.perf_counter()
    while True:
        base.append(baseline())
        meas.append(measured())
        current = spread(base[-window:])
        progress(f"round {len(base)}: baseline spread over the last {min(window, len(base))} is {current:.1%}")
        if len(base) >= window and (current < target or time.perf_counter() - start > budget_s):
            return {"baseline": base[-window:], "measured": meas[-window:], "rounds": len(base),
                    "spread": current, "settled": current < target, "elapsed_s": time.perf_counter() - start}
