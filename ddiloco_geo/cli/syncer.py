"""``ddiloco-geo syncer``: one syncer shard, until SIGTERM/SIGINT (then drain) or idle exit."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal

from ddiloco_geo import protocol
from ddiloco_geo.cli.settings import settings_from
from ddiloco_geo.core.model import build_model, embedding_rule
from ddiloco_geo.core.signing import syncer_keys
from ddiloco_geo.metrics import serve_from_config
from ddiloco_geo.storage import open_store
from ddiloco_geo.syncer import Syncer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quorum", type=int, help="minimum distinct learners K per merge")
    p.add_argument("--shard", help="'i/S': own fragments p with p %% S == i")
    p.add_argument("--grace-gamma", type=float, help="share of slack spent waiting for stragglers (0: no grace)")
    p.add_argument("--idle-exit", type=float, help="exit after this many seconds without activity")


def run(args: argparse.Namespace) -> int:
    settings, _ = settings_from(args, {
        "syncer.quorum": args.quorum, "syncer.shard": args.shard,
        "syncer.grace_gamma": args.grace_gamma, "syncer.idle_exit_s": args.idle_exit,
    })
    with contextlib.ExitStack() as stack:  # closed in reverse: metrics server, then the store
        store = open_store(settings.storage)
        stack.callback(store.close)
        # one model for the spec and the embedding rule (alone, the rule builds it on the meta device,
        # whose first use imports torch._dynamo: seconds of CPU at every syncer start)
        net = build_model(settings.model)
        spec, params = protocol.build_spec(settings, net)
        spec = protocol.create_or_load_spec(store, spec)
        syncer = Syncer(store, spec, **settings.syncer.model_dump(), is_embedding=embedding_rule(settings.model, net),
                        **syncer_keys(settings.security))
        syncer.bootstrap(params)
        server = serve_from_config(settings.metrics, syncer.registry, syncer.health)
        if server is not None:
            stack.callback(server.stop)

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, syncer.request_stop)
            await syncer.run()

        asyncio.run(main())
        if args.json:
            print(json.dumps(syncer.status(), default=str))
    return 0
