"""``ddiloco-geo bench overhead``: what syncing costs a learner, on loopback and over a slow link.

The product's central claim is that a learner step never waits on the network. This benchmark
runs, as real processes against a real S3 server (moto on 127.0.0.1, started here) with a syncer
process running throughout, one learner at a time:

1. ``off``: the same learner with syncing disabled (after the first pull: no deltas, no polling);
2. ``loopback``: syncing on, the learner talks to the S3 server directly;
3. ``wan``: syncing on, the learner's storage traffic goes through the WAN emulator
   (``ddiloco-geo wan-proxy``; default 100 ms round trip, 20 Mbit/s, as between continents).

The three phases interleave (off, loopback, wan, off, loopback, wan, ...) until the ``off`` runs'
last ``--window`` tokens/s are within 5% of each other ((max - min) / median) or ``--budget-s``
runs out (:mod:`.rounds`); a single bracketing pair once gave baselines 44% apart, which made the
ratios meaningless. Figures are medians over the last window, reported with their spreads, the
number of rounds and ``settled`` (false: the baseline never settled, read the ratios as noise).

Throughput is the learner's own tokens/s from joining until it stopped stepping (its
``exit.json``; the exit path, i.e. the final flush and the checkpoint, is reported as
``flush_s``). The figures of merit are ``loopback.ratio`` and ``wan.ratio`` = median tokens/s
with syncing / median tokens/s without (goal ≥ 0.95); ``round_ratios`` pairs each run with its
own round's ``off`` run. On a 2-core machine the syncer and the S3 server share the cores with the
learner, in every phase alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid
from typing import Any

from ddiloco_geo.tools import motoserver
from ddiloco_geo.tools.bench.rounds import interleave, spread
from ddiloco_geo.tools.wanproxy import WanProxyThread


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small", help="built-in model size (default small, ~11M parameters)")
    p.add_argument("--steps", type=int, default=72, help="inner steps per phase")
    p.add_argument("--delay-ms", type=float, default=50.0, help="one-way delay of the emulated link")
    p.add_argument("--rate-mbit", type=float, default=20.0, help="bandwidth of the emulated link")
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--window", type=int, default=3, help="interleaved rounds the medians are taken over")
    p.add_argument("--budget-s", type=float, default=900.0,
                   help="seconds to bring the off runs' spread under 5%% (default 900; a round is 3 runs)")


def _learner(common: list[str], name: str, endpoint: str, steps: int, sync: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "ddiloco_geo", "learner", *common, "--id", name, "--json",
           "--set", f"storage.endpoint_url={endpoint}", "--set", f"learner.max_steps={steps}",
           "--set", f"learner.sync_enabled={'true' if sync else 'false'}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"learner {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])


def run(args: argparse.Namespace) -> int:
    if args.window < 2 or args.budget_s < 0 or args.steps < 1:
        print("bench overhead: need --window >= 2, --budget-s >= 0 and --steps >= 1", file=sys.stderr)
        return 2
    try:
        import moto.server  # noqa: F401
    except ImportError:
        raise SystemExit("bench overhead needs the S3 test server: pip install 'ddiloco-geo[test]'") from None
    import boto3


    for name, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(name, value)
    server = motoserver.threaded(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    common = ["--store", f"s3://{bucket}/run", "--set", f"model.name={args.model}",
              "--set", f"data.max_bytes={args.max_bytes}", "--set", "storage.region=us-east-1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    syncer = subprocess.Popen([sys.executable, "-m", "ddiloco_geo", "syncer", *common,
                               "--set", f"storage.endpoint_url={endpoint}"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    names = (f"bench-{i}" for i in range(1 << 30))

    def progress(msg: str) -> None:
        print(f"bench overhead: {msg}", file=sys.stderr, flush=True)

    def phase(name: str, url: str, sync: bool) -> dict[str, Any]:
        res = _learner(common, f"{next(names)}-{name}", url, args.steps, sync)
        progress(f"{name} tokens/s {res['tokens_per_s']:.0f} ({args.steps} steps, model {args.model})")
        return res

    try:
        with WanProxyThread("127.0.0.1", port, delay_s=args.delay_ms / 1000,
                            rate_bps=args.rate_mbit * 1e6) as proxy:
            runs = interleave(
                lambda: phase("off", endpoint, False)["tokens_per_s"],
                lambda: {"loopback": phase("loopback", endpoint, True), "wan": phase("wan", proxy.url, True)},
                window=args.window, budget_s=args.budget_s, progress=progress)
            wan_stats = proxy.proxy.stats()
    finally:
        syncer.terminate()
        syncer.wait(timeout=120)
        server.stop()
    off = runs["baseline"]
    base = statistics.median(off)

    def summary(name: str) -> dict[str, Any]:
        results = [r[name] for r in runs["measured"]]
        tps = [r["tokens_per_s"] for r in results]
        r = sorted(results, key=lambda r: r["tokens_per_s"])[len(results) // 2]  # the median run's details
        return {"tokens_per_s": statistics.median(tps), "ratio": statistics.median(tps) / base,
                "runs_tokens_per_s": tps, "spread": spread(tps),
                "round_ratios": [t / o for t, o in zip(tps, off)],
                "deltas_sent": r["uploads"]["deltas_sent"], "upload_queue_at_exit": r["upload_queue"],
                "globals_adopted": r["poller"].get("updates_applied", 0) + r["poller"].get("globals_fetched", 0),
                "bytes_up": r["storage"]["bytes_up"], "bytes_down": r["storage"]["bytes_down"],
                "flush_s": r.get("flush_s")}

    out = {
        "model": args.model, "steps": args.steps, "link": {"delay_ms_one_way": args.delay_ms, "rate_mbit": args.rate_mbit},
        "off_tokens_per_s": off, "baseline_tokens_per_s": base, "baseline_spread_ratio": runs["spread"],
        "rounds": runs["rounds"], "window": args.window, "settled": runs["settled"],
        "loopback": summary("loopback"), "wan": summary("wan"),
        "goal_ratio": 0.95, "proxy": wan_stats,
    }
    print(json.dumps(out, indent=1) if getattr(args, "json", False) else
          f"loopback {out['loopback']['ratio']:.3f}  wan {out['wan']['ratio']:.3f}  (baseline spread "
          f"{out['baseline_spread_ratio']:.1%} over the last {args.window} of {out['rounds']} rounds"
          + ("" if out["settled"] else "; it never settled: read the ratios as noise") + ")")
    return 0
