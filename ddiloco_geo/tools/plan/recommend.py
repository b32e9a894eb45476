"""Pick one option under the constraints, and lay out the answer next to the two DP baselines.

Constraints (``[job]``): a learner needs bandwidth to the syncer region; WAN utilization at least
``min_utilization``; wall-clock within ``deadline_hours`` and total cost within ``budget_usd`` when
given; a token-efficiency row must exist. Among Decoupled DiLoCo options that meet all of them the
**cheapest in total** wins; ties go to the shorter wall-clock, then to the option id (so the answer
is deterministic). The baselines are shown whatever the constraints say: data-parallel in the single
region where it costs least, and data-parallel across the recommended regions (or across all
regions when the recommendation uses one).
"""

from __future__ import annotations

import math

from ddiloco_geo.tools.plan.inputs import PlanInput
from ddiloco_geo.tools.plan.options import Option, enumerate_options


def apply_constraints(plan: PlanInput, options: list[Option]) -> None:
    job = plan.job
    for o in options:
        if not o.feasible:
            continue
        if o.utilization < job.min_utilization:
            o.reasons.append(f"WAN utilization {o.utilization:.1%} < min_utilization {job.min_utilization:.0%}")
        if job.deadline_hours is not None and o.wall_h > job.deadline_hours:
            o.reasons.append(f"wall-clock {o.wall_h:.0f} h > deadline {job.deadline_hours:g} h")
        if job.budget_usd is not None and o.total_usd > job.budget_usd:
            o.reasons.append(f"cost ${o.total_usd:,.0f} > budget ${job.budget_usd:,.0f}")
        o.feasible = not o.reasons


def _key(o: Option) -> tuple:
    return (round(o.total_usd, 2), round(o.wall_h, 4), o.id)


def row(plan: PlanInput, o: Option) -> dict:
    per_bt = o.usd_per_billion_tokens(plan.job.tokens) if math.isfinite(o.wall_h) else None
    return {
        "id": o.id, "system": o.system, "regions": o.regions, "home": o.home, "purchase": o.purchase,
        "learners_per_region": o.learners_per_region, "learners": o.learners_per_region * len(o.regions),
        "codec": o.codec, "H": o.H, "P": o.P, "syncer_shards": o.syncer_shards, "accelerators": o.accelerators,
        "efficiency": o.efficiency, "tokens_to_buy": o.tokens_to_buy, "utilization": round(o.utilization, 4),
        "goodput": round(o.goodput, 4), "wall_h": round(o.wall_h, 2) if math.isfinite(o.wall_h) else None,
        "total_usd": round(o.total_usd, 2), "usd_per_billion_tokens": per_bt and {k: round(v, 2) for k, v in per_bt.items()},
        "storage_gb_held": round(o.storage_gb, 1), "wan_bytes_per_token": round(o.wan_bytes_per_token, 3),
        "feasible": o.feasible, "reasons": o.reasons,
    }


def plan_run(plan: PlanInput) -> dict:
    """Every option, the recommended one and the two baselines, as plain data (the JSON output)."""
    options = enumerate_options(plan)
    apply_constraints(plan, options)
    ddl = sorted((o for o in options if o.system == "ddiloco" and o.feasible), key=_key)
    best = ddl[0] if ddl else None
    dp_region = sorted((o for o in options if o.system == "dp_region" and math.isfinite(o.wall_h)), key=_key)
    wan_regions = best.regions if best and len(best.regions) > 1 else [r.name for r in plan.regions]
    dp_wan = [o for o in options if o.system == "dp_wan" and sorted(o.regions) == sorted(wan_regions)
              and o.purchase == (best.purchase if best else "ondemand")]
    return {
        "recommended": row(plan, best) if best else None,
        "dp_cheapest_region": row(plan, dp_region[0]) if dp_region else None,
        "dp_across_regions": row(plan, dp_wan[0]) if dp_wan else None,
        "efficiency_used": [vars(e) for e in plan.efficiency],
        "gc": plan.gc.model_dump(),
        "options": [row(plan, o) for o in options],
        "why_none": None if best else sorted({r for o in options if o.system == "ddiloco" for r in o.reasons})[:20],
    }
