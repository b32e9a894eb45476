"""``ddiloco-geo simulate``: goodput, sensitivity, heterogeneity, scavenging and bandwidth.

Modes (positional, default ``goodput``):

``goodput``      dp vs elastic_dp vs ddiloco over a grid of chip counts and M (closed forms,
                 :mod:`ddiloco_geo.tools.sim.goodput`); ``--calibrate`` re-solves the two unknown
                 constants from the paper's two headline cells.
``sensitivity``  each fixed constant ×0.5 and ×1.5 (re-calibrated), each fitted one unrecalibrated:
                 the change of every cell in goodput points.
``hetero``       4 full-speed + 4 slower learners, K=M vs K=1 vs K=1+grace.
``scavenge``     part-time extra learners vs a DP job that must reconfigure.
``bandwidth``    WAN bandwidth per learner for utilization targets, bytes and egress $.

``--json`` prints only JSON on stdout (a list of rows; for ``--calibrate`` one object); progress
goes to stderr; charts are written as PNG under ``--out`` (default ``out/sim``) unless ``--no-chart``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ddiloco_geo.tools.sim import chart
from ddiloco_geo.tools.sim.bandwidth import DEFAULT_UTILIZATION, BandwidthModel, bandwidth_rows
from ddiloco_geo.tools.sim.calibrate import calibrate
from ddiloco_geo.tools.sim.chart import goodput_chart
from ddiloco_geo.tools.sim.goodput import DEFAULT_CHIPS, DEFAULT_LEARNERS, ClusterModel, simulate_grid
from ddiloco_geo.tools.sim.hetero import HeteroConfig, simulate_hetero
from ddiloco_geo.tools.sim.scavenge import DEFAULT_EXTRA_RATIOS, ScavengeConfig, scavenge_rows
from ddiloco_geo.tools.sim.sensitivity import sensitivity_rows

MODES = ("goodput", "sensitivity", "hetero", "scavenge", "bandwidth")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(float(x)) for x in text.split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", nargs="?", choices=MODES, default="goodput", help="what to simulate (default goodput)")
    p.add_argument("--out", default="out/sim", metavar="DIR", help="where PNG charts go (default out/sim)")
    p.add_argument("--no-chart", action="store_true", help="do not write PNG charts")
    p.add_argument("--seed", type=int, default=0, help="seed of the failure traces / step times")
    g = p.add_argument_group("goodput")
    g.add_argument("--chips", type=_ints, default=DEFAULT_CHIPS, help="comma list, e.g. 150000,1200000")
    g.add_argument("--learners", type=_ints, default=DEFAULT_LEARNERS, help="comma list of M, e.g. 2,4,8,16")
    g.add_argument("--calibrate", action="store_true", help="solve the unknown constants from the paper's targets")
    d = ClusterModel()
    g.add_argument("--mtbi-days", type=float, default=d.mtbi_days, help="mean time between interruptions per chip")
    g.add_argument("--slice-chips", type=int, default=d.slice_chips, help="chips per slice (unit of failure)")
    g.add_argument("--detect-s", type=float, default=d.detect_s, help="time to notice a failure")
    g.add_argument("--repair-s", "--repair-mean-s", type=float, default=d.repair_s, dest="repair_s",
                   help="time a failed slice stays out of service")
    g.add_argument("--downscale-s", type=float, default=d.downscale_s, help="elastic downscale pause")
    g.add_argument("--upscale-s", type=float, default=d.upscale_s, help="elastic upscale pause")
    g.add_argument("--restart-s", type=float, default=d.restart_s, help="DP restart: reschedule, reload, recompile")
    g.add_argument("--ckpt-s", type=float, default=d.ckpt_s, help="blocking time of one DP checkpoint")
    g.add_argument("--spare-sigmas", type=float, default=d.spare_sigmas, help="DP spare pool margin (std devs)")
    g.add_argument("--step-cv", type=float, default=d.step_cv, help="per-slice step-time coefficient of variation")
    g.add_argument("--quorum", type=int, default=d.quorum, help="minimum quorum K")
    g.add_argument("--horizon-hours", type=float, default=d.horizon_s / 3600, help="horizon of the event-simulation check (the closed forms do not use it)")
    g.add_argument("--step-s", type=float, default=None,
                   help="step time in s (goodput: the step in flight lost per failure, default 2; "
                        "bandwidth/scavenge: overrides the FLOPs-derived step)")
    h = p.add_argument_group("hetero")
    hc = HeteroConfig()
    h.add_argument("--fast-learners", type=int, default=hc.fast_learners)
    h.add_argument("--slow-learners", type=int, default=hc.slow_learners)
    h.add_argument("--slow-factor", type=float, default=hc.slow_factor, help="slow step time / fast step time")
    h.add_argument("--slow-cv", type=float, default=hc.slow_cv, help="step-time variance of the slow learners")
    h.add_argument("--fast-cv", type=float, default=hc.fast_cv)
    h.add_argument("--gamma", type=float, default=hc.gamma, help="grace safety factor γ")
    h.add_argument("--sync-s", type=float, default=hc.sync_s, help="transfer + merge time, in steps")
    s = p.add_argument_group("scavenge")
    sc = ScavengeConfig()
    s.add_argument("--extra-ratios", type=_floats, default=DEFAULT_EXTRA_RATIOS, help="e.g. 0.25,0.5,1,3")
    s.add_argument("--extra-hours", type=float, default=sc.extra_hours, help="hours per period the extra fleet is up")
    s.add_argument("--period-hours", type=float, default=sc.period_hours)
    s.add_argument("--budget-base-hours", type=float, default=sc.budget_base_hours,
                   help="token budget, in hours of the base fleet alone")
    s.add_argument("--wan-gbps", type=float, default=sc.wan_gbps, help="cross-region link of a DP job (0: none)")
    b = p.add_argument_group("bandwidth")
    bm = BandwidthModel()
    b.add_argument("--params", type=float, default=bm.params, help="model parameters, e.g. 10e9")
    b.add_argument("--layers", type=int, default=bm.layers)
    b.add_argument("--tokens-per-step", type=float, default=bm.tokens_per_step)
    b.add_argument("--chips-per-learner", type=int, default=bm.chips_per_learner)
    b.add_argument("--peak-tflops", type=float, default=bm.peak_tflops)
    b.add_argument("--mfu", type=float, default=bm.mfu)
    b.add_argument("--H", type=int, default=bm.H, dest="H")
    b.add_argument("--P", type=int, default=bm.P, dest="P")
    b.add_argument("--tau", type=int, default=bm.tau)
    b.add_argument("--precision", default=bm.precision, help="DDiLoCo wire precision (fp32, bf16, fp8, int4, ...)")
    b.add_argument("--dp-precision", default=bm.dp_precision, help="DP gradient precision")
    b.add_argument("--sites", type=int, default=bm.sites, help="learners / DP sites in the ring")
    b.add_argument("--dp-overlap-steps", type=int, default=bm.dp_overlap_steps)
    b.add_argument("--rtt-ms", type=float, default=bm.rtt_ms)
    b.add_argument("--utilization", type=_floats, default=DEFAULT_UTILIZATION, help="targets, e.g. 0.5,0.9,0.99")
    b.add_argument("--egress-usd-per-gb", type=float, default=bm.egress_usd_per_gb)


def cluster_model(args: argparse.Namespace) -> ClusterModel:
    return ClusterModel(
        mtbi_days=args.mtbi_days, slice_chips=args.slice_chips, detect_s=args.detect_s,
        repair_s=args.repair_s, downscale_s=args.downscale_s, upscale_s=args.upscale_s,
        restart_s=args.restart_s, ckpt_s=args.ckpt_s, spare_sigmas=args.spare_sigmas, step_s=args.step_s or 2.0, step_cv=args.step_cv,
        quorum=args.quorum, horizon_s=args.horizon_hours * 3600)


def bandwidth_model(args: argparse.Namespace) -> BandwidthModel:
    return BandwidthModel(
        params=args.params, layers=args.layers, tokens_per_step=args.tokens_per_step,
        chips_per_learner=args.chips_per_learner, peak_tflops=args.peak_tflops, mfu=args.mfu,
        step_s=args.step_s, H=args.H, P=args.P, tau=args.tau, precision=args.precision,
        dp_precision=args.dp_precision, sites=args.sites, dp_overlap_steps=args.dp_overlap_steps,
        rtt_ms=args.rtt_ms, egress_usd_per_gb=args.egress_usd_per_gb)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    out = Path(args.out)
    if args.mode == "goodput" and args.calibrate:
        _say("simulate: calibrating (closed form) ...")
        result = calibrate(cluster_model(args))
        _emit(args, result, None)
        return 0
    if args.mode == "goodput":
        model = cluster_model(args)
        chips = tuple(args.chips)
        done = []

        def progress(n: int) -> None:
            done.append(n)
            _say(f"simulate: {len(done)}/{len(chips)} chip counts done ({n:,} chips, "
                 f"{time.monotonic() - started:.1f}s)")

        rows = simulate_grid(chips, tuple(args.learners), model, progress)
        chart = None
        if not args.no_chart:
            chart = goodput_chart(rows, out / "goodput.png",
                                  f"Goodput under failures (MTBI {model.mtbi_days:g} days/chip, K={model.quorum})")
    elif args.mode == "sensitivity":
        rows = sensitivity_rows(cluster_model(args), tuple(args.chips), tuple(args.learners))
        chart = None if args.no_chart else _chart("sensitivity_chart", rows, out / "sensitivity.png")
    elif args.mode == "hetero":
        cfg = HeteroConfig(fast_learners=args.fast_learners, slow_learners=args.slow_learners,
                           slow_factor=args.slow_factor, slow_cv=args.slow_cv, fast_cv=args.fast_cv,
                           tau=args.tau, fragments=args.P, sync_s=args.sync_s, gamma=args.gamma)
        _say("simulate hetero: K=M, K=1, K=1+grace ...")
        rows = simulate_hetero(cfg, args.seed)
        chart = None if args.no_chart else _chart("hetero_chart", rows, out / "hetero.png")
    elif args.mode == "scavenge":
        cfg = ScavengeConfig(extra_hours=args.extra_hours, period_hours=args.period_hours,
                             budget_base_hours=args.budget_base_hours, H=args.H, wan_gbps=args.wan_gbps,
                             join_s=args.upscale_s, reconfig_s=args.restart_s, bandwidth=bandwidth_model(args))
        rows = scavenge_rows(cfg, tuple(args.extra_ratios))
        chart = None if args.no_chart else _chart("scavenge_chart", rows, out / "scavenge.png")
    else:
        rows = bandwidth_rows(bandwidth_model(args), tuple(args.utilization))
        chart = None if args.no_chart else _chart("bandwidth_chart", rows, out / "bandwidth.png")
    if chart:
        _say(f"simulate: chart written to {chart}")
    _say(f"simulate: {args.mode} done in {time.monotonic() - started:.2f}s")
    _emit(args, rows, chart)
    return 0


def _chart(name: str, rows: list[dict], path: Path) -> Path:
    return getattr(chart, name)(rows, path)


def _emit(args: argparse.Namespace, result, chart) -> None:
    if args.json:
        print(json.dumps(result, indent=2))
        return
    if isinstance(result, dict):
        print(json.dumps(result, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"simulate {args.mode}")
    keys = list(result[0])
    for k in keys:
        table.add_column(k, justify="left" if isinstance(result[0][k], str) else "right")
    for r in result:
        table.add_row(*[_fmt(k, r[k]) for k in keys])
    Console().print(table)


def _fmt(key: str, value) -> str:
    if value is None:
        return "unattainable"
    if key in ("goodput", "uptime", "merged_work_ratio") and isinstance(value, float):
        return f"{100 * value:.1f}%"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
        return f"{value:,}"
    return str(value)
