"""``ddiloco-geo bench bandwidth``: bytes on the wire per token, against data-parallel.

Runs M learners and a syncer with the default algorithm settings (P = 24, H = 16, tau = 2, int4 deltas,
int4 update objects, K = 1 with the grace window) on the in-process harness, each learner with its
own store client so its traffic is counted on its own, and measures, per learner and per token:

- **bytes sent** (deltas, heartbeats) and **bytes received** (index polls, update objects, full
  globals when it falls behind), in steady state: the first pull of the model is reported apart;
- against a **ring all-reduce of fp32 gradients every step** among the same M workers, where each
  worker sends 2(M−1)/M · 4·N bytes per step and receives as many.

``ratio_total`` = (DP sent + received) / (learner sent + received): the figure of merit (goal ≥ 150).
``ratio_sent`` compares what each side sends, as the all-reduce literature usually quotes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ddiloco_geo.tools.bench.quality import bench_settings
from ddiloco_geo.tools.inprocess import InProcessRun, LearnerSpeed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--steps", type=int, default=144, help="inner steps per learner (9 sync periods at H=16)")
    p.add_argument("--max-bytes", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], dest="overrides", help="extra settings KEY=VALUE")


def run(args: argparse.Namespace) -> int:
    # the exit checkpoint (parameters + AdamW moments) is a one-off, not traffic per token: off here,
    # its size is reported apart
    settings = bench_settings(args, **{"learner.checkpoint_on_exit": False})
    M = args.learners
    print(f"bench bandwidth: {M} learners x {args.steps} steps, model {args.model}", file=sys.stderr)
    speeds = [LearnerSpeed(1.0 if i % 2 == 0 else 1.18, 0.10) for i in range(M)]
    run_ = InProcessRun(settings, speeds, seed=args.seed)
    try:
        joined = [l.store.stats.snapshot() for l in run_.learners]
        status = run_.run()
        final = [l.store.stats.snapshot() for l in run_.learners]
        num_params = sum(run_.spec.plan.numel(p) for p in range(run_.spec.plan.num_fragments))
        tokens_per_step = settings.learner.batch_size * settings.model.block_size
        per_learner = []
        for i, learner in enumerate(run_.learners):
            up = final[i]["bytes_up"] - joined[i]["bytes_up"]
            down = final[i]["bytes_down"] - joined[i]["bytes_down"]
            per_learner.append({
                "learner": learner.learner_id, "steps": learner.step, "tokens": learner.tokens_total,
                "bytes_up": up, "bytes_down": down, "join_bytes_down": joined[i]["bytes_down"],
                "poller": dict(learner.poller.counters), "uploads": dict(learner.uploader.counters),
            })
    finally:
        run_.close()
    tokens = sum(l["tokens"] for l in per_learner)
    up = sum(l["bytes_up"] for l in per_learner)
    down = sum(l["bytes_down"] for l in per_learner)
    dp_sent_per_step = 2 * (M - 1) / M * 4 * num_params
    dp_per_token = 2 * dp_sent_per_step / tokens_per_step
    ours_per_token = (up + down) / tokens
    c = status["counters"]
    out: dict[str, Any] = {
        "model": args.model, "num_params": num_params, "learners": M, "steps_per_learner": args.steps,
        "fragments": settings.fragments.num_fragments, "sync_every": settings.fragments.sync_every,
        "codec": settings.run.codec, "update_codec": settings.syncer.update_codec,
        "learner_bytes_per_token": ours_per_token, "learner_sent_per_token": up / tokens,
        "learner_received_per_token": down / tokens,
        "dp_allreduce_bytes_per_token": dp_per_token,
        "ratio_total": dp_per_token / ours_per_token,
        "ratio_sent": (dp_sent_per_step / tokens_per_step) / (up / tokens),
        "goal_ratio": 150,
        "mean_contributors_per_merge": c["contributors_total"] / max(1, c["merges"]),
        "join_bytes_per_learner": per_learner[0]["join_bytes_down"],
        "checkpoint_bytes_per_learner": 3 * 4 * num_params,
        "per_learner": per_learner,
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"learner bytes/token {ours_per_token:.2f} (sent {up / tokens:.2f}, received {down / tokens:.2f}); "
              f"DP all-reduce {dp_per_token:.1f}; ratio {out['ratio_total']:.0f}x (sent only {out['ratio_sent']:.0f}x)")
    return 0
