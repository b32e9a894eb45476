"""Command line: parse argv, set up logging, signals and the allocator, hand off to one module.
Nothing else.

Every subcommand lives in its own module, which exposes ``add_arguments(parser)`` and
``run(args) -> int``; only the chosen one is imported (so ``ddiloco-geo config --show`` does not
import torch). Common flags, accepted by every subcommand:

``--config FILE``   TOML settings file (else ``$DDILOCO_CONFIG``)
``--set KEY=VALUE`` override any settings key (repeatable), e.g. ``--set syncer.quorum=2``
``--store URL``     shorthand for ``--set storage.url=URL``
``--json``          machine-readable output on stdout
``-v/--verbose``    debug logging
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import logging
import os
import sys

from ddiloco_geo import __version__
from ddiloco_geo.core.errors import ConfigError, DdilocoError

# name -> one-line help; the command lives in ddiloco_geo.cli.<name> (add_arguments, run)
COMMANDS: dict[str, str] = {
    "local": "run a syncer and M learners as processes on one machine (the main job)",
    "learner": "run one learner (inner AdamW loop, posts deltas, adopts globals)",
    "syncer": "run the syncer (merges deltas, outer Nesterov step, publishes globals)",
    "config": "show the resolved configuration and where each value came from",
    "selfcheck": "check a store: create-only, compare-and-swap, list, ranged get, delete",
    "bench": "benchmarks that print JSON (codec, quality, bandwidth, overhead, syncer)",
    "simulate": "goodput and bandwidth simulator at data-centre scale",
    "plan": "recommend learners, regions, H, P, codec and syncer from a regions file; time and cost",
    "wan-proxy": "TCP proxy on 127.0.0.1 that adds delay and caps bandwidth",
    "fault-proxy": "HTTP proxy on 127.0.0.1 that injects storage faults from a seed",
    "status": "live view of a run, from the bucket alone",
    "report": "PNG charts and a summary of a run",
    "chaos": "seeded chaos run on real processes and a real S3 server",
    "snapshot": "take a consistent snapshot of a run",
    "restore": "start or roll back a run from a snapshot",
    "export": "write the global model as one plain safetensors file",
    "data": "tokenize a text corpus into token shards (data prepare) or train a BPE tokenizer (data tokenizer)",
    "replay": "recompute every published version and check it bit for bit",
    "gc": "delete what the retention policy allows from a run's bucket (--dry-run to look)",
}


def common_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", metavar="FILE", help="TOML settings file (else $DDILOCO_CONFIG)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                   help="override a settings key, e.g. --set syncer.quorum=2 (repeatable)")
    p.add_argument("--store", metavar="URL", help="run location (file://, memory://, s3://, gs://)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


# --- entry ---------------------------------------------------------------------------------------


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddiloco-geo",
        description="Decoupled DiLoCo over object storage: learners anywhere, a bucket in between.",
    )
    parser.add_argument("--version", action="version", version=f"ddiloco-geo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = common_parser()
    for name, help_text in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text, parents=[common])
        if name == chosen:
            mod = importlib.import_module(f"ddiloco_geo.cli.{name.replace('-', '_')}")
            mod.add_arguments(sp)
            sp.set_defaults(_module=mod, _name=name)
    return parser


def setup_malloc() -> None:
    """Keep freed memory for reuse (glibc only; ``DDILOCO_MALLOC_TUNING=0`` leaves the defaults).

    glibc serves allocations above a threshold (at most 32 MB) with fresh ``mmap`` pages and
    returns freed heap memory to the system: every decoded delta, update and training activation
    then pays a page fault per 4 KiB on first touch, which measured more than the int4 decode
    itself (29.5 ms against 10.8 ms for a 32 MB fragment). With both thresholds at 1 GiB the
    process keeps what it freed and reuses it; its resident size stays at its peak instead of
    shrinking between rounds."""
    if os.environ.get("DDILOCO_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not mallopt(m_mmap_threshold, 1 << 30):  # a glibc that caps the threshold: its largest, 32 MiB
        mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 1 << 30)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("botocore", "aiobotocore", "s3fs", "gcsfs", "fsspec", "urllib3", "asyncio", "google", "werkzeug"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    setup_logging(args.verbose)
    setup_malloc()
    mod = args._module
    try:
        return int(mod.run(args) or 0)
    except ConfigError as exc:
        print(f"ddiloco-geo {args._name}: {exc}", file=sys.stderr)
        return 2
    except DdilocoError as exc:
        print(f"ddiloco-geo {args._name}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
