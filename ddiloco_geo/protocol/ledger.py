"""The delta ledger: every delta a learner wrote is merged, superseded by a newer cumulative delta of
the same learner (and so merged through it), rejected with a recorded reason, or unaccounted; and
the listings every actor and tool shares (learner ids, quarantine records, a learner's next
sequence number).
"""

from __future__ import annotations

import logging
from typing import Any


from ddiloco_geo import codec
from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import CodecError, StorageError
from ddiloco_geo.core.signing import Verifier
from ddiloco_geo.protocol.verified import SYNCER_SIGNER, Skipped, learner_signer, read_record, verified_header
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)


def learner_ids(store: Store) -> tuple[list[str], list[str]]:
    """(valid learner ids, listing prefixes under ``learners/`` that are not valid ids)."""
    ids, bad = [], []
    for prefix in store.list_prefixes(layout.LEARNERS):
        try:
            ids.append(layout.parse_learner_prefix(prefix))
        except layout.LayoutError:
            bad.append(prefix)
    return ids, bad


def quarantine_records(store: Store, verifier: Verifier | None = None) -> tuple[set[str], list[str]]:
    """(learner ids with a valid quarantine record, record keys ignored). With ``verifier`` a
    record counts only if the syncer signed it and it names the learner its key names; forged,
    unsigned or malformed records are ignored (the caller logs them)."""
    out, ignored = set(), []
    for key in store.list(layout.QUARANTINE):
        try:
            learner = layout.parse_quarantine_key(key)
        except layout.LayoutError:
            ignored.append(key)
            continue
        if verifier is not None:
            rec = read_record(store, key, verifier, SYNCER_SIGNER)
            if rec is None or rec.get("learner") != learner:
                ignored.append(key)
                continue
        out.add(learner)
    return out, ignored


def quarantined_learners(store: Store, verifier: Verifier | None = None) -> set[str]:
    """Learner ids with a quarantine record; with ``verifier`` only records the syncer signed."""
    learners, ignored = quarantine_records(store, verifier)
    for key in ignored:
        log.debug("quarantine_record_ignored key=%r", key)
    return learners


def next_delta_seq(store: Store, learner: str, verifier: Verifier | None = None) -> int:
    """One past the highest sequence number among a learner's delta keys (0 if it has none). With
    ``verifier`` (one that knows this learner's key) only deltas it signed count, newest first, so
    junk another writer put at a huge sequence number cannot push the learner's numbering away."""
    newest = newest_delta(store, learner, verifier)
    return 0 if newest is None else newest[0] + 1


def newest_delta(store: Store, learner: str, verifier: Verifier | None = None,
                 read_header: bool = False) -> tuple[int, codec.Header | None] | None:
    """(sequence number, header) of a learner's newest delta, None if it has none. The header is read
    (and the delta counts only if it is readable and names this learner and number) with
    ``verifier``, where it must also carry the learner's signature, or with ``read_header``."""
    seqs = {}
    for key in store.list(layout.deltas_dir(learner)):
        try:
            seqs[key] = layout.parse_delta_key(key).seq
        except layout.LayoutError:
            continue
    for key in sorted(seqs, key=seqs.get, reverse=True):
        if verifier is None and not read_header:
            return seqs[key], None
        try:
            header = verified_header(store, key, verifier, learner_signer(learner))
        except (CodecError, StorageError):
            continue
        if header.seq == seqs[key] and header.learner == learner:
            return seqs[key], header
    return None


