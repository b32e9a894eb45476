"""Everything the report shows except the evaluation, read from the bucket (``get``/``list`` only) into
one JSON-able summary dict.

Times are seconds since the first global was published (``start_time``: the newest ``init``
record, once every fragment has one). From the merge records (:func:`ddiloco_geo.protocol.merge_records`):
every merge's contributors, staleness and tokens, and when each delta was accounted for; from
``syncer/rejected/``: rejection events; per learner: :func:`~ddiloco_geo.ops.report.learners.learner_history`;
from ``syncer/status/``: the syncers' byte counters. Bytes are compared with a data-parallel ring
all-reduce of fp32 gradients every step (2(M-1)/M * 4 * params per learner step). The delta ledger
is the protocol's (:func:`ddiloco_geo.protocol.ledger`), so the report, the syncer's tests and
``status`` count merged, superseded, rejected (including a quarantined learner's deltas) and
unaccounted deltas the same way. A run is ``live`` while a learner is alive or a syncer that is not
draining updated its status within :data:`~ddiloco_geo.ops.status.SILENT_AFTER_S`.
"""

from __future__ import annotations

import time
from typing import Any

from ddiloco_geo import protocol
from ddiloco_geo.core import layout
from ddiloco_geo.ops.report.learners import learner_history, throughput_rates
from ddiloco_geo.ops.status import SILENT_AFTER_S

# the ledger's fields the report shows (the rest of protocol.ledger is in ``merges``/``versions_published``)
LEDGER_FIELDS = ("deltas_written", "deltas_merged", "deltas_superseded", "deltas_rejected", "rejected_by_reason",
                 "deltas_unaccounted", "unaccounted_keys")


def collect(store, *, max_delta_headers: int = 4000, verifier=None) -> dict[str, Any]:
    """Everything the report shows except the evaluation, as one JSON-able dict (reads only); with
    ``verifier`` only signed records (the rest counted in ``skipped_unverified``)."""
    now = time.time()
    skipped = protocol.Skipped()
    spec = protocol.load_spec(store)
    P = spec.plan.num_fragments
    num_params = sum(spec.plan.numel(p) for p in range(P))
    records = protocol.merge_records(store, verifier, skipped)
    published = [r for r in records if isinstance(r.get("published_at"), (int, float))]
    inits = [float(r["published_at"]) for r in published if r.get("kind") == "init"]
    t0 = max(inits) if len(inits) >= P else min((float(r["published_at"]) for r in published), default=now)
    merges = [r for r in published if r.get("kind") == "merge"]
    merges.sort(key=lambda r: float(r["published_at"]))

    # where each delta ended: merged or superseded by a merge published at t, or rejected at t
    accounted_at: dict[str, float] = {}
    for r in merges:
        for e in r.get("merged", []):
            accounted_at[e["key"]] = float(r["published_at"])
        for k in r.get("superseded", []):
            accounted_at.setdefault(k, float(r["published_at"]))
    rejected = []
    for key in store.list(layout.SYNCER + "rejected/"):
        rec = protocol.read_record(store, key, verifier, "syncer", skipped, "reject_record")
        if rec and isinstance(rec.get("key"), str) and isinstance(rec.get("at", 0), (int, float)):
            rejected.append(rec)
            accounted_at.setdefault(rec["key"], float(rec.get("at") or now))

    covered: dict[tuple[str, int, int], int] = {}  # (learner, fragment, base) -> tokens already merged
    merge_rows = [_merge_row(r, t0, covered) for r in merges]  # in publish order
    events: list[dict[str, Any]] = []
    learners = {name: learner_history(store, name, t0, now, accounted_at, events, max_delta_headers, verifier, skipped)
                for name in protocol.learner_ids(store)[0]}
    for name, rec in learners.items():
        rec.update(_merged_throughput(name, merges, t0, P))
    for rec in rejected:
        events.append({"time": float(rec.get("at") or now) - t0, "learner": rec.get("learner"), "kind": "rejected",
                       "detail": f"{rec.get('reason')} ({rec['key'].rsplit('/', 1)[-1]})"})
    events.sort(key=lambda e: (e["time"], e["learner"] or "", e["kind"]))

    syncers = _syncers(store, now, verifier, skipped)
    M = len(learners)
    steps_total = sum(int(l["steps"] or 0) for l in learners.values())
    ledger = protocol.ledger(store, verifier)
    live = any(l["state"] == "alive" for l in learners.values()) or any(
        s["age_s"] < SILENT_AFTER_S and not s.get("draining") for s in syncers)
    last_event = max([float(r["published_at"]) for r in published] + [now - l["last_seen_s"] for l in learners.values()
                                                                      if l["last_seen_s"] is not None], default=t0)
    staleness = [s for m in merge_rows for s in m["staleness"]]
    contributors = [m["contributors"] for m in merge_rows]
    return {
        "url": store.url, "run_id": spec.run_id, "generated_at": now, "start_time": t0,
        "state": "live" if live else "finished", "wall_s": (now if live else last_event) - t0,
        "model": spec.model, "num_params": num_params, "num_fragments": P, "sync_every": spec.sync_every,
        "codec": spec.codec, "num_learners": M,
        "tokens_total": sum(int(l["tokens"] or 0) for l in learners.values()),
        "steps_total": steps_total,
        "tokens_merged": sum(m["tokens"] for m in merge_rows) / P,
        "versions_published": {str(p): max([int(r["version"]) for r in records if int(r["fragment"]) == p], default=0)
                               for p in range(P)},
        "merges": merge_rows,
        "merge_stats": {
            "count": len(merge_rows),
            "contributors_mean": sum(contributors) / len(contributors) if contributors else None,
            "contributors_max": max(contributors, default=None),
            "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
            "staleness_max": max(staleness, default=None),
        },
        "bytes": _bytes(learners, syncers, num_params, steps_total),
        "ledger": {k: ledger[k] for k in LEDGER_FIELDS},
        "learners": learners, "syncers": syncers, "events": events,
        "skipped_unverified": skipped.as_dict(), "junk_keys": ledger["junk_keys"],
    }


