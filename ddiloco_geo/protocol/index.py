"""Reads of published globals: the ``globals/HEAD`` index (compare-and-swap, only moves forward;
in a signed run signed by the syncer, and an index that does not verify reads as absent), version listings (authoritative; the index may lag a crash), one fragment version, and the whole
global model. The write side is :mod:`ddiloco_geo.protocol.publish`.
"""

from __future__ import annotations

import json
import logging
import time

import torch

from ddiloco_geo import codec
from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import CodecError, NotFoundError, PreconditionFailedError
from ddiloco_geo.core.signing import Signer, Verifier, sign_record, verify_record
from ddiloco_geo.protocol.spec import RunSpec
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)

MAX_INDEX_BYTES = 2**20
MAX_VERSION = 10**10  # the layout's version field has ten digits


def _parse_index(data: bytes, verifier: Verifier | None) -> dict[int, int] | None:
    """The index's versions, or None when it is malformed or (with ``verifier``) not the syncer's."""
    try:
        record = json.loads(data) if len(data) <= MAX_INDEX_BYTES else None
        if not isinstance(record, dict) or not isinstance(record.get("versions"), dict):
            return None
        if verifier is not None and not verify_record(record, verifier, "syncer"):
            return None
        out = {}
        for p, v in record["versions"].items():
            if not (isinstance(p, str) and p.isdigit() and type(v) is int and 0 <= v < MAX_VERSION):
                return None
            out[int(p)] = v
        return out
    except (ValueError, RecursionError):
        return None


def read_index(store: Store, verifier: Verifier | None = None) -> tuple[dict[int, int], str | None]:
    """Newest published version per fragment, and the CAS token ({} and None if absent).

    With ``verifier`` (a signed run) only an index the syncer signed counts; a forged, unsigned or
    malformed one reads as empty (readers fall back to waiting or listing) and the syncer's next
    publish replaces it."""
    try:
        data, token = store.read_token(layout.globals_index_key())
    except NotFoundError:
        return {}, None
    versions = _parse_index(data, verifier)
    if versions is None:
        log.warning("index_unverified key=%r action=ignored_until_the_syncer_rewrites_it", layout.globals_index_key())
        return {}, token
    return versions, token


def advance_index(store: Store, versions: dict[int, int], attempts: int = 50, *, signer: Signer | None = None,
                  verifier: Verifier | None = None) -> dict[int, int]:
    """Raise the index's entries to at least ``versions`` (never lowers one); CAS with retry. In a
    signed run (``signer``, ``verifier``) the index is signed, and one that does not verify is
    replaced, not raised: a forged entry at a huge version would otherwise stay forever."""
    for _ in range(attempts):
        current, token = read_index(store, verifier)
        merged = dict(current)
        for p, v in versions.items():
            merged[p] = max(v, merged.get(p, -1))
        if merged == current and token is not None:
            return current
        record = {"versions": {str(p): v for p, v in sorted(merged.items())}}
        body = json.dumps(sign_record(record, signer)).encode()
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
