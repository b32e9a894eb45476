"""``ddiloco-geo restore --store URL --snapshot ID (--to URL2 | --rollback [--force])``: start a new
run from a snapshot (:func:`ddiloco_geo.ops.snapshot.restore_to`) or roll this run back to it in
place by publishing new versions (:func:`ddiloco_geo.ops.snapshot.rollback`)."""

from __future__ import annotations

import argparse
import json

from ddiloco_geo.cli.settings import settings_from
from ddiloco_geo.core.signing import tool_keys
from ddiloco_geo.ops.snapshot import DEFAULT_ACTIVE_WINDOW_S, load_manifest, restore_to, rollback
from ddiloco_geo.storage import open_store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--snapshot", required=True, metavar="ID", help="snapshot to restore")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to", metavar="URL", help="start a new run at URL from the snapshot")
    mode.add_argument("--rollback", action="store_true",
                      help="roll this run back: publish new versions equal to the snapshot's")
    p.add_argument("--force", action="store_true", help="roll back even if a syncer looks active")
    p.add_argument("--active-window", type=float, default=DEFAULT_ACTIVE_WINDOW_S, metavar="S",
                   help="a syncer status/lease updated within S seconds counts as active (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    settings, _ = settings_from(args)
    store = open_store(settings.storage)
    try:
        manifest = load_manifest(store, args.snapshot, tool_keys(settings.security)[0])
        if args.rollback:
            result = rollback(store, manifest, force=args.force, active_window_s=args.active_window)
            text = (f"rolled back to snapshot {args.snapshot}: new versions {result['published']}, "
                    f"unchanged fragments {result['unchanged']}")
        else:
            dst = open_store(settings.storage.model_copy(update={"url": args.to}))
            try:
                versions = restore_to(store, manifest, dst)
            finally:
                dst.close()
            result = {"snapshot": args.snapshot, "to": args.to, "versions": {str(p): v for p, v in versions.items()}}
            text = f"new run at {args.to} from snapshot {args.snapshot}: versions {versions}"
        print(json.dumps(result, default=str) if args.json else text)
    finally:
        store.close()
    return 0
