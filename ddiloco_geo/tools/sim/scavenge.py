"""Scavenging: extra compute that comes and goes on a schedule (paper §4.9, §4.10.5).

A base fleet of ``base_learners`` learners (same chips each) runs all the time. An extra fleet of
``extra_ratio`` × the base appears for ``extra_hours`` of every ``period_hours`` (``+100% at
night``: ratio 1, 8 h of 24), in another region. Throughput is counted in base-learner units, so
the base fleet alone processes the token budget in ``budget_base_hours``. No failures here.

``ddiloco``  extra learners join through the normal recovery path: each arrival spends ``join_s``
    pulling state before it steps, and a departure throws away its unmerged progress, on average
    half a fragment period (``H/2`` steps of ``step_s``). The base fleet never pauses.

``dp_reconfig``  one data-parallel job that grows to the extra fleet and shrinks back. Every fleet
    change pauses the whole job for ``reconfig_s`` (a restart at the new size), and while it spans
    two regions every step also waits for a cross-region ring all-reduce of the gradient at
    ``wan_gbps`` (not overlapped, as in ``bandwidth.py``); ``wan_gbps = 0`` means no WAN penalty
    (extra chips in the same region).

``base_only``  ignore the extra compute (what a DP job that cannot reconfigure does).

Reported: hours of wall-clock to the token budget and the speed-up over ``base_only``. Token
efficiency per learner is taken as equal across systems (the paper reports quality parity); the
model measures wall-clock only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.sim.bandwidth import BITS, BandwidthModel
from ddiloco_geo.tools.sim.goodput import CALIBRATED_RESCALE_S, CALIBRATED_RESTART_S

DEFAULT_EXTRA_RATIOS = (0.25, 0.5, 1.0, 3.0)


@dataclass(frozen=True)
class ScavengeConfig:
    base_learners: int = 4
    extra_hours: float = 8.0
    period_hours: float = 24.0
    budget_base_hours: float = 168.0
    join_s: float = CALIBRATED_RESCALE_S
    reconfig_s: float = CALIBRATED_RESTART_S
    H: int = 24
    wan_gbps: float = 100.0
    bandwidth: BandwidthModel = BandwidthModel()

    def __post_init__(self) -> None:
        if not 0 <= self.extra_hours <= self.period_hours or self.period_hours <= 0:
            raise ConfigError("need 0 <= extra_hours <= period_hours and period_hours > 0")
        if self.base_learners < 1 or self.budget_base_hours <= 0:
            raise ConfigError("base_learners >= 1 and budget_base_hours > 0 are required")
        if min(self.join_s, self.reconfig_s, self.wan_gbps) < 0:
            raise ConfigError("join_s, reconfig_s and wan_gbps must be >= 0")

    @property
    def dp_wan_slowdown(self) -> float:
        """Step-time factor of a DP job that spans two regions (1 when wan_gbps is 0)."""
        if self.wan_gbps == 0:
            return 1.0
        bw = self.bandwidth
        allreduce_s = 1.0 * bw.params * BITS[bw.dp_precision] / (self.wan_gbps * 1e9)  # 2(n-1)/n, n=2
        return (bw.step_time_s + allreduce_s) / bw.step_time_s


def _hours_to_budget(cfg: ScavengeConfig, rate_in: float, rate_out: float,
                     cost_in_h: float, cost_out_h: float) -> float:
    """Wall hours until the budget is met, with throughput ``rate_in`` inside windows and
    ``rate_out`` outside, minus ``cost_*_h`` base-learner-hours of work at each window edge."""
    budget = cfg.budget_base_hours * cfg.base_learners
    done, t = 0.0, 0.0
    while True:
        for length, rate, cost in ((cfg.extra_hours, rate_in, cost_in_h),
                                   (cfg.period_hours - cfg.extra_hours, rate_out, cost_out_h)):
            done -= cost
            if rate > 0 and done + rate * length >= budget:
                return t + (budget - done) / rate
            done += rate * length
            t += length
        if t > 1e6:
            raise ConfigError("token budget never reached; check the rates")


def scavenge_rows(cfg: ScavengeConfig | None = None,
                  extra_ratios: tuple[float, ...] = DEFAULT_EXTRA_RATIOS) -> list[dict]:
    cfg = cfg or ScavengeConfig()
    base = float(cfg.base_learners)
    base_h = _hours_to_budget(cfg, base, base, 0.0, 0.0)
    step_s = cfg.bandwidth.step_time_s
    rows = []
    for x in extra_ratios:
        if x < 0:
            raise ConfigError(f"extra ratio {x} must be >= 0")
        extra = base * x
        # ddiloco: arrivals pay join_s each; departures lose H/2 steps of unmerged work
        ddl_h = _hours_to_budget(cfg, base + extra, base, extra * cfg.join_s / 3600,
                                 extra * cfg.H / 2 * step_s / 3600)
        # dp: whole-job pause at each change, WAN slowdown while spanning two regions
        pause_h = cfg.reconfig_s / 3600
        dp_h = _hours_to_budget(cfg, (base + extra) / cfg.dp_wan_slowdown, base,
                                (base + extra) * pause_h, base * pause_h)
        for system, hours in (("ddiloco", ddl_h), ("dp_reconfig", dp_h), ("base_only", base_h)):
            rows.append({"system": system, "extra_ratio": x, "hours_to_budget": round(hours, 2),
                         "speedup_vs_base": round(base_h / hours, 4)})
    return rows
