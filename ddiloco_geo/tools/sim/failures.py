"""Seeded failure traces and an event simulation that checks the closed forms of :mod:`.goodput`.

A group of ``chips`` chips, cut into slices of ``slice_chips``, sees slice failures as a Poisson
process of rate ``chips / MTBI`` (one interrupted chip takes its slice down). :func:`draw_trace`
draws one seeded trace over ``horizon_s``; the same (chips, seed) always gives the same trace.

The simulations walk the trace event by event with the overlap rule the closed forms assume: an
event that arrives while the group is already paused (detecting, restarting or rescaling) is
absorbed by that pause. Everything else is counted as it happens: the work since the last
checkpoint (DP) or the step in flight (elastic) at each failure that hits a running group, and
the chips missing while a slice is in repair. Agreement with :mod:`.goodput` within sampling
noise is a test (``tests/sim/test_goodput.py``); the command line uses the closed forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.sim.goodput import ClusterModel, checkpoint_interval_s, spare_ratio


@dataclass(frozen=True)
class FailureTrace:
    """Failures of one group over ``[0, horizon_s)``, sorted by time."""

    chips: int
    horizon_s: float
    times_s: np.ndarray


def draw_trace(chips: int, model: ClusterModel, seed: int = 0) -> FailureTrace:
    if chips < 1:
        raise ConfigError(f"chips={chips} must be >= 1")
    rng = np.random.default_rng([seed, chips])
    count = rng.poisson(model.rate(chips) * model.horizon_s)
    return FailureTrace(chips, model.horizon_s, np.sort(rng.uniform(0.0, model.horizon_s, count)))


def simulate_dp_events(trace: FailureTrace, model: ClusterModel) -> float:
    """Goodput of a fixed-size DP job with hot spares on ``trace`` (absorbing overlap rule)."""
    tau = checkpoint_interval_s(model, trace.chips)
    outage = model.detect_s + model.restart_s
    useful, resume = 0.0, 0.0
    for t in trace.times_s:
        if t < resume:
            continue  # absorbed by the restart in progress
        up = t - resume
        useful += up - (up % tau)  # the work since the last checkpoint is lost
        resume = t + outage
    useful += max(0.0, trace.horizon_s - resume)
    return (1 - spare_ratio(model, trace.chips)) * (1 - model.ckpt_s / tau) * useful / trace.horizon_s


def simulate_elastic_events(trace: FailureTrace, model: ClusterModel) -> tuple[float, float]:
    """(goodput, fraction of time stepping) of one elastic group on ``trace``."""
    fail = trace.times_s
    back = fail + model.repair_s
    when = np.concatenate((fail, back[back < trace.horizon_s]))
    is_fail = np.concatenate((np.ones(fail.size, bool), np.zeros(when.size - fail.size, bool)))
    order = np.argsort(when, kind="stable")
    pause = {True: model.detect_s + model.downscale_s, False: model.upscale_s}
    running, lost, resume = 0.0, 0.0, 0.0
    for t, f in zip(when[order], is_fail[order]):
        if t < resume:
            continue  # absorbed by the rescale in progress
        running += t - resume
        if f:
            lost += (t - resume) % model.step_s
        resume = t + pause[bool(f)]
    running += max(0.0, trace.horizon_s - resume)
    missing_chip_s = model.slice_chips * float(np.sum(np.minimum(back, trace.horizon_s) - fail))
    useful = trace.chips * (running - lost) - missing_chip_s
    return useful / (trace.chips * trace.horizon_s), running / trace.horizon_s
