"""``ddiloco-geo bench WHICH``: benchmarks that print JSON and compare against a baseline measured
in the same run (ratios, not absolute times: these machines are noisy). Benchmarks are commands,
never tests. Each lives in its own module exposing ``add_arguments(parser)`` and ``run(args)``.
"""

from __future__ import annotations

import argparse
import importlib
import logging

BENCHMARKS = {
    "codec": "encode/decode throughput and wire size of each codec vs a memory copy",
    "quality": "eval loss of Decoupled DiLoCo vs data-parallel on the same tokens",
    "convergence": "the convergence study: data-parallel, lock-step and Decoupled DiLoCo up to a compute-optimal budget",
    "bandwidth": "bytes on the wire per token vs a ring all-reduce of fp32 gradients",
    "overhead": "learner tokens/s with syncing on vs off, on loopback and through the WAN emulator",
    "syncer": "syncer MB/s decoded, merged and published vs a plain fp32 add",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="benchmark", metavar="WHICH", required=True)
    for name, help_text in BENCHMARKS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON on stdout")
        try:
            importlib.import_module(f"ddiloco_geo.tools.bench.{name}").add_arguments(sp)
        except ModuleNotFoundError:
            pass


def run(args: argparse.Namespace) -> int:
    if not args.verbose:  # the services' per-merge and per-step lines would drown the progress lines
        for name in ("ddiloco_geo.syncer", "ddiloco_geo.learner", "ddiloco_geo.protocol"):
            logging.getLogger(name).setLevel(logging.WARNING)
    return importlib.import_module(f"ddiloco_geo.tools.bench.{args.benchmark}").run(args)
