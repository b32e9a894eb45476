"""The fault-free baseline of a chaos run: the same job without chaos, for ``loss_ratio``.

Same settings and M learners on a fresh prefix of the same bucket, at equal tokens merged. A run's
tokens merged are its delivered learner steps (goodput x steps taken). A fault-free run's final loss
is itself noisy: on the chaos testbed two runs at the same budget end 1-3% apart (the learners'
timing decides which deltas meet in which merge), as much as the 3% the chaos goal allows. So
``runs`` fault-free runs (``chaos --baseline-runs``, default :data:`BASELINE_RUNS`) each end their own
whole learning-rate schedule, each on its own prefix (``<prefix>``, ``<prefix>-2``, ...), and the
baseline's loss at the chaos run's delivered steps is a least-squares line through their (delivered
steps, final loss), with its standard error (:func:`equal_token_loss`). The first run's
``learner.max_steps`` is the chaos run's delivered steps over M; under ``learner.schedule=run``
faster learners run a little past the budget (3-10% on the chaos testbed), so each later run is aimed,
through the overshoot measured so far, where the runs' delivered steps average the target
(:func:`next_max_steps`), where the line is most precise. Run by
:class:`~ddiloco_geo.tools.local.LocalRun` (what ``ddiloco-geo local`` runs): no proxies, no
stragglers, no kills, no storage faults. Its children get the chaos run's environment (no
``DDILOCO_*`` variables: the settings file decides). It runs in a thread so the chaos run's hard
deadline still holds: past it, the baseline's processes are SIGKILLed and the report says
``baseline_error`` (a later run starts only when the time left is at least twice what the last
took). A failed baseline run is reported, never raised: the chaos report stands on its own, with
the runs that finished.

Adds to the report: ``baseline_store`` (the first run's), ``baseline_eval_loss`` (at the chaos
run's tokens merged), ``loss_ratio`` (chaos final loss / that), ``loss_comparison`` (how the two
are compared, each baseline run's steps, tokens and loss, the standard errors),
``baseline_deltas_unaccounted`` (summed over the baseline runs) and ``goodput_baseline`` (the first
run's goodput, the same computation over its one incarnation per learner).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
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

BASELINE_RUNS = 3  # fault-free runs per chaos run: the loss's standard error about 1/sqrt(3) of one run's spread
SPREAD = 0.15  # later runs are aimed within this share of the chaos run's delivered steps
FLAT = 0.02  # runs whose delivered steps span less than this share of the target: their mean, no slope


def run_baseline(settings: Settings, report: dict[str, Any], *, url: str, out: Path, env: Mapping[str, str],
                 deadline: float, runs: int = BASELINE_RUNS) -> None:
    """Run ``runs`` fault-free baselines (the first at ``url``, then ``url-2``, ...) and add their
    figures to ``report``. ``deadline``: ``time.monotonic()`` after which their processes are killed."""
    target, max_steps = delivered_steps(report), equal_token_steps(report, settings)
    done: list[dict[str, Any]] = []
    for attempt in range(1, max(1, runs) + 1):
        started = time.monotonic()
        suffix = "" if attempt == 1 else f"-{attempt}"
        run = _one_run(settings, max_steps, url=url + suffix, out=out.with_name(out.name + suffix), env=env,
                       deadline=deadline)
        if "error" in run:
            if not done:
                report["baseline_error"] = run["error"]
                return
            log.warning("chaos_baseline_run_failed run=%d error=%s: comparing with the %d before it",
                        attempt, run["error"], len(done))
            break
        done.append(run)
        again = next_max_steps(target, done, settings.local.learners)
        if attempt == runs or again is None or deadline - time.monotonic() < 2 * (time.monotonic() - started):
            break
        log.info("chaos_baseline_again run=%d delivered=%s target=%.1f max_steps=%d", attempt + 1,
                 run["delivered_steps"], target, again)
        max_steps = again
    first = done[0]
    loss, how, se = equal_token_loss([(r["delivered_steps"], r["eval_loss"]) for r in done], target)
    report["baseline_store"] = first["store"]
    report["baseline_eval_loss"] = loss
    report["loss_ratio"] = round(report["final_eval_loss"] / loss, 4)
    report["baseline_deltas_unaccounted"] = sum(r["deltas_unaccounted"] for r in done)
    report["goodput_baseline"] = first["goodput"]
    report["loss_comparison"] = loss_comparison(report, done, how, se)


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


def next_max_steps(target: float | None, runs: list[Mapping[str, Any]], learners: int) -> int | None:
    """``learner.max_steps`` of the next baseline run: aimed at the delivered steps that bring the
    runs' mean to the chaos run's ``target`` (within :data:`SPREAD` of it), where a line through
    their losses is most precise, through the overshoot of the runs so far (their delivered steps over
    M x max_steps: ``learner.schedule=run`` runs past the budget in proportion to it). None when the
    target or every run's delivered figure is unknown."""
    known = [r for r in runs if r.get("delivered_steps")]
    if not target or not known:
        return None
    overshoot = sum(r["delivered_steps"] / (learners * r["max_steps"]) for r in known) / len(known)
    aim = (len(known) + 1) * target - sum(r["delivered_steps"] for r in known)
    aim = min(max(aim, (1 - SPREAD) * target), (1 + SPREAD) * target)
    return max(1, round(aim / (learners * overshoot)))


