"""``ddiloco-geo bench syncer``: syncer throughput per core against a plain fp32 add.

Writes M int4 deltas for every fragment of a model into a memory:// store, then times the real
syncer doing one round over all of them: list, fetch, decode and validate (``poll_once``), then
anchor, RDA merge, Nesterov step and publish (global, update object, state, tape, index). The
baseline, timed in the same run on the same decoded tensors, is a plain fp32 sum of the M deltas.
Throughput counts the deltas' fp32 size; torch runs on one thread, so the figures are per core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid

import torch

from ddiloco_geo import codec, protocol
from ddiloco_geo.core import config, layout
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.model import embedding_rule
from ddiloco_geo.storage import open_store
from ddiloco_geo.syncer import Syncer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    settings, _ = config.load(cli={"model": {"name": args.model}, "syncer": {"grace_gamma": 0.0}})
    best_syncer = best_add = float("inf")
    fp32_bytes = 0
    for rep in range(args.repeats):
        store = open_store(settings.storage.model_copy(update={"url": f"memory://bench-{uuid.uuid4().hex[:8]}"}))
        spec, params = protocol.build_spec(settings)
        spec = protocol.create_or_load_spec(store, spec)
        syncer = Syncer(store, spec, **settings.syncer.model_dump(),
                        is_embedding=embedding_rule(settings.model))
        syncer.bootstrap(params)
        gen = torch.Generator().manual_seed(rep)
        decoded = []
        for p in range(spec.plan.num_fragments):
            for m in range(args.learners):
                pg = {n: 1e-3 * torch.randn(s, generator=gen) for n, s in spec.plan.expect(p).items()}
                header = codec.Header(kind="delta", run_id=spec.run_id, fragment=p, learner=f"l{m}", seq=p,
                                      base_version=0, clock=VectorClock({f"l{m}": p + 1}), num_steps=24,
                                      num_tokens=24 * 1024)
                store.put_if_absent(layout.delta_key(f"l{m}", p, p), codec.encode(pg, header, codec="int4"))
                decoded.append(pg)
        fp32_bytes = sum(t.numel() * 4 for pg in decoded for t in pg.values())
        print(f"bench syncer: round {rep + 1}/{args.repeats}, {len(decoded)} deltas, {fp32_bytes / 2**20:.0f} MB fp32",
              file=sys.stderr)
        t0 = time.perf_counter()
        asyncio.run(syncer.poll_once())
        merged = syncer.merge_ready()
        best_syncer = min(best_syncer, time.perf_counter() - t0)
        assert merged == spec.plan.num_fragments, merged
        t0 = time.perf_counter()
        for p in range(spec.plan.num_fragments):
            group = decoded[p * args.learners:(p + 1) * args.learners]
            for n in group[0]:
                acc = group[0][n].clone()
                for pg in group[1:]:
                    acc.add_(pg[n])
        best_add = min(best_add, time.perf_counter() - t0)
        store.close()
    mb = fp32_bytes / 2**20
    out = {"model": args.model, "learners": args.learners, "deltas_fp32_mb": mb,
           "syncer_mb_per_s_per_core": mb / best_syncer, "fp32_add_mb_per_s_per_core": mb / best_add,
           "ratio_vs_add": (mb / best_syncer) / (mb / best_add), "syncer_round_s": best_syncer}
    print(json.dumps(out, indent=1) if args.json else
          f"syncer {out['syncer_mb_per_s_per_core']:.0f} MB/s/core vs fp32 add {out['fp32_add_mb_per_s_per_core']:.0f}")
    return 0
