"""Goodput and uptime under chip failures, derived from what one failure costs (paper §4.1, §4.9).

Definitions (one axis for every system):

- **allocated chip-time** = ``chips × wall time``: every chip is paid for, spares included.
- **goodput** = useful chip-time / allocated chip-time. Useful: a chip was stepping, its step
  finished, the step was not thrown away by a restart, and (DDiLoCo) it can reach a merge.
- **uptime** = fraction of wall time during which the system advances training at all.

Failures. Every chip is interrupted as a Poisson process with mean time between interruptions
``mtbi_days``; an interrupted chip takes its slice (``slice_chips``, the failure domain) out of
service for ``repair_s``, after which the slice (or a replacement) is usable again. A synchronous
group of n chips therefore sees failures at rate ``λ(n) = n / MTBI``. This is the only quantity
that scales linearly with chips; per-failure costs are taken as independent of size (assumption,
docs/simulator.md §1).

What one failure costs, per system:

``dp``  data-parallel, fixed-size mesh, hot spares. Detection (``detect_s``: the job stalls in a
    collective until a heartbeat times out), then a restart (``restart_s``: reschedule onto spares,
    reload the checkpoint, rebuild the mesh, recompile) and the work since the last checkpoint.
    Checkpoints go to host memory every ``τ = max(step_s, sqrt(2·ckpt_s/λ))`` (Young's optimum,
    never more often than once a step) and block for ``ckpt_s`` each. The spare pool covers the
    slices in repair (Little's law: ``λ·repair_s`` slices on average) plus ``spare_sigmas``
    standard deviations; spares are allocated and idle.

``elastic_dp``  drop the failed slice and continue smaller: detection, then a downscale pause
    (``downscale_s``), the step in flight is lost; when the slice is back, an upscale pause
    (``upscale_s``). Between pauses the group runs without the slices in repair (on average
    ``slice_chips·repair_s/MTBI`` of its chips: Little's law again). No spares, no checkpoint
    reload: the state survives on the remaining replicas.

``ddiloco``  M learners of ``chips/M`` chips, each an ``elastic_dp`` group at rate ``λ/M``. A
    failure pauses only its learner. With quorum K the run stalls while fewer than K learners
    step; a learner's steps count only while at least K-1 others step too. Learners fail
    independently, so the number stepping is binomial.

How costs overlap when failures arrive faster than recoveries: a failure that arrives while a
group is already recovering is absorbed by that recovery (a restart or a rescale re-plans around
every slice known to be down when it commits). Each group is then a one-server loss system
(M/G/1/1), whose fraction of time running is ``1 / (1 + λ·E[pause per event])`` whatever the
distribution of pause lengths (Erlang's insensitivity). The old model let every failure extend the
outage (a union of intervals), which is ``exp(−λ·cost)``: that made goodput fall exponentially with
chips, while the published figures fall gently. :mod:`.failures` checks the closed forms against
seeded event simulations with the same rule.

Stragglers: with ``step_cv > 0`` a synchronous group of n slices waits for its slowest member each
step: useful fraction ``1 / (1 + step_cv·z_n)``, z_n the expected maximum of n standard normals
(Blom). Default 0.

The unknown constants ``restart_s`` and ``downscale_s = upscale_s`` are solved in closed form from
the paper's two headline cells (:mod:`.calibrate`); every other constant is documented with its
source or reason in docs/simulator.md, and :mod:`.sensitivity` shows what each one moves.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from statistics import NormalDist

from ddiloco_geo.core.errors import ConfigError

DAY_S = 86400.0
SYSTEMS = ("dp", "elastic_dp", "ddiloco")
DEFAULT_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
DEFAULT_LEARNERS = (2, 4, 8, 16)

# Solved by `ddiloco-geo simulate --calibrate` (closed form); see docs/simulator.md §1.
CALIBRATED_RESTART_S = 54.3
CALIBRATED_RESCALE_S = 8.2


@dataclass(frozen=True)
class ClusterModel:
    """Every constant of the failure model besides the chip count and M (units in the names)."""

    mtbi_days: float = 365.0
    slice_chips: int = 256
    detect_s: float = 10.0
    repair_s: float = 600.0
    restart_s: float = CALIBRATED_RESTART_S
    downscale_s: float = CALIBRATED_RESCALE_S
    upscale_s: float = CALIBRATED_RESCALE_S
    ckpt_s: float = 0.05
    spare_sigmas: float = 3.0
    step_s: float = 2.0
    step_cv: float = 0.0
    quorum: int = 1
    horizon_s: float = 7 * DAY_S  # only the event simulation (failures.py) uses it

    def __post_init__(self) -> None:
        for name in ("detect_s", "repair_s", "restart_s", "downscale_s", "upscale_s", "ckpt_s",
                     "spare_sigmas", "step_cv"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if self.step_s <= 0 or self.mtbi_days <= 0 or self.horizon_s <= 0 or self.slice_chips < 1:
            raise ConfigError("step_s, mtbi_days, horizon_s must be > 0 and slice_chips >= 1")
        if self.quorum < 1:
            raise ConfigError(f"quorum={self.quorum} must be >= 1 (K=1: never stall while a learner is up)")

    @property
    def mtbi_s(self) -> float:
        return self.mtbi_days * DAY_S

    def rate(self, chips: float) -> float:
        """Slice failures per second seen by a synchronous group of ``chips`` chips."""
        return chips / self.mtbi_s

    def with_rescale(self, rescale_s: float) -> "ClusterModel":
        return replace(self, downscale_s=rescale_s, upscale_s=rescale_s)

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


def straggler_efficiency(num_slices: float, step_cv: float) -> float:
    """Useful fraction of a synchronous group of ``num_slices`` that waits for its slowest member."""
    n = int(round(num_slices))
    if step_cv == 0 or n < 2:
        return 1.0
    z = NormalDist().inv_cdf((n - 0.375) / (n + 0.25))
    return 1.0 / (1.0 + step_cv * z)


def checkpoint_interval_s(model: ClusterModel, chips: float) -> float:
    """Young's optimum ``sqrt(2·ckpt_s/λ)``, but never more often than once a step."""
    lam = model.rate(chips)
    return max(model.step_s, math.sqrt(2 * model.ckpt_s / lam)) if model.ckpt_s > 0 else model.step_s


