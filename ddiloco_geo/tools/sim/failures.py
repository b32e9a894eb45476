"""Seeded failure traces and the interval arithmetic the goodput model is built on.

A cluster of ``chips`` chips is cut into slices of ``slice_chips`` (the unit that fails, is
dropped and comes back; 256 chips on TPU-like hardware). Every chip is interrupted as a Poisson
process with mean time between interruptions ``mtbi_s``, and one interrupted chip takes its whole
slice down, so slice failures arrive cluster-wide as a Poisson process of rate ``chips / mtbi_s``
and land on a uniformly chosen slice. Each failure keeps its slice down for a repair time drawn
from a configurable distribution (``exp``, ``const`` or ``lognormal`` with σ=1, all with the given
mean).

One :class:`FailureTrace` is drawn per cell (chip count, seed) and shared by every system and
every M in that cell, so differences between systems are never sampling noise. Repair times are
stored as unit draws (mean 1) and scaled by the mean when used, so a calibration search over the
mean sees one fixed trace (common random numbers, a monotone objective).

The helpers below work on sets of half-open intervals ``[start, end)`` clipped to ``[0, horizon)``:
:func:`union` merges them, :func:`covered_before` measures how much of a union lies before given
instants. Everything is vectorised; there is no per-event Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco_geo.core.errors import ConfigError

REPAIR_DISTRIBUTIONS = ("exp", "const", "lognormal")


@dataclass(frozen=True)
class FailureTrace:
    """Failures of one cluster over ``[0, horizon_s)``, sorted by time."""

    chips: int
    slice_chips: int
    horizon_s: float
    times_s: np.ndarray  # arrival instants, sorted
    slices: np.ndarray  # index of the failed slice, in [0, num_slices)
    repair_unit: np.ndarray  # repair time / mean repair time (mean 1)

    @property
    def num_slices(self) -> int:
        return max(1, round(self.chips / self.slice_chips))

    @property
    def num_failures(self) -> int:
        return int(self.times_s.size)


def draw_trace(*, chips: int, mtbi_s: float, slice_chips: int, horizon_s: float,
               repair_dist: str = "exp", seed: int = 0) -> FailureTrace:
    """Draw the failure trace of one cell; the same (chips, seed) always gives the same trace."""
    if chips < 1 or slice_chips < 1:
        raise ConfigError(f"chips={chips} and slice_chips={slice_chips} must both be >= 1")
    if mtbi_s <= 0 or horizon_s <= 0:
        raise ConfigError("mtbi and horizon must be > 0 (e.g. --mtbi-days 365 --horizon-hours 48)")
    if repair_dist not in REPAIR_DISTRIBUTIONS:
        raise ConfigError(f"repair distribution {repair_dist!r}: choose one of {REPAIR_DISTRIBUTIONS}")
    rng = np.random.default_rng([seed, chips])
    num_slices = max(1, round(chips / slice_chips))
    count = rng.poisson(chips / mtbi_s * horizon_s)
    times = np.sort(rng.uniform(0.0, horizon_s, count))
    slices = rng.integers(0, num_slices, count)
    if repair_dist == "exp":
        unit = rng.exponential(1.0, count)
    elif repair_dist == "const":
        unit = np.ones(count)
    else:  # lognormal, sigma 1, rescaled to mean 1
        unit = rng.lognormal(-0.5, 1.0, count)
    return FailureTrace(chips, slice_chips, horizon_s, times, slices, unit)


def union(starts: np.ndarray, ends: np.ndarray, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Merge intervals ``[starts, ends)`` into sorted disjoint ones, clipped to ``[0, horizon_s)``."""
    if starts.size == 0:
        return np.empty(0), np.empty(0)
    order = np.argsort(starts, kind="stable")
    s = np.clip(starts[order], 0.0, horizon_s)
    e = np.clip(ends[order], 0.0, horizon_s)
    reach = np.maximum.accumulate(e)
    is_new = np.empty(s.size, dtype=bool)
    is_new[0] = True
    is_new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(is_new)
    last = np.append(first[1:] - 1, s.size - 1)
    return s[first], reach[last]


def covered_before(s: np.ndarray, e: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Measure of the disjoint union ``∪[s, e)`` that lies in ``[0, x)``, for every ``x``."""
    x = np.asarray(x, dtype=float)
    if s.size == 0:
        return np.zeros_like(x)
    done = np.concatenate(([0.0], np.cumsum(e - s)))
    k = np.searchsorted(s, x, side="right")  # intervals starting at or before x
    partial = np.where(k > 0, np.clip(x - s[np.maximum(k - 1, 0)], 0.0,
                                      (e - s)[np.maximum(k - 1, 0)]), 0.0)
    return done[np.maximum(k - 1, 0)] * (k > 0) + partial


def resume_before(s: np.ndarray, e: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each instant ``t``: is it the start of a union interval (the system was running just
    before), and when did the system last resume (end of the previous interval, or 0)."""
    k = np.searchsorted(s, t, side="right") - 1
    starts_group = (k >= 0) & (s[np.maximum(k, 0)] == t)
    prev_end = np.where(k >= 1, e[np.maximum(k - 1, 0)], 0.0)
    return starts_group, prev_end
