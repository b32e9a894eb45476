"""The run as the bucket holds it: the run spec, the index of global versions, and reads of them.

Shared by the learner, the syncer, ``local`` and the tools, so that every reader interprets the
bucket the same way. The write side of globals belongs to the syncer; this module only reads them
(and creates the run spec once, create-only: the first writer wins and every later one must agree).

Run spec (``run.json``, JSON, layout version 1): run id, model settings, fragment plan and its
digest, schedule (P, H, tau), wire codec. A learner whose own model produces a different plan
refuses to join with a message naming both digests.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco_geo import codec

from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import CodecError, ConfigError, NotFoundError, PreconditionFailedError
from ddiloco_geo.core.fragments import FragmentPlan
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSpec:
    run_id: str
    model: dict[str, Any]
    plan: FragmentPlan
    sync_every: int
    overlap: int
    codec: str
    block_size: int
    layout_version: int = layout.LAYOUT_VERSION

    def to_json(self) -> str:
        return json.dumps(
            {
                "layout_version": self.layout_version,
                "run_id": self.run_id,
                "model": self.model,
                "plan": json.loads(self.plan.to_json()),
                "plan_digest": self.plan.digest(),
                "sync_every": self.sync_every,
                "overlap": self.overlap,
                "codec": self.codec,
                "block_size": self.block_size,
            },
            sort_keys=True,
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> "RunSpec":
        try:
            d = json.loads(text)
            if d.get("layout_version") != layout.LAYOUT_VERSION:
                raise ConfigError(
                    f"run.json has layout version {d.get('layout_version')!r}; this build reads "
                    f"{layout.LAYOUT_VERSION}: use a matching ddiloco-geo release"
                )
            plan = FragmentPlan.from_json(json.dumps(d["plan"]))
            if plan.digest() != d["plan_digest"]:
                raise ConfigError("run.json is inconsistent: its plan does not match its plan_digest")
            return cls(
                run_id=d["run_id"], model=d["model"], plan=plan, sync_every=int(d["sync_every"]),
                overlap=int(d["overlap"]), codec=d["codec"], block_size=int(d["block_size"]),
            )
        except (KeyError, TypeError, ValueError, CodecError) as exc:
            raise ConfigError(f"run.json is malformed ({exc}); was it written by ddiloco-geo?") from None


def create_or_load_spec(store: Store, spec: RunSpec) -> RunSpec:
    """Create ``run.json`` if absent; otherwise load it and check it describes the same training."""
    store.put_if_absent(layout.RUN_SPEC, spec.to_json().encode())
    existing = load_spec(store)
    if existing.plan.digest() != spec.plan.digest():
        raise ConfigError(
            f"the run at {store.url} was created with fragment plan {existing.plan.digest()[:12]} but this "
            f"process's model gives {spec.plan.digest()[:12]}: use the run's model settings "
            f"({existing.model}) or a new --store"
        )
    return existing


def load_spec(store: Store) -> RunSpec:
    return RunSpec.from_json(store.get(layout.RUN_SPEC))


def wait_for_spec(store: Store, timeout_s: float, poll_s: float = 0.5) -> RunSpec:
    """The one wait a learner may do: for the run to exist at all (first pull of the model)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return load_spec(store)
        except NotFoundError:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"no run.json at {store.url} after {timeout_s:.0f}s: start a syncer on this store first"
                ) from None
            time.sleep(poll_s)


# --- the index of global versions ----------------------------------------------------------------


def read_index(store: Store) -> tuple[dict[int, int], str | None]:
    """Newest published version per fragment, and the CAS token ({} and None if absent)."""
    try:
        data, token = store.read_token(layout.globals_index_key())
    except NotFoundError:
        return {}, None
    try:
        raw = json.loads(data)["versions"]
        return {int(p): int(v) for p, v in raw.items()}, token
    except (ValueError, KeyError, TypeError):
        log.warning("index_malformed key=%s action=rebuild_on_next_publish", layout.globals_index_key())
        return {}, token


def advance_index(store: Store, versions: dict[int, int], attempts: int = 50) -> dict[int, int]:
    """Raise the index's entries to at least ``versions`` (never lowers one); CAS with retry."""
    for _ in range(attempts):
        current, token = read_index(store)
        merged = dict(current)
        for p, v in versions.items():
            merged[p] = max(v, merged.get(p, -1))
        if merged == current and token is not None:
            return current
        body = json.dumps({"versions": {str(p): v for p, v in sorted(merged.items())}}).encode()
        try:
            store.cas(layout.globals_index_key(), body, token)
            return merged
        except PreconditionFailedError:
            time.sleep(0.01)
    raise PreconditionFailedError(f"globals index still contended after {attempts} attempts")


def list_versions(store: Store, fragment: int) -> list[int]:
    out = []
    for key in store.list(layout.fragment_dir(fragment)):
        try:
            out.append(layout.parse_global_key(key)[1])
        except layout.LayoutError:
            continue
    return out


def latest_version(store: Store, fragment: int, hint: int | None = None) -> int | None:
    """Newest version of one fragment by listing (authoritative; the index may lag a crash)."""
    start = layout.global_key(fragment, hint) if hint is not None and hint > 0 else None
    keys_after = store.list(layout.fragment_dir(fragment), start_after=start)
    versions = []
    for key in keys_after:
        try:
            versions.append(layout.parse_global_key(key)[1])
        except layout.LayoutError:
            continue
    if versions:
        return max(versions)
    return hint


def read_global(store: Store, spec: RunSpec, fragment: int, version: int, *, verify=None,
                require_signature: bool = False) -> tuple[codec.Header, dict[str, torch.Tensor]]:
    """A global fragment version; with ``verify``, only if the syncer signed it."""
    data = store.get(layout.global_key(fragment, version))
    header, tensors = codec.decode(data, kind="global", run_id=spec.run_id, expect=spec.plan.expect(fragment),
                                   verify=verify, require_signature=require_signature,
                                   expected_signer="syncer" if verify is not None else None)
    if header.fragment != fragment or header.version != version:
        raise CodecError("bad_header", f"global {fragment}/{version} claims {header.fragment}/{header.version}")
    return header, tensors


def read_header(store: Store, key: str) -> codec.Header:
    """Header only, with two ranged reads (the safetensors header length, then the header)."""
    head = store.get(key, 0, 8)
    span = codec.header_span(head)
    return codec.read_header(head + store.get(key, 8, span))


# --- the delta ledger ----------------------------------------------------------------------------


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
    for prefix in store.list_prefixes(layout.LEARNERS):
        learner = prefix[len(layout.LEARNERS):].strip("/")
        if not layout.ID_PATTERN.match(learner):
            continue
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
    quarantined = {k[len(layout.SYNCER + "quarantine/"):-len(".json")] for k in store.list(layout.SYNCER + "quarantine/")}
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


def read_global_params(store: Store, spec: RunSpec) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
    """The newest published version of every fragment, as one parameter dict (the global model)."""
    index, _ = read_index(store)
    params: dict[str, torch.Tensor] = {}
    versions: dict[int, int] = {}
    for p in range(spec.plan.num_fragments):
        version = latest_version(store, p, hint=index.get(p))
        if version is None:
            raise NotFoundError(f"fragment {p} has no published version at {store.url}")
        _, tensors = read_global(store, spec, p, version)
        params.update(tensors)
        versions[p] = version
    return params, versions
