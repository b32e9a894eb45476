"""Snapshots, restore, rollback and export: operations on a run that never stop it.

``ddiloco-geo snapshot --store URL [--id ID]``
    Write ``snapshots/<id>/manifest.json`` (create-only): a consistent cut of the run — for every
    fragment one published version (its global key, state key, vector clock and per-learner
    high-water marks), plus every delta written but not yet accounted for by that version (key,
    counters, base version, vector clock). Training goes on while it is taken. Order of reads:
    all learners' delta prefixes, then ``syncer/rejected/``, then each ``globals/fPPP/`` listing
    (authoritative; the index may lag). docs/operations.md has the consistency argument.

``ddiloco-geo restore --store URL --snapshot ID --to URL2``
    Start a new run at URL2 from the snapshot: ``run.json`` (same run id, model and plan), each
    fragment's snapshot global under its own key (byte copy, same version number), its state object
    under its own key (same momentum and residual tensors, high-water marks reset: the new run has
    no deltas), the index, and the manifest. A syncer started on URL2 resumes from exactly those
    versions and outer states. Deltas are not copied: in-flight work is not carried over.

``ddiloco-geo restore --store URL --snapshot ID --rollback [--force] [--active-window S]``
    Roll the run back in place. Objects are create-only and versions only move forward, so for
    every fragment whose newest version is past the snapshot's, a rollback publishes a **new**
    version v_current + 1 with the snapshot's params and outer state (momentum, step count,
    residual) and the merge record ``{"kind": "rollback", "snapshot": ID, "from_version": v_snap}``,
    with the syncer's publish order (state, global = commit point, tape, index). Nothing is deleted
    or overwritten. Refuses while a syncer status (``syncer/status/*.json``) or lease was updated
    in the last ``--active-window`` seconds, unless ``--force``.

``ddiloco-geo export --store URL [--snapshot ID] --out model.safetensors``
    The global model (newest versions, or the snapshot's) as one plain safetensors file: parameter
    names as keys, fp32, metadata ``run_id``, ``versions`` (JSON), ``model`` (JSON of the model
    settings), ``snapshot`` — readable with ``safetensors.torch.load_file`` alone.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from datetime import datetime, timezone
from typing import Any

import torch
from safetensors.torch import save_file

from ddiloco_geo import codec, protocol
from ddiloco_geo.core import layout
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.errors import CodecError, DdilocoError, NotFoundError
from ddiloco_geo.core.signing import sign_record, verify_record
from ddiloco_geo.protocol.publish import commit_version
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1
ROLLBACK_ACTOR = "syncer"  # rollback versions are published on the syncer's behalf
DEFAULT_ACTIVE_WINDOW_S = 30.0


class SnapshotError(DdilocoError):
    pass


def default_snapshot_id(now: float | None = None) -> str:
    t = datetime.fromtimestamp(time.time() if now is None else now, tz=timezone.utc)
    return t.strftime("s%Y%m%dt%H%M%Sz")


def _clock_json(clock: VectorClock) -> dict[str, int]:
    return json.loads(clock.to_json())


# --- snapshot ------------------------------------------------------------------------------------


def _list_deltas(store: Store) -> list[str]:
    found = []
    for learner in protocol.learner_ids(store)[0]:
        found.extend(store.list(layout.deltas_dir(learner)))
    return found


def _rejected_keys(store: Store) -> set[str]:
    """Delta keys with a rejection record (rebuilt from the record's key, which mirrors the delta's)."""
    out = set()
    for key in store.list(layout.SYNCER + "rejected/"):
        rest = key[len(layout.SYNCER + "rejected/"):]
        if rest.endswith(".json"):
            learner, _, name = rest.partition("/")
            out.add(f"{layout.LEARNERS}{learner}/deltas/{name[:-len('.json')]}{layout.TENSOR_SUFFIX}")
    return out


def take_snapshot(store: Store, spec: protocol.RunSpec, snapshot_id: str | None = None,
                  now: float | None = None, verifier=None, signer=None) -> dict[str, Any]:
    """Build and write the manifest (create-only; in a signed run signed with the run's syncer key,
    which whoever holds the run secret holds); return it. SnapshotError if the id exists."""
    now = time.time() if now is None else now
    snapshot_id = layout.check_id(snapshot_id or default_snapshot_id(now), "snapshot id")
    manifest_key = layout.snapshot_manifest_key(snapshot_id)
    try:
        store.get(manifest_key, 0, 1)
        raise SnapshotError(f"snapshot {snapshot_id!r} already exists at {manifest_key}: pick another --id "
                            "(snapshots are create-only)")
    except NotFoundError:
        pass
    # 1. deltas first: every delta listed here was written before any version chosen below exists
    #    (or is older), so no listed delta can depend on a version after the cut
    written = _list_deltas(store)
    rejected = _rejected_keys(store)
    # 2. the newest version of every fragment, by listing (authoritative)
    index, _ = protocol.read_index(store, verifier)
    fragments: dict[str, Any] = {}
    consumed_by: dict[int, dict[str, int]] = {}
    frontier = VectorClock()
    for p in range(spec.plan.num_fragments):
        versions = protocol.list_versions(store, p)
        if not versions:
            raise SnapshotError(f"fragment {p} has no published version yet: start the syncer first")
        v, header = _newest_verified(store, p, versions, verifier)
        gkey = layout.global_key(p, v)
        state_key = header.extra.get("state_key")
        consumed: dict[str, int] = {}
        if state_key:
            st = protocol.verified_header(store, state_key, verifier, "syncer")
            consumed = {str(k): int(x) for k, x in st.extra.get("consumed", {}).items()}
        consumed_by[p] = consumed
        frontier = frontier.merge(header.clock)
        fragments[str(p)] = {"version": v, "global": gkey, "state_key": state_key, "clock": _clock_json(header.clock),
                             "consumed": consumed, "kind": header.extra.get("kind")}
    # 3. in flight: written, above the fragment's high-water mark for that learner, not rejected
    in_flight = []
    for key in sorted(written):
        try:
            dk = layout.parse_delta_key(key)
        except layout.LayoutError:
            continue
        if dk.fragment not in consumed_by or key in rejected:
            continue
        if dk.seq <= consumed_by[dk.fragment].get(dk.learner, -1):
            continue
        entry: dict[str, Any] = {"key": key, "learner": dk.learner, "seq": dk.seq, "fragment": dk.fragment}
        try:
            h = protocol.read_header(store, key)
            entry.update(base_version=h.base_version, num_steps=h.num_steps, num_tokens=h.num_tokens,
                         clock=_clock_json(h.clock))
            frontier = frontier.merge(h.clock)
        except (CodecError, NotFoundError) as exc:
            entry.update(clock=None, error=str(exc))
        in_flight.append(entry)
    manifest = {
        "format": MANIFEST_FORMAT,
        "snapshot": snapshot_id,
        "run_id": spec.run_id,
        "plan_digest": spec.plan.digest(),
        "created_at": datetime.fromtimestamp(now, tz=timezone.utc).isoformat(),
        "created_at_unix": now,
        "fragments": fragments,
        "in_flight": in_flight,
        "clock": _clock_json(frontier),
        "index_at_cut": {str(p): v for p, v in sorted(index.items())},
    }
    manifest = sign_record(manifest, signer)
    body = json.dumps(manifest, indent=1, sort_keys=True).encode()
    if not store.put_if_absent(manifest_key, body):
        if store.get(manifest_key) != body:  # a retried create finds its own object: that is fine
            raise SnapshotError(f"snapshot {snapshot_id!r} already exists at {manifest_key}: pick another --id "
                                "(snapshots are create-only)")
    log.info("snapshot_written id=%s versions=%s in_flight=%d", snapshot_id,
             {p: f["version"] for p, f in fragments.items()}, len(in_flight))
    return manifest


def load_manifest(store: Store, snapshot_id: str, verifier=None) -> dict[str, Any]:
    """A snapshot's manifest; with ``verifier`` (a signed run) only if the run's key signed it."""
    key = layout.snapshot_manifest_key(snapshot_id)
    try:
        manifest = json.loads(store.get(key))
    except NotFoundError:
        raise SnapshotError(f"no snapshot {snapshot_id!r} at {store.url} ({key} not found)") from None
    except ValueError as exc:
        raise SnapshotError(f"{key} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise SnapshotError(f"{key} is not a JSON object")
    if verifier is not None and not verify_record(manifest, verifier, "syncer"):
        raise SnapshotError(f"{key} is not signed with this run's key: forged, altered, or written without "
                            "security.run_secret; refusing to use it")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise SnapshotError(f"{key} has format {manifest.get('format')!r}; this build reads {MANIFEST_FORMAT}")
    return manifest


def snapshot_versions(manifest: dict[str, Any]) -> dict[int, int]:
    return {int(p): int(f["version"]) for p, f in manifest["fragments"].items()}


def _check_run(manifest: dict[str, Any], spec: protocol.RunSpec) -> None:
    if manifest["run_id"] != spec.run_id or manifest["plan_digest"] != spec.plan.digest():
        raise SnapshotError(f"snapshot {manifest['snapshot']!r} belongs to run {manifest['run_id']!r} "
                            f"(plan {manifest['plan_digest'][:12]}), not to this run {spec.run_id!r} "
                            f"(plan {spec.plan.digest()[:12]})")


# --- restore into a new run ----------------------------------------------------------------------


def _put_same(store: Store, key: str, data: bytes) -> None:
    """Create-only, idempotent: an existing identical object is fine, a different one is an error."""
    if not store.put_if_absent(key, data) and store.get(key) != data:
        raise SnapshotError(f"{store.url}/{key} already exists with other content: restore into an empty --to store")


def restore_to(src: Store, manifest: dict[str, Any], dst: Store) -> dict[int, int]:
    """Start a new run at ``dst`` from a snapshot; returns the versions it starts from."""
    spec_bytes = src.get(layout.RUN_SPEC)
    spec = protocol.RunSpec.from_json(spec_bytes)
    _check_run(manifest, spec)
    ours = {f["global"] for f in manifest["fragments"].values()}
    foreign = [k for k in dst.list(layout.GLOBALS) if k not in ours and k != layout.globals_index_key()]
    foreign += dst.list(layout.LEARNERS, limit=1)
    if foreign:  # a rerun of an interrupted restore finds only its own objects, and may go on
        raise SnapshotError(f"{dst.url} already holds a run ({foreign[0]}): restore into an empty --to store")
    _put_same(dst, layout.RUN_SPEC, spec_bytes)
    versions = snapshot_versions(manifest)
    for p, v in sorted(versions.items()):
        frag = manifest["fragments"][str(p)]
        global_bytes = src.get(frag["global"])
        header = codec.read_header(global_bytes)
        state_key = header.extra.get("state_key")
        if state_key != frag["state_key"] or header.version != v or header.fragment != p:
            raise SnapshotError(f"{frag['global']} does not match the manifest (state {state_key!r})")
        st_header, st_tensors = codec.decode(src.get(state_key), kind="state", run_id=spec.run_id)
        # the new run has no deltas: high-water marks from the old run would make a learner that
        # reuses an id (and so restarts its sequence at 0) have its first deltas skipped
        st_header.extra = {**st_header.extra, "consumed": {},
                           "restored_from": {"snapshot": manifest["snapshot"], "consumed": st_header.extra.get("consumed", {})}}
        _put_same(dst, state_key, codec.encode(st_tensors, st_header, codec="fp32"))
        _put_same(dst, frag["global"], global_bytes)  # the commit point comes after its state
    _put_same(dst, layout.snapshot_manifest_key(manifest["snapshot"]), src.get(layout.snapshot_manifest_key(manifest["snapshot"])))
    protocol.advance_index(dst, versions)
    log.info("restored snapshot=%s to=%s versions=%s", manifest["snapshot"], dst.url, versions)
    return versions


# --- roll back in place --------------------------------------------------------------------------


def active_syncers(store: Store, window_s: float, now: float | None = None) -> list[str]:
    """Syncer status objects (``time``) or leases (``time``/``renewed_at``/``expires_at``, wall
    seconds) that show a syncer alive within ``window_s``; one line each."""
    now = time.time() if now is None else now
    found = []
    for prefix in (layout.SYNCER + "status/", layout.SYNCER + "leases/"):
        for key in store.list(prefix):
            try:
                doc = json.loads(store.get(key))
            except (ValueError, NotFoundError):
                continue
            if not isinstance(doc, dict):
                continue
            if isinstance(doc.get("expires_at"), (int, float)) and doc["expires_at"] > now:
                found.append(f"{key}: lease held until {doc['expires_at'] - now:.0f} s from now")
                continue
            stamps = [doc.get(f) for f in ("time", "renewed_at", "updated_at")]
            stamps = [s for s in stamps if isinstance(s, (int, float))]
            if stamps and now - max(stamps) < window_s and not doc.get("stopped"):
                found.append(f"{key}: updated {now - max(stamps):.0f} s ago")
    return found


def rollback(store: Store, manifest: dict[str, Any], *, force: bool = False,
             active_window_s: float = DEFAULT_ACTIVE_WINDOW_S, attempts: int = 5) -> dict[str, Any]:
    """Publish, for every fragment past the snapshot, a new version equal to the snapshot's."""
    spec = protocol.load_spec(store)
    _check_run(manifest, spec)
    active = active_syncers(store, active_window_s)
    if active and not force:
        raise SnapshotError("a syncer looks active (" + "; ".join(active) + "): stop it first, or pass --force "
                            "(a running syncer then loses its next publish race and adopts the rollback)")
    snap = snapshot_versions(manifest)
    published: dict[int, int] = {}
    unchanged: list[int] = []
    for p, v_snap in sorted(snap.items()):
        src_header, params = protocol.read_global(store, spec, p, v_snap)
        st_header, st_tensors = codec.decode(store.get(src_header.extra["state_key"]), kind="state", run_id=spec.run_id)
        for _ in range(attempts):
            current = protocol.latest_version(store, p)
            if current is None or current < v_snap:
                raise SnapshotError(f"fragment {p} is at version {current}, before the snapshot's {v_snap}: "
                                    "is this the snapshot's run?")
            if current == v_snap:
                unchanged.append(p)
                break
            cur_header = protocol.read_header(store, layout.global_key(p, current))
            cur_state = protocol.read_header(store, cur_header.extra["state_key"])
            version = current + 1
            clock = cur_header.clock.merge(src_header.clock).tick(ROLLBACK_ACTOR)
            # momentum and residual are the snapshot's; the high-water marks stay the current ones,
            # so no delta already accounted for is merged again and none is dropped
            consumed = cur_state.extra.get("consumed", {})
            record = {"kind": "rollback", "snapshot": manifest["snapshot"], "from_version": v_snap,
                      "rolled_back_version": current, "merged": [], "superseded": [], "contributors": 0}
            state_key = commit_version(
                store, run_id=spec.run_id, fragment=p, version=version, params=params, state_tensors=st_tensors,
                state_extra={"consumed": consumed, "outer_num_steps": int(st_header.extra.get("outer_num_steps", 0)),
                             "rollback": {"snapshot": manifest["snapshot"], "from_version": v_snap}},
                record=record, clock=clock)
            if state_key is None:  # a syncer published this version first
                log.warning("rollback_race_lost fragment=%d version=%d action=retry", p, version)
                continue
            published[p] = version
            log.info("rolled_back fragment=%d from=%d to_snapshot_version=%d as=%d", p, current, v_snap, version)
            break
        else:
            raise SnapshotError(f"fragment {p}: lost the publish race {attempts} times; is a syncer running?")
    return {"snapshot": manifest["snapshot"], "published": {str(p): v for p, v in published.items()},
            "unchanged": unchanged, "forced": bool(active and force)}


