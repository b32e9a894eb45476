"""Command line: parse argv, set up logging and signals, hand off to one module. Nothing else.

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
import importlib
import json
import logging
import sys
from typing import Any

from ddiloco_geo import __version__
from ddiloco_geo.core.errors import ConfigError, DdilocoError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "local": ("ddiloco_geo.tools.local", "run a syncer and M learners as processes on one machine (the main job)"),
    "learner": ("ddiloco_geo.learner", "run one learner (inner AdamW loop, posts deltas, adopts globals)"),
    "syncer": ("ddiloco_geo.syncer", "run the syncer (merges deltas, outer Nesterov step, publishes globals)"),
    "config": ("ddiloco_geo.cli.main", "show the resolved configuration and where each value came from"),
    "selfcheck": ("ddiloco_geo.ops.selfcheck", "check a store: create-only, compare-and-swap, list, ranged get, delete"),
    "bench": ("ddiloco_geo.tools.bench", "benchmarks that print JSON (codec, quality, bandwidth, overhead, syncer)"),
    "simulate": ("ddiloco_geo.tools.sim", "goodput and bandwidth simulator at data-centre scale"),
    "wan-proxy": ("ddiloco_geo.tools.wanproxy", "TCP proxy on 127.0.0.1 that adds delay and caps bandwidth"),
    "status": ("ddiloco_geo.ops.status", "live view of a run, from the bucket alone"),
    "report": ("ddiloco_geo.ops.report", "PNG charts and a summary of a run"),
    "chaos": ("ddiloco_geo.tools.chaos", "seeded chaos run on real processes and a real S3 server"),
    "snapshot": ("ddiloco_geo.ops.snapshot", "take a consistent snapshot of a run"),
    "restore": ("ddiloco_geo.ops.snapshot", "start or roll back a run from a snapshot"),
    "export": ("ddiloco_geo.ops.snapshot", "write the global model as one plain safetensors file"),
    "replay": ("ddiloco_geo.ops.replay", "recompute every published version and check it bit for bit"),
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


def cli_overrides(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Nested dict of settings given on the command line: --set pairs, --store, and ``extra``
    (a flat {"section.field": value} map a subcommand built from its own flags)."""
    flat: dict[str, Any] = {}
    for item in getattr(args, "overrides", []) or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set syncer.quorum=2")
        key, value = item.split("=", 1)
        flat[key.strip()] = _parse_value(value)
    if getattr(args, "store", None):
        flat["storage.url"] = args.store
    flat.update({k: v for k, v in (extra or {}).items() if v is not None})
    tree: dict[str, Any] = {}
    for dotted, value in flat.items():
        node = tree
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def settings_from(args: argparse.Namespace, extra: dict[str, Any] | None = None):
    """Resolve the settings tree for a subcommand (CLI > env > file > defaults)."""
    from ddiloco_geo.core import config

    return config.load(cli=cli_overrides(args, extra), config_file=getattr(args, "config", None))


# --- `config` subcommand -------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--show", action="store_true", help="print every key, its value and its source")


def run(args: argparse.Namespace) -> int:
    from ddiloco_geo.core import config

    settings, origin = settings_from(args)
    rows = config.explain(settings, origin)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    width = max(len(r["key"]) for r in rows)
    for r in rows:
        print(f"{r['key']:<{width}}  {json.dumps(r['value'], default=str):<40}  [{r['source']}]")
    return 0


# --- entry ---------------------------------------------------------------------------------------


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddiloco-geo",
        description="Decoupled DiLoCo over object storage: learners anywhere, a bucket in between.",
    )
    parser.add_argument("--version", action="version", version=f"ddiloco-geo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = common_parser()
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text, parents=[common])
        if name == chosen:
            mod = importlib.import_module(module)
            adder = getattr(mod, f"add_{name.replace('-', '_')}_arguments", None) or mod.add_arguments
            adder(sp)
            sp.set_defaults(_module=mod, _name=name)
    return parser


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
    mod = args._module
    runner = getattr(mod, f"run_{args._name.replace('-', '_')}", None) or mod.run
    try:
        return int(runner(args) or 0)
    except ConfigError as exc:
        print(f"ddiloco-geo {args._name}: {exc}", file=sys.stderr)
        return 2
    except DdilocoError as exc:
        print(f"ddiloco-geo {args._name}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
