"""``ddiloco-geo replay --store URL [--fragment P] [--threads N]``: recompute every published version
and check it bit for bit (:func:`ddiloco_geo.ops.replay.replay`). The outer optimizer's
hyperparameters and the fallback update codec come from the ``syncer`` settings. Exit status 0 if
everything matches, 1 on a divergence; progress goes to stderr every few seconds."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ddiloco_geo import protocol
from ddiloco_geo.cli.settings import settings_from
from ddiloco_geo.core.outer import settings_kwargs
from ddiloco_geo.core.signing import tool_keys
from ddiloco_geo.ops.replay import replay
from ddiloco_geo.storage import open_store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fragment", type=int, action="append", metavar="P",
                   help="replay only fragment P (repeatable; default: all)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch intra-op threads for the recomputation (default: torch's default)")


class _Progress:
    def __init__(self, every_s: float = 2.0) -> None:
        self.every_s = every_s
        self.last = time.monotonic()

    def __call__(self, p: int, v: int, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            print(f"replay: {done}/{total} versions (fragment {p} version {v})", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    settings, _ = settings_from(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = settings.syncer
    outer_kwargs = settings_kwargs(cfg)
    verifier, required = tool_keys(settings.security)
    store = open_store(settings.storage)
    try:
        spec = protocol.load_spec(store)
        result = replay(store, spec, outer_kwargs=outer_kwargs, fragments=args.fragment,
                        update_codec=cfg.update_codec, progress=_Progress(), verifier=verifier,
                        require_signatures=required)
    finally:
        store.close()
    if args.json:
        print(json.dumps(result, default=str))
    else:
        d = result["first_divergence"]
        if d is None:
            roots = f"; rooted at {result['roots']}" if result["roots"] else ""
            print(f"replay ok: {result['versions_checked']} versions of {result['fragments']} fragments match "
                  f"bit for bit{roots}")
        else:
            print(f"replay DIVERGED at fragment {d['fragment']} version {d['version']}: {d['what']}"
                  f"{' tensor ' + d['tensor'] if d['tensor'] else ''}"
                  f"{' max |diff| ' + repr(d['max_abs_diff']) if d['max_abs_diff'] is not None else ''}: {d['detail']}")
            print(f"  ({result['versions_checked']} versions matched; outer {outer_kwargs}; torch "
                  f"{result['torch_version']} {result['cpu_capability']} threads {result['torch_threads']})")
    return 0 if result["ok"] else 1
