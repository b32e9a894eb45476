"""The one verified read path: what every tool and role reads back from the bucket, and trusts.

Anyone who can write the bucket without the run secret can put objects anywhere (``docs/security.md``:
the learners/-write and anywhere-write capabilities). In a signed run (a :class:`~ddiloco_geo.core.
signing.Verifier` is given) nothing read here is believed unless the syncer (globals, updates, state,
tape entries, rejection and quarantine records, status) or the learner (heartbeats, exit records)
signed it; what fails is skipped, counted in a :class:`Skipped` and logged once with the key quoted
(``%r``: a newline in a key cannot forge a log line). Without a verifier (an unsigned run) the same
functions read everything that parses: there is nothing to check against.

- :func:`newest_global` / :func:`global_model`: the newest version of a fragment that verifies, not
  the newest key (a forged ``v9999999999`` is skipped, and so is a forged ``globals/HEAD``);
- :func:`verified_header`: a tensor object's header and its signature, with two ranged reads;
- :func:`read_record`: a JSON record, signed by whom it should be; :func:`heartbeat` and
  :func:`exit_record` also validate every field a tool uses (types, ranges, lengths), so a heartbeat
  whose ``time`` is a string reads as absent instead of crashing ``status``;
- :func:`record_forged` (at ``layout.forged_key``): where the syncer sets aside a global that fails
  verification (``syncer/forged/fPPP/vVVVVVVVVVV.json``; the object stays for an operator to delete).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco_geo import codec
from ddiloco_geo.codec.framing import as_bytes, parse_framing
from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import CodecError, NotFoundError, StorageError
from ddiloco_geo.core.signing import (
    SIGNATURE_FIELD, SIGNER_FIELD, Verifier, sign_record, signed_message, verify_record,
)
from ddiloco_geo.protocol.index import list_versions, read_global
from ddiloco_geo.protocol.spec import RunSpec
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)

SYNCER_SIGNER = "syncer"
MAX_RECORD_BYTES = 4 * 2**20  # heartbeats and exit records (with history) are far smaller
MAX_TEXT = 300  # longest string field a tool shows


@dataclass
class Skipped:
    """What a reader refused, by kind (``global``, ``tape``, ``heartbeat``, ...): counted and shown."""

    counts: dict[str, int] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)  # the first few, for the operator

    def add(self, kind: str, key: str, why: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if len(self.keys) < 20:
            self.keys.append(key)
        log.warning("unverified_object_skipped kind=%s key=%r reason=%r", kind, key, why[:200])

    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, Any]:
        return {"total": self.total(), "by_kind": dict(self.counts), "keys": list(self.keys)}


def learner_signer(learner: str) -> str:
    return f"learner:{learner}"


# --- tensor objects ------------------------------------------------------------------------------


def verified_header(store: Store, key: str, verifier: Verifier | None, expected_signer: str,
                    require: bool = True) -> codec.Header:
    """The header of a tensor object (two ranged reads); with ``verifier``, only if
    ``expected_signer`` signed it (the signature covers every metadata field, the tensor checksum
    included, so a verified header is the signer's). CodecError(reason) otherwise."""
    head = store.get(key, 0, 8)
    span = codec.header_span(head)
    data = head + store.get(key, 8, span)
    header = codec.read_header(data)
    if verifier is None:
        return header
    entries, _ = parse_framing(as_bytes(data), prefix_only=True)
    meta = entries.get("__metadata__") or {}
    signer, signature = meta.get(SIGNER_FIELD), meta.get(SIGNATURE_FIELD)
    if signature is None:
        if require:
            raise CodecError("unsigned", "object has no signature and signatures are required")
        return header
    if signer != expected_signer or not verifier.verify(signer, signed_message(meta), signature):
        raise CodecError("bad_signature", f"not signed by {expected_signer!r}")
    header.signer = signer
    return header


def newest_global(store: Store, spec: RunSpec, fragment: int, verifier: Verifier | None = None,
                  require: bool = False, skipped: Skipped | None = None, below: int | None = None
                  ) -> tuple[int, codec.Header, dict[str, torch.Tensor]] | None:
    """(version, header, params) of the newest version of ``fragment`` that decodes and verifies
    (at most ``below`` - 1), or None. Newer keys that fail are skipped and counted: the listing, not
    the index, is read, since ``globals/HEAD`` is not signed."""
    skipped = skipped if skipped is not None else Skipped()
    for version in sorted(list_versions(store, fragment), reverse=True):
        if below is not None and version >= below:
            continue
        try:
            header, params = read_global(store, spec, fragment, version, verify=verifier, require_signature=require)
            return version, header, params
        except NotFoundError:
            continue
        except CodecError as exc:
            skipped.add("global", layout.global_key(fragment, version), f"{exc.reason}: {exc.detail}")
    return None


@dataclass
class GlobalModel:
    params: dict[str, torch.Tensor]
    versions: dict[int, int]
    skipped: Skipped


def global_model(store: Store, spec: RunSpec, verifier: Verifier | None = None, require: bool = False) -> GlobalModel:
    """The newest verified version of every fragment, as one parameter dict."""
    skipped = Skipped()
    params: dict[str, torch.Tensor] = {}
    versions: dict[int, int] = {}
    for p in range(spec.plan.num_fragments):
        found = newest_global(store, spec, p, verifier, require, skipped)
        if found is None:
            raise NotFoundError(f"fragment {p} has no verified published version at {store.url}")
        versions[p], _, tensors = found
        params.update(tensors)
    return GlobalModel(params, versions, skipped)


# --- JSON records --------------------------------------------------------------------------------


def read_record(store: Store, key: str, verifier: Verifier | None = None, expected_signer: str | None = None,
                skipped: Skipped | None = None, kind: str = "record") -> dict[str, Any] | None:
    """The JSON object at ``key``; None if missing, too large, not a JSON object, or (with
    ``verifier``) not signed by ``expected_signer`` (counted in ``skipped``)."""
    try:
        data = store.get(key, 0, MAX_RECORD_BYTES + 1)
    except NotFoundError:
        return None
    except StorageError as exc:
        log.debug("record_unreadable key=%r error=%s", key, exc)
        return None
    why = None
    value = None
    if len(data) > MAX_RECORD_BYTES:
        why = "too large"
    else:
        try:
            value = json.loads(data)
        except (ValueError, RecursionError):
            why = "not JSON"
    if why is None and not isinstance(value, dict):
        why = "not a JSON object"
    if why is None and verifier is not None and not verify_record(value, verifier, expected_signer or ""):
        why = f"not signed by {expected_signer!r}"
    if why is not None:
        if skipped is not None:
            skipped.add(kind, key, why)
        return None
    return value


def _number(value: Any, low: float = 0.0, high: float = math.inf) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and low <= value <= high else None


def _count(value: Any) -> int | None:
    number = _number(value, 0, 2**62)
    return int(number) if number is not None else None


def _text(value: Any) -> str | None:
    return value[:MAX_TEXT] if isinstance(value, str) else None


def _storage(value: Any) -> dict[str, int]:
    value = value if isinstance(value, dict) else {}
    return {k: _count(value.get(k)) or 0 for k in ("bytes_up", "bytes_down")}


def _versions(value: Any) -> list[int] | None:
    """A learner's base version per fragment: a list of non-negative ints, else absent."""
    if not isinstance(value, list) or len(value) > 100_000:
        return None
    out = [_count(v) for v in value]
    return None if any(v is None for v in out) else out


def clean_learner_record(rec: dict[str, Any]) -> dict[str, Any]:
    """The fields of a heartbeat or exit record that tools use, each checked (absent if invalid):
    numbers finite and in range, strings short, nested objects objects. Times more than a day in
    the future read as absent (a forged 'alive forever')."""
    uploads = rec.get("uploads") if isinstance(rec.get("uploads"), dict) else {}
    history = rec.get("history") if isinstance(rec.get("history"), list) else []
    return {
        "time": _number(rec.get("time"), 0, time.time() + 86400),
        "state": _text(rec.get("state")), "region": _text(rec.get("region")), "reason": _text(rec.get("reason")),
        "step": _count(rec.get("step")), "tokens": _count(rec.get("tokens")),
        "tokens_per_s": _number(rec.get("tokens_per_s")), "loss": _number(rec.get("loss"), -math.inf),
        "upload_queue": _count(rec.get("upload_queue")),
        "uploads": {"deltas_sent": _count(uploads.get("deltas_sent"))},
        "storage": _storage(rec.get("storage")),
        "versions": _versions(rec.get("versions")),
        "fragment_steps": {k: _count((rec.get("fragment_steps") if isinstance(rec.get("fragment_steps"), dict)
                                      else {}).get(k)) for k in ("trained", "past_send", "discarded")},
        "send_timing": {k: _count(rec["send_timing"].get(k)) for k in ("lead", "on_time", "late")}
        if isinstance(rec.get("send_timing"), dict) else None,
        "history": [h for h in history[:100_000] if isinstance(h, dict)],
        "signer": _text(rec.get("signer")),
        "checkpoint": _text(rec.get("checkpoint")), "resumed_from": _text(rec.get("resumed_from")),
        "flushed": rec.get("flushed") if isinstance(rec.get("flushed"), (bool, int)) else None,
    }


def heartbeat(store: Store, learner: str, verifier: Verifier | None = None,
              skipped: Skipped | None = None) -> dict[str, Any] | None:
    """A learner's heartbeat, signed by that learner (with ``verifier``), fields validated."""
    rec = read_record(store, layout.heartbeat_key(learner), verifier, learner_signer(learner), skipped, "heartbeat")
    return clean_learner_record(rec) if rec is not None else None


def exit_record(store: Store, learner: str, verifier: Verifier | None = None,
                skipped: Skipped | None = None) -> dict[str, Any] | None:
    """A learner's exit record, signed by that learner (with ``verifier``), fields validated."""
    rec = read_record(store, layout.exit_key(learner), verifier, learner_signer(learner), skipped, "exit_record")
    return clean_learner_record(rec) if rec is not None else None


def syncer_status(store: Store, key: str, verifier: Verifier | None = None,
                  skipped: Skipped | None = None) -> dict[str, Any] | None:
    """A syncer shard's status object, signed by the syncer (with ``verifier``)."""
    rec = read_record(store, key, verifier, SYNCER_SIGNER, skipped, "syncer_status")
    if rec is None:
        return None
    rec = dict(rec)
    rec["time"] = _number(rec.get("time"), 0, time.time() + 86400)
    for name in ("versions", "pending", "counters", "last_merge"):
        if not isinstance(rec.get(name), dict):
            rec[name] = {}
    rec["shard"] = _text(rec.get("shard")) or "?"
    return rec


# --- forged globals the syncer sets aside ----------------------------------------------------------


def record_forged(store: Store, fragment: int, version: int, reason: str, signer: Any = None) -> None:
    """Set aside a global that fails verification: a create-only record (never adopted; an
    operator deletes the global and this record)."""
    gkey = layout.global_key(fragment, version)
    record = {"key": gkey, "fragment": fragment, "version": version, "reason": reason[:300], "at": time.time(),
              "action": f"never adopted; an operator may delete {gkey} and this record"}
    try:
        store.put_if_absent(layout.forged_key(fragment, version), json.dumps(sign_record(record, signer)).encode())
    except StorageError as exc:
        log.warning("forged_record_failed key=%r error=%s", gkey, exc)
    log.error("global_forged_set_aside fragment=%d version=%d reason=%r", fragment, version, reason[:300])
