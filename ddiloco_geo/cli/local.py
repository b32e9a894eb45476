"""``ddiloco-geo local``: flags, settings, and the human summary of :class:`~ddiloco_geo.tools.local.LocalRun`."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from ddiloco_geo.cli.settings import settings_from
from ddiloco_geo.core.errors import ConfigError, DdilocoError
from ddiloco_geo.storage import open_store
from ddiloco_geo.tools.local import LocalRun
from ddiloco_geo.tools.sample import sample_global

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--learners", type=int, help="number of learner processes M (default 3)")
    p.add_argument("--out", help="directory for summary.json, training.png and logs (default ./out)")
    p.add_argument("--steps", type=int, help="inner steps per learner (learner.max_steps; with the default learner.schedule=run the run stops after about learners x steps in all: 3-10%% more in the chaos baselines, as each learner counts the others' steps from their merged deltas, which trail them)")
    p.add_argument("--model", help="built-in model size (nano, tiny, small, ...)")
    p.add_argument("--quorum", type=int, help="syncer quorum K")
    p.add_argument("--join", action="store_true", help="join the existing run at --store instead of starting fresh")
    p.add_argument("--eval-every", type=float, default=20.0, help="seconds between global evaluations (0: start and end only)")
    p.add_argument("--no-live", action="store_true", help="plain progress lines instead of the live table")


def run(args: argparse.Namespace) -> int:
    settings, _ = settings_from(args, {
        "local.learners": args.learners, "local.out": args.out, "learner.max_steps": args.steps,
        "model.name": args.model, "syncer.quorum": args.quorum, "local.fresh": False if args.join else None,
    })
    if settings.syncer.quorum > settings.local.learners:  # a check for this command only: it knows M
        raise ConfigError(f"syncer.quorum={settings.syncer.quorum} exceeds local.learners={settings.local.learners}: "
                          "no merge could ever happen; lower the quorum or add learners")
    summary = LocalRun(settings, eval_every_s=args.eval_every, live=not args.no_live and not args.json).run()
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        print_summary(summary, Path(settings.local.out), sample=_sample(settings))
    ok = summary["deltas_unaccounted"] == 0 and summary["processes_failed"] == 0
    return 0 if ok else 1


def _sample(settings) -> str | None:
    """About 200 bytes the global model writes after a prompt; None if the run cannot be read."""
    try:
        with open_store(settings.storage) as store:
            return sample_global(store, settings)
    except DdilocoError as exc:
        log.warning("sample_skipped error=%s", exc)
        return None


def print_summary(summary: dict[str, Any], out: Path, sample: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="ddiloco-geo local: summary", show_header=False)
    ratio = summary.get("dp_allreduce_ratio")
    rows = [
        ("global eval loss", f"{summary['initial_eval_loss']:.3f} -> {summary['final_eval_loss']:.3f}"),
        ("learners / tokens", f"{summary['num_learners']} / {summary['tokens_total']:,}"),
        ("versions published", f"{sum(summary['versions_published'].values())} over {summary['num_fragments']} fragments"),
        ("deltas written / merged / rejected / unaccounted",
         f"{summary['deltas_written']} / {summary['deltas_merged']} / {summary['deltas_rejected']} / "
         f"{summary['deltas_unaccounted']}"),
        ("bytes up / down", f"{summary['bytes_up'] / 2**20:.1f} MiB / {summary['bytes_down'] / 2**20:.1f} MiB"),
        ("data-parallel all-reduce would move", f"{summary['dp_allreduce_bytes'] / 2**20:.1f} MiB"
         + (f" ({ratio:.1f}x more)" if ratio else "")),
        ("unverified objects ignored", _skipped(summary)),
        ("wall time", f"{summary['wall_s']:.0f} s"),
        ("written", f"{out / 'summary.json'}, {out / 'training.png'}"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    if sample is not None:
        from rich.panel import Panel
        from rich.text import Text

        Console().print(Panel(Text(sample), title="sample from the global model (top-8, seed 0)", expand=False))


def _skipped(summary: dict[str, Any]) -> str:
    """What the final evaluation and the ledger refused to read (forged or unsigned objects)."""
    parts = []
    for where, skipped in (summary.get("skipped_unverified") or {}).items():
        for kind, n in sorted(((skipped or {}).get("by_kind") or {}).items()):
            parts.append(f"{where}: {n} {kind}")
    junk = summary.get("junk_keys") or 0
    if junk:
        parts.append(f"{junk} junk keys under learners/")
    return ", ".join(parts) or "none"
