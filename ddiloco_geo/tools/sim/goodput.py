"""Goodput and uptime of three training systems on one shared failure trace (paper §4.1, §4.9).

Definitions (the same for every system, so they compare on one axis):

- **allocated chip-time** = ``chips × horizon``: every chip is paid for all the time.
- **goodput** = useful chip-time / allocated chip-time. Useful means a chip was stepping, its step
  finished, and the step counts toward training.
- **uptime** = fraction of wall time during which the system advances training at all.

Systems, all driven by the same :class:`~ddiloco_geo.tools.sim.failures.FailureTrace`:

``dp``  data-parallel without elasticity. Any failure stops every chip; the job restarts once the
    failed slice is back and then pays ``restart_s`` (reschedule, reload, recompile). A failure
    during the repair or the restart extends the outage. The job therefore runs at time t exactly
    when no failure i has ``t_i <= t < t_i + repair_i + restart_s``: the complement of a union of
    intervals, computed exactly. Each failure that hits a running job also loses the step in
    flight (the time since the last step boundary; later lost work since a checkpoint is part of
    ``restart_s``).

``elastic_dp``  drop the failed slice and continue smaller. A failure pauses every chip for
    ``downscale_s``; when the slice comes back, every chip pauses again for ``upscale_s`` to take
    it in. Between pauses the job runs on the chips that are up. A failure that hits a running job
    loses the step in flight on every chip.

``ddiloco``  Decoupled DiLoCo with M learners on ``chips/M`` chips each (slice ``s`` belongs to
    learner ``s mod M``). Each learner is an ``elastic_dp`` job over its own slices: a failure
    pauses and rescales only that learner. The run stalls when fewer than K learners are stepping;
    during a stall the work of the learners that are still stepping cannot reach a merge and is
    not useful. Uptime is the fraction of time at least K learners step.

So ``ddiloco`` with M=1, K=1 *is* ``elastic_dp``, and M learners on N chips are M independent
copies of one elastic learner on N/M chips (tested invariants).

Stragglers: with ``step_cv > 0`` a synchronous group of n slices waits for the slowest one each
step, so its useful fraction is ``1 / (1 + step_cv · z_n)`` with z_n the expected maximum of n
standard normals (Blom's approximation). The calibrated default is ``step_cv = 0``.

Approximations (documented, small in the calibrated regime where under 0.1% of slices are down):
two failures of the same slice are counted as two slices down; a learner's lost-step cost uses its
nominal chip count; the stall correction uses ``chips/M`` per stepping learner.

The defaults in :class:`ClusterModel` are the calibrated constants (see ``calibrate.py`` and
docs/simulator.md): chosen once so that at 1.2M chips and a one-year MTBI ``dp`` has 27% goodput
and ``ddiloco`` with M=8 has 88%. Every other cell follows from the model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from statistics import NormalDist

import numpy as np

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.sim.failures import FailureTrace, covered_before, draw_trace, resume_before, union

DAY_S = 86400.0
SYSTEMS = ("dp", "elastic_dp", "ddiloco")
DEFAULT_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
DEFAULT_LEARNERS = (2, 4, 8, 16)

# Calibrated by `ddiloco-geo simulate --calibrate` (seed 0, 7-day horizon); see docs/simulator.md.
CALIBRATED_REPAIR_MEAN_S = 18.2
CALIBRATED_RESCALE_S = 15.4


@dataclass(frozen=True)
class ClusterModel:
    """Everything the goodput model needs besides the chip count and M.

    ``restart_s`` defaults to the rescale time: both are dominated by rebuilding the device mesh and
    recompiling (the calibration ties them; see docs/simulator.md).
    """

    mtbi_days: float = 365.0
    slice_chips: int = 256
    repair_mean_s: float = CALIBRATED_REPAIR_MEAN_S
    repair_dist: str = "exp"
    downscale_s: float = CALIBRATED_RESCALE_S
    upscale_s: float = CALIBRATED_RESCALE_S
    restart_s: float = CALIBRATED_RESCALE_S
    step_s: float = 2.0
    step_cv: float = 0.0
    quorum: int = 1
    horizon_s: float = 7 * DAY_S

    def __post_init__(self) -> None:
        for name in ("repair_mean_s", "downscale_s", "upscale_s", "restart_s", "step_cv"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if self.step_s <= 0 or self.mtbi_days <= 0 or self.horizon_s <= 0:
            raise ConfigError("step_s, mtbi_days and horizon_s must be > 0")
        if self.quorum < 1:
            raise ConfigError(f"quorum={self.quorum} must be >= 1 (K=1: never stall while a learner is up)")

    @property
    def mtbi_s(self) -> float:
        return self.mtbi_days * DAY_S

    def with_rescale(self, rescale_s: float) -> "ClusterModel":
        return replace(self, downscale_s=rescale_s, upscale_s=rescale_s, restart_s=rescale_s)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Outcome:
    system: str
    chips: int
    learners: int
    goodput: float
    uptime: float

    def row(self) -> dict:
        return {"system": self.system, "chips": self.chips, "learners": self.learners,
                "goodput": round(self.goodput, 4), "uptime": round(self.uptime, 4)}


def trace_for(chips: int, model: ClusterModel, seed: int = 0) -> FailureTrace:
    return draw_trace(chips=chips, mtbi_s=model.mtbi_s, slice_chips=model.slice_chips,
                      horizon_s=model.horizon_s, repair_dist=model.repair_dist, seed=seed)


def straggler_efficiency(num_slices: float, step_cv: float) -> float:
    """Useful fraction of a synchronous group of ``num_slices`` that waits for its slowest member."""
    n = int(round(num_slices))
    if step_cv == 0 or n < 2:
        return 1.0
    z = NormalDist().inv_cdf((n - 0.375) / (n + 0.25))
    return 1.0 / (1.0 + step_cv * z)


def _lost_step_s(t: np.ndarray, s: np.ndarray, e: np.ndarray, step_s: float) -> np.ndarray:
    """Work lost by failures at ``t``: the step in flight, if the system was running just before."""
    was_running, resumed = resume_before(s, e, t)
    return np.where(was_running, np.mod(t - resumed, step_s), 0.0)


def simulate_dp(trace: FailureTrace, model: ClusterModel) -> Outcome:
    t = trace.times_s
    repair = trace.repair_unit * model.repair_mean_s
    s, e = union(t, t + repair + model.restart_s, trace.horizon_s)
    run_s = trace.horizon_s - float(np.sum(e - s))
    lost_s = float(np.sum(_lost_step_s(t, s, e, model.step_s)))
    eff = straggler_efficiency(trace.num_slices, model.step_cv)
    goodput = eff * (run_s - lost_s) / trace.horizon_s
    return Outcome("dp", trace.chips, 1, goodput, run_s / trace.horizon_s)


@dataclass(frozen=True)
class _Learner:
    useful_chip_s: float
    pause_starts: np.ndarray
    pause_ends: np.ndarray


def _elastic_learner(t: np.ndarray, repair: np.ndarray, chips: float, slice_chips: int,
                     horizon_s: float, model: ClusterModel) -> _Learner:
    """One elastic data-parallel job of ``chips`` chips hit by failures at ``t``."""
    back = t + repair
    s, e = union(np.concatenate((t, back)),
                 np.concatenate((t + model.downscale_s, back + model.upscale_s)), horizon_s)
    paused_s = float(np.sum(e - s))
    run_s = horizon_s - paused_s
    # chip-seconds the failed slices were down while the job was otherwise running
    down_total = np.minimum(back, horizon_s) - t
    down_paused = covered_before(s, e, np.minimum(back, horizon_s)) - covered_before(s, e, t)
    missing_chip_s = slice_chips * float(np.sum(down_total - down_paused))
    lost_chip_s = chips * float(np.sum(_lost_step_s(t, s, e, model.step_s)))
    eff = straggler_efficiency(chips / slice_chips, model.step_cv)
    useful = eff * max(0.0, chips * run_s - missing_chip_s - lost_chip_s)
    return _Learner(useful, s, e)


def simulate_elastic_dp(trace: FailureTrace, model: ClusterModel) -> Outcome:
    out = simulate_ddiloco(trace, model, learners=1, quorum=1)
    return replace(out, system="elastic_dp")


def simulate_ddiloco(trace: FailureTrace, model: ClusterModel, *, learners: int,
                     quorum: int | None = None) -> Outcome:
    k = model.quorum if quorum is None else quorum
    if not 1 <= k <= learners:
        raise ConfigError(f"quorum K={k} must be between 1 and M={learners}")
    if learners > trace.num_slices:
        raise ConfigError(f"M={learners} learners need at least {learners} slices; "
                          f"the cluster has {trace.num_slices}")
    chips_each = trace.chips / learners
    repair = trace.repair_unit * model.repair_mean_s
    owner = trace.slices % learners
    parts = []
    for m in range(learners):
        mine = owner == m
        parts.append(_elastic_learner(trace.times_s[mine], repair[mine], chips_each,
                                      trace.slice_chips, trace.horizon_s, model))
    useful = sum(p.useful_chip_s for p in parts)
    stall_s, stepping_in_stall_s = _stall(parts, learners, k, trace.horizon_s)
    useful = max(0.0, useful - chips_each * stepping_in_stall_s)
    goodput = useful / (trace.chips * trace.horizon_s)
    return Outcome("ddiloco", trace.chips, learners, goodput, 1.0 - stall_s / trace.horizon_s)


def _stall(parts: list[_Learner], learners: int, quorum: int, horizon_s: float) -> tuple[float, float]:
    """Time with fewer than ``quorum`` learners stepping, and learner-seconds stepped during it."""
    starts = np.concatenate([p.pause_starts for p in parts])
    ends = np.concatenate([p.pause_ends for p in parts])
    if starts.size == 0:
        return 0.0, 0.0
    when = np.concatenate((starts, ends))
    delta = np.concatenate((np.ones(starts.size), -np.ones(ends.size)))
    order = np.argsort(when, kind="stable")
    when, paused = when[order], np.cumsum(delta[order])
    span = np.diff(np.append(when, horizon_s))
    stalled = (learners - paused) < quorum
    return float(np.sum(span[stalled])), float(np.sum(span[stalled] * (learners - paused[stalled])))


def simulate_cell(chips: int, learners: tuple[int, ...], model: ClusterModel, seed: int = 0) -> list[Outcome]:
    """Every system on one shared trace: ``dp``, ``elastic_dp``, then ``ddiloco`` for each M."""
    trace = trace_for(chips, model, seed)
    out = [simulate_dp(trace, model), simulate_elastic_dp(trace, model)]
    out += [simulate_ddiloco(trace, model, learners=m) for m in learners]
    return out


def simulate_grid(chips: tuple[int, ...] = DEFAULT_CHIPS, learners: tuple[int, ...] = DEFAULT_LEARNERS,
                  model: ClusterModel | None = None, seed: int = 0, progress=None) -> list[dict]:
    """The table of the issue: one row per (system, chips, learners)."""
    model = model or ClusterModel()
    rows: list[dict] = []
    for n in chips:
        rows += [o.row() for o in simulate_cell(n, learners, model, seed)]
        if progress:
            progress(n)
    return rows
