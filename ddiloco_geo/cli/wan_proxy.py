"""``ddiloco-geo wan-proxy``: one :class:`~ddiloco_geo.tools.wanproxy.WanProxy` on loopback until
SIGINT/SIGTERM; prints where it listens, and its counters when it stops."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import Callable
from typing import Any

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.wanproxy import WanProxy, join_host_port, parse_host_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, metavar="HOST:PORT", help="where to relay, e.g. 127.0.0.1:9000")
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where to listen (default 127.0.0.1:0, a free port)")
    p.add_argument("--delay-ms", type=float, default=50.0, help="one-way delay in ms (default 50; RTT is twice)")
    p.add_argument("--rate-mbit", type=float, default=20.0,
                   help="bandwidth per direction in Mbit/s, shared by all connections (default 20; 0 = unlimited)")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="extra one-way delay, uniform in [0, J] ms (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the jitter (default 0)")
    p.add_argument("--allow-non-loopback", action="store_true",
                   help="allow --listen on a non-loopback address (the proxy has no authentication)")


def run(args: argparse.Namespace) -> int:
    target_host, target_port = parse_host_port(args.target, "--target")
    listen_host, listen_port = parse_host_port(args.listen, "--listen")
    if args.rate_mbit < 0:
        raise ConfigError(f"--rate-mbit {args.rate_mbit}: must be >= 0 (0 = unlimited)")
    proxy = WanProxy(
        target_host, target_port,
        listen_host=listen_host, listen_port=listen_port,
        delay_s=args.delay_ms / 1000, rate_bps=args.rate_mbit * 1e6 or None,
        jitter_s=args.jitter_ms / 1000, seed=args.seed,
        allow_non_loopback=args.allow_non_loopback,
    )
    asyncio.run(_serve_until_signal(proxy, args))
    return 0


async def _serve_until_signal(proxy: WanProxy, args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await proxy.start()
    _emit(args.json, {
        "listen": proxy.address_text, "url": proxy.url, "target": join_host_port(proxy.target_host, proxy.target_port),
        "delay_ms": args.delay_ms, "rate_mbit": args.rate_mbit or None, "jitter_ms": args.jitter_ms,
    }, lambda d: f"{d['url']} -> {d['target']} delay_ms={d['delay_ms']:g} rate_mbit={d['rate_mbit']} "
                 f"jitter_ms={d['jitter_ms']:g} (Ctrl-C to stop)")
    try:
        await stop.wait()
    finally:
        await proxy.close()
    _emit(args.json, proxy.stats(), lambda d: " ".join(f"{k}={v}" for k, v in d.items()))


def _emit(as_json: bool, record: dict[str, Any], text: Callable[[dict[str, Any]], str]) -> None:
    print(json.dumps(record) if as_json else text(record), flush=True)
