"""``ddiloco-geo selfcheck [--keep]``: run :func:`ddiloco_geo.ops.selfcheck.selfcheck` against the
configured store and print the report (a rich table, or JSON with ``--json``). Exit status 0 only
if every check passed; ``--keep`` leaves the selfcheck objects in the store."""

from __future__ import annotations

import argparse
import json

from ddiloco_geo.cli.settings import settings_from
from ddiloco_geo.ops.selfcheck import selfcheck
from ddiloco_geo.storage import open_store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep", action="store_true", help="leave the selfcheck objects in the store")


def run(args: argparse.Namespace) -> int:
    settings, _ = settings_from(args)
    with open_store(settings.storage) as store:
        report = selfcheck(store, keep=getattr(args, "keep", False))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0 if report["ok"] else 1


def _print_table(report: dict) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a dependency, but a plain table is enough
        print(f"selfcheck {report['url']}")
        for r in report["checks"]:
            print(f"  {'PASS' if r['ok'] else 'FAIL'}  {r['name']:<24} {r['ms']:>8.1f} ms  {r['detail']}")
        print("all checks passed" if report["ok"] else "SOME CHECKS FAILED")
        return
    table = Table(title=f"selfcheck {report['url']}")
    for col in ("check", "result", "ms", "detail"):
        table.add_column(col)
    for r in report["checks"]:
        table.add_row(r["name"], "[green]pass[/]" if r["ok"] else "[red]FAIL[/]", f"{r['ms']:.1f}", r["detail"])
    console = Console()
    console.print(table)
    console.print("[green]all checks passed[/]" if report["ok"] else "[red]some checks failed[/]")
