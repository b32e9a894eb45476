"""The fault-free baseline of a chaos run: the same job without chaos, for ``loss_ratio``.

Same settings and M learners on a fresh prefix of the same bucket, at equal tokens merged: its
``learner.max_steps`` is the chaos run's delivered learner steps (goodput x steps taken) over M, so
both runs merge about as many tokens, each over its own whole learning-rate schedule (the chaos run's
restarts and stragglers make it take more steps than its budget, and lose some). Run by
:class:`~ddiloco_geo.tools.local.LocalRun` (what ``ddiloco-geo local`` runs): no proxies, no
stragglers, no kills, no storage faults. Its children get the chaos run's environment (no
``DDILOCO_*`` variables: the settings file decides). It runs in a thread so the chaos run's hard
deadline still holds: past it, the baseline's processes are SIGKILLed and the report says
``baseline_error``. A failed baseline is reported, never raised: the chaos report stands on its own.

Adds to the report: ``baseline_store``, ``baseline_eval_loss``, ``loss_ratio`` (chaos final loss /
baseline final loss), ``loss_comparison`` (how the two are compared; both runs' learner steps taken and delivered), ``baseline_deltas_unaccounted`` and ``goodput_baseline`` (the same goodput
computation over the baseline's one incarnation per learner).
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


def run_baseline(settings: Settings, report: dict[str, Any], *, url: str, out: Path, env: Mapping[str, str],
                 deadline: float) -> None:
    """Run the baseline at ``url`` and add its figures to ``report``. ``deadline``: ``time.monotonic()``
    after which its processes are killed."""
    max_steps = equal_token_steps(report, settings)
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
        report["baseline_error"] = result.get("error", "timed out")
        return
    s = result["summary"]
    report["baseline_store"] = url
    report["baseline_eval_loss"] = s["final_eval_loss"]
    report["loss_ratio"] = round(report["final_eval_loss"] / s["final_eval_loss"], 4)
    baseline_steps = sum(int(l.get("steps") or 0) for l in s["learners"].values())
    report["baseline_deltas_unaccounted"] = s["deltas_unaccounted"]
    report["goodput_baseline"] = baseline_goodput(settings, s["learners"])
    report["loss_comparison"] = loss_comparison(report, baseline_steps, max_steps)


def delivered_steps(report: Mapping[str, Any]) -> float | None:
    """The chaos run's learner steps that reached a merged delta (goodput x steps taken), the measure
    of tokens merged; None without steps or a goodput."""
    steps, goodput = report.get("steps_taken"), report.get("goodput")
    return steps * goodput if steps and goodput is not None else None


def equal_token_steps(report: Mapping[str, Any], settings: Settings) -> int:
    """The baseline's ``learner.max_steps``: the chaos run's delivered learner steps over M (its own
    ``max_steps`` when the chaos report has no goodput)."""
    delivered = delivered_steps(report)
    return settings.learner.max_steps if delivered is None else max(1, round(delivered / settings.local.learners))


def loss_comparison(report: dict[str, Any], baseline_steps: int, baseline_max_steps: int | None = None) -> dict[str, Any]:
    """How ``loss_ratio`` compares the two runs: at the end of each, and how far apart in learner steps
    taken and in learner steps delivered (merged: goodput x steps), the measure of tokens merged."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a and b else None

    steps = report.get("steps_taken")
    delivered = delivered_steps(report)
    base_delivered = baseline_steps * report["goodput_baseline"] if report.get("goodput_baseline") is not None else None
    return {
        "how": "final eval loss of the global model (same held-out batches) over the fault-free run's, both after "
               "every learner ended its schedule, at equal tokens merged: the fault-free run's learner.max_steps "
               "(baseline_max_steps) is the chaos run's delivered learner steps (learner steps that reached a "
               "merged delta, goodput x steps) over M; delivered_ratio says how near equal they came",
        "baseline_max_steps": baseline_max_steps,
        "learner_steps": steps, "baseline_learner_steps": baseline_steps, "steps_ratio": ratio(steps, baseline_steps),
        "delivered_steps": None if delivered is None else round(delivered, 1),
        "baseline_delivered_steps": None if base_delivered is None else round(base_delivered, 1),
        "delivered_ratio": ratio(delivered, base_delivered)}


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
