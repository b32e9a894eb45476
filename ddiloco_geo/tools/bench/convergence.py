"""``ddiloco-geo bench convergence``: where the loss goes, on the same tokens, up to a compute-optimal budget.

For each number of learners M and each horizon h (a share of the budget B = tokens_per_param ×
parameters, 20 by default: compute-optimal), every **arm** trains from the same initial weights on
exactly the same tokens (M shards of the corpus, the learners' readers) with the same schedule
length, and the final model is evaluated on the same held-out batches:

- ``dp``: data-parallel (:func:`~ddiloco_geo.tools.bench.reference.train_dp`), its peak learning
  rate the best of ``--dp-lr-scales`` at each horizon (the baseline is tuned, not handicapped);
- the **ablation ladder**, each rung adding one design piece to the previous one:
  ``lockstep`` synchronous DiLoCo, whole model, fp32 (reference trainer) →
  ``streaming`` fragments P = H on the real learner and syncer (in-process harness), K = M, fp32 →
  ``int4`` int4 deltas and updates → ``async`` K = 1 + grace, learners of different speeds
  (half 18% slower, 10% jitter) → ``adopt`` the adoption policy (``learner.adopt``) →
  ``faults`` a learner killed without flushing at 40% of its steps and restarted later.

Reported per (M, arm, h): eval loss, the ratio to data-parallel at the same tokens, and at the
largest horizon the **token efficiency**: data-parallel's tokens over the tokens the arm needs to
reach data-parallel's final loss (interpolated on the arm's losses over the horizons in log
tokens; extrapolated from the last two horizons, and flagged, when the arm never gets there), and
``dp_equivalent``, the same ratio at the arm's final loss: data-parallel's tokens to get as far (on
data-parallel's curve) over the arm's tokens.
Settings common to every arm come from ``--set``; each arm's own settings are in ``ARMS``.
``--seeds 0,1,2`` runs the whole study once per seed (initial weights, data order and the harness's
timing all drawn from it) and reports the **spread**: per M and arm, at the largest horizon, the
ratio to data-parallel and the points from lock-step on each seed, with mean, standard deviation and
standard error. A single run of an arm moves by about a point with its seed (docs/benchmarks.md),
as much as most effects studied here, so a goal of half a point is read on a mean over seeds.
Runs go to ``--jobs`` worker processes (one torch thread each); progress lines on stderr; a PNG
of eval loss against tokens per M.

Cost: a full-budget run of the nano model is 30–40 minutes on one core (about 3,000 tokens/s), so
the defaults (M = 4, horizons 0.5 and 1, ``lockstep`` and ``adopt``, data-parallel at 0.75× (4.5e-3): six
runs) take about 70 minutes on 2 quiet cores; the whole ladder at M = 2 and 4 over three horizons
with two data-parallel rates is about 21 full-budget runs, five hours.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ddiloco_geo.core import config
from ddiloco_geo.core import model as modelmod
from ddiloco_geo.tools.bench.reference import hetero_speeds, lr_scales, train_dp, train_harness, train_lockstep
from ddiloco_geo.tools.inprocess import Fault, LearnerSpeed

EQUAL = "equal"
HETERO = "hetero"

# name -> (kind, settings, speeds, faults); each rung adds one piece to the one before
ARMS: dict[str, tuple[str, dict[str, Any], str, bool]] = {
    "lockstep": ("lockstep", {"run.codec": "fp32"}, EQUAL, False),
    "streaming": ("harness", {"run.codec": "fp32", "syncer.update_codec": "fp32", "syncer.quorum": "M",
                              "syncer.grace_gamma": 0.0, "learner.adopt": "overwrite"}, EQUAL, False),
    "int4": ("harness", {"syncer.quorum": "M", "syncer.grace_gamma": 0.0, "learner.adopt": "overwrite"}, EQUAL, False),
    "async": ("harness", {"syncer.quorum": 1, "syncer.grace_gamma": 0.5, "learner.adopt": "overwrite"}, HETERO, False),
    "adopt": ("harness", {"syncer.quorum": 1, "syncer.grace_gamma": 0.5, "learner.adopt": "keep_progress"}, HETERO, False),
    "faults": ("harness", {"syncer.quorum": 1, "syncer.grace_gamma": 0.5, "learner.adopt": "keep_progress"}, HETERO, True),
}
LADDER = "lockstep,streaming,int4,async,adopt,faults"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="nano", help="built-in model size (default nano, ~0.5M parameters)")
    p.add_argument("--learners", default="4", help="comma list of M (the ladder runs at the largest)")
    p.add_argument("--tokens-per-param", type=float, default=20.0, help="budget B = this x parameters (20: compute-optimal)")
    p.add_argument("--horizons", default="0.5,1", help="shares of the budget, each a run with its own schedule")
    p.add_argument("--arms", default="lockstep,adopt", help=f"comma list of {', '.join(ARMS)} (dp always runs; "
                   f"the whole ladder: {LADDER})")
    p.add_argument("--ladder-at", default="max", help="M at which the whole ladder runs ('max' or a number); "
                   "other M run lockstep and the product default (adopt) only")
    p.add_argument("--dp-lr-scales", default="0.75,1,1.25", help="data-parallel peak lr, as multipliers of learner.lr, "
                   "tried (best kept per horizon): 0.75 and 1 each won on some seeds at M = 2 by up to 3.8 points, "
                   "1.25 beat 1 at M = 4 (docs/benchmarks.md, stop 52)")
    p.add_argument("--corpus", help="data.corpus for every arm (default: the settings')")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--out", default="out/convergence", help="directory for convergence.json and convergence.png")
    p.add_argument("--seed", type=int, default=0, help="harness seed (learner speeds and jitter)")
    p.add_argument("--seeds", help="comma list: the whole study once per seed S, each with --seed S and "
                   "model.seed=S (initial weights and data order); the JSON's 'spread' gives, per M and arm, "
                   "the ratio to data-parallel and the points from lock-step on each seed, with their mean, "
                   "standard deviation and standard error")
    p.add_argument("--set", action="append", default=[], dest="overrides", help="settings KEY=VALUE for every arm")
    p.add_argument("--speeds", choices=["arm", EQUAL, HETERO], default="arm",
                   help="learner speeds of the harness arms: each arm's own (default), or all equal / half 18%% slower")
    p.add_argument("--jitter", type=float, help="step-time jitter of the harness arms, as a share of the step "
                   "(default: the arm's: 0 for equal speeds, 0.1 for mixed)")


# what the study sets itself, and the option a user sets it with instead of --set
STUDY_KEYS = {"model.name": "--model", "learner.max_steps": "--horizons and --tokens-per-param",
              "data.eval_batches": "nothing (32, the same eval set for every arm)", "learner.log_every": "nothing",
              "local.learners": "--learners", "data.corpus": "--corpus"}


def _settings(args: argparse.Namespace, M: int, steps: int, arm_settings: dict[str, Any]):
    """The user's ``--set`` for every arm, then the study's and the arm's own settings on top
    (``run`` refuses a ``--set`` of any of those keys, see ``_refuse_fixed``)."""
    flat = {"model.name": args.model, "learner.max_steps": steps, "data.eval_batches": 32,
            "learner.log_every": 10**6, "local.learners": M,
            **({"data.corpus": args.corpus} if args.corpus else {}),
            **{k: (M if v == "M" else v) for k, v in arm_settings.items()}}
    settings, _ = config.load(cli=config.overrides_tree(getattr(args, "overrides", None), flat))
    return settings


def _parse_seeds(text: str | None) -> list[int | None]:
    """``--seeds``: distinct integers; ``[None]`` without it (one study at ``--seed``)."""
    if not text:
        return [None]
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds {text!r}: expected a comma list of integers, e.g. 0,1,2") from None
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds {text!r}: list each seed once")
    return seeds


def _seed_args(plain: dict[str, Any], seed: int | None) -> dict[str, Any]:
    """A job's arguments: ``plain`` as given, or for one seed of ``--seeds`` with that seed as the
    harness's (``--seed``) and the initial weights' (``model.seed``)."""
    if seed is None:
        return plain
    return {**plain, "seed": seed, "overrides": [*(plain.get("overrides") or []), f"model.seed={seed}"]}


def _set_keys(overrides: list[str] | None) -> set[str]:
    """The settings keys a list of ``--set KEY=VALUE`` names."""
    return {item.split("=", 1)[0].strip() for item in overrides or []}


def _refuse_fixed(overrides: list[str] | None, arm: str) -> None:
    """A ``--set`` of a key the study or ``arm`` sets would lose silently (``_settings``): refuse it,
    saying what to use instead."""
    keys = _set_keys(overrides)
    study = sorted(keys & set(STUDY_KEYS))
    if study:
        raise SystemExit(f"--set {', '.join(study)}: the study sets it for every arm; use "
                         f"{'; '.join(f'{STUDY_KEYS[k]} for {k}' for k in study)}")
    fixed = sorted(keys & set(ARMS[arm][1]))
    if fixed:
        raise SystemExit(f"--set {', '.join(fixed)}: arm {arm!r} fixes it ({', '.join(f'{k}={ARMS[arm][1][k]}' for k in fixed)}); "
                         f"each rung of the ladder is defined by its settings: pick the arm that has the value, or leave {arm!r} out")


def _exit_with_parent(parent: int) -> None:
    """Pool initializer: a worker whose parent died (killed, Ctrl-C) exits instead of training on
    for an hour as an orphan."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _task(job: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    args = argparse.Namespace(**job["args"])
    t0 = time.perf_counter()
    M, steps, arm = job["M"], job["steps"], job["arm"]
    if arm.startswith("dp"):
        settings = _settings(args, M, steps, {})
        res = train_dp(settings, M, lr_scale=job["lr_scale"], label=f"dp x{job['lr_scale']} M={M} h={job['h']}")
        out = {"eval_loss": res.eval_loss, "tokens": res.tokens, "lr_scale": job["lr_scale"]}
    else:
        kind, arm_settings, speeds, faults = ARMS[arm]
        settings = _settings(args, M, steps, arm_settings)
        if kind == "lockstep":
            res = train_lockstep(settings, M, label=f"lockstep M={M} h={job['h']}")
            out = {"eval_loss": res.eval_loss, "tokens": res.tokens}
        else:
            speeds = speeds if getattr(args, "speeds", "arm") == "arm" else args.speeds
            out = _harness(settings, M, speeds, faults, args.seed, f"{arm} M={M} h={job['h']}",
                           jitter=getattr(args, "jitter", None))
    out.update({"arm": arm, "M": M, "h": job["h"], "steps": steps, "seed": args.seed, "wall_s": time.perf_counter() - t0})
    return out


