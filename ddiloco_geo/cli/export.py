"""``ddiloco-geo export --store URL [--snapshot ID] --out FILE``: write the global model (newest
versions, or the snapshot's) as one plain safetensors file (:func:`ddiloco_geo.ops.snapshot.export_model`);
with ``--format hf``, as a directory ``transformers`` loads with ``from_pretrained``
(:func:`ddiloco_geo.ops.export_hf.export_hf`; the tokenizer of a ``tokens:`` corpus goes with it)."""

from __future__ import annotations

import argparse
import json

from ddiloco_geo.cli.settings import settings_from
from ddiloco_geo.learner.data import tokenizer_json
from ddiloco_geo.ops.export_hf import export_hf
from ddiloco_geo.core.signing import tool_keys
from ddiloco_geo.ops.snapshot import export_model, load_manifest
from ddiloco_geo.storage import open_store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--snapshot", metavar="ID", help="export the snapshot's versions (default: the newest)")
    p.add_argument("--out", required=True, metavar="FILE", help="output .safetensors file (--format hf: a new directory)")
    p.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors: one plain file; hf: a transformers from_pretrained directory (needs the [hf] extra)")


def run(args: argparse.Namespace) -> int:
    settings, _ = settings_from(args)
    store = open_store(settings.storage)
    try:
        verifier, required = tool_keys(settings.security)
        manifest = load_manifest(store, args.snapshot, verifier) if args.snapshot else None
        if args.format == "hf":
            result = export_hf(store, args.out, manifest, tokenizer_json=tokenizer_json(settings.data),
                               verifier=verifier, require_signatures=required)
            print(json.dumps(result, default=str) if args.json else
                  f"wrote {result['out']}: {result['architecture']}, {result['parameters']} parameters, "
                  f"versions {result['versions']}{', tokenizer' if result['tokenizer'] else ''}")
            return 0
        result = export_model(store, args.out, manifest, verifier=verifier, require_signatures=required)
    finally:
        store.close()
    print(json.dumps(result, default=str) if args.json else
          f"wrote {result['out']}: {result['tensors']} tensors, {result['parameters']} parameters, "
          f"versions {result['versions']}")
    return 0
