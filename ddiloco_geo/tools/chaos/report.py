"""The chaos report: what the supervisor saw, joined with what the bucket says.

Read from the bucket: the ledger (``protocol.ledger``: written = merged (incl. superseded) +
rejected, none unaccounted), the merge records, every delta's header (learner, seq, fragment,
step, num_steps), the learners' exit records, the final global model (evaluated). From the
supervisor: every process incarnation (start, signal, exit, resume point, heartbeat observations),
the events, the actions' outcomes, the syncer's retry counters.

Computed (definitions in :mod:`ddiloco_geo.tools.chaos.goals` and ``docs/chaos.md``): downtime
and its intervals, stalls, goodput per learner, and recovery times (``notice_to_exit``,
``restart_to_first_step``, ``restart_to_first_merge``, ``syncer_start_to_ready``,
``syncer_restart_to_first_publish``, ``syncer_drain``). Times in the report are seconds since the
run started. The per-incarnation heartbeat series is written to ``OUT/heartbeats.json``.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ddiloco_geo import protocol
from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import CodecError, NotFoundError, StorageError
from ddiloco_geo.storage import Store
from ddiloco_geo.tools.chaos.goals import (
    compute_downtime, compute_goodput, find_stalls, first_merge_after, stall_period, unaccounted_deliveries,
)
from ddiloco_geo.tools.chaos.supervisor import Proc, Supervisor
from ddiloco_geo.tools.chaos.testbed import Testbed
from ddiloco_geo.tools.evaluate import Evaluator

log = logging.getLogger(__name__)


def delta_headers(store: Store) -> dict[str, dict[str, Any]]:
    """key -> header fields of every decodable delta of every learner in the bucket."""
    ids, _ = protocol.learner_ids(store)
    all_keys = [k for lid in ids for k in store.list(layout.deltas_dir(lid))]

    def one(key: str):
        try:
            h = protocol.read_header(store, key)
            return key, {"learner": h.learner, "seq": h.seq, "fragment": h.fragment, "num_steps": h.num_steps,
                         "step": int(h.extra.get("step", 0))}
        except (CodecError, StorageError):
            return key, None

    with ThreadPoolExecutor(16) as pool:
        return {k: v for k, v in pool.map(one, all_keys) if v is not None}


def rejections(store: Store) -> dict[str, dict[str, Any]]:
    """Delta key -> the rejection record a syncer wrote for it."""
    out = {}
    for key in store.list(layout.SYNCER + "rejected/"):
        try:
            rec = json.loads(store.get(key))
        except (NotFoundError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("key"), str):
            out[rec["key"]] = rec
    return out


def rejected_then_superseded(rejected: dict[str, dict[str, Any]], records: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Deltas one syncer rejected (e.g. ``future_base`` while it lagged) whose work reached the
    model anyway, through a newer cumulative delta another syncer merged. ``protocol.ledger``
    counts them once, as merged; this list is for the report only."""
    merged = {e["key"] for r in records for e in r.get("merged", [])}
    accounted = {k for r in records for k in r.get("superseded", [])} - merged
    return [{"key": k, "reason": rec.get("reason")} for k, rec in rejected.items() if k in accounted]


