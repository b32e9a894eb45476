"""``ddiloco-geo bench codec``: wire size, speed and error of every codec on a realistic fragment.

The fragment is one transformer block's tensors (attention qkv/proj, MLP in/out, layer norms,
biases), sized to about ``--mb`` MB of fp32 and filled from a seeded normal distribution. The
baseline is a plain memory copy of the same tensors into preallocated buffers (``Tensor.copy_``).
For each codec the phases interleave (copy, encode + decode, copy, ...), one run each, until the
copy's last ``--repeats`` runs are within 5% of each other ((max - min) / median) or ``--budget-s``
runs out; the figures are medians over that window, and ``rounds``, ``memcpy_spread`` and
``settled`` say how much to trust them (on a loaded machine a best-of hides the noise; this shows
it). Per codec:

    wire_ratio       wire bytes / fp32 bytes (fp32_over_wire: the inverse)
    speed_vs_memcpy  median copy time / median (encode + decode) time
    encode_mb_s, decode_mb_s, max_abs_err, rel_l2_err, memcpy_mb_s, rounds, memcpy_spread, settled

Goals (issue 14): int4 ``wire_ratio`` <= 0.14, topk ``wire_ratio`` <= 0.01, and int4 and topk
``speed_vs_memcpy`` >= 0.2. topk runs with its own chunk (4096) unless ``--block-size`` is not
the int default; ``--topk`` sets the values kept per chunk.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

from ddiloco_geo import codec
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.tools.bench.rounds import interleave, spread

MB = 1024 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=float, default=32.0, help="fragment size in MB of fp32 (default 32)")
    p.add_argument("--repeats", type=int, default=5,
                   help="window of interleaved rounds the medians and spreads are taken over (default 5)")
    p.add_argument("--budget-s", type=float, default=30.0,
                   help="seconds per codec to bring the memcpy baseline's spread under 5%% (default 30)")
    p.add_argument("--topk", type=int, default=0, help="topk: values kept per chunk (default: 84 per 4096)")
    p.add_argument("--block-size", type=int, default=codec.DEFAULT_BLOCK_SIZE,
                   help=f"int8/int4 block size (default {codec.DEFAULT_BLOCK_SIZE}; topk uses its chunk "
                        f"of {codec.DEFAULT_CHUNK} unless another size is given)")  # fmt: skip
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


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(tensors: dict[str, torch.Tensor], codecs: list[str], repeats: int, block_size: int,
            progress=lambda msg: None, budget_s: float = 30.0, topk: int = 0) -> list[dict]:  # fmt: skip
    """One row per codec; ``repeats`` is the window of interleaved rounds the medians are taken
    over, ``budget_s`` the time allowed per codec to bring the baseline's spread under 5%."""
    fp32_bytes = sum(t.numel() * 4 for t in tensors.values())
    mb = fp32_bytes / MB
    buffers = {k: torch.empty_like(t) for k, t in tensors.items()}

    def copy() -> None:
        for k, t in tensors.items():
            buffers[k].copy_(t)

    header = codec.Header(kind="delta", run_id="bench", fragment=0, learner="bench", seq=1,
                          base_version=0, clock=VectorClock({"bench": 1}), num_steps=24, num_tokens=1 << 20)  # fmt: skip
    results: list[dict] = []
    for name in codecs:
        progress(f"{name} ...")
        bs = codec.DEFAULT_CHUNK if name == "topk" and block_size == codec.DEFAULT_BLOCK_SIZE else block_size
        kwargs = {"codec": name, "block_size": bs, "topk": topk or None}
        wire = codec.encode(tensors, header, **kwargs)
        copy(), codec.decode(wire)  # warm-up

        def round_trip() -> tuple[float, float]:
            t0 = time.perf_counter()
            data = codec.encode(tensors, header, **kwargs)
            t1 = time.perf_counter()
            codec.decode(data)
            return t1 - t0, time.perf_counter() - t1

        runs = interleave(lambda: _timed(copy), round_trip, window=max(2, repeats), budget_s=budget_s)
        memcpy_s = statistics.median(runs["baseline"])
        enc_s = statistics.median(e for e, _ in runs["measured"])
        dec_s = statistics.median(d for _, d in runs["measured"])
        total_s = statistics.median(e + d for e, d in runs["measured"])
        header_back, out = codec.decode(wire)
        err2 = ref2 = 0.0
        max_abs = 0.0
        for k, t in tensors.items():
            diff = out[k] - t
            max_abs = max(max_abs, float(diff.abs().max()))
            err2 += float(diff.double().square().sum())
            ref2 += float(t.double().square().sum())
        row = {
            "codec": name,
            "block_size": header_back.block_size,
            "topk": header_back.topk,
            "fragment_mb": round(mb, 2),
            "wire_bytes": len(wire),
            "wire_ratio": round(len(wire) / fp32_bytes, 5),
            "fp32_over_wire": round(fp32_bytes / len(wire), 1),
            "encode_mb_s": round(mb / enc_s, 1),
            "decode_mb_s": round(mb / dec_s, 1),
            "encode_decode_mb_s": round(mb / total_s, 1),
            "speed_vs_memcpy": round(memcpy_s / total_s, 4),
            "memcpy_mb_s": round(mb / memcpy_s, 1),
            "memcpy_spread": round(runs["spread"], 4),
            "codec_spread": round(spread([e + d for e, d in runs["measured"]]), 4),
            "rounds": runs["rounds"],
            "settled": runs["settled"],
            "max_abs_err": max_abs,
            "rel_l2_err": math.sqrt(err2 / ref2) if ref2 else 0.0,
            "threads": torch.get_num_threads(),
            "repeats": repeats,
        }
        progress(f"{name}: wire ratio {row['wire_ratio']:.4f}, {row['encode_decode_mb_s']:,.0f} MB/s, "
                 f"{row['speed_vs_memcpy']:.3f} of memcpy ({row['rounds']} rounds, memcpy spread "
                 f"{row['memcpy_spread']:.1%})")  # fmt: skip
        results.append(row)
    return results


