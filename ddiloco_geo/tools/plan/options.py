"""Every configuration the planner considers, and what each one predicts (time, goodput, cost).

Three systems, all on the same regions file:

``ddiloco``  Decoupled DiLoCo: a subset of regions, ``learners_per_region`` learners in each (each a
    spot group: the region's instances split evenly), the bucket and the syncer in one of them
    (``home``), H = P, a wire codec, spot or on-demand. Per learner: its compute step, the WAN
    utilization (one fragment up and one down per step over the region→home link, shared by the
    region's learners, full duplex; a fragment's round trip within τ steps:
    ``u = min(1, step/t_frag, τ·step/(t_up + t_down + rtt))``, the bounds of
    :mod:`ddiloco_geo.tools.sim.bandwidth`) and its goodput from the simulator's elastic group
    (:func:`ddiloco_geo.tools.sim.goodput.elastic_group`, K = 1, failure domain = one instance, the
    region's interruption rate). A region without bandwidth to home cannot host a learner.
``dp_region``  data-parallel on every accelerator of one region (:func:`~ddiloco_geo.tools.sim.goodput.dp_outcome`:
    restarts, checkpoints, hot spares); the interconnect inside a region is taken as free.
``dp_wan``  data-parallel across regions: a ring all-reduce of the gradient (``dp_bytes_per_param``)
    over the WAN every step, not overlapped (as in ``simulate bandwidth``), on the best ring order
    (the one whose slowest link is fastest); infeasible if a ring needs a link with no bandwidth.

Wall-clock = tokens / efficiency / (Σ learner tokens/s × utilization × goodput); compute cost =
instance-hours × price (+ syncer cores); the other terms are in :mod:`.costs`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from ddiloco_geo.tools.plan import costs
from ddiloco_geo.tools.plan.costs import GB, Learner
from ddiloco_geo.tools.plan.inputs import CODEC_BYTES_PER_PARAM, PlanInput, Region
from ddiloco_geo.tools.sim.goodput import ClusterModel, dp_outcome, elastic_group


@dataclass
class Option:
    id: str
    system: str
    regions: list[str]
    home: str | None
    purchase: str
    learners_per_region: int = 0
    codec: str = "-"
    H: int = 0
    P: int = 0
    syncer_shards: int = 0
    accelerators: int = 0
    efficiency: float = 1.0
    efficiency_source: str = ""
    utilization: float = 0.0
    goodput: float = 0.0
    tokens_to_buy: float = 0.0
    wall_h: float = math.inf
    compute_usd: float = 0.0
    egress_usd: float = 0.0
    requests_usd: float = 0.0
    storage_usd: float = 0.0
    storage_gb: float = 0.0
    wan_bytes_per_token: float = 0.0
    feasible: bool = True
    reasons: list[str] = field(default_factory=list)

    @property
    def total_usd(self) -> float:
        return self.compute_usd + self.egress_usd + self.requests_usd + self.storage_usd

    def usd_per_billion_tokens(self, tokens: float) -> dict[str, float]:
        scale = 1e9 / tokens  # per billion of the job's tokens (what it is worth), not of the tokens bought
        terms = {k: getattr(self, f"{k}_usd") * scale for k in ("compute", "egress", "requests", "storage")}
        return {**terms, "total": sum(terms.values())}


def cluster_model(plan: PlanInput, region: Region, purchase: str, step_s: float) -> ClusterModel:
    """The simulator's failure model for one region: the failure domain is one instance."""
    per_accel_per_day = 24 / plan.job.ondemand_mtbi_days / 24  # hardware, every purchase kind
    if purchase == "spot":
        per_accel_per_day += region.interruptions_per_hour * 24 / region.accelerators_per_instance
    mtbi_days = 1 / per_accel_per_day
    return ClusterModel(mtbi_days=mtbi_days, slice_chips=region.accelerators_per_instance,
                        repair_s=plan.job.repair_s, step_s=step_s)


def price(region: Region, purchase: str) -> float:
    return region.spot_usd_per_hour if purchase == "spot" else region.ondemand_usd_per_hour


def step_s(plan: PlanInput, accelerators: float, speed: float) -> float:
    return plan.job.step_s * plan.job.step_accelerators / (accelerators * speed)


def tokens_per_s(plan: PlanInput, learners: list[Learner]) -> float:
    return sum(plan.job.tokens_per_step * ln.steps_per_hour / 3600 for ln in learners)


