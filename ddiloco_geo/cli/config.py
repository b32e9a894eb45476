"""``ddiloco-geo config --show``: every settings key, its value and where it came from."""

from __future__ import annotations

import argparse
import json

from ddiloco_geo.cli.settings import settings_from
from ddiloco_geo.core import config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--show", action="store_true", help="print every key, its value and its source")


def run(args: argparse.Namespace) -> int:
    settings, origin = settings_from(args)
    rows = config.explain(settings, origin)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    width = max(len(r["key"]) for r in rows)
    for r in rows:
        print(f"{r['key']:<{width}}  {json.dumps(r['value'], default=str):<40}  [{r['source']}]")
    return 0
