"""The fault-free baseline of a chaos run: the same job without chaos, for ``loss_ratio``.

Same settings and M learners on a fresh prefix of the same bucket, at equal tokens merged. A run's
tokens merged are its delivered learner steps (goodput x steps taken). The first baseline's
``learner.max_steps`` is the chaos run's delivered steps over M; under ``learner.schedule=run``
faster learners run a little past the budget (3-10% on the chaos testbed), so when the first
baseline delivered more than ``TOLERANCE`` away from the chaos run, a second one runs (on its own
prefix, ``<prefix>-2``) aimed as far on the other side (:func:`next_max_steps`), and the baseline's
loss at the chaos run's delivered steps is interpolated between the two (:func:`equal_token_loss`). Each run
ends its own whole learning-rate schedule. Run by :class:`~ddiloco_geo.tools.local.LocalRun` (what
``ddiloco-geo local`` runs): no proxies, no stragglers, no kills, no storage faults. Its children
get the chaos run's environment (no ``DDILOCO_*`` variables: the settings file decides). It runs
in a thread so the chaos run's hard deadline still holds: past it, the baseline's processes are
SIGKILLed and the report says ``baseline_error`` (a second baseline starts only when the time left
is at least twice what the first took). A failed baseline is reported, never raised: the chaos
report stands on its own.

Adds to the report: ``baseline_store`` (the first run's), ``baseline_eval_loss`` (at the chaos
run's tokens merged), ``loss_ratio`` (chaos final loss / that), ``loss_comparison`` (how the two
are compared, each baseline run's steps, tokens and loss), ``baseline_deltas_unaccounted`` (summed
over the baseline runs) and ``goodput_baseline`` (the first run's goodput, the same computation
over its one incarnation per learner).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ddiloco_geo import protocol
from ddiloco_geo.core import layout
from ddiloco_geo.core.config import Settings
from ddiloco_geo.core.errors import NotFoundError
from ddiloco_geo.storage import open_store
from ddiloco_geo.tools.chaos.goals import compute_goodput
from ddiloco_geo.tools.local import LocalRun

log = logging.getLogger(__name__)

TOLERANCE = 0.015  # a baseline within 1.5% of the chaos run's delivered steps needs no second run


def run_baseline(settings: Settings, report: dict[str, Any], *, url: str, out: Path, env: Mapping[str, str],
                 deadline: float) -> None:
    """Run the baseline at ``url`` (and, if it missed the chaos run's tokens merged, a second one at
    ``url + '-2'``) and add its figures to ``report``. ``deadline``: ``time.monotonic()`` after which
    their processes are killed."""
    target, max_steps = delivered_steps(report), equal_token_steps(report, settings)
    runs: list[dict[str, Any]] = []
    for attempt in (1, 2):
        started = time.monotonic()
        run = _one_run(settings, max_steps, url=url if attempt == 1 else f"{url}-2",
                       out=out if attempt == 1 else out.with_name(f"{out.name}-2"), env=env, deadline=deadline)
        if "error" in run:
            if not runs:
                report["baseline_error"] = run["error"]
                return
            log.warning("chaos_baseline_second_run_failed error=%s: comparing with the first alone", run["error"])
            break
        runs.append(run)
        again = next_max_steps(target, run, max_steps)
        if attempt == 2 or again is None or deadline - time.monotonic() < 2 * (time.monotonic() - started):
            break
        log.info("chaos_baseline_again delivered=%s target=%.1f max_steps=%d", run["delivered_steps"], target, again)
        max_steps = again
    first = runs[0]
    loss, how = equal_token_loss([(r["delivered_steps"], r["eval_loss"]) for r in runs], target)
    report["baseline_store"] = first["store"]
    report["baseline_eval_loss"] = loss
    report["loss_ratio"] = round(report["final_eval_loss"] / loss, 4)
    report["baseline_deltas_unaccounted"] = sum(r["deltas_unaccounted"] for r in runs)
    report["goodput_baseline"] = first["goodput"]
    report["loss_comparison"] = loss_comparison(report, runs, how)


def _one_run(settings: Settings, max_steps: int, *, url: str, out: Path, env: Mapping[str, str],
             deadline: float) -> dict[str, Any]:
    """One fault-free run: its store, max_steps, learner steps taken and delivered, final loss,
    unaccounted deltas and goodput; or ``{"error": ...}``."""
    settings = settings.model_copy(update={
        "storage": settings.storage.model_copy(update={"url": url}),
        "local": settings.local.model_copy(update={"out": str(out)}),
        "learner": settings.learner.model_copy(update={"max_steps": max_steps}),
    })
    log.info("chaos_baseline_start store=%s max_steps=%d", url, max_steps)
    lr = LocalRun(settings, eval_every_s=0, live=False, env=env)
    result: dict[str, Any] = {}

    def go() -> None:
        try:
            result["summary"] = lr.run()
        except Exception as exc:  # reported, not raised: the chaos report stands on its own
            result["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=go, name="baseline", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(1.0)
        if time.monotonic() > deadline:
            log.error("chaos_baseline_timeout: killing its processes")
            lr.kill_all()
            thread.join(60)
            break
    if "summary" not in result:
        return {"error": result.get("error", "timed out")}
    s = result["summary"]
    steps = sum(int(l.get("steps") or 0) for l in s["learners"].values())
    goodput = baseline_goodput(settings, s["learners"])
    return {"store": url, "max_steps": max_steps, "learner_steps": steps,
            "delivered_steps": None if goodput is None else round(steps * goodput, 1),
            "eval_loss": s["final_eval_loss"], "deltas_unaccounted": s["deltas_unaccounted"], "goodput": goodput}


def delivered_steps(report: Mapping[str, Any]) -> float | None:
    """The chaos run's learner steps that reached a merged delta (goodput x steps taken), the measure
    of tokens merged; None without steps or a goodput."""
    steps, goodput = report.get("steps_taken"), report.get("goodput")
    return steps * goodput if steps and goodput is not None else None


def equal_token_steps(report: Mapping[str, Any], settings: Settings) -> int:
    """The first baseline's ``learner.max_steps``: the chaos run's delivered learner steps over M (its
    own ``max_steps`` when the chaos report has no goodput)."""
    delivered = delivered_steps(report)
    return settings.learner.max_steps if delivered is None else max(1, round(delivered / settings.local.learners))


def next_max_steps(target: float | None, run: Mapping[str, Any], max_steps: int) -> int | None:
    """``max_steps`` of a second baseline, aimed at the mirror image of ``run`` (the first, at
    ``max_steps``) across the chaos run's delivered steps ``target``: scaled by (target / delivered)²,
    so that the target lies between the two runs (the overshoot of ``learner.schedule=run`` scales
    with the budget) and the loss interpolated there averages both; None when the first came within
    ``TOLERANCE``, or either figure is unknown, or the scaled value rounds to the same."""
    got = run.get("delivered_steps")
    if not target or not got or abs(got / target - 1) <= TOLERANCE:
        return None
    again = max(1, round(max_steps * (target / got) ** 2))
    return None if again == max_steps else again


def equal_token_loss(points: Iterable[tuple[float | None, float]], target: float | None) -> tuple[float, str]:
    """The baseline's final loss at ``target`` delivered steps, from (delivered steps, final loss)
    of one or two runs, and how it was taken: ``interpolated`` (linear between two runs on either
    side of the target), else ``nearest`` (the run nearest the target: no extrapolation, which two
    noisy losses a few percent apart in tokens would amplify), or ``single`` (one run, or no
    delivered figures to compare)."""
    points = list(points)
    known = sorted(p for p in points if p[0] is not None)
    if target is None or len(known) < 2:
        return points[0][1], "single"
    (x0, y0), (x1, y1) = known[0], known[-1]
    if x0 <= target <= x1 and x1 > x0:
        return y0 + (y1 - y0) * (target - x0) / (x1 - x0), "interpolated"
    return _nearest(known, target)[1], "nearest"


def _nearest(points: Iterable[tuple[float, float]], target: float) -> tuple[float, float]:
    """The (delivered steps, loss) point whose delivered steps are nearest ``target``."""
    return min(points, key=lambda p: abs(p[0] - target))


def loss_comparison(report: dict[str, Any], runs: list[dict[str, Any]], taken: str = "single") -> dict[str, Any]:
    """How ``loss_ratio`` compares the chaos run with its baseline runs: at the end of each, and how
    far apart in learner steps taken and delivered (merged: goodput x steps), the measure of tokens
    merged. ``delivered_ratio`` is the chaos run's delivered steps over those the baseline loss stands
    for: the target itself when interpolated, else the run taken's."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a and b else None

    steps, delivered = report.get("steps_taken"), delivered_steps(report)
    first = runs[0]
    if taken == "interpolated":
        base_delivered = delivered
    elif taken == "nearest":
        base_delivered = _nearest([(r["delivered_steps"], r["eval_loss"]) for r in runs
                                   if r["delivered_steps"] is not None], delivered)[0]
    else:
        base_delivered = first["delivered_steps"]
    return {
        "how": "final eval loss of the global model (same held-out batches) over the fault-free run's, both after "
               "every learner ended its schedule, at equal tokens merged (learner steps that reached a merged delta, "
               "goodput x steps): the first fault-free run's learner.max_steps (baseline_max_steps) is the chaos run's "
               f"delivered steps over M; when it delivered more than {TOLERANCE:.1%} away from them, a second run aimed "
               "as far on the other side, and the fault-free loss interpolated between the two at the chaos run's "
               "delivered steps (baseline_loss_taken; never extrapolated: outside the two, the nearer); delivered_ratio "
               "says how near equal the compared tokens are",
        "baseline_max_steps": first["max_steps"],
        "learner_steps": steps, "baseline_learner_steps": first["learner_steps"],
        "steps_ratio": ratio(steps, first["learner_steps"]),
        "delivered_steps": None if delivered is None else round(delivered, 1),
        "baseline_delivered_steps": None if base_delivered is None else round(base_delivered, 1),
        "delivered_ratio": ratio(delivered, base_delivered),
        "baseline_loss_taken": taken,
        "baseline_runs": [{k: r[k] for k in ("store", "max_steps", "learner_steps", "delivered_steps", "eval_loss")}
                          for r in runs]}


def baseline_goodput(settings: Settings, learners: Iterable[str]) -> float | None:
    """Goodput of the baseline run: one incarnation per learner, from step 0 to its exit record's step."""
    store = open_store(settings.storage)
    try:
        spec = protocol.load_spec(store)
        incs, merged = {}, []
        for lid in learners:
            try:
                rec = json.loads(store.get(layout.exit_key(lid)))
            except (NotFoundError, ValueError):
                continue
            incs[lid] = [{"s0": 0, "s1": int(rec["step"]), "first_seq": 0, "parent": None}]
        for r in protocol.merge_records(store):
            for e in r.get("merged", []):
                h = protocol.read_header(store, e["key"])
                merged.append({"learner": h.learner, "seq": h.seq, "fragment": h.fragment,
                               "num_steps": h.num_steps, "step": int(h.extra.get("step", 0))})
        gp = compute_goodput(incs, merged, spec.plan.num_fragments)
        return None if gp["goodput"] is None else round(gp["goodput"], 4)
    finally:
        store.close()