def ddiloco_learners(plan: PlanInput, regions: list[Region], home: Region, purchase: str, per_region: int,
                     codec: str, H: int, reasons: list[str]) -> list[Learner]:
    job = plan.job
    out = []
    for r in regions:
        if r.instances < per_region:
            reasons.append(f"{r.name} has {r.instances} instances, fewer than {per_region} learners")
            continue
        gbps = r.gbps_to(home.name) / per_region
        if gbps <= 0:
            reasons.append(f"no bandwidth from {r.name} to the syncer region {home.name}")
            continue
        instances = r.instances // per_region
        accel = instances * r.accelerators_per_instance
        step = step_s(plan, accel, r.speed)
        frag = job.params * math.ceil(job.layers / H) / job.layers if H <= job.layers else job.params / job.layers
        t_up = frag * CODEC_BYTES_PER_PARAM[codec] * 8 / (gbps * 1e9)
        t_down = frag * CODEC_BYTES_PER_PARAM[job.update_codec] * 8 / (gbps * 1e9)
        rtt = r.rtt_ms.get(home.name, 0.0) / 1e3
        u = min(1.0, step / max(t_up, t_down), job.tau * step / (t_up + t_down + rtt))
        good, _ = elastic_group(accel, cluster_model(plan, r, purchase, step))
        out += [Learner(r.name, accel, instances, step, u, good)] * per_region
    return out


def evaluate_ddiloco(plan: PlanInput, names: tuple[str, ...], home: str, purchase: str, per_region: int,
                     codec: str, H: int) -> Option:
    job = plan.job
    eff = plan.efficiency_of("ddiloco", codec, H)
    opt = Option(id=f"ddiloco:{'+'.join(names)}@{home}:{purchase}:x{per_region}:{codec}:H{H}", system="ddiloco",
                 regions=list(names), home=home, purchase=purchase, learners_per_region=per_region,
                 codec=codec, H=H, P=min(H, job.layers))
    learners = ddiloco_learners(plan, [plan.region(n) for n in names], plan.region(home), purchase, per_region,
                                codec, H, opt.reasons)
    if opt.reasons or eff is None:
        if eff is None:
            opt.reasons.append(f"no token-efficiency row for ddiloco/{codec}/H={H} (add one to [[efficiency]])")
        opt.feasible = False
        return opt
    opt.efficiency, opt.efficiency_source = eff.ratio, eff.source
    rate = tokens_per_s(plan, learners)
    if rate <= 0:
        opt.feasible = False
        opt.reasons.append("no learner makes progress: interruptions come faster than its steps and checkpoints "
                           "(plan on-demand capacity, or a smaller repair_s)")
        return opt
    opt.tokens_to_buy = job.tokens / eff.ratio
    opt.wall_h = opt.tokens_to_buy / rate / 3600
    ideal = sum(job.tokens_per_step / ln.step_s for ln in learners)
    opt.goodput = sum(job.tokens_per_step / ln.step_s * ln.goodput for ln in learners) / ideal
    opt.utilization = sum(job.tokens_per_step / ln.step_s * ln.utilization for ln in learners) / ideal
    opt.accelerators = sum(ln.accelerators for ln in learners)
    # syncer: the fp32 bytes of every learner's whole model once per H steps, at a core's throughput
    mb_per_s = sum(job.params * 4 / (H * ln.step_s) * ln.utilization for ln in learners) / 1e6
    opt.syncer_shards = min(opt.P, max(1, math.ceil(mb_per_s / (job.syncer_mb_per_s_per_core * job.syncer_headroom))))
    instance_usd_h = sum(ln.instances * price(plan.region(ln.region), purchase) for ln in learners)
    opt.compute_usd = opt.wall_h * (instance_usd_h + opt.syncer_shards * job.syncer_usd_per_core_hour)
    opt.egress_usd, wan_bytes = costs.egress_usd(plan, home, learners, opt.wall_h, codec, H)
    opt.wan_bytes_per_token = wan_bytes / opt.tokens_to_buy
    opt.requests_usd = costs.requests_usd(plan, home, learners, opt.wall_h)
    opt.storage_gb = costs.storage_gb(plan, learners, H, codec)
    opt.storage_usd = costs.storage_usd(plan, home, opt.storage_gb, opt.wall_h)
    return opt