def accounted_at(records: list[dict[str, Any]], rejected: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Delta key -> when a syncer accounted for it: the publish time of the first merge record that
    merged or superseded it; ``-inf`` for a rejected delta, which never waits for a publish (at the
    end of a run a restarted learner's stale deltas, rejected one by one as they arrived, once
    counted as a stall until the syncer stopped: chaos seed 24 under learner.schedule=run)."""
    out: dict[str, float] = {k: -math.inf for k in rejected}
    for r in records:
        t = r.get("published_at")
        if r.get("kind") != "merge" or not t:
            continue
        for k in [e["key"] for e in r.get("merged", [])] + list(r.get("superseded", [])):
            out[k] = min(out.get(k, math.inf), float(t))
    return out


def incarnation_keys(learners: list[Proc], headers: dict[str, dict[str, Any]]) -> dict[int, list[str]]:
    """Learner process pid -> the delta keys it wrote (its learner's seqs from its first_seq up to
    the next incarnation's)."""
    out = {}
    for lid in sorted({p.target for p in learners}):
        mine = [p for p in learners if p.target == lid]
        for k, p in enumerate(mine):
            nxt = mine[k + 1].first_seq if k + 1 < len(mine) else None
            out[p.pid] = [key for key, h in headers.items() if h["learner"] == lid and h["seq"] >= p.first_seq
                          and (nxt is None or h["seq"] < nxt)]
    return out


def exit_records(store: Store, learners: list[Proc]) -> dict[int, dict[str, Any]]:
    """Learner process pid -> its exit record (each learner keeps only its newest one, so an
    incarnation that a later one replaced has none here)."""
    out = {}
    for lid in sorted({p.target for p in learners}):
        try:
            rec = json.loads(store.get(layout.exit_key(lid)))
        except (NotFoundError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("pid"), int):
            out[rec["pid"]] = rec
    return out


def incarnation_table(learners: list[Proc], headers: dict[str, dict[str, Any]],
                      exits: dict[int, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per learner, its incarnations in start order as :func:`~.goals.compute_goodput` takes them."""
    # each incarnation's last step: its exit record if it wrote one, else what was seen of it
    exit_steps = {p.pid: int(exits[p.pid]["step"]) for p in learners if p.pid in exits}
    incs: dict[str, list[dict[str, Any]]] = {}
    keys = incarnation_keys(learners, headers)
    for lid in sorted({p.target for p in learners}):
        mine = [p for p in learners if p.target == lid]
        rows = []
        for k, p in enumerate(mine):
            own = [headers[key] for key in keys[p.pid]]
            seen = max([o[1] for o in p.obs] + [int(p.last_hb.get("step", 0) or 0)] +
                       [h["step"] for h in own] + [p.s0])
            s1 = exit_steps.get(p.pid, seen)
            parent = None
            if p.resumed_checkpoint:
                # checkpoints are written on a clean exit only: the newest one is the latest
                # earlier incarnation's that was not SIGKILLed
                clean = [j for j, q in enumerate(mine[:k]) if q.signal != "SIGKILL"]
                parent = clean[-1] if clean else None
            rows.append({"pid": p.pid, "incarnation": k, "s0": p.s0, "s1": s1, "first_seq": p.first_seq,
                         "parent": parent, "resumed_checkpoint": p.resumed_checkpoint})
        incs[lid] = rows
    return incs


def heartbeat_series(learners: list[Proc]) -> list[dict[str, Any]]:
    """Per incarnation, the observations and end :func:`~.goals.compute_downtime` takes."""
    series = []
    for p in learners:
        obs = [(o[0], o[1]) for o in p.obs]
        if p.signalled_at is not None:
            end = p.signalled_at
        elif p.done_at is not None:  # the end of its schedule (its position at max_steps: learner.schedule),
            # from the first heartbeat that showed its last step: under schedule=run the position reaches
            # max_steps only at the stop, a heartbeat after the last step (seed 22 counted the gap as downtime)
            last = max((step for t, step in obs if t <= p.done_at), default=None)
            end = min((t for t, step in obs if step == last), default=p.done_at)
        else:
            end = min(p.exit_time, obs[-1][0]) if (obs and p.exit_time) else None
        series.append({"obs": obs, "end": end, "signalled_at": p.signalled_at,
                       "first_stepped": bool(p.obs) and p.obs[0][3] is not None})
    return series


def stalls_of(sup: Supervisor, learners: list[Proc], pubs: list[float], period_s: float,
              keys: dict[int, list[str]], accounted: dict[str, float]) -> list[dict[str, float]]:
    """Stalls from publish times, delta deliveries (a heartbeat whose ``deltas_sent`` grew, or the
    exit record's count, while merge and rejection records do not yet account for that many of
    the process's deltas: :func:`~.goals.unaccounted_deliveries`) and syncer uptime (ready ->
    signalled or exited)."""
    deliveries = []
    for p in learners:
        seen = [(t1, n1) for (t0, _, n0, _), (t1, _, n1, _) in zip(p.obs, p.obs[1:]) if n1 > n0]
        if p.last_hb.get("state") == "exited" and p.obs:
            sent = int(p.last_hb.get("uploads", {}).get("deltas_sent", 0))
            if sent > p.obs[-1][2]:
                seen.append((float(p.last_hb.get("time", p.obs[-1][0])), sent))
        deliveries += unaccounted_deliveries(seen, keys.get(p.pid, []), accounted)
    syncer_up = []
    for p in sup.procs:
        if p.role == "syncer" and p.ready_at is not None:
            end = p.signalled_at or p.exit_time or time.time()
            syncer_up.append((p.ready_at, end))
    return find_stalls(pubs, deliveries, syncer_up, period_s)


def recovery(sup: Supervisor, learners: list[Proc], records: list[dict[str, Any]], pubs: list[float],
             keys: dict[int, list[str]], exits: dict[int, dict[str, Any]],
             ) -> tuple[dict[str, list[float]], list[dict[str, Any]], dict[str, bool]]:
    """(recovery_s lists, per-restart detail, restarted process -> merged after its restart).

    A restarted learner that wrote no delta and exited because the run's budget was spent
    (``learner.schedule = run``: its peers trained its share while it was down, so it came back to
    no work) has nothing to merge: its detail says ``no_work_left`` and it is not in the map. Any
    other restarted learner without a merge after its restart is, and fails the goal."""
    notice = [round(p.exit_time - p.signalled_at, 3) for p in learners
              if p.signal == "SIGTERM" and p.exit_time is not None]
    restart_merge, restart_detail, restarted_merged = [], [], {}
    for p in learners:
        if p.incarnation == 0:
            continue
        first = first_merge_after(records, p.target, p.first_seq)
        first_step = p.obs[0][0] if p.obs else None
        d = {"learner": p.target, "process": p.name, "restarted_at": round(p.started - sup.t0, 3),
             "first_seq": p.first_seq, "resume_step": p.s0,
             "restart_to_first_step": None if first_step is None else round(first_step - p.started, 3),
             "restart_to_first_merge": None if first is None else round(first - p.started, 3),
             "deltas_written": len(keys.get(p.pid, [])), "exit_reason": exits.get(p.pid, {}).get("reason")}
        d["no_work_left"] = first is None and d["deltas_written"] == 0 and d["exit_reason"] == "max_steps"
        restart_detail.append(d)
        if not d["no_work_left"]:
            restarted_merged[p.name] = first is not None
        if first is not None:
            restart_merge.append(d["restart_to_first_merge"])
    syncer_ready, syncer_publish, drains = [], [], []
    for p in sup.procs:
        if p.role != "syncer":
            continue
        if p.ready_at is not None:
            syncer_ready.append(round(p.ready_at - p.started, 3))
            after = [t for t in pubs if t >= p.ready_at]
            if after and (p.incarnation > 0 or p.target == "syncer-2"):
                syncer_publish.append(round(min(after) - p.started, 3))
        if p.signal == "SIGTERM" and p.exit_time is not None:
            drains.append(round(p.exit_time - p.signalled_at, 3))
    out = {"notice_to_exit": notice, "restart_to_first_merge": restart_merge,
           "restart_to_first_step": [d["restart_to_first_step"] for d in restart_detail
                                     if d["restart_to_first_step"] is not None],
           "syncer_start_to_ready": syncer_ready, "syncer_restart_to_first_publish": syncer_publish,
           "syncer_drain": drains}
    return out, restart_detail, restarted_merged


def faults_seen(sup: Supervisor, learners: list[Proc]) -> dict[str, dict[str, int]]:
    """Storage retries by reason actually seen (heartbeats / exit records, the syncer's status)."""
    seen: dict[str, dict[str, int]] = {}
    for p in learners:
        if "storage.fault_rate" in p.settings:
            seen[p.name] = dict((p.last_hb.get("storage") or {}).get("retries", {}))
    syncer_retries: dict[str, int] = {}
    for st in sup.syncer_status:
        for k, v in (st["storage"].get("retries") or {}).items():
            syncer_retries[k] = max(syncer_retries.get(k, 0), int(v))
    seen["syncer(status)"] = syncer_retries
    return seen


def build_report(sup: Supervisor, store: Store, testbed: Testbed, evaluator: Evaluator) -> dict[str, Any]:
    plan, t0 = sup.plan, sup.t0
    t_read = time.monotonic()
    log.info("chaos_report reading the ledger, merge records and delta headers from %s", testbed.url)
    led = protocol.ledger(store)
    records = protocol.merge_records(store)
    rejected = rejections(store)
    double = rejected_then_superseded(rejected, records)
    spec = protocol.load_spec(store)
    headers = delta_headers(store)
    log.info("chaos_report read %d merge records and %d delta headers in %.1fs", len(records), len(headers),
             time.monotonic() - t_read)

    learners = [p for p in sup.procs if p.role == "learner"]
    exits = exit_records(store, learners)
    incs = incarnation_table(learners, headers, exits)
    merged_entries = []
    for r in records:
        for e in r.get("merged", []):
            h = headers.get(e["key"])
            if h is not None:
                merged_entries.append({**h, "num_steps": e.get("num_steps", h["num_steps"])})
    gp = compute_goodput(incs, merged_entries, spec.plan.num_fragments)

    step_times = [o[3] for p in learners for o in p.obs if o[3]]
    step_s = statistics.median(step_times) if step_times else 0.5
    gap_s = max(10.0, 10 * step_s)
    downtime, down_iv = compute_downtime(heartbeat_series(learners), gap_s)
    (sup.out / "heartbeats.json").write_text(json.dumps(
        {p.name: [[round(o[0] - t0, 3), o[1], o[2], o[3]] for o in p.obs] for p in learners}))

    pubs = [float(r["published_at"]) for r in records if r.get("kind") == "merge" and r.get("published_at")]
    period = stall_period(spec.sync_every, step_s, pubs)
    keys = incarnation_keys(learners, headers)
    stalls = stalls_of(sup, learners, pubs, period, keys, accounted_at(records, rejected))
    recovery_s, restart_detail, restarted_merged = recovery(sup, learners, records, pubs, keys, exits)

    faults_configured = [{"process": p.name, "pid": p.pid, "rate": p.settings["storage.fault_rate"],
                          "seed": p.settings["storage.fault_seed"]} for p in sup.procs if "storage.fault_rate" in p.settings]
    wan = {"regions": plan["regions"], "placement": plan["placement"],
           "proxies": {r: {"url": px.url, **px.stats()} for r, px in testbed.proxies.items()},
           "proxied_learners": sorted(l for l, r in plan["placement"].items() if r != "home")}

    initial = evaluator.initial()
    final, versions = evaluator.global_loss(store, spec)
    failed = [{"process": p.name, "code": p.returncode} for p in sup.procs
              if p.returncode not in (0, None) and p.signal != "SIGKILL"]
    return {
        "seed": plan["seed"], "store": testbed.url, "endpoint": testbed.endpoint,
        "learners": plan["learners"], "steps": plan["steps"], "rounds": plan["rounds"],
        "timed_out": sup.timed_out,
        "downtime_s": round(downtime, 3),
        "downtime_intervals": [(round(a - t0, 3), round(b - t0, 3)) for a, b in down_iv],
        "stalls": [{**s, "start": round(s["start"] - t0, 3), "end": round(s["end"] - t0, 3)} for s in stalls],
        "step_s_median": round(step_s, 4), "fragment_period_s": round(period, 3), "stepping_gap_s": round(gap_s, 3),
        "goodput": None if gp["goodput"] is None else round(gp["goodput"], 4),
        "goodput_by_learner": gp["by_learner"], "steps_taken": gp["steps_taken"],
        "deltas_written": led["deltas_written"], "deltas_merged": led["deltas_merged"],
        "deltas_superseded": led["deltas_superseded"], "deltas_rejected": led["deltas_rejected"],
        "rejected_by_reason": led["rejected_by_reason"], "deltas_unaccounted": led["deltas_unaccounted"],
        "unaccounted_keys": led["unaccounted_keys"],
        "deltas_rejected_then_superseded": len(double), "rejected_then_superseded": double[:20],
        "versions_published": sum(1 for r in records if r.get("kind") == "merge"),
        "final_versions": {str(p): v for p, v in versions.items()},
        "initial_eval_loss": initial, "final_eval_loss": final,
        "baseline_eval_loss": None, "loss_ratio": None, "goodput_baseline": None,
        "recovery_s": recovery_s,
        "restarts": restart_detail, "restarted_merged_after_restart": restarted_merged,
        "faults_configured": faults_configured, "fault_retries_seen": faults_seen(sup, learners), "wan": wan,
        "incarnations": incs,
        "processes": [{"process": p.name, "pid": p.pid, "started": round(p.started - t0, 3),
                       "signal": p.signal, "exit_code": p.returncode,
                       "exited": None if p.exit_time is None else round(p.exit_time - t0, 3)} for p in sup.procs],
        "processes_failed": failed,
        "events": sup.events,
        "plan": plan,
        "actions": {aid: {k: v for k, v in st.items() if k != "proc"} | (
            {"time": round(st["time"] - t0, 3)} if "time" in st else {}) for aid, st in sup.action_state.items()},
    }