def _harness(settings, M: int, speeds: str, faults: bool, seed: int, label: str,
             jitter: float | None = None) -> dict[str, Any]:
    sp = [LearnerSpeed(1.0, 0.0)] * M if speeds == EQUAL else hetero_speeds(M)
    if jitter is not None:
        sp = [LearnerSpeed(s.step_s, jitter) for s in sp]
    steps = settings.learner.max_steps
    events = [Fault(learner=M - 1, at_step=int(0.4 * steps), down_steps=max(1, int(0.05 * steps)))] if faults else []
    out = train_harness(settings, sp, seed=seed, faults=events, label=label)
    out["discarded_ratio"] = out.pop("discarded_fragment_steps_ratio")
    return out


def token_efficiency(dp: list[tuple[int, float]], arm: list[tuple[int, float]]) -> tuple[float | None, bool]:
    """DP's tokens at its largest horizon over the tokens the arm needs for DP's final loss;
    (value, extrapolated). Curves are (tokens, loss) sorted by tokens."""
    if not dp or len(arm) < 2:
        return None, False
    t_dp, target = dp[-1]
    pts = [(math.log(t), l) for t, l in arm]
    for (x0, l0), (x1, l1) in zip(pts, pts[1:]):
        if (l0 - target) * (l1 - target) <= 0 and l0 != l1:
            x = x0 + (target - l0) * (x1 - x0) / (l1 - l0)
            return t_dp / math.exp(x), False
    if arm[0][1] <= target:  # better than data-parallel already at its smallest horizon
        return t_dp / arm[0][0], True
    (x0, l0), (x1, l1) = pts[-2], pts[-1]
    if l1 >= l0:  # not improving: no estimate
        return 0.0, True
    x = x1 + (target - l1) * (x1 - x0) / (l1 - l0)
    return t_dp / math.exp(x), True