def best_ring(regions: list[Region]) -> tuple[list[str], float, float]:
    """(order, bottleneck Gbit/s, sum of link RTTs in s) of the ring whose slowest link is fastest."""
    first, rest = regions[0], regions[1:]
    best: tuple[list[str], float, float] = ([], 0.0, 0.0)
    for perm in itertools.permutations(rest):
        ring = [first, *perm]
        links = list(zip(ring, ring[1:] + ring[:1]))
        if len(ring) == 2:
            links = links[:1]
        bottleneck = min(a.gbps_to(b.name) for a, b in links)
        rtt = sum(a.rtt_ms.get(b.name, 0.0) for a, b in links) / 1e3
        if bottleneck > best[1]:
            best = ([r.name for r in ring], bottleneck, rtt)
    return best


def evaluate_dp(plan: PlanInput, names: tuple[str, ...], purchase: str) -> Option:
    job = plan.job
    regions = [plan.region(n) for n in names]
    system = "dp_region" if len(regions) == 1 else "dp_wan"
    opt = Option(id=f"{system}:{'+'.join(names)}:{purchase}", system=system, regions=list(names), home=names[0],
                 purchase=purchase, codec="bf16" if job.dp_bytes_per_param == 2 else "-")
    eff = plan.efficiency_of("dp", "-", 0)
    opt.efficiency, opt.efficiency_source = eff.ratio, eff.source
    accel = sum(r.accelerators for r in regions)
    speed_accel = sum(r.accelerators * r.speed for r in regions)
    compute = job.step_s  # the global batch grows with the (speed-weighted) accelerators: weak scaling
    batch = job.tokens_per_step * speed_accel / job.step_accelerators
    comm = 0.0
    if len(regions) > 1:
        order, gbps, rtt = best_ring(regions)
        if gbps <= 0:
            opt.feasible = False
            opt.reasons.append("no ring of links with bandwidth joins " + ", ".join(names))
            return opt
        n = len(regions)
        sent = 2 * (n - 1) / n * job.params * job.dp_bytes_per_param
        comm = sent * 8 / (gbps * 1e9) + rtt
        opt.regions = order
        opt.wan_bytes_per_token = sent * n / batch
        opt.egress_usd = 0.0  # filled below once the step count is known
    opt.utilization = compute / (compute + comm)
    # failure rate of the whole job: the sum of the regions' rates
    rate = sum(r.accelerators / cluster_model(plan, r, purchase, compute).mtbi_days for r in regions)
    slice_chips = max(r.accelerators_per_instance for r in regions)
    model = ClusterModel(mtbi_days=accel / rate, slice_chips=slice_chips, repair_s=job.repair_s, step_s=compute + comm)
    opt.goodput = dp_outcome(accel, model).goodput
    opt.accelerators = accel
    if opt.goodput <= 0:
        opt.feasible = False
        opt.reasons.append(f"no progress: at {compute + comm:.3g} s a step the job fails faster than it steps and "
                           "checkpoints (plan on-demand capacity, fewer regions, or faster links)")
        return opt
    opt.tokens_to_buy = job.tokens / eff.ratio
    opt.wall_h = opt.tokens_to_buy / (batch / (compute + comm) * opt.goodput) / 3600
    steps = opt.tokens_to_buy / batch
    if len(regions) > 1:
        per_site = 2 * (len(regions) - 1) / len(regions) * job.params * job.dp_bytes_per_param
        opt.egress_usd = sum(steps * per_site / GB * r.egress_usd_per_gb for r in regions)
    opt.compute_usd = opt.wall_h * sum(r.instances * price(r, purchase) for r in regions)
    opt.storage_gb = costs.dp_storage_gb(plan)
    opt.storage_usd = costs.storage_usd(plan, names[0], opt.storage_gb, opt.wall_h)
    return opt


def enumerate_options(plan: PlanInput) -> list[Option]:
    """Every option, in a fixed order (regions file order, then the job's candidate lists)."""
    job = plan.job
    names = [r.name for r in plan.regions]
    out: list[Option] = []
    for size in range(1, len(names) + 1):
        for subset in itertools.combinations(names, size):
            for purchase in job.purchase:
                out.append(evaluate_dp(plan, subset, purchase))
                for home, per_region, codec, H in itertools.product(subset, job.learners_per_region, job.codecs,
                                                                    job.h_candidates):
                    out.append(evaluate_ddiloco(plan, subset, home, purchase, per_region, codec, H))
    return out
