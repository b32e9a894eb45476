"""The raw backend interface under :class:`~ddiloco_geo.storage.store.Store`, and what backends share.

A :class:`Backend` performs one attempt of one operation against one kind of storage: no retries,
no error translation, no stats (the store does those, once). It may raise anything. Its
operations mirror the store's, with ``create`` for ``put_if_absent``::

    create(key, data) -> bool            create-only: True = created, False = it already existed
    get(key, start, end) -> bytes        bytes [start, end), end None = to the end
    read_token(key) -> (bytes, token)    content and an opaque version token
    cas(key, data, token) -> token       token None = create; else replace only if unchanged;
                                         a lost race raises PreconditionFailedError
    list(prefix, start_after, limit)     keys under prefix, sorted, strictly after start_after
    list_prefixes(prefix)                S3 ``Delimiter="/"`` common prefixes below prefix
    delete(key)                          missing is fine
    torn_write(key, data)                what an interrupted write leaves (fault injection only)

Keys arrive already checked (:mod:`ddiloco_geo.storage.keys`). Backends without native version
tokens (local, memory) use :func:`hash_token`, the BLAKE3 of the content (as the codec's checksum).
"""

from __future__ import annotations

from collections.abc import Iterable

import blake3


class Backend:
    """Raw operations, no retries. May raise anything; :class:`Store` translates it."""

    url: str = ""

    def create(self, key: str, data: bytes) -> bool:
        raise NotImplementedError

    def get(self, key: str, start: int, end: int | None) -> bytes:
        raise NotImplementedError

    def read_token(self, key: str) -> tuple[bytes, str]:
        raise NotImplementedError

    def cas(self, key: str, data: bytes, token: str | None) -> str:
        raise NotImplementedError

    def list(self, prefix: str, start_after: str | None, limit: int | None) -> list[str]:
        raise NotImplementedError

    def list_prefixes(self, prefix: str) -> list[str]:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def torn_write(self, key: str, data: bytes) -> None:
        """Leave whatever a write interrupted half-way would leave (never a visible object)."""

    def close(self) -> None:
        pass


def filter_keys(keys: Iterable[str], prefix: str, start_after: str | None, limit: int | None) -> list[str]:
    """The listing answer from unsorted keys: under ``prefix``, strictly after ``start_after``, sorted, capped."""
    out = sorted(k for k in keys if k.startswith(prefix) and (start_after is None or k > start_after))
    return out if limit is None else out[:limit]


def common_prefixes(keys: Iterable[str], prefix: str) -> list[str]:
    """S3 ``Delimiter="/"`` semantics: the distinct ``prefix + segment + "/"`` of deeper keys."""
    out = set()
    for key in keys:
        if key.startswith(prefix):
            cut = key.find("/", len(prefix))
            if cut >= 0:
                out.add(key[: cut + 1])
    return sorted(out)


def hash_token(data: bytes) -> str:
    """The version token of backends without one of their own: BLAKE3 of the content."""
    return blake3.blake3(data).hexdigest()