def merge_records(store: Store, verifier: Verifier | None = None, skipped: Skipped | None = None) -> list[dict[str, Any]]:
    """Every published merge record (from the event tape; from the global's header if the tape
    entry is missing, e.g. after a crash between the two writes). With ``verifier`` only what the
    syncer signed (tape entry or global header); the rest is counted in ``skipped``."""
    skipped = skipped if skipped is not None else Skipped()
    records: dict[tuple[int, int], dict[str, Any]] = {}
    for key in store.list(layout.SYNCER + "tape/"):
        rec = read_record(store, key, verifier, SYNCER_SIGNER)
        try:
            if rec is None:
                raise ValueError("unreadable or unsigned")
            where = (int(rec["fragment"]), int(rec["version"]))
            if key != layout.tape_key(*where):
                raise ValueError("names another version than its key")
            records[where] = rec
        except (ValueError, KeyError, TypeError, layout.LayoutError):
            log.debug("tape_entry_unreadable key=%r", key)
    for key in store.list(layout.GLOBALS):
        try:
            p, v = layout.parse_global_key(key)
        except layout.LayoutError:
            continue
        if (p, v) not in records:
            try:
                header = verified_header(store, key, verifier, SYNCER_SIGNER)
                if header.fragment != p or header.version != v:
                    raise CodecError("bad_header", "names another version than its key")
                records[(p, v)] = {"fragment": p, "version": v, **header.extra}
            except (CodecError, StorageError) as exc:
                skipped.add("global", key, getattr(exc, "reason", str(exc)))
    return [records[k] for k in sorted(records)]


def _entries(records: list[dict[str, Any]], field: str) -> set[str]:
    out = set()
    for r in records:
        for e in r.get(field) or []:
            key = e.get("key") if isinstance(e, dict) else e
            if isinstance(key, str):
                out.add(key)
    return out


def ledger(store: Store, verifier: Verifier | None = None) -> dict[str, Any]:
    """Every delta written is merged, superseded by a newer cumulative delta of the same learner
    (and so merged through it), rejected with a recorded reason, or unaccounted. Keys under a
    learner's ``deltas/`` that are not delta keys are ``junk_keys`` (the syncer counts them as
    ``bad_key``), not deltas. With ``verifier`` only syncer-signed merge, rejection and quarantine
    records count; ``skipped`` says how many were not."""
    written, junk = set(), 0
    for learner in learner_ids(store)[0]:
        for key in store.list(layout.deltas_dir(learner)):
            try:
                layout.parse_delta_key(key)
                written.add(key)
            except layout.LayoutError:
                junk += 1
    skipped = Skipped()
    records = merge_records(store, verifier, skipped)
    merged = _entries(records, "merged")
    superseded = _entries(records, "superseded")
    rejected: dict[str, str] = {}
    for key in store.list(layout.SYNCER + "rejected/"):
        rec = read_record(store, key, verifier, SYNCER_SIGNER, skipped, "reject_record")
        if rec is not None and isinstance(rec.get("key"), str) and isinstance(rec.get("reason"), str):
            rejected[rec["key"]] = rec["reason"][:64]
    by_reason: dict[str, int] = {}
    for k in written:
        if k in rejected and k not in merged and k not in superseded:
            by_reason[rejected[k]] = by_reason.get(rejected[k], 0) + 1
    # deltas of a quarantined learner are ignored without a record each: they count as rejected
    quarantined = quarantined_learners(store, verifier)
    for k in sorted(written - merged - superseded - set(rejected)):
        if layout.parse_learner(k) in quarantined:
            rejected[k] = "quarantined"
            by_reason["quarantined"] = by_reason.get("quarantined", 0) + 1
    accounted = merged | superseded | set(rejected)
    unaccounted = sorted(written - accounted)
    versions: dict[int, int] = {}
    for r in records:  # merge_records checked fragment and version against the key
        versions[int(r["fragment"])] = max(versions.get(int(r["fragment"]), 0), int(r["version"]))
    return {
        "deltas_written": len(written),
        "deltas_merged": len(written & (merged | superseded)),
        "deltas_superseded": len(written & (superseded - merged)),
        "deltas_rejected": sum(by_reason.values()),
        "rejected_by_reason": by_reason,
        "deltas_unaccounted": len(unaccounted),
        "unaccounted_keys": unaccounted[:20],
        "junk_keys": junk,
        "skipped_unverified": skipped.as_dict(),
        "versions_published": versions,
        "merges": [
            {"fragment": r["fragment"], "version": r["version"], "contributors": r.get("contributors", 0),
             "grace_s": r.get("grace_s", 0.0), "staleness": r.get("staleness", []),
             "published_at": r.get("published_at")}
            for r in records if r.get("kind") == "merge"
        ],
    }
