"""``ddiloco-geo bench syncer``: syncer throughput per core against a plain fp32 add, and capacity.

Each round writes M deltas (``--codec``, int4 by default; ``topk`` in a top-k run, so merged per
index: ``syncer.sparse_average=auto``) for every fragment of a model into a fresh
memory:// store, then times the real syncer doing one round over all of them: list, fetch, decode
and validate (``poll_once``: **intake**), then anchor, RDA merge, Nesterov step and publish
(update object, global, state, tape, index: **merge**). The baseline is a plain fp32 sum of the M
decoded deltas of each fragment into a new tensor. The phases interleave (add, syncer, add, ...)
until the add's spread is under 5% or ``--budget-s`` runs out (:mod:`.rounds`); figures are
medians over the last ``--window`` rounds. Throughput counts the deltas' fp32 size.

torch runs on one thread, but intake decodes on worker threads and the codec hashes on one, so
process CPU time is measured too: ``*_per_cpu_s`` figures are per core-second, and
``ratio_vs_add_cpu`` compares CPU times. On a machine loaded past its cores, wall time mostly
measures waiting for a core, so the rounds settle on the add's CPU time and the CPU figures are the
ones to read; ``*_per_s_per_core`` and ``ratio_vs_add`` (wall) are reported beside them.

**Capacity** (issue 14): a learner of a model of P parameters taking ``--steps-per-s`` steps a
second sends every fragment once per H (``--sync-every``) steps, i.e. 4·P bytes of fp32-equivalent
deltas every H steps. One syncer core processing X bytes of fp32-equivalent deltas per CPU-second
keeps up with ``X / (4 · P · steps_per_s / H)`` learners, at the measured M learners per merge
(per-merge work, the outer step and the publish, is shared by a round's M deltas, so more learners
per merge means more learners per core). The wire size does not enter: it costs network, and
decode time, which is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from typing import Any

import torch

from ddiloco_geo import codec, protocol
from ddiloco_geo.core import config, layout
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.model import embedding_rule
from ddiloco_geo.storage import open_store
from ddiloco_geo.syncer import Syncer
from ddiloco_geo.tools.bench.rounds import interleave, spread

MB = 1024 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small")
    p.add_argument("--learners", type=int, default=4, help="learners per merge (M)")
    p.add_argument("--codec", default="int4", choices=codec.CODECS, help="codec of the learners' deltas")
    p.add_argument("--window", type=int, default=3, help="interleaved rounds the medians are taken over")
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="seconds to bring the fp32 add's spread under 5%% (default 60)")
    p.add_argument("--params", type=float, default=1e9, help="model size of the capacity figure")
    p.add_argument("--steps-per-s", type=float, default=1.0, help="learner steps per second (capacity)")
    p.add_argument("--sync-every", type=int, default=config.FragmentConfig().sync_every,
                   help="H: steps between two sends of a fragment (default: fragments.sync_every's)")


class Round:
    """One syncer over a fresh store holding M deltas of every fragment."""

    def __init__(self, settings: Any, args: argparse.Namespace, seed: int) -> None:
        self.store = open_store(settings.storage.model_copy(update={"url": f"memory://bench-{uuid.uuid4().hex[:8]}"}))
        spec, params = protocol.build_spec(settings)
        self.spec = spec = protocol.create_or_load_spec(self.store, spec)
        self.syncer = Syncer(self.store, spec, **settings.syncer.model_dump(), is_embedding=embedding_rule(settings.model))
        self.syncer.bootstrap(params)
        gen = torch.Generator().manual_seed(seed)
        self.deltas: list[list[dict[str, torch.Tensor]]] = []
        self.wire_bytes = 0
        for p in range(spec.plan.num_fragments):
            group = []
            for m in range(args.learners):
                pg = {n: 1e-3 * torch.randn(s, generator=gen) for n, s in spec.plan.expect(p).items()}
                header = codec.Header(kind="delta", run_id=spec.run_id, fragment=p, learner=f"l{m}", seq=p,
                                      base_version=0, clock=VectorClock({f"l{m}": p + 1}), num_steps=24,
                                      num_tokens=24 * 1024)
                data = codec.encode(pg, header, codec=args.codec, **spec.codec_args(args.codec))
                self.wire_bytes += len(data)
                self.store.put_if_absent(layout.delta_key(f"l{m}", p, p), data)
                group.append(pg)
            self.deltas.append(group)
        self.fp32_bytes = sum(t.numel() * 4 for group in self.deltas for pg in group for t in pg.values())

    def run(self) -> dict[str, float]:
        """Time one syncer round: intake, merge and publish, total (wall seconds) and process CPU."""
        cpu0, t0 = time.process_time(), time.perf_counter()
        asyncio.run(self.syncer.poll_once())
        t1 = time.perf_counter()
        merged = self.syncer.merge_ready()
        t2, cpu2 = time.perf_counter(), time.process_time()
        assert merged == self.spec.plan.num_fragments, merged
        for key in self.store.list():  # memory:// buckets live as long as the process: free this one's
            self.store.delete(key)
        self.store.close()
        return {"intake_s": t1 - t0, "merge_s": t2 - t1, "total_s": t2 - t0, "cpu_s": cpu2 - cpu0}


def fp32_add(deltas: list[list[dict[str, torch.Tensor]]]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of a plain fp32 sum of each fragment's M deltas."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    for group in deltas:
        for n in group[0]:
            acc = group[0][n].clone()
            for pg in group[1:]:
                acc.add_(pg[n])
    return time.perf_counter() - t0, time.process_time() - cpu0


def run(args: argparse.Namespace) -> int:
    if args.learners < 1 or args.window < 2 or args.budget_s < 0 or args.sync_every < 1:
        print("bench syncer: need --learners >= 1, --window >= 2, --budget-s >= 0, --sync-every >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    settings, _ = config.load(cli={"model": {"name": args.model}, "syncer": {"grace_gamma": 0.0},
                                   "run": {"codec": args.codec}})  # a top-k run merges per index (sparse_average=auto)

    def progress(msg: str) -> None:
        print(f"bench syncer: {msg}", file=sys.stderr, flush=True)

    warm = Round(settings, args, seed=0)  # one untimed round: thread pools, first-touch allocations
    deltas, fp32_bytes, wire_bytes = warm.deltas, warm.fp32_bytes, warm.wire_bytes
    warm.run()
    progress(f"{len(deltas) * args.learners} {args.codec} deltas a round, {fp32_bytes / MB:.0f} MB fp32, "
             f"{wire_bytes / MB:.1f} MB on the wire; interleaving fp32 add and syncer rounds")
    seeds = iter(range(1, 1 << 30))
    add_wall: list[float] = []

    def add_cpu_s() -> float:
        wall, cpu = fp32_add(deltas)
        add_wall.append(wall)
        return cpu

    def syncer_round() -> dict[str, float]:
        return Round(settings, args, seed=next(seeds)).run()  # writing the deltas is not timed

    runs = interleave(add_cpu_s, syncer_round, window=args.window, budget_s=args.budget_s, progress=progress)
    mb = fp32_bytes / MB
    med = {k: statistics.median(r[k] for r in runs["measured"]) for k in ("intake_s", "merge_s", "total_s", "cpu_s")}
    add_s, add_cpu = statistics.median(add_wall[-args.window:]), statistics.median(runs["baseline"])
    per_cpu = mb / med["cpu_s"]
    learner_mb_s = 4 * args.params * args.steps_per_s / args.sync_every / MB
    out = {
        "model": args.model, "learners": args.learners, "codec": args.codec, "threads": torch.get_num_threads(),
        "deltas_fp32_mb": round(mb, 2), "deltas_wire_mb": round(wire_bytes / MB, 3),
        "syncer_mb_per_cpu_s": round(per_cpu, 1),
        "fp32_add_mb_per_cpu_s": round(mb / add_cpu, 1),
        "ratio_vs_add_cpu": round(add_cpu / med["cpu_s"], 4),
        "syncer_mb_per_s_per_core": round(mb / med["total_s"], 1),
        "fp32_add_mb_per_s_per_core": round(mb / add_s, 1),
        "ratio_vs_add": round(add_s / med["total_s"], 4),
        "syncer_round_s": round(med["total_s"], 4), "intake_s": round(med["intake_s"], 4),
        "merge_publish_s": round(med["merge_s"], 4), "syncer_cpu_s": round(med["cpu_s"], 4),
        "rounds": runs["rounds"], "window": args.window, "settled": runs["settled"],
        "add_cpu_spread": round(runs["spread"], 4), "add_wall_spread": round(spread(add_wall[-args.window:]), 4),
        "syncer_cpu_spread": round(spread([r["cpu_s"] for r in runs["measured"]]), 4),
        "syncer_wall_spread": round(spread([r["total_s"] for r in runs["measured"]]), 4),
        "capacity": {
            "params": args.params, "steps_per_s": args.steps_per_s, "sync_every": args.sync_every,
            "learner_fp32_mb_per_s": round(learner_mb_s, 1),
            "learners_per_core": round(per_cpu / learner_mb_s, 3),
            "formula": "learners_per_core = syncer_mb_per_cpu_s / (4 B * params * steps_per_s / sync_every / 2^20)",
        },
        "goal_ratio_vs_add": 0.3,
    }
    print(json.dumps(out, indent=1) if getattr(args, "json", False) else
          f"syncer {per_cpu:.0f} MB per CPU-s vs fp32 add {out['fp32_add_mb_per_cpu_s']:.0f}: ratio "
          f"{out['ratio_vs_add_cpu']:.4f} (wall: {out['ratio_vs_add']:.4f}); "
          f"{out['capacity']['learners_per_core']:.2f} learners of {args.params:.0e} parameters per core; "
          f"{out['rounds']} rounds, add CPU-time spread {out['add_cpu_spread']:.1%}"
          + ("" if out["settled"] else " (the budget ran out before it settled)"))
    return 0
