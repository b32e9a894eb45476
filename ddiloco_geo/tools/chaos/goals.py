"""What a chaos run measures and the goals it is judged by (pure functions; unit-tested).

Definitions (also in ``docs/chaos.md``):

``downtime_s``   time during which at least one learner had joined and not yet stopped, yet no
                 learner was stepping (a learner steps between two of its heartbeats whose step
                 advanced) -- :func:`compute_downtime`;
``stalls``       stretches longer than ``STALL_PERIODS`` fragment periods (H x median step time)
                 and than ``STALL_GAPS`` of the syncer's own median gaps between publishes, with no
                 version published while a syncer was serving and a delivered delta was waiting
                 (a learner's heartbeat shows more deltas sent than merge and rejection records
                 account for at that time) -- :func:`find_stalls`, :func:`stall_period`,
                 :func:`unaccounted_deliveries`;
``goodput``      share of learner steps whose work reached a merged delta: per learner incarnation
                 and fragment, the steps up to the highest step covered by a merged delta, over
                 P x steps taken -- :func:`compute_goodput`;
``restart_to_first_merge``  restart -> ``published_at`` of the first merge record holding a delta
                 of the new incarnation -- :func:`first_merge_after`.

:func:`goals` turns a report into pass/fail: completed, zero downtime, no stalls, a balanced
ledger (written = merged + rejected, none unaccounted), every restarted learner merged again, no
process failed, and the final loss within ``LOSS_GOAL`` of the fault-free baseline when there is one.

Every threshold is relative to what the run itself measured (the learners' step times, the
syncer's publish cadence), never a wall-clock constant: a machine whose CPUs are taken by other
work slows every step and every merge, and that alone is neither downtime nor a stall. Zero
downtime means no interval in which every live learner stopped for longer than ``STEP_PATIENCE``
of its median step times (``downtime_s`` itself is reported unfiltered).
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from ddiloco_geo.core import layout

LOSS_GOAL = 1.03          # chaos final loss within 3 % of the fault-free baseline
STALL_PERIODS = 3.0       # a stall: longer than this many fragment periods without a publish ...
STALL_GAPS = 5.0          # ... and than this many of the syncer's own median gaps between publishes
STEP_PATIENCE = 3.0       # a downtime interval shorter than this many median step times is a slow step


# --- interval arithmetic -------------------------------------------------------------------------


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged, non-empty intervals covering the same points."""
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract(base: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``union(base)`` minus ``union(cut)``."""
    out = []
    cut = union(cut)
    for a, b in union(base):
        cur = a
        for c, d in cut:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
            if cur >= b:
                break
        if cur < b:
            out.append((cur, b))
    return out


def measure(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union."""
    return sum(b - a for a, b in union(intervals))


# --- what a run measures -------------------------------------------------------------------------


def compute_downtime(series: list[dict[str, Any]], gap_s: float = 10.0) -> tuple[float, list[tuple[float, float]]]:
    """Global downtime from heartbeat observations of every learner incarnation.

    ``series``: one dict per incarnation with ``obs`` = [(heartbeat time, step), ...] (running
    heartbeats only, in time order), ``end`` (when it stopped counting as alive: the signal time, its
    last step at ``max_steps``, or its exit; default its last observation) and optionally
    ``signalled_at`` and ``first_stepped`` (its first heartbeat already says it has taken a step: a
    step time). An incarnation is alive from its first heartbeat (after joining) to ``end``; it is
    stepping between two consecutive observations whose step advanced (at most ``gap_s`` before the
    later one, so a long silence is not taken for progress), and, if it was signalled while stepping
    (its last two observations advanced, or its only one was ``first_stepped``: chaos seed 39 killed
    a learner 0.3 s after the one heartbeat it wrote, before the others' first, and that read as
    downtime), from its last observation up to the signal (at most ``gap_s``). Downtime is the time
    some incarnation was alive and none was stepping. Returns (seconds, intervals).
    """
    alive, stepping = [], []
    for s in series:
        obs = sorted(s.get("obs") or [])
        if not obs:
            continue
        end = s.get("end")
        end = obs[-1][0] if end is None else end
        alive.append((obs[0][0], end))
        for (t0, s0), (t1, s1) in zip(obs, obs[1:]):
            if s1 > s0:
                stepping.append((max(t0, t1 - gap_s), t1))
        sig = s.get("signalled_at")
        was_stepping = obs[-1][1] > obs[-2][1] if len(obs) >= 2 else bool(s.get("first_stepped"))
        if sig is not None and was_stepping:
            stepping.append((obs[-1][0], min(sig, obs[-1][0] + gap_s)))
    down = subtract(alive, stepping)
    return sum(b - a for a, b in down), down


def find_stalls(publish_times: list[float], delivery_times: list[float], syncer_up: list[tuple[float, float]],
                period_s: float, factor: float = STALL_PERIODS) -> list[dict[str, float]]:
    """Stretches longer than ``factor`` fragment periods with no version published while a syncer
    was serving and delivered work was waiting.

    Within each stretch of syncer uptime, between two consecutive publishes (or the stretch's
    ends), work waits from the first delta delivered after the earlier publish (from the start of
    the stretch if a delta delivered since the last publish before it was already waiting). A
    stall is such a wait that lasts longer than ``factor * period_s`` before the next publish (or
    the end of the stretch).
    """
    pubs = sorted(publish_times)
    deliveries = sorted(delivery_times)
    limit = factor * period_s
    stalls = []

    def first_delivery(after: float, before: float) -> float | None:
        i = bisect.bisect_right(deliveries, after)
        return deliveries[i] if i < len(deliveries) and deliveries[i] < before else None

    for u0, u1 in union(syncer_up):
        inside = [p for p in pubs if u0 < p < u1]
        bounds = [u0, *inside, u1]
        for i, (x, y) in enumerate(zip(bounds, bounds[1:])):
            waiting = first_delivery(x, y)
            if i == 0:
                j = bisect.bisect_right(pubs, u0)
                last_pub = pubs[j - 1] if j else -math.inf
                k = bisect.bisect_right(deliveries, last_pub)
                if k < len(deliveries) and deliveries[k] <= u0:
                    waiting = u0
            if waiting is not None and y - waiting > limit:
                stalls.append({"start": waiting, "end": y, "length_s": y - waiting, "limit_s": limit})
    return stalls


def unaccounted_deliveries(sent_seen: list[tuple[float, int]], keys: list[str],
                           accounted_at: dict[str, float]) -> list[float]:
    """Times at which one learner incarnation is seen to have delivered work still waiting.

    ``sent_seen``: (time, deltas sent so far) at each observation where its count grew; ``keys``:
    the incarnation's delta keys; ``accounted_at``: key -> when a syncer accounted for it (the
    publish time of the merge record that merged or superseded it; ``-inf`` if it was rejected: it
    waits for no publish). A heartbeat is seen up to a heartbeat interval after the upload, so a
    delta can be merged before it is "seen": such an observation is not waiting work (at the end of
    a run it was once counted as a stall until the syncer stopped)."""
    out = []
    for t, sent in sent_seen:
        done = sum(1 for k in keys if accounted_at.get(k, math.inf) <= t)
        if done < sent:
            out.append(t)
    return out


def compute_goodput(incarnations: dict[str, list[dict[str, Any]]], merged: list[dict[str, Any]],
                    num_fragments: int) -> dict[str, Any]:
    """Share of learner compute (steps) that ended up in a merged delta.

    ``incarnations[learner]``: its processes in start order, each with ``s0`` (step it started or
    resumed at), ``s1`` (its last step), ``first_seq`` (first delta sequence number it wrote) and
    ``parent`` (index of the incarnation whose checkpoint it resumed from, or None).
    ``merged``: every merged delta (superseded ones are contained in a merged one) with
    ``learner``, ``seq``, ``fragment``, ``step`` (the learner's step counter when it was taken) and
    ``num_steps`` (steps since the learner last adopted that fragment): it covers steps
    (step - num_steps, step] of its fragment; steps at or below its incarnation's ``s0`` belong to
    the incarnation whose checkpoint was resumed (the counters were restored with it).

    For each incarnation k and fragment p, the steps up to the highest step whose fragment-p work
    is covered by a merged delta are delivered (the tau-step overlap between a send and the next
    adoption counts as delivered: it is the algorithm's own cost, the same without faults); the rest
    (work lost to a SIGKILL, or in deltas that were rejected or never merged) is lost.
    goodput = delivered / (P x steps taken), overall and per learner.
    """
    high: dict[tuple[str, int, int], int] = {}
    for d in merged:
        incs = incarnations.get(d["learner"])
        if not incs:
            continue
        k = max((i for i, inc in enumerate(incs) if inc["first_seq"] <= d["seq"]), default=0)
        hi, lo = int(d["step"]), int(d["step"]) - int(d["num_steps"])
        seen = set()
        while k is not None and k not in seen:
            seen.add(k)
            inc = incs[k]
            top = min(hi, inc["s1"])
            if top > inc["s0"]:
                slot = (d["learner"], k, int(d["fragment"]))
                high[slot] = max(high.get(slot, inc["s0"]), top)
            if lo >= inc["s0"] or inc.get("parent") is None:
                break
            hi, k = inc["s0"], inc["parent"]
    by_learner = {}
    taken_all = delivered_all = 0
    for learner, incs in incarnations.items():
        taken = sum(max(0, inc["s1"] - inc["s0"]) for inc in incs)
        delivered = sum(high.get((learner, k, p), inc["s0"]) - inc["s0"]
                        for k, inc in enumerate(incs) for p in range(num_fragments))
        by_learner[learner] = {"steps_taken": taken, "fragment_steps_delivered": delivered,
                               "goodput": delivered / (num_fragments * taken) if taken else None}
        taken_all += taken
        delivered_all += delivered
    return {"goodput": delivered_all / (num_fragments * taken_all) if taken_all else None,
            "steps_taken": taken_all, "fragment_steps_delivered": delivered_all, "by_learner": by_learner}


def first_merge_after(records: list[dict[str, Any]], learner: str, first_seq: int) -> float | None:
    """``published_at`` of the first merge record holding a delta of ``learner`` with seq >= first_seq."""
    times = []
    for r in records:
        if r.get("kind") != "merge" or r.get("published_at") is None:
            continue
        seqs = [e["seq"] for e in r.get("merged", []) if e.get("learner") == learner]
        for key in r.get("superseded", []):
            try:
                dk = layout.parse_delta_key(key)
            except layout.LayoutError:
                continue
            if dk.learner == learner:
                seqs.append(dk.seq)
        if any(s >= first_seq for s in seqs):
            times.append(float(r["published_at"]))
    return min(times) if times else None


# --- the goals -----------------------------------------------------------------------------------


def stall_period(sync_every: int, step_s: float, publish_times: list[float]) -> float:
    """The period stalls are measured in: a fragment period (H x median step time), or the
    syncer's own median gap between publishes x STALL_GAPS / STALL_PERIODS if that is longer."""
    pubs = sorted(publish_times)
    gaps = sorted(b - a for a, b in zip(pubs, pubs[1:]) if b > a)
    median_gap = gaps[len(gaps) // 2] if gaps else 0.0
    return max(sync_every * step_s, median_gap * STALL_GAPS / STALL_PERIODS)


def real_downtime(intervals: list[tuple[float, float]], step_s: float) -> list[tuple[float, float]]:
    """Downtime intervals longer than STEP_PATIENCE median step times (shorter ones are a slow step)."""
    return [(a, b) for a, b in intervals if b - a > STEP_PATIENCE * step_s]


def goals(report: dict[str, Any]) -> dict[str, bool]:
    """Goal name -> met, for a report (``loss_within_3pct`` only when there is a baseline)."""
    step_s = report.get("step_s_median") or 0.0
    out = {
        "completed": not report["timed_out"],
        "zero_downtime": report["downtime_s"] == 0 or not real_downtime(
            [tuple(iv) for iv in report.get("downtime_intervals", [])], step_s),
        "no_stalls": not report["stalls"],
        "ledger_balanced": report["deltas_unaccounted"] == 0 and report["deltas_written"]
        == report["deltas_merged"] + report["deltas_rejected"],
        "restarted_learners_merged": all(report["restarted_merged_after_restart"].values()),
        "no_process_failed": not report["processes_failed"],
    }
    if report.get("loss_ratio") is not None:
        out["loss_within_3pct"] = report["loss_ratio"] <= LOSS_GOAL
    return out