def equal_token_loss(points: Iterable[tuple[float | None, float]], target: float | None
                     ) -> tuple[float, str, float | None]:
    """The baseline's final loss at ``target`` delivered steps from (delivered steps, final loss) of
    the runs, how it was taken, and its standard error (None when the runs cannot say):

    - ``fit``: the least-squares line through the runs, at the target, or at the nearer end of their
      span when the target lies outside it (never extrapolated: a slope from a few noisy losses a few
      percent apart in tokens would amplify their noise); standard error from the residuals (three
      runs or more);
    - ``mean``: runs whose delivered steps span less than :data:`FLAT` of the target say nothing
      about a slope: their mean, standard error s / sqrt(n);
    - ``single``: one run, or no target or delivered figures to compare: the first run's loss."""
    points = list(points)
    known = [p for p in points if p[0] is not None]
    if target is None or len(known) < 2:
        return points[0][1], "single", None
    n = len(known)
    xs, ys = [p[0] for p in known], [p[1] for p in known]
    if max(xs) - min(xs) < FLAT * target:
        return statistics.fmean(ys), "mean", statistics.stdev(ys) / n**0.5
    slope, intercept = statistics.linear_regression(xs, ys)
    at = min(max(target, min(xs)), max(xs))
    if n < 3:
        return intercept + slope * at, "fit", None
    mx = statistics.fmean(xs)
    s = math.sqrt(sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys)) / (n - 2))
    return intercept + slope * at, "fit", s * math.sqrt(1 / n + (at - mx) ** 2 / sum((x - mx) ** 2 for x in xs))


def loss_comparison(report: dict[str, Any], runs: list[dict[str, Any]], taken: str = "single",
                    se: float | None = None) -> dict[str, Any]:
    """How ``loss_ratio`` compares the chaos run with its baseline runs: at the end of each, and how
    far apart in learner steps taken and delivered (merged: goodput x steps), the measure of tokens
    merged. ``delivered_ratio`` is the chaos run's delivered steps over those the baseline loss stands
    for (the target, or the nearer end of the runs' span, when fitted; else the first run's);
    ``baseline_loss_se`` the standard error of the baseline's loss (:func:`equal_token_loss`) and
    ``loss_ratio_se`` what it makes of the ratio's (the chaos run's own run-to-run spread not
    included: one chaos run cannot measure it)."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a and b else None

    steps, delivered = report.get("steps_taken"), delivered_steps(report)
    first = runs[0]
    spans = [r["delivered_steps"] for r in runs if r["delivered_steps"] is not None]
    if taken in ("fit", "mean") and delivered is not None:
        base_delivered = delivered if taken == "mean" else min(max(delivered, min(spans)), max(spans))
    else:
        base_delivered = first["delivered_steps"]
    loss, final = report.get("baseline_eval_loss"), report.get("final_eval_loss")
    return {
        "how": "final eval loss of the global model (same held-out batches) over the fault-free runs', each after "
               "every learner ended its schedule, at equal tokens merged (learner steps that reached a merged delta, "
               "goodput x steps): the first fault-free run's learner.max_steps (baseline_max_steps) is the chaos run's "
               "delivered steps over M, each later one aimed so that the runs' delivered steps average the chaos "
               "run's; the fault-free loss is a least-squares line through the runs' (delivered steps, loss) at the "
               "chaos run's delivered steps (baseline_loss_taken 'fit'; never extrapolated: outside the runs' span, "
               "at its nearer end), their mean when their delivered steps span under "
               f"{FLAT:.0%} ('mean'), or one run's loss ('single'); baseline_loss_se is that loss's standard error; "
               "delivered_ratio says how near equal the compared tokens are",
        "baseline_max_steps": first["max_steps"],
        "learner_steps": steps, "baseline_learner_steps": first["learner_steps"],
        "steps_ratio": ratio(steps, first["learner_steps"]),
        "delivered_steps": None if delivered is None else round(delivered, 1),
        "baseline_delivered_steps": None if base_delivered is None else round(base_delivered, 1),
        "delivered_ratio": ratio(delivered, base_delivered),
        "baseline_loss_taken": taken,
        "baseline_loss_se": None if se is None else round(se, 4),
        "loss_ratio_se": None if se is None or not loss or not final else round(final / loss * se / loss, 4),
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
