"""Choose the goodput model's unknown constants from the paper's two headline numbers.

Targets (Decoupled DiLoCo, arXiv 2604.21428): at 1.2M chips with a one-year MTBI per chip,
data-parallel without elasticity has **27%** goodput and Decoupled DiLoCo with M=8 has **88%**.

Unknowns: the mean slice repair time ``repair_mean_s`` (exponential), the elastic rescale time
(downscale = upscale = ``rescale_s``) and the DP restart cost ``restart_s``. Two targets pin two
numbers, so one tie is assumed: ``restart_s = rescale_s`` (a restart and a rescale both rebuild the
mesh and recompile; DP's extra cost, waiting for the repair, is modelled separately). Everything
else (slice size 256, step 2 s, step_cv 0, K=1) keeps its default.

The solve is nested bisection on one fixed trace (common random numbers make both goodputs
monotone in both unknowns):

- inner: for a given repair mean, the rescale time at which ``ddiloco`` M=8 hits 88% (it depends
  almost only on the rescale time: a learner pauses twice per failure of one of its slices);
- outer: the repair mean at which ``dp`` hits 27% with that rescale time (``dp`` is down for
  repair + restart after every failure).

Nothing else is fitted: every other cell of the grid follows from these two numbers.
"""

from __future__ import annotations

from dataclasses import replace

from ddiloco_geo.tools.sim.goodput import ClusterModel, simulate_ddiloco, simulate_dp, trace_for

TARGET_CHIPS = 1_200_000
TARGET_LEARNERS = 8
TARGET_DP = 0.27
TARGET_DDILOCO = 0.88


def _bisect(f, lo: float, hi: float, tol: float = 0.01) -> float:
    """Root of a decreasing ``f`` on [lo, hi] (clamped to the ends if there is none)."""
    if f(lo) <= 0:
        return lo
    if f(hi) >= 0:
        return hi
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if f(mid) > 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def calibrate(model: ClusterModel | None = None, *, seed: int = 0, chips: int = TARGET_CHIPS,
              learners: int = TARGET_LEARNERS, target_dp: float = TARGET_DP,
              target_ddiloco: float = TARGET_DDILOCO, progress=None) -> dict:
    """Solve for (repair_mean_s, rescale_s); returns the constants and the goodputs they give."""
    base = model or ClusterModel()
    trace = trace_for(chips, base, seed)

    def ddiloco(m: ClusterModel) -> float:
        return simulate_ddiloco(trace, m, learners=learners, quorum=1).goodput

    def rescale_for(repair_s: float) -> float:
        at = replace(base, repair_mean_s=repair_s)
        return _bisect(lambda r: ddiloco(at.with_rescale(r)) - target_ddiloco, 0.0, 600.0)

    def dp_gap(repair_s: float) -> float:
        m = replace(base, repair_mean_s=repair_s).with_rescale(rescale_for(repair_s))
        if progress:
            progress(repair_s)
        return simulate_dp(trace, m).goodput - target_dp

    repair_s = round(_bisect(dp_gap, 0.0, 3600.0, tol=0.05), 1)
    rescale_s = round(rescale_for(repair_s), 1)
    fitted = replace(base, repair_mean_s=repair_s).with_rescale(rescale_s)
    return {
        "targets": {"chips": chips, "mtbi_days": base.mtbi_days, "dp": target_dp,
                    "ddiloco_learners": learners, "ddiloco": target_ddiloco},
        "constants": {"repair_mean_s": repair_s, "repair_dist": base.repair_dist,
                      "downscale_s": rescale_s, "upscale_s": rescale_s, "restart_s": rescale_s},
        "tie": "restart_s = downscale_s = upscale_s",
        "achieved": {"dp": round(simulate_dp(trace, fitted).goodput, 4),
                     "ddiloco": round(ddiloco(fitted), 4)},
        "seed": seed,
        "horizon_s": base.horizon_s,
        "model": fitted.as_dict(),
    }