def _newest_verified(store: Store, p: int, versions: list[int], verifier) -> tuple[int, Any]:
    """The newest version whose header the syncer signed (with ``verifier``); forged ones skipped."""
    for v in sorted(versions, reverse=True):
        try:
            return v, protocol.verified_header(store, layout.global_key(p, v), verifier, "syncer")
        except (CodecError, NotFoundError) as exc:
            log.warning("snapshot_version_skipped key=%r reason=%s", layout.global_key(p, v), exc)
    raise SnapshotError(f"fragment {p} has no verified version: check security.run_secret")


# --- export --------------------------------------------------------------------------------------


def export_params(store: Store, spec: protocol.RunSpec, manifest: dict[str, Any] | None, verifier=None,
                  require_signatures: bool = False) -> tuple[dict[str, torch.Tensor], dict[int, int], protocol.Skipped]:
    """What every export writes: with ``verifier`` only syncer-signed globals, the newest that
    verifies per fragment (forged newer ones skipped and counted) or the snapshot's, which must."""
    if manifest is None:
        found = protocol.global_model(store, spec, verifier, require_signatures)
        return found.params, found.versions, found.skipped
    _check_run(manifest, spec)
    versions = snapshot_versions(manifest)
    params: dict[str, torch.Tensor] = {}
    for p, v in sorted(versions.items()):
        params.update(protocol.read_global(store, spec, p, v, verify=verifier, require_signature=require_signatures)[1])
    return params, versions, protocol.Skipped()


