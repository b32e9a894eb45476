"""``ddiloco-geo plan REGIONS.toml``: learners, where, H, P, codec, syncer; time and cost (issue #16).

Reads a regions file (``docs/examples/regions.toml``; format in :mod:`ddiloco_geo.tools.plan.inputs`),
considers every option (:mod:`ddiloco_geo.tools.plan.options`), and prints the recommendation next
to data-parallel in the cheapest single region and data-parallel across regions: goodput, wall-clock,
cost per billion tokens split into compute, egress, requests and storage.

``--json``          only JSON on stdout (recommended, both baselines, every option with its reasons)
``--out DIR``       where ``plan.png`` goes (cost against wall-clock, recommended one ringed)
``--no-chart``      no PNG
``--tfvars FILE``   write terraform.tfvars for terraform/examples/multi-region
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddiloco_geo.tools.plan import load_plan, plan_run
from ddiloco_geo.tools.plan import tfvars as tfvarsmod
from ddiloco_geo.tools.plan.chart import options_chart


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("regions", metavar="REGIONS.toml", help="regions and job file, e.g. docs/examples/regions.toml")
    p.add_argument("--out", default="out/plan", metavar="DIR", help="where plan.png goes (default out/plan)")
    p.add_argument("--no-chart", action="store_true", help="do not write the PNG")
    p.add_argument("--tfvars", metavar="FILE", help="write terraform.tfvars for terraform/examples/multi-region")
    p.add_argument("--run-id", default="run1", help="run_id written to the tfvars")
    p.add_argument("--bucket-name", default=None, help="bucket_name written to the tfvars (default ddiloco-<run-id>-bucket)")
    p.add_argument("--model-name", default="small", help="DDILOCO_MODEL__NAME written to the tfvars")
    p.add_argument("--all", action="store_true", help="human output: list every option, not only the summary")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.regions)
    result = plan_run(plan)
    if not args.no_chart:
        chart = options_chart(result, Path(args.out) / "plan.png", plan.job.deadline_hours)
        result["chart"] = str(chart)
        _say(f"plan: chart written to {chart}")
    if args.tfvars:
        text = tfvarsmod.render(plan, result, args.regions, args.run_id, args.bucket_name, args.model_name)
        result["tfvars"] = str(tfvarsmod.write(args.tfvars, text))
        _say(f"plan: terraform.tfvars written to {args.tfvars}")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _table(result, args.all)
    return 0 if result["recommended"] else 1


FIELDS = (
    ("option", lambda r: r["id"]),
    ("regions (home *)", lambda r: ", ".join(n + ("*" if n == r["home"] and r["system"] == "ddiloco" else "")
                                            for n in r["regions"])),
    ("capacity", lambda r: f"{r['purchase']}, {r['accelerators']} accelerators"),
    ("learners", lambda r: f"{r['learners']} ({r['learners_per_region']} a region)" if r["learners"] else "-"),
    ("codec / H / P", lambda r: f"{r['codec']} / {r['H']} / {r['P']}" if r["system"] == "ddiloco" else r["codec"]),
    ("syncer shards", lambda r: str(r["syncer_shards"] or "-")),
    ("token efficiency", lambda r: f"{r['efficiency']:.2f}"),
    ("tokens to buy", lambda r: f"{r['tokens_to_buy'] / 1e9:,.0f} B"),
    ("goodput", lambda r: f"{r['goodput']:.1%}"),
    ("WAN utilization", lambda r: f"{r['utilization']:.1%}"),
    ("WAN bytes / token", lambda r: f"{r['wan_bytes_per_token']:,.1f}"),
    ("wall-clock", lambda r: f"{r['wall_h']:,.1f} h" if r["wall_h"] is not None else "-"),
    *[(f"$/Btok {k}", (lambda k: lambda r: f"{(r['usd_per_billion_tokens'] or {}).get(k, 0):,.2f}")(k))
      for k in ("compute", "egress", "requests", "storage", "total")],
    ("total", lambda r: f"${r['total_usd']:,.0f}"),
    ("storage held", lambda r: f"{r['storage_gb_held']:,.0f} GB"),
    ("feasible", lambda r: "yes" if r["feasible"] else "no: " + "; ".join(r["reasons"])),
)


def _table(result: dict, every: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = [("recommended", result["recommended"]), ("dp, cheapest region", result["dp_cheapest_region"]),
            ("dp across regions", result["dp_across_regions"])]
    table = Table(title="ddiloco-geo plan")
    table.add_column("")
    for label, _ in cols:
        table.add_column(label)
    for name, get in FIELDS:
        table.add_row(name, *["none" if r is None else get(r) for _, r in cols])
    console = Console()
    console.print(table)
    if result["why_none"]:
        console.print("no feasible option; reasons seen:\n  " + "\n  ".join(result["why_none"]))
    if every:
        every_table = Table(title="every option")
        for col in ("option", "wall h", "$/B total", "feasible"):
            every_table.add_column(col)
        for r in result["options"]:
            usd = r["usd_per_billion_tokens"] or {}
            every_table.add_row(r["id"], "-" if r["wall_h"] is None else f"{r['wall_h']:,.1f}",
                                f"{usd.get('total', 0):,.2f}", "yes" if r["feasible"] else "; ".join(r["reasons"]))
        console.print(every_table)
