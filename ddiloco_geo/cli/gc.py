"""``ddiloco-geo gc --store URL [--dry-run] [--bytes] [--json]``: apply the retention policy of the
``gc`` settings section to a run's bucket (:mod:`ddiloco_geo.ops.gc`). Safe while the run is live."""

from __future__ import annotations

import argparse
import json

from ddiloco_geo.cli.settings import settings_from
from ddiloco_geo.core.signing import tool_keys
from ddiloco_geo.ops.gc import apply_gc, bytes_held, plan_gc
from ddiloco_geo.storage import open_store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    p.add_argument("--bytes", action="store_true",
                   help="also count GB held before and after (one GET per object: small runs only)")
    p.add_argument("--keep-versions", type=int, help="override gc.keep_versions")


def run(args: argparse.Namespace) -> int:
    extra = {"gc.keep_versions": args.keep_versions} if args.keep_versions else {}
    settings, _ = settings_from(args, extra)
    cfg = settings.gc
    store = open_store(settings.storage)
    try:
        before = bytes_held(store) if args.bytes else None
        plan = plan_gc(store, keep_versions=cfg.keep_versions, replay_window_s=cfg.replay_window_s,
                       lag_window_s=cfg.lag_window_s, verifier=tool_keys(settings.security)[0])
        deleted = 0 if args.dry_run else apply_gc(store, plan)
        result = {"dry_run": args.dry_run, **plan.summary(), "deleted": deleted}
        if before is not None:
            result["gb_held_before"] = before
            result["gb_held_after"] = before if args.dry_run else bytes_held(store)
    finally:
        store.close()
    if args.json:
        print(json.dumps(result))
    else:
        verb = "would delete" if args.dry_run else "deleted"
        print(f"gc: {verb} {result['objects_to_delete']} objects {result['by_kind']}; "
              f"kept {result['objects_kept']}; floors {result['floors']}")
    return 0