def spare_ratio(model: ClusterModel, chips: float) -> float:
    """Share of the allocation a fixed-size job keeps as hot spares (Little's law + σ margin)."""
    in_repair = model.rate(chips) * model.repair_s
    spares = math.ceil(in_repair + model.spare_sigmas * math.sqrt(in_repair)) * model.slice_chips
    return min(1.0, spares / chips)


def missing_ratio(model: ClusterModel) -> float:
    """Share of an elastic group's chips in repair at any time: ``slice·repair_s / MTBI``."""
    return min(1.0, model.slice_chips * model.repair_s / model.mtbi_s)


def dp_outcome(chips: int, model: ClusterModel) -> Outcome:
    lam = model.rate(chips)
    tau = checkpoint_interval_s(model, chips)
    uptime = 1.0 / (1.0 + lam * (model.detect_s + model.restart_s))
    # of the time running: the checkpoint stalls, and the work since the last checkpoint at each failure
    running = max(0.0, 1.0 - model.ckpt_s / tau) * max(0.0, 1.0 - lam * tau / 2)
    eff = straggler_efficiency(chips / model.slice_chips, model.step_cv)
    goodput = (1.0 - spare_ratio(model, chips)) * uptime * running * eff
    return Outcome("dp", chips, 1, goodput, uptime)


def elastic_group(chips: float, model: ClusterModel) -> tuple[float, float]:
    """(goodput, fraction of time stepping) of one elastic data-parallel group of ``chips``."""
    lam = model.rate(chips)
    stepping = 1.0 / (1.0 + lam * (model.detect_s + model.downscale_s + model.upscale_s))
    lost_step = max(0.0, 1.0 - lam * model.step_s / 2)  # the step in flight at each failure
    eff = straggler_efficiency(chips / model.slice_chips, model.step_cv)
    return (1.0 - missing_ratio(model)) * stepping * lost_step * eff, stepping


def _at_least(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) >= k)."""
    if k <= 0:
        return 1.0
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def ddiloco_outcome(chips: int, model: ClusterModel, learners: int, quorum: int | None = None) -> Outcome:
    k = model.quorum if quorum is None else quorum
    if not 1 <= k <= learners:
        raise ConfigError(f"quorum K={k} must be between 1 and M={learners}")
    if learners > max(1, round(chips / model.slice_chips)):
        raise ConfigError(f"M={learners} learners need at least {learners} slices of {model.slice_chips} chips")
    good, stepping = elastic_group(chips / learners, model)
    goodput = good * _at_least(k - 1, learners - 1, stepping)
    return Outcome("ddiloco", chips, learners, goodput, _at_least(k, learners, stepping))


def elastic_outcome(chips: int, model: ClusterModel) -> Outcome:
    return replace(ddiloco_outcome(chips, model, 1, 1), system="elastic_dp")


def simulate_cell(chips: int, learners: tuple[int, ...], model: ClusterModel) -> list[Outcome]:
    """Every system at one chip count: ``dp``, ``elastic_dp``, then ``ddiloco`` for each M."""
    return [dp_outcome(chips, model), elastic_outcome(chips, model),
            *[ddiloco_outcome(chips, model, m) for m in learners]]


def simulate_grid(chips: tuple[int, ...] = DEFAULT_CHIPS, learners: tuple[int, ...] = DEFAULT_LEARNERS,
                  model: ClusterModel | None = None, progress=None) -> list[dict]:
    """One row per (system, chips, learners)."""
    model = model or ClusterModel()
    rows: list[dict] = []
    for n in chips:
        rows += [o.row() for o in simulate_cell(n, learners, model)]
        if progress:
            progress(n)
    return rows
