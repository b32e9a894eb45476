"""Reads of published globals: the ``globals/HEAD`` index (compare-and-swap, only moves forward),
version listings (authoritative; the index may lag a crash), one fragment version, and the whole
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
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)


from ddiloco_geo.protocol.spec import RunSpec


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
