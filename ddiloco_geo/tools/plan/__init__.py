"""``ddiloco-geo plan``: from a regions file to a deployment (learners, H, P, codec, syncer, cost).

Facade of the planner; the command line is :mod:`ddiloco_geo.cli.plan`.

- :mod:`.inputs`     the regions/job/efficiency TOML, validated (measured defaults with sources)
- :mod:`.options`    every configuration considered: DDiLoCo, DP in one region, DP over the WAN
- :mod:`.costs`      egress, requests and storage held under the gc retention policy
- :mod:`.recommend`  constraints, the choice, the baselines, the JSON rows
- :mod:`.tfvars`     terraform.tfvars for terraform/examples/multi-region
- :mod:`.chart`      PNG: cost against wall-clock, one point per option
"""

from ddiloco_geo.tools.plan.inputs import PlanInput, load_plan, parse_plan
from ddiloco_geo.tools.plan.recommend import plan_run

__all__ = ["PlanInput", "load_plan", "parse_plan", "plan_run"]