def dp_equivalent(dp: list[tuple[int, float]], arm: list[tuple[int, float]]) -> tuple[float | None, bool]:
    """The same ratio as ``token_efficiency`` (data-parallel's tokens over the arm's at equal loss),
    taken at the arm's final loss on data-parallel's curve: the share of the arm's tokens that
    data-parallel needs to get as far; (value, extrapolated). Where the arm ends above data-parallel's
    final loss this interpolates between data-parallel's horizons (cheap runs) instead of
    extrapolating the arm's curve. Flagged when the arm's loss is outside data-parallel's curve: above
    its first point (the value is then an upper bound, its smallest horizon over the arm's tokens) or
    below its last (extrapolated). None without two data-parallel horizons."""
    if len(dp) < 2 or not arm:
        return None, False
    inverse, extrapolated = token_efficiency([arm[-1]], dp)
    return (1.0 / inverse if inverse else None), extrapolated


def run(args: argparse.Namespace) -> int:
    Ms = [int(m) for m in args.learners.split(",")]
    horizons = sorted(float(h) for h in args.horizons.split(","))
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in ARMS:
            raise SystemExit(f"unknown arm {a!r}: choose from {', '.join(ARMS)}")
        _refuse_fixed(args.overrides, a)
    seeds = _parse_seeds(getattr(args, "seeds", None))
    if seeds != [None] and "model.seed" in _set_keys(args.overrides):
        raise SystemExit("--set model.seed: --seeds sets it for each seed (model.seed = the seed)")
    dp_scales = lr_scales(args.dp_lr_scales)
    ladder_M = max(Ms) if args.ladder_at == "max" else int(args.ladder_at)
    base = _settings(args, Ms[0], 1, {})
    params = sum(p.numel() for p in modelmod.build_model(base.model).parameters())
    budget = args.tokens_per_param * params
    tokens_per_step = base.learner.batch_size * base.model.block_size
    jobs = []
    for M in Ms:
        for h in horizons:
            steps = max(2 * base.fragments.sync_every, round(h * budget / (M * tokens_per_step)))
            for scale in dp_scales:
                jobs.append({"arm": f"dp@{scale}", "lr_scale": scale, "M": M, "h": h, "steps": steps})
            for a in arms if M == ladder_M else [a for a in arms if a in ("lockstep", "adopt")]:
                jobs.append({"arm": a, "M": M, "h": h, "steps": steps})
    plain = {k: v for k, v in vars(args).items() if not callable(v) and not k.startswith("_")}
    jobs = [{**j, "args": _seed_args(plain, seed)} for seed in seeds for j in jobs]
    print(f"bench convergence: {params} parameters, budget {budget / 1e6:.1f}M tokens, {len(jobs)} runs on "
          f"{args.jobs} workers", file=sys.stderr, flush=True)
    results, t0 = [], time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx, initializer=_exit_with_parent,
                                                initargs=(os.getpid(),)) as pool:
        futures = [pool.submit(_task, j) for j in sorted(jobs, key=lambda j: -j["steps"])]
        for i, fut in enumerate(concurrent.futures.as_completed(futures)):
            r = fut.result()
            results.append(r)
            print(f"bench convergence: [{i + 1}/{len(jobs)}] {r['arm']} M={r['M']} h={r['h']} "
                  f"eval_loss={r['eval_loss']:.4f} ({r['wall_s']:.0f} s, {time.perf_counter() - t0:.0f} s total)",
                  file=sys.stderr, flush=True)
    out = summarize(results, Ms, horizons, arms, params, budget)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "convergence.json").write_text(json.dumps(out, indent=1))
    plot(out, out_dir / "convergence.png")
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for row in out["table"]:
            print(f"seed {row['seed']} M={row['M']} {row['arm']:>9}: loss {row['eval_loss']:.4f} ratio "
                  f"{row['loss_ratio']:.4f} efficiency {row.get('token_efficiency')}")
        for row in out["spread"]:
            vs_lock = row.get("points_vs_lockstep")
            print(f"M={row['M']} {row['arm']:>9} over {row['n']} seed(s): ratio {_fmt(row['loss_ratio'])}"
                  + (f", points from lock-step {_fmt(vs_lock)}" if vs_lock else ""))
    return 0