def run(args: argparse.Namespace) -> int:
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    unknown = [c for c in codecs if c not in codec.CODECS]
    if unknown or args.repeats < 2 or args.mb <= 0 or args.budget_s < 0:
        print(f"bench codec: unknown codec {unknown} or --repeats < 2, --mb <= 0 or --budget-s < 0; codecs are "
              f"{', '.join(codec.CODECS)}", file=sys.stderr)  # fmt: skip
        return 2
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, args.threads or usable or 1))
    tensors = fragment(args.mb, args.seed)

    def progress(msg: str) -> None:
        print(f"bench codec: {msg}", file=sys.stderr, flush=True)

    progress(f"fragment of {len(tensors)} tensors, {sum(t.numel() for t in tensors.values()) * 4 / MB:.1f} MB, "
             f"{torch.get_num_threads()} threads, medians of {args.repeats} interleaved rounds")  # fmt: skip
    results = measure(tensors, codecs, args.repeats, args.block_size, progress, args.budget_s, args.topk)
    if getattr(args, "json", False):
        print(json.dumps(results, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"codec on a {results[0]['fragment_mb'] if results else 0} MB fragment "
                        f"(memcpy {results[0]['memcpy_mb_s'] if results else 0:,} MB/s)")  # fmt: skip
    for col in ("codec", "wire_ratio", "speed_vs_memcpy", "encode MB/s", "decode MB/s", "rounds", "memcpy spread",
                "max_abs_err", "rel_l2_err"):
        table.add_column(col, justify="left" if col == "codec" else "right")
    for r in results:
        table.add_row(r["codec"], f"{r['wire_ratio']:.4f}", f"{r['speed_vs_memcpy']:.3f}",
                      f"{r['encode_mb_s']:,.0f}", f"{r['decode_mb_s']:,.0f}", str(r["rounds"]),
                      f"{r['memcpy_spread']:.1%}" + ("" if r["settled"] else " (budget)"),
                      f"{r['max_abs_err']:.3g}", f"{r['rel_l2_err']:.3g}")  # fmt: skip
    Console().print(table)
    return 0
