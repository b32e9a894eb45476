"""The delta ledger: every delta a learner wrote is merged, superseded by a newer cumulative delta of
the same learner (and so merged through it), rejected with a recorded reason, or unaccounted; and
the listings every actor and tool shares (learner ids, quarantine records, a learner's next
sequence number).
"""

from __future__ import annotations

import json
import logging
from typing import Any


from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import CodecError, NotFoundError
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)


from ddiloco_geo.protocol.index import read_header


def learner_ids(store: Store) -> tuple[list[str], list[str]]:
    """(valid learner ids, listing prefixes under ``learners/`` that are not valid ids)."""
    ids, bad = [], []
    for prefix in store.list_prefixes(layout.LEARNERS):
        try:
            ids.append(layout.parse_learner_prefix(prefix))
        except layout.LayoutError:
            bad.append(prefix)
    return ids, bad


def quarantined_learners(store: Store) -> set[str]:
    """Learner ids with a quarantine record (malformed record keys are ignored)."""
    out = set()
    for key in store.list(layout.QUARANTINE):
        try:
            out.add(layout.parse_quarantine_key(key))
        except layout.LayoutError:
            log.warning("quarantine_key_malformed key=%r", key)
    return out


def next_delta_seq(store: Store, learner: str) -> int:
    """One past the highest sequence number among a learner's delta keys (0 if it has none)."""
    seqs = []
    for key in store.list(layout.deltas_dir(learner)):
        try:
            seqs.append(layout.parse_delta_key(key).seq)
        except layout.LayoutError:
            continue
    return max(seqs) + 1 if seqs else 0


def merge_records(store: Store) -> list[dict[str, Any]]:
    """Every published merge record (from the event tape; from the global's header if the tape
    entry is missing, e.g. after a crash between the two writes)."""
    records: dict[tuple[int, int], dict[str, Any]] = {}
    for key in store.list(layout.SYNCER + "tape/"):
        try:
            rec = json.loads(store.get(key))
            records[(int(rec["fragment"]), int(rec["version"]))] = rec
        except (ValueError, KeyError, TypeError, NotFoundError):
            log.warning("tape_entry_unreadable key=%s", key)
    for key in store.list(layout.GLOBALS):
        try:
            p, v = layout.parse_global_key(key)
        except layout.LayoutError:
            continue
        if (p, v) not in records:
            try:
                header = read_header(store, key)
                records[(p, v)] = {"fragment": p, "version": v, **header.extra}
            except CodecError as exc:
                log.warning("global_header_unreadable key=%s reason=%s", key, exc.reason)
    return [records[k] for k in sorted(records)]


def ledger(store: Store) -> dict[str, Any]:
    """Every delta written is merged, superseded by a newer cumulative delta of the same learner
    (and so merged through it), rejected with a recorded reason, or unaccounted."""
    written = set()
    for learner in learner_ids(store)[0]:
        written.update(store.list(layout.deltas_dir(learner)))
    records = merge_records(store)
    merged = {e["key"] for r in records for e in r.get("merged", [])}
    superseded = {k for r in records for k in r.get("superseded", [])}
    rejected: dict[str, str] = {}
    for key in store.list(layout.SYNCER + "rejected/"):
        try:
            rec = json.loads(store.get(key))
            rejected[rec["key"]] = rec["reason"]
        except (ValueError, KeyError, TypeError, NotFoundError):
            log.warning("reject_record_unreadable key=%s", key)
    by_reason: dict[str, int] = {}
    for k in written:
        if k in rejected and k not in merged and k not in superseded:
            by_reason[rejected[k]] = by_reason.get(rejected[k], 0) + 1
    # deltas of a quarantined learner are ignored without a record each: they count as rejected
    quarantined = quarantined_learners(store)
    for k in sorted(written - merged - superseded - set(rejected)):
        if layout.parse_learner(k) in quarantined:
            rejected[k] = "quarantined"
            by_reason["quarantined"] = by_reason.get("quarantined", 0) + 1
    accounted = merged | superseded | set(rejected)
    unaccounted = sorted(written - accounted)
    versions: dict[int, int] = {}
    for r in records:
        versions[int(r["fragment"])] = max(versions.get(int(r["fragment"]), 0), int(r["version"]))
    return {
        "deltas_written": len(written),
        "deltas_merged": len(written & (merged | superseded)),
        "deltas_superseded": len(written & (superseded - merged)),
        "deltas_rejected": sum(by_reason.values()),
        "rejected_by_reason": by_reason,
        "deltas_unaccounted": len(unaccounted),
        "unaccounted_keys": unaccounted[:20],
        "versions_published": versions,
        "merges": [
            {"fragment": r["fragment"], "version": r["version"], "contributors": r.get("contributors", 0),
             "grace_s": r.get("grace_s", 0.0), "staleness": r.get("staleness", []),
             "published_at": r.get("published_at")}
            for r in records if r.get("kind") == "merge"
        ],
    }
