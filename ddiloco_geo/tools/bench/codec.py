"""``ddiloco-geo bench codec``: wire size, speed and error of every codec on a realistic fragment.

The fragment is one transformer block's tensors (attention qkv/proj, MLP in/out, layer norms,
biases), sized to about ``--mb`` MB of fp32 and filled from a seeded normal distribution. The
baseline is a plain memory copy of the same tensors into preallocated buffers (``Tensor.copy_``,
best of ``--repeats``); ``.clone()`` (which also pays for fresh pages) is reported alongside.
For each codec, encode and decode are timed back to back (best of ``--repeats``, after one
warm-up) and compared with the copy:

    wire_ratio       wire bytes / fp32 bytes
    speed_vs_memcpy  (encode + decode) throughput / copy throughput
    encode_mb_s, decode_mb_s, max_abs_err, rel_l2_err, and the baseline figures

Goals from the design: int4 ``wire_ratio`` <= 0.14 and int4 ``speed_vs_memcpy`` >= 0.2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from ddiloco_geo import codec
from ddiloco_geo.core.clocks import VectorClock

MB = 1024 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=float, default=32.0, help="fragment size in MB of fp32 (default 32)")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions, best is kept (default 5)")
    p.add_argument("--block-size", type=int, default=codec.DEFAULT_BLOCK_SIZE,
                   help=f"int8/int4 block size (default {codec.DEFAULT_BLOCK_SIZE})")  # fmt: skip
    p.add_argument("--codecs", default=",".join(codec.CODECS), help="comma-separated codecs to run")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: usable CPUs)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fragment's values")


def fragment(mb: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """One GPT block of width d (12 d^2 weights), d a multiple of 64 chosen to be about ``mb`` MB."""
    d = max(64, 64 * round(math.sqrt(mb * MB / 4 / 12) / 64))
    shapes = {
        "attn.c_attn.weight": (3 * d, d), "attn.c_attn.bias": (3 * d,),
        "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,),
        "ln_1.weight": (d,), "ln_1.bias": (d,), "ln_2.weight": (d,), "ln_2.bias": (d,),
        "mlp.c_fc.weight": (4 * d, d), "mlp.c_fc.bias": (4 * d,),
        "mlp.c_proj.weight": (d, 4 * d), "mlp.c_proj.bias": (d,),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    return {f"blocks.3.{k}": torch.randn(s, generator=gen) * 1e-3 for k, s in sorted(shapes.items())}


def _best(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(tensors: dict[str, torch.Tensor], codecs: list[str], repeats: int, block_size: int,
            progress=lambda msg: None) -> list[dict]:  # fmt: skip
    fp32_bytes = sum(t.numel() * 4 for t in tensors.values())
    mb = fp32_bytes / MB
    buffers = {k: torch.empty_like(t) for k, t in tensors.items()}

    def copy() -> None:
        for k, t in tensors.items():
            buffers[k].copy_(t)

    def clone() -> None:
        for t in tensors.values():
            t.clone()

    copy()
    memcpy_s, clone_s = _best(copy, repeats), _best(clone, repeats)

    header = codec.Header(kind="delta", run_id="bench", fragment=0, learner="bench", seq=1,
                          base_version=0, clock=VectorClock({"bench": 1}), num_steps=24, num_tokens=1 << 20)  # fmt: skip
    results: list[dict] = []
    totals: list[float] = []
    for name in codecs:
        progress(f"{name} ...")
        wire = codec.encode(tensors, header, codec=name, block_size=block_size)
        codec.decode(wire)  # warm-up
        enc_best = dec_best = total_best = math.inf
        for _ in range(repeats):
            # The baselines are re-timed next to each codec run, so that load from elsewhere on the
            # machine hits both sides of the ratio alike; the best time over the run is kept.
            memcpy_s, clone_s = min(memcpy_s, _best(copy, 1)), min(clone_s, _best(clone, 1))
            t0 = time.perf_counter()
            wire = codec.encode(tensors, header, codec=name, block_size=block_size)
            t1 = time.perf_counter()
            _, out = codec.decode(wire)
            t2 = time.perf_counter()
            enc_best, dec_best = min(enc_best, t1 - t0), min(dec_best, t2 - t1)
            total_best = min(total_best, t2 - t0)
            del out
        _, out = codec.decode(wire)
        err2 = ref2 = 0.0
        max_abs = 0.0
        for k, t in tensors.items():
            diff = out[k] - t
            max_abs = max(max_abs, float(diff.abs().max()))
            err2 += float(diff.double().square().sum())
            ref2 += float(t.double().square().sum())
        row = {
            "codec": name,
            "block_size": block_size if name in codec.QMAX else 0,
            "fragment_mb": round(mb, 2),
            "wire_bytes": len(wire),
            "wire_ratio": round(len(wire) / fp32_bytes, 5),
            "encode_mb_s": round(mb / enc_best, 1),
            "decode_mb_s": round(mb / dec_best, 1),
            "encode_decode_mb_s": round(mb / total_best, 1),
            "max_abs_err": max_abs,
            "rel_l2_err": math.sqrt(err2 / ref2) if ref2 else 0.0,
            "threads": torch.get_num_threads(),
            "repeats": repeats,
        }
        progress(f"{name}: wire ratio {row['wire_ratio']:.4f}, {row['encode_decode_mb_s']:,.0f} MB/s")
        results.append(row)
        totals.append(total_best)
    for row, total_s in zip(results, totals, strict=True):  # final (best) baselines for every row
        row.update(speed_vs_memcpy=round(memcpy_s / total_s, 4), speed_vs_clone=round(clone_s / total_s, 4),
                   memcpy_mb_s=round(mb / memcpy_s, 1), clone_mb_s=round(mb / clone_s, 1))  # fmt: skip
    progress(f"memcpy {mb / memcpy_s:,.0f} MB/s, clone {mb / clone_s:,.0f} MB/s")
    return results


def run(args: argparse.Namespace) -> int:
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    unknown = [c for c in codecs if c not in codec.CODECS]
    if unknown or args.repeats < 1 or args.mb <= 0:
        print(f"bench codec: unknown codec {unknown} or non-positive --repeats/--mb; codecs are "
              f"{', '.join(codec.CODECS)}", file=sys.stderr)  # fmt: skip
        return 2
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, args.threads or usable or 1))
    tensors = fragment(args.mb, args.seed)

    def progress(msg: str) -> None:
        print(f"bench codec: {msg}", file=sys.stderr, flush=True)

    progress(f"fragment of {len(tensors)} tensors, {sum(t.numel() for t in tensors.values()) * 4 / MB:.1f} MB, "
             f"{torch.get_num_threads()} threads, best of {args.repeats}")  # fmt: skip
    results = measure(tensors, codecs, args.repeats, args.block_size, progress)
    if getattr(args, "json", False):
        print(json.dumps(results, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"codec on a {results[0]['fragment_mb'] if results else 0} MB fragment "
                        f"(memcpy {results[0]['memcpy_mb_s'] if results else 0:,} MB/s)")  # fmt: skip
    for col in ("codec", "wire_ratio", "speed_vs_memcpy", "encode MB/s", "decode MB/s", "max_abs_err", "rel_l2_err"):
        table.add_column(col, justify="left" if col == "codec" else "right")
    for r in results:
        table.add_row(r["codec"], f"{r['wire_ratio']:.4f}", f"{r['speed_vs_memcpy']:.3f}",
                      f"{r['encode_mb_s']:,.0f}", f"{r['decode_mb_s']:,.0f}",
                      f"{r['max_abs_err']:.3g}", f"{r['rel_l2_err']:.3g}")  # fmt: skip
    Console().print(table)
    return 0
