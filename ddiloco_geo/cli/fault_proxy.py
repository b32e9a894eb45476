"""``ddiloco-geo fault-proxy``: one :class:`~ddiloco_geo.tools.faultproxy.FaultProxy` on loopback in
front of a storage server until SIGINT/SIGTERM; prints where it listens, and its counters when it
stops. Point ``storage.endpoint_url`` at the printed URL."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.faultproxy import FAULT_KINDS, FaultProxy, HttpFaultPlan
from ddiloco_geo.tools.wanproxy import parse_host_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, metavar="HOST:PORT", help="the storage server, e.g. 127.0.0.1:9000")
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where to listen, loopback only (default 127.0.0.1:0, a free port)")
    p.add_argument("--rate", type=float, default=0.1, help="share of requests given a fault (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the decisions (default 0)")
    p.add_argument("--kinds", default=",".join(FAULT_KINDS), help=f"comma-separated subset of {','.join(FAULT_KINDS)}")
    p.add_argument("--keep-write-answers", action="store_true",
                   help="the contract profile: never lose the answer of a write (no reset/lost response on writes)")
    p.add_argument("--latency-ms", type=float, default=500.0, help="mean latency spike in ms (default 500)")


def run(args: argparse.Namespace) -> int:
    target_host, target_port = parse_host_port(args.target, "--target")
    listen_host, listen_port = parse_host_port(args.listen, "--listen")
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    try:
        plan = (HttpFaultPlan.contract(args.seed, args.rate, kinds=kinds, latency_s=args.latency_ms / 1000)
                if args.keep_write_answers else
                HttpFaultPlan(seed=args.seed, rate=args.rate, kinds=kinds, latency_s=args.latency_ms / 1000))
    except ValueError as exc:
        raise ConfigError(f"fault-proxy: {exc}") from None
    proxy = FaultProxy(target_host, target_port, plan, listen_host=listen_host, listen_port=listen_port)
    asyncio.run(_serve_until_signal(proxy, args))
    return 0


async def _serve_until_signal(proxy: FaultProxy, args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await proxy.start()
    started = {"url": proxy.url, "target": args.target, "rate": args.rate, "seed": args.seed}
    print(json.dumps(started) if args.json else
          f"{proxy.url} -> {args.target} rate={args.rate:g} seed={args.seed} (Ctrl-C to stop)", flush=True)
    try:
        await stop.wait()
    finally:
        await proxy.close()
    stats = proxy.stats()
    print(json.dumps(stats) if args.json else
          f"requests={stats['requests']} fault_ratio={stats['fault_ratio']:.3f} "
          + " ".join(f"{k}={n}" for k, n in stats["faults"].items()), flush=True)