def _fmt(stats: dict[str, Any]) -> str:
    return f"mean {stats['mean']:.4f}" + (f" sd {stats['sd']:.4f} se {stats['se']:.4f}" if stats["sd"] is not None else "")


def _stats(values: list[float]) -> dict[str, Any]:
    """Mean, sample standard deviation and standard error of the mean (None for one value)."""
    sd = statistics.stdev(values) if len(values) > 1 else None
    return {"values": values, "mean": statistics.fmean(values), "sd": sd,
            "se": sd / math.sqrt(len(values)) if sd is not None else None}


def spread(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (M, arm), at the largest horizon, over the seeds: the loss ratio to data-parallel, and for
    every arm but lock-step its points from lock-step on the same seed (100 × (arm − lock-step) /
    data-parallel: the difference of the two ratios, paired by seed)."""
    last: dict[int, float] = {}
    for r in table:
        last[r["M"]] = max(last.get(r["M"], r["h"]), r["h"])
    top = {(r["M"], r["arm"], r["seed"]): r for r in table if r["h"] == last[r["M"]]}
    out = []
    for M, arm in sorted({(M, a) for M, a, _ in top}, key=lambda k: (k[0], list(ARMS).index(k[1]))):
        rows = sorted((r for k, r in top.items() if k[:2] == (M, arm)), key=lambda r: r["seed"])
        entry = {"M": M, "arm": arm, "n": len(rows), "seeds": [r["seed"] for r in rows],
                 "loss_ratio": _stats([r["loss_ratio"] for r in rows])}
        paired = [(r, top[(M, "lockstep", r["seed"])]) for r in rows if (M, "lockstep", r["seed"]) in top]
        if arm != "lockstep" and paired:
            entry["points_vs_lockstep"] = _stats([100 * (r["eval_loss"] - lock["eval_loss"]) / r["dp_eval_loss"]
                                                  for r, lock in paired])
        out.append(entry)
    return out


def summarize(results: list[dict[str, Any]], Ms: list[int], horizons: list[float], arms: list[str],
              params: int, budget: float) -> dict[str, Any]:
    """The table (a row per seed, M, arm and horizon), the curves (per seed when there are several)
    and the spread over the seeds (:func:`spread`)."""
    seeds = sorted({r["seed"] for r in results})
    table, curves = [], {}
    for seed in seeds:
        tag = f" seed {seed}" if len(seeds) > 1 else ""
        _summarize_seed([r for r in results if r["seed"] == seed], Ms, horizons, arms, table, curves, tag)
    return {"parameters": params, "budget_tokens": budget, "horizons": horizons, "learners": Ms, "seeds": seeds,
            "how": "each (seed, M, arm, horizon) a separate run with its own schedule; ratio = arm / best data-parallel "
                   "at the same tokens and seed; token_efficiency = dp tokens / tokens the arm needs for dp's final loss; "
                   "dp_equivalent = tokens dp needs for the arm's final loss / the arm's tokens; spread: over the "
                   "seeds at the largest horizon, points_vs_lockstep = 100 x (arm - lockstep) / dp, paired by seed",
            "table": table, "spread": spread(table), "curves": curves,
            "dp_runs": [r for r in results if r["arm"].startswith("dp@")]}


def _summarize_seed(results: list[dict[str, Any]], Ms: list[int], horizons: list[float], arms: list[str],
                    table: list[dict[str, Any]], curves: dict[str, Any], tag: str) -> None:
    for M in Ms:
        dp_best: dict[float, dict[str, Any]] = {}
        for r in results:
            if r["M"] == M and r["arm"].startswith("dp@"):
                if r["h"] not in dp_best or r["eval_loss"] < dp_best[r["h"]]["eval_loss"]:
                    dp_best[r["h"]] = r
        dp_curve = [(dp_best[h]["tokens"], dp_best[h]["eval_loss"]) for h in horizons if h in dp_best]
        curves[f"M={M} dp{tag}"] = dp_curve
        for a in arms:
            rows = sorted((r for r in results if r["M"] == M and r["arm"] == a), key=lambda r: r["h"])
            if not rows:
                continue
            curve = [(r["tokens"], r["eval_loss"]) for r in rows]
            curves[f"M={M} {a}{tag}"] = curve
            eff, extrapolated = token_efficiency(dp_curve, curve)
            equivalent, eq_extrapolated = dp_equivalent(dp_curve, curve)
            for r in rows:
                dp_loss = dp_best[r["h"]]["eval_loss"]
                row = {**{k: v for k, v in r.items() if k != "wall_s"}, "dp_eval_loss": dp_loss,
                       "dp_lr_scale": dp_best[r["h"]]["lr_scale"], "loss_ratio": r["eval_loss"] / dp_loss,
                       "wall_s": r["wall_s"]}
                if r["h"] == max(horizons):
                    row.update({"token_efficiency": eff, "efficiency_extrapolated": extrapolated,
                                "dp_equivalent": equivalent, "dp_equivalent_extrapolated": eq_extrapolated})
                table.append(row)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ms = out["learners"]
    fig, axes = plt.subplots(1, len(Ms), figsize=(6 * len(Ms), 4.5), squeeze=False)
    for ax, M in zip(axes[0], Ms):
        for name, curve in out["curves"].items():
            if not name.startswith(f"M={M} ") or not curve:
                continue
            t, loss = zip(*curve)
            ax.plot([x / 1e6 for x in t], loss, marker="o", label=name.split(" ", 1)[1],
                    linewidth=2.5 if " dp" in name else 1.2, color="black" if " dp" in name else None)
        ax.set_xscale("log")
        ax.set_xlabel("tokens (millions, all learners together)")
        ax.set_ylabel("eval loss (global model)")
        ax.set_title(f"M = {M}, {out['parameters'] / 1e6:.2f}M parameters")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
