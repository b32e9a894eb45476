"""``terraform.tfvars`` for ``terraform/examples/multi-region`` from a plan.

The example deploys exactly three AWS regions (home: bucket + syncer + a fleet; second; third), the
same number of learners in each, one instance per learner, one syncer, spot fleets. So the file is
written for the recommended option when it uses three regions, else for the cheapest feasible
three-region option (said in the file's header); what the example cannot express (syncer shards,
learners spanning several instances, on-demand fleets) is written as a comment, never dropped
silently. Values are HCL literals (strings JSON-quoted), so ``terraform validate`` accepts the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.plan.inputs import PlanInput

REGIONS_IN_EXAMPLE = 3


def pick(result: dict) -> tuple[dict, str]:
    """(row, why) of the option the example can deploy."""
    best = result["recommended"]
    if best and len(best["regions"]) == REGIONS_IN_EXAMPLE:
        return best, "the recommended option"
    three = [r for r in result["options"] if r["system"] == "ddiloco" and r["feasible"]
             and len(r["regions"]) == REGIONS_IN_EXAMPLE]
    if not three:
        raise ConfigError("no feasible Decoupled DiLoCo option uses three regions, which is what "
                          "terraform/examples/multi-region deploys; relax the constraints or edit the example")
    three.sort(key=lambda r: (r["total_usd"], r["wall_h"], r["id"]))
    return three[0], (f"the cheapest feasible three-region option (the recommended one uses "
                      f"{len(best['regions']) if best else 0} region(s); the example deploys three)")


def _hcl(value) -> str:
    if isinstance(value, dict):
        inner = "\n".join(f"  {k} = {_hcl(v)}" for k, v in value.items())
        return "{\n" + inner + "\n}"
    if isinstance(value, list):
        return "[" + ", ".join(_hcl(v) for v in value) + "]"
    return json.dumps(value)


def render(plan: PlanInput, result: dict, source: str, run_id: str = "run1", bucket_name: str | None = None,
           model_name: str = "small") -> str:
    opt, why = pick(result)
    home = opt["home"]
    others = [r for r in opt["regions"] if r != home]
    types = sorted({plan.region(r).instance_type for r in opt["regions"]})
    per_learner = [plan.region(r).instances // opt["learners_per_region"] for r in opt["regions"]]
    settings = {
        "DDILOCO_MODEL__NAME": model_name,
        "DDILOCO_RUN__CODEC": opt["codec"],
        "DDILOCO_FRAGMENTS__NUM_FRAGMENTS": str(opt["P"]),
        "DDILOCO_FRAGMENTS__SYNC_EVERY": str(opt["H"]),
        "DDILOCO_FRAGMENTS__OVERLAP": str(plan.job.tau),
        "DDILOCO_SYNCER__UPDATE_CODEC": plan.job.update_codec,
        "DDILOCO_GC__KEEP_VERSIONS": str(plan.gc.keep_versions),
        "DDILOCO_GC__REPLAY_WINDOW_S": str(plan.gc.replay_window_s),
    }
    header = [
        f"# Written by `ddiloco-geo plan` from {source}: {why}.",
        f"# Option {opt['id']}: predicted wall-clock {opt['wall_h']} h, goodput {opt['goodput']:.1%}, "
        f"${opt['total_usd']:,.0f} in total.",
    ]
    if opt["syncer_shards"] > 1:
        header.append(f"# The plan wants {opt['syncer_shards']} syncer shards (--shard i/{opt['syncer_shards']}); "
                      "the example runs one syncer: add shards by hand (DDILOCO_SYNCER__SHARD).")
    if max(per_learner) > 1:
        header.append(f"# Each learner spans {per_learner} instances per region in the plan; the example "
                      "starts one instance per learner.")
    if opt["purchase"] == "ondemand":
        header.append("# The plan uses on-demand capacity; the example's fleets are spot (learner-fleet "
                      "module: on_demand_base_capacity).")
    values = {
        "run_id": run_id,
        "bucket_name": bucket_name or f"ddiloco-{run_id}-bucket",
        "home_region": home,
        "second_region": others[0],
        "third_region": others[1],
        "learners_per_region": opt["learners_per_region"],
        "learner_instance_types": types,
        "settings": settings,
        "syncer_settings": {"DDILOCO_SYNCER__QUORUM": "1"},
    }
    body = "\n".join(f"{k} = {_hcl(v)}" for k, v in values.items())
    return "\n".join(header) + "\n\n" + body + "\n"


def write(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
