"""Garbage collection of a run's bucket under a retention policy (``ddiloco-geo gc``).

Every object in the layout is create-only and nothing in the system deletes, so a run's bucket
grows by a global version, an update object and a state object per fragment merge, and by every
delta. This module decides what can go, and deletes only that.

Policy (settings section ``gc``, :class:`~ddiloco_geo.core.config.GcConfig`), per fragment p: a
**floor** f_p, the oldest version that stays; everything from f_p to the newest version stays, so
the kept chain is contiguous and ``replay`` checks it rooted at f_p (as it does a restored run).
f_p starts at ``newest − keep_versions + 1`` and is lowered, until nothing changes, to

- every snapshot's version of p (``snapshots/*/manifest.json``; every key a manifest names is kept);
- the version before the oldest one published in the last ``replay_window_s`` (replay of a version
  starts from the one before it);
- the base version of every live learner (heartbeat newer than ``lag_window_s``) and of every delta
  not yet merged, superseded or rejected (the syncer anchors it at its base);
- for every kept merge version, the base versions of its merged deltas, and for a kept rollback
  version the version it rolls back to (replay reads both).

What may go: globals ``v`` and update objects ``u`` below the floor; syncer state objects below the
floor that no manifest names (states at or above it stay, including ones a running syncer wrote
for a version it has not published yet); deltas merged or superseded by a version at or below the
floor (replay does not recompute the root) and deltas rejected more than ``replay_window_s`` ago.
Never: ``run.json``, the index, heartbeats, exit and checkpoint objects, the event tape, leases,
status, reject and quarantine records, manifests, and any delta not yet accounted for.

In a signed run (``security.run_secret`` set) only objects the syncer signed decide what goes: merge
and rejection records and the newest version of each fragment (a forged global at a huge version is
not "newest"; a forged rejection or merge record cannot get an honest pending delta deleted);
heartbeats count only if their learner signed them. Whatever does not verify, and malformed
manifests, are skipped and counted (``skipped_unverified``); they can only make gc keep more.

Races with a live run: versions only move forward and merged deltas are never read again by the
syncer, so a plan made from a listing stays safe while the run goes on; a learner that adopts a
version below the floor would have to be one whose heartbeat is older than ``lag_window_s``.
Deletes run deltas first, then updates, globals and states.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import CodecError, LayoutError, NotFoundError
from ddiloco_geo.core.signing import Verifier
from ddiloco_geo.protocol.index import read_header
from ddiloco_geo.protocol.ledger import learner_ids, merge_records
from ddiloco_geo.protocol.verified import SYNCER_SIGNER, Skipped, heartbeat, read_record, verified_header
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)

GB = 1e9


@dataclass
class GcPlan:
    floors: dict[int, int]
    newest: dict[int, int]
    delete: list[str] = field(default_factory=list)
    kept: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    skipped: Skipped = field(default_factory=Skipped)

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = defaultdict(int)
        for key in self.delete:
            kinds[_kind(key)] += 1
        return {"floors": {str(p): v for p, v in sorted(self.floors.items())},
                "newest": {str(p): v for p, v in sorted(self.newest.items())},
                "objects_to_delete": len(self.delete), "by_kind": dict(sorted(kinds.items())),
                "objects_kept": self.kept, "floor_reasons": self.reasons,
                "skipped_unverified": self.skipped.as_dict()}


def _kind(key: str) -> str:
    if key.startswith(layout.LEARNERS):
        return "delta"
    if key.startswith(layout.SYNCER + "state/"):
        return "state"
    return "update" if key.rsplit("/", 1)[-1].startswith("u") else "global"


def _manifest_keys(store: Store, skipped: Skipped) -> tuple[set[str], dict[int, int]]:
    """Every object key any snapshot names, and the oldest snapshot version per fragment (a
    manifest only makes gc keep more; a malformed one is skipped and counted)."""
    keys: set[str] = set()
    oldest: dict[int, int] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str) and node.endswith(layout.TENSOR_SUFFIX):
            keys.add(node)

    for key in store.list(layout.SNAPSHOTS):
        if not key.endswith("/manifest.json"):
            continue
        manifest = read_record(store, key, skipped=skipped, kind="manifest")
        if manifest is None:  # missing or not a JSON object: counted by read_record
            continue
        fragments = manifest.get("fragments")
        if not isinstance(fragments, dict) or not all(
                str(p).isdigit() and isinstance(e, dict) and type(e.get("version")) is int for p, e in fragments.items()):
            skipped.add("manifest", key, "malformed")
            continue
        walk(manifest)
        for p, entry in fragments.items():
            oldest[int(p)] = min(oldest.get(int(p), entry["version"]), entry["version"])
    return keys, oldest


def _versions(store: Store, verifier: Verifier | None, skipped: Skipped) -> dict[int, list[int]]:
    """Listed versions per fragment up to the newest one the syncer signed (with ``verifier``):
    a forged global at a huge version must not become the "newest" that floors count from."""
    out: dict[int, list[int]] = defaultdict(list)
    for key in store.list(layout.GLOBALS):
        try:
            p, v = layout.parse_global_key(key)
        except LayoutError:
            continue
        out[p].append(v)
    kept = {}
    for p, vs in out.items():
        vs.sort()
        while vs and verifier is not None:
            try:
                verified_header(store, layout.global_key(p, vs[-1]), verifier, SYNCER_SIGNER)
                break
            except (CodecError, NotFoundError) as exc:
                skipped.add("global", layout.global_key(p, vs.pop()), str(exc))
        if vs:
            kept[p] = vs
    return kept


def _live_bases(store: Store, now: float, lag_window_s: float, verifier: Verifier | None,
                skipped: Skipped) -> dict[int, int]:
    """Lowest base version per fragment among learners whose (verified) heartbeat is recent."""
    low: dict[int, int] = {}
    for learner in learner_ids(store)[0]:
        beat = heartbeat(store, learner, verifier, skipped)
        if beat is None or beat["time"] is None or now - beat["time"] > lag_window_s:
            continue
        for p, v in enumerate(beat["versions"] or []):
            low[p] = min(low.get(p, v), v)
    return low


def plan_gc(store: Store, *, keep_versions: int, replay_window_s: float, lag_window_s: float,
            now: float | None = None, verifier: Verifier | None = None) -> GcPlan:
    """What the policy deletes now; reads only (listings, records, heartbeats, delta headers). With
    ``verifier`` (a signed run) only what the syncer signed decides a deletion: merge and
    rejection records and the newest version; what does not verify is skipped and counted."""
    now = time.time() if now is None else now
    skipped = Skipped()
    versions = _versions(store, verifier, skipped)
    records = {(int(r["fragment"]), int(r["version"])): r for r in merge_records(store, verifier, skipped)}
    pinned, snap_oldest = _manifest_keys(store, skipped)
    live = _live_bases(store, now, lag_window_s, verifier, skipped)
    written = sorted(k for learner in learner_ids(store)[0] for k in store.list(layout.deltas_dir(learner)))
    merged_in: dict[str, tuple[int, int]] = {}
    for (p, v), rec in records.items():
        for entry in rec.get("merged") or []:
            merged_in[entry["key"]] = (p, v)
        for key in rec.get("superseded") or []:
            merged_in.setdefault(key, (p, v))
    rejected_at: dict[str, float] = {}
    for key in store.list(layout.SYNCER + "rejected/"):
        rec = read_record(store, key, verifier, SYNCER_SIGNER, skipped, "reject_record")
        at = rec.get("at", now) if rec is not None else None
        if rec is not None and isinstance(rec.get("key"), str) and isinstance(at, (int, float)) and math.isfinite(at):
            rejected_at[rec["key"]] = float(at)
    pending_bases: dict[int, int] = {}
    for key in written:
        if key in merged_in or key in rejected_at:
            continue
        try:
            header = read_header(store, key)
        except (CodecError, NotFoundError):
            continue  # unreadable: the syncer will reject it; it stays until then
        pending_bases[header.fragment] = min(pending_bases.get(header.fragment, header.base_version),
                                             header.base_version)

    floors, reasons = {}, defaultdict(int)
    for p, vs in versions.items():
        window = [v for v in vs if float(records.get((p, v), {}).get("published_at") or 0) >= now - replay_window_s]
        candidates = {"keep_versions": vs[-1] - keep_versions + 1, "snapshot": snap_oldest.get(p),
                      "replay_window": (min(window) - 1) if window else None, "live_learner": live.get(p),
                      "pending_delta": pending_bases.get(p)}
        floor, why = vs[-1] - keep_versions + 1, "keep_versions"
        for name, value in candidates.items():
            if value is not None and value < floor:
                floor, why = value, name
        while True:  # kept versions must be recomputable from kept objects
            needed = [floor]
            for v in (x for x in vs if x > floor):  # listed ones only: a forged v9999999999 is one entry
                rec = records.get((p, v), {})
                needed += [int(e["base_version"]) for e in rec.get("merged") or []]
                if rec.get("kind") == "rollback" and isinstance(rec.get("from_version"), int):
                    needed.append(rec["from_version"])
            if min(needed) >= floor:
                break
            floor, why = min(needed), "chain"
        floors[p] = max(vs[0], floor)
        reasons[why] += 1

    plan = GcPlan(floors, {p: vs[-1] for p, vs in versions.items()}, reasons=dict(reasons), skipped=skipped)
    for key in written:
        if key in pinned:
            continue
        if key in merged_in:
            p, v = merged_in[key]
            if v <= floors.get(p, -1):
                plan.delete.append(key)
        elif key in rejected_at and now - rejected_at[key] > replay_window_s:
            plan.delete.append(key)
    for p, vs in versions.items():
        for v in vs:
            if v < floors[p]:
                for key in (layout.global_update_key(p, v), layout.global_key(p, v)):
                    if key not in pinned:
                        plan.delete.append(key)
    for key in store.list(layout.SYNCER + "state/"):
        try:
            p, v = _state_version(key)
        except LayoutError:
            continue
        if p in floors and v < floors[p] and key not in pinned:
            plan.delete.append(key)
    listed = len(store.list(""))
    plan.kept = listed - len(plan.delete)
    return plan


def _state_version(key: str) -> tuple[int, int]:
    parts = key.split("/")
    if len(parts) != 4 or not parts[2].startswith("f") or not parts[3].startswith("v"):
        raise LayoutError(f"not a state key: {key!r}")
    return int(parts[2][1:]), int(parts[3][1:1 + layout.VERSION_DIGITS])


def apply_gc(store: Store, plan: GcPlan) -> int:
    """Delete the plan's objects (deltas, then updates, globals, states); returns how many went."""
    order = {"delta": 0, "update": 1, "global": 2, "state": 3}
    done = 0
    for key in sorted(plan.delete, key=lambda k: (order[_kind(k)], k)):
        try:
            store.delete(key)
            done += 1
        except NotFoundError:
            continue  # already gone (a concurrent gc): the same outcome
    log.info("gc_deleted objects=%d", done)
    return done


def bytes_held(store: Store, prefix: str = "") -> dict[str, float]:
    """Bytes under ``prefix`` by top-level folder. One GET per object: the storage protocol has no
    size listing yet, so use on small runs or with ``--bytes`` deliberately."""
    held: dict[str, float] = defaultdict(float)
    for key in store.list(prefix):
        held[key.split("/", 1)[0]] += len(store.get(key))
    return {k: round(v / GB, 6) for k, v in sorted(held.items())}
