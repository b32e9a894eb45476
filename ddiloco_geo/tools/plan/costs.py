"""What a configuration pays besides compute: egress, requests, storage held (the cost model).

Every figure is for the whole run (``wall_h`` hours, ``steps`` learner-steps) and in US dollars.

- **Egress.** A learner outside the bucket's (home) region pays its region's egress on every delta
  it sends; the home region pays its egress on every update object a remote learner downloads
  (one fragment per step each way with H = P and merge spacing 1: one version per fragment period).
- **Requests** (home region prices, the bucket's). Per learner: a delta PUT per step, a heartbeat
  PUT every ``heartbeat_s``, an index GET every ``learner_poll_s``, an update GET per step. The
  syncer: a LIST per learner every ``syncer_poll_s`` (LIST is billed as a PUT), a GET per delta,
  and five PUTs per merged version (global, update, state, tape, index).
- **Storage held** under the gc retention policy (:mod:`ddiloco_geo.ops.gc`): per fragment the
  versions kept are ``max(keep_versions, versions published in replay_window_s + 1)``, each one a
  global (fp32), an update object (update codec) and a syncer state (fp32 momentum), plus the merged
  deltas of those versions, plus one checkpoint per learner. GB-months = GB × wall hours / 730.
  Data-parallel holds two checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddiloco_geo.tools.plan.inputs import CODEC_BYTES_PER_PARAM, PlanInput

GB = 1e9
HOURS_PER_MONTH = 730.0
PUTS_PER_VERSION = 5


@dataclass(frozen=True)
class Learner:
    region: str
    accelerators: int
    instances: int
    step_s: float  # compute time of one step
    utilization: float  # share of wall time not stalled on the WAN
    goodput: float  # simulator: useful share of allocated time under interruptions

    @property
    def steps_per_hour(self) -> float:
        return 3600 / self.step_s * self.utilization * self.goodput


def bytes_per_step(params: float, codec: str, update_codec: str, H: int) -> tuple[float, float]:
    """(sent, received) payload bytes of one learner-step: 1/H of the model each way (H = P)."""
    return params / H * CODEC_BYTES_PER_PARAM[codec], params / H * CODEC_BYTES_PER_PARAM[update_codec]


def egress_usd(plan: PlanInput, home: str, learners: list[Learner], wall_h: float, codec: str,
               H: int) -> tuple[float, float]:
    """(USD, bytes crossing regions) of a DDiLoCo run: per step, 1/H of the model each way."""
    up_step, down_step = bytes_per_step(plan.job.params, codec, plan.job.update_codec, H)
    usd = sent = 0.0
    for ln in learners:
        if ln.region == home:
            continue
        steps = ln.steps_per_hour * wall_h
        up, down = steps * up_step, steps * down_step
        usd += up / GB * plan.region(ln.region).egress_usd_per_gb + down / GB * plan.region(home).egress_usd_per_gb
        sent += up + down
    return usd, sent


def requests_usd(plan: PlanInput, home: str, learners: list[Learner], wall_h: float) -> float:
    r = plan.region(home)
    puts = gets = 0.0
    for ln in learners:
        steps = ln.steps_per_hour * wall_h
        puts += steps + wall_h * 3600 / plan.heartbeat_s
        gets += wall_h * 3600 / plan.learner_poll_s + steps
        gets += steps  # the syncer reads every delta
        puts += wall_h * 3600 / plan.syncer_poll_s  # the syncer lists each learner's prefix
    versions = wall_h * 3600 / mean_step_s(learners)  # one version per fragment period per fragment
    puts += versions * PUTS_PER_VERSION
    return puts / 1000 * r.put_usd_per_1k + gets / 1000 * r.get_usd_per_1k


def mean_step_s(learners: list[Learner]) -> float:
    rate = sum(1 / ln.step_s * ln.utilization for ln in learners) / len(learners)
    return 1 / rate


def storage_gb(plan: PlanInput, learners: list[Learner], H: int, codec: str) -> float:
    """GB held in steady state under the retention policy."""
    job = plan.job
    period_s = H * mean_step_s(learners)  # one version of each fragment per fragment period
    versions = max(plan.gc.keep_versions, math.ceil(plan.gc.replay_window_s / period_s) + 1)
    per_version = job.params * (4 + CODEC_BYTES_PER_PARAM[job.update_codec] + 4
                                + len(learners) * CODEC_BYTES_PER_PARAM[codec])
    return (versions * per_version + len(learners) * job.params * job.checkpoint_bytes_per_param) / GB


def storage_usd(plan: PlanInput, home: str, gb: float, wall_h: float) -> float:
    return gb * wall_h / HOURS_PER_MONTH * plan.region(home).storage_usd_per_gb_month


def dp_storage_gb(plan: PlanInput) -> float:
    return 2 * plan.job.params * plan.job.checkpoint_bytes_per_param / GB
