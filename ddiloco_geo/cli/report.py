"""``ddiloco-geo report <run-url> --out DIR``: PNG charts and a one-page summary of a run, from the
bucket alone (:func:`ddiloco_geo.ops.report.build_report`); with a ``summary.json`` written by
``ddiloco-geo local`` instead of a URL, re-draw that run's ``training.png``.

For a ``file://`` run it refuses a directory without ``run.json`` (opening a directory store would
create its lock folder) and an ``--out`` inside the run's directory: the report never writes there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddiloco_geo.cli.settings import settings_from
from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.ops.report import build_report, plot_local_run
from ddiloco_geo.storage import open_store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", nargs="?",
                   help="the run's --store URL (file://, s3://, gs://; or a run directory), "
                        "or a summary.json written by `ddiloco-geo local`")
    p.add_argument("--out", default=None,
                   help="output directory (default: ./report for a run; next to the summary for a summary.json)")
    p.add_argument("--eval-points", type=int, default=7,
                   help="instants at which the global model is rebuilt and evaluated (0: no evaluation)")
    p.add_argument("--eval-batches", type=int, default=None, help="eval batches per point (default: data.eval_batches)")
    p.add_argument("--max-delta-headers", type=int, default=4000,
                   help="read delta headers (incarnation boundaries) only for learners with at most this many deltas")


def _is_summary(source: str | None) -> bool:
    return bool(source) and "://" not in source and source.endswith(".json") and Path(source).is_file()


def run(args: argparse.Namespace) -> int:
    if _is_summary(args.source):
        return _run_summary(args)
    url = args.source
    if url and "://" not in url:
        url = f"file://{Path(url).resolve()}"
    settings, _ = settings_from(args, {"storage.url": url})
    url = settings.storage.url
    out = Path(args.out or "report").resolve()
    if url.startswith("file://"):
        root = Path(url[len("file://"):]).resolve()
        # opening a directory store creates its lock folder: refuse anything that is not a run
        if not (root / "run.json").is_file():
            raise ConfigError(f"{root} holds no run.json: pass the --store URL the run was started with")
        if out == root or root in out.parents:
            raise ConfigError(f"--out {out} is inside the run's prefix {root}: the report never writes there")
    if args.eval_points < 0:
        raise ConfigError("--eval-points must be >= 0")
    store = open_store(settings.storage)
    try:
        summary = build_report(store, settings, out, eval_points=args.eval_points, eval_batches=args.eval_batches,
                               max_delta_headers=args.max_delta_headers)
    finally:
        store.close()
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        print(summary["page"]["markdown"])
    return 0


def _run_summary(args: argparse.Namespace) -> int:
    src = Path(args.source)
    summary = json.loads(src.read_text())
    out = Path(args.out) if args.out else src.parent
    path = plot_local_run(summary, out / "training.png")
    print(json.dumps({"plot": str(path)}) if args.json else path, file=sys.stdout)
    return 0
