"""``ddiloco-geo chaos``: flags, settings (over the chaos defaults) and the printed summary of a
:class:`~ddiloco_geo.tools.chaos.ChaosRun`.

Settings precedence: command line > environment > settings file > ``CHAOS_DEFAULTS`` > the
project's defaults. This process reads the bucket itself (the report, the evaluation, the
baseline's view), so for an S3 emulator on this machine it gets the same dummy credentials its
children do, where none are set: process setup, like logging, belongs here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

from ddiloco_geo.cli.settings import cli_overrides
from ddiloco_geo.core import config
from ddiloco_geo.core.config import Settings
from ddiloco_geo.tools.chaos import CHAOS_DEFAULTS, LONG, SHORT, ChaosRun, emulator_credentials, plan_schedule
from ddiloco_geo.tools.chaos.baseline import BASELINE_RUNS

SUMMARY_KEYS = ("downtime_s", "stalls", "goodput", "goodput_baseline", "deltas_written", "deltas_merged",
                "deltas_rejected", "deltas_unaccounted", "final_eval_loss", "baseline_eval_loss", "loss_ratio",
                "recovery_s", "goals")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="seed of the chaos schedule (default 0)")
    p.add_argument("--learners", type=int, help="learner processes M (default 3; --long 4)")
    p.add_argument("--steps", type=int, help="inner steps per learner (default 120; --long 400)")
    p.add_argument("--rounds", type=int, help="rounds of chaos events (default 1; --long 3)")
    p.add_argument("--long", action="store_true", help="the benchmark: more learners, steps and rounds")
    p.add_argument("--out", default="chaos-out", help="directory for chaos.json, plan.json and logs (default ./chaos-out)")
    p.add_argument("--no-baseline", action="store_true", help="skip the fault-free baseline runs (no loss_ratio)")
    p.add_argument("--baseline-runs", type=int, default=BASELINE_RUNS, choices=range(1, 11), metavar="N",
                   help=f"fault-free runs the chaos run's loss is compared with (default {BASELINE_RUNS}): "
                        "their line at its tokens merged, with a standard error")
    p.add_argument("--timeout", type=float, help="hard overall timeout in seconds (default 900; --long 3600)")
    p.add_argument("--sample-s", type=float, default=0.5, help="heartbeat sampling interval (default 0.5 s)")
    p.add_argument("--plan-only", action="store_true", help="print the schedule for --seed and exit")


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    shape = dict(LONG if args.long else SHORT)
    for key in ("learners", "steps", "rounds", "timeout"):
        if getattr(args, key, None) is not None:
            shape[key] = getattr(args, key)
    plan = plan_schedule(args.seed, shape["learners"], shape["steps"], shape["rounds"])
    if args.plan_only:
        print(json.dumps(plan, indent=1))
        return 0
    settings = chaos_settings(args, shape)
    if settings.learner.max_steps != plan["steps"]:
        plan = plan_schedule(args.seed, shape["learners"], settings.learner.max_steps, shape["rounds"])
    for k, v in emulator_credentials(settings.storage.endpoint_url).items():
        os.environ.setdefault(k, v)
    base_url = args.store or (settings.storage.url if settings.storage.url.startswith("s3://") else None)
    # SIGTERM (a CI timeout, an operator) unwinds like Ctrl-C: the supervisor's and the testbed's
    # finally blocks stop every learner, syncer and server this run started, by PID
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    chaos = ChaosRun(settings, plan, out=Path(args.out).resolve(), sample_s=args.sample_s,
                     timeout_s=shape["timeout"], baseline=0 if args.no_baseline else args.baseline_runs, base_url=base_url)
    report = chaos.run()
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        for k in SUMMARY_KEYS:
            print(f"{k}: {json.dumps(report.get(k), default=str)}")
        print(f"report: {Path(args.out).resolve() / 'chaos.json'}")
    return 0 if report["ok"] else 1


def chaos_settings(args: argparse.Namespace, shape: dict[str, Any]) -> Settings:
    """Resolve settings: CLI > env > file > the chaos defaults > the project's defaults."""
    extra = {"learner.max_steps": args.steps, "local.learners": shape["learners"]}
    _, origin = config.load(cli=cli_overrides(args, extra), config_file=args.config)
    tree: dict[str, Any] = {}
    defaults = dict(CHAOS_DEFAULTS, **{"learner.max_steps": shape["steps"]})
    for dotted, value in defaults.items():
        if dotted in origin:
            continue
        section, name = dotted.split(".")
        tree.setdefault(section, {})[name] = value
    user = cli_overrides(args, extra)
    for section, values in user.items():
        if isinstance(values, dict):
            tree.setdefault(section, {}).update(values)
        else:
            tree[section] = values
    settings, _ = config.load(cli=tree, config_file=args.config)
    return settings
