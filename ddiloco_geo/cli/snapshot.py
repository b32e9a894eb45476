"""``ddiloco-geo snapshot --store URL [--id ID]``: write a consistent snapshot manifest of a run
(:func:`ddiloco_geo.ops.snapshot.take_snapshot`; training goes on while it is taken)."""

from __future__ import annotations

import argparse
import json

from ddiloco_geo import protocol
from ddiloco_geo.cli.settings import settings_from
from ddiloco_geo.core import layout
from ddiloco_geo.core.signing import tool_keys, tool_signer
from ddiloco_geo.ops.snapshot import snapshot_versions, take_snapshot
from ddiloco_geo.storage import open_store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--id", help="snapshot id (default: the UTC time, e.g. s20261129t174500z)")


def run(args: argparse.Namespace) -> int:
    settings, _ = settings_from(args)
    store = open_store(settings.storage)
    try:
        spec = protocol.load_spec(store)
        verifier, _ = tool_keys(settings.security)
        m = take_snapshot(store, spec, args.id, verifier=verifier, signer=tool_signer(settings.security))
    finally:
        store.close()
    versions = snapshot_versions(m)
    result = {"snapshot": m["snapshot"], "key": layout.snapshot_manifest_key(m["snapshot"]),
              "versions": {str(p): v for p, v in versions.items()}, "in_flight": len(m["in_flight"])}
    print(json.dumps(result, default=str) if args.json else
          f"snapshot {m['snapshot']}: versions {versions}, {len(m['in_flight'])} deltas in flight")
    return 0
