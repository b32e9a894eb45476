"""``ddiloco-geo status [URL] [--watch]``: print the view of a run that :mod:`ddiloco_geo.ops.status`
builds from the bucket (a rich table, a live table with ``--watch``, or JSON with ``--json``).
With ``security.run_secret`` set, each learner's heartbeat signature is checked."""

from __future__ import annotations

import argparse
import json
import time

from ddiloco_geo.cli.settings import settings_from
from ddiloco_geo.core.signing import run_verifier
from ddiloco_geo.ops.status import LiveView, collect, render
from ddiloco_geo.storage import open_store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="?", help="the run's --store URL")
    p.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p.add_argument("--egress-usd-per-gb", type=float, default=0.02, help="price of cross-region traffic for the estimate")


def run(args: argparse.Namespace) -> int:
    settings, _ = settings_from(args, {"storage.url": args.url})
    store = open_store(settings.storage)
    verifier = None
    if settings.security.run_secret is not None:
        verifier = run_verifier(settings.security.run_secret.get_secret_value())
    try:
        if args.json:
            print(json.dumps(collect(store, args.egress_usd_per_gb, verifier), indent=1, default=str))
            return 0
        from rich.console import Console

        console = Console()
        if not args.watch:
            console.print(render(collect(store, args.egress_usd_per_gb, verifier)))
            return 0
        with LiveView(store, live=True, verifier=verifier) as view:
            while True:
                view.refresh()
                time.sleep(2)
    except KeyboardInterrupt:
        return 0
    finally:
        store.close()