def _merge_row(r: dict[str, Any], t0: float, covered: dict[tuple[str, int, int], int]) -> dict[str, Any]:
    """One merge. Its tokens are the ones it newly merged: a learner's deltas on one base are
    cumulative, so a later delta on a base already merged adds only its increment."""
    entries = r.get("merged", [])
    tokens = 0
    for e in entries:
        slot = (str(e["learner"]), int(r["fragment"]), int(e.get("base_version", -1)))
        n = int(e.get("num_tokens", 0))
        tokens += max(0, n - covered.get(slot, 0))
        covered[slot] = max(n, covered.get(slot, 0))
    return {
        "fragment": int(r["fragment"]), "version": int(r["version"]), "time": float(r["published_at"]) - t0,
        "contributors": int(r.get("contributors", len({e["learner"] for e in entries}))),
        "staleness": [int(s) for s in r.get("staleness", [])], "grace_s": float(r.get("grace_s", 0.0)),
        "tokens": tokens,
        "learners": sorted({e["learner"] for e in entries}),
    }


def _merged_throughput(name: str, merges: list[dict[str, Any]], t0: float, P: int) -> dict[str, Any]:
    """Tokens of ``name`` merged over time (each fragment sees each token once: divide by P), and
    the tokens/s they imply."""
    series, total = [], 0
    for r in merges:
        toks = sum(int(e.get("num_tokens", 0)) for e in r.get("merged", []) if e.get("learner") == name)
        if toks:
            total += toks
            series.append((float(r["published_at"]) - t0, total / P))
    # merges arrive in bursts: about one bin per fragment period of this learner's deltas
    entries = sum(1 for r in merges for e in r.get("merged", []) if e.get("learner") == name)
    return {"merged_tokens": [{"time": t, "tokens": v} for t, v in series],
            "throughput_merged": throughput_rates(series, bins=max(3, min(12, entries // max(1, P))))}


def _syncers(store, now: float, verifier=None, skipped=None) -> list[dict[str, Any]]:
    syncers = []
    for key in store.list(layout.SYNCER + "status/"):
        st = protocol.syncer_status(store, key, verifier, skipped)
        if st:
            syncers.append({"shard": st.get("shard"), "age_s": now - (st["time"] if st["time"] is not None else now),
                            "counters": st.get("counters"),
                            "storage": st["storage"] if isinstance(st.get("storage"), dict) else {},
                            "draining": st.get("draining")})
    return syncers


def _bytes(learners: dict[str, dict[str, Any]], syncers: list[dict[str, Any]], num_params: int,
           steps_total: int) -> dict[str, Any]:
    lup = sum(int(l["bytes_up"]) for l in learners.values())
    ldown = sum(int(l["bytes_down"]) for l in learners.values())
    sup = sum(int(s["storage"].get("bytes_up", 0)) for s in syncers)
    sdown = sum(int(s["storage"].get("bytes_down", 0)) for s in syncers)
    M = len(learners)
    dp = int(2 * (M - 1) / M * 4 * num_params * steps_total) if M > 1 else 0
    moved = lup + ldown + sup + sdown
    return {"learner_up": lup, "learner_down": ldown, "syncer_up": sup, "syncer_down": sdown, "total": moved,
            "dp_allreduce": dp, "dp_ratio": dp / moved if moved else None}