def export_model(store: Store, out: str, manifest: dict[str, Any] | None = None, verifier=None,
                 require_signatures: bool = False) -> dict[str, Any]:
    """Write the global model to ``out`` (atomically); returns what was written. With ``verifier``
    only syncer-signed globals: the newest that verifies per fragment (forged newer ones are skipped
    and counted in ``skipped_unverified``), or the snapshot's, which must verify."""
    spec = protocol.load_spec(store)
    params, versions, skipped = export_params(store, spec, manifest, verifier, require_signatures)
    tensors = {n: t.detach().to(torch.float32).contiguous() for n, t in sorted(params.items())}
    metadata = {
        "format": "ddiloco-geo-export-1",
        "run_id": spec.run_id,
        "versions": json.dumps({str(p): v for p, v in sorted(versions.items())}),
        "model": json.dumps(spec.model, sort_keys=True),
        "snapshot": manifest["snapshot"] if manifest else "",
    }
    out = os.path.abspath(out)
    directory = os.path.dirname(out)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".export-", suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return {"out": out, "run_id": spec.run_id, "versions": {str(p): v for p, v in sorted(versions.items())},
            "tensors": len(tensors), "parameters": int(sum(t.numel() for t in tensors.values())),
            "bytes": os.path.getsize(out), "snapshot": metadata["snapshot"] or None,
            "skipped_unverified": skipped.as_dict()}
