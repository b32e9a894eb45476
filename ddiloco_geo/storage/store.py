"""The storage protocol: a small, synchronous, thread-safe domain API over fsspec (habit 5).

Every byte this system moves goes through :class:`Store`, over one of four raw backends
(``file://`` :mod:`.local`, ``memory://`` :mod:`.memory`, ``s3://`` :mod:`.s3`, ``gs://``
:mod:`.gcs`); :func:`open_store` picks one from ``storage.url``. Keys are relative to the root URL
and are checked before any I/O (:mod:`.keys`).

Operations and their semantics::

    put_if_absent(key, data) -> bool     create-only: True = created, False = it already existed
    get(key, start, end) -> bytes        whole object or the range [start, end)
    read_token(key) -> (bytes, token)    content and an opaque version token
    cas(key, data, token) -> token       compare-and-swap; token None = create; else replace only
                                         if unchanged since read_token returned ``token``
    list(prefix, start_after, limit)     keys under prefix, lexicographic, strictly after start_after
    list_prefixes(prefix)                "directories" one level below prefix, e.g. "learners/a/"
    delete(key)                          missing is fine

How each backend provides the two conditional writes:

* local: create = temp file + fsync + ``os.link``; CAS = ``flock`` + BLAKE3 compare + ``os.replace``.
* memory: fsspec's MemoryFileSystem under one process-wide lock; token = BLAKE3 of the content.
* s3: PutObject with ``If-None-Match: *`` (create) or ``If-Match: <ETag>`` (CAS); token = ETag.
* gcs: single-request (multipart) upload with ``ifGenerationMatch=0`` or ``=<generation>``;
  token = generation.

Failure semantics. Errors are translated once (:mod:`.translate`) into
:mod:`ddiloco_geo.core.errors`: missing -> :class:`NotFoundError`; a lost CAS ->
:class:`PreconditionFailedError`; throttling, 5xx, timeouts and connection failures ->
:class:`TransientStorageError`; anything else -> :class:`StorageError`. Only transient errors are
retried, once, here (:mod:`.retry`); ``Store.stats`` (:mod:`.stats`) counts attempts, retries and
errors. Messages name the operation and the key and never contain credentials; ``Store.url`` has
no userinfo or query string. A closed store raises StorageError; ``close()`` is idempotent.

A create-only put whose response was lost and then retried finds its own object and returns
False: "already exists" is an answer, and callers that care read the object and compare. The same
holds for a CAS whose response was lost: the retry raises PreconditionFailedError although the
write landed; callers re-read the pointer and see their own value. :mod:`.faults` injects exactly
these faults, deterministically, under the retry layer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ddiloco_geo.core.config import StorageConfig
from ddiloco_geo.core.errors import StorageError
from ddiloco_geo.storage.backend import Backend
from ddiloco_geo.storage.faults import FaultInjectingBackend, FaultPlan
from ddiloco_geo.storage.gcs import GCSBackend
from ddiloco_geo.storage.keys import check_key, check_prefix
from ddiloco_geo.storage.local import LocalBackend
from ddiloco_geo.storage.memory import MemoryBackend
from ddiloco_geo.storage.retry import RetryPolicy
from ddiloco_geo.storage.s3 import S3Backend
from ddiloco_geo.storage.stats import StoreStats
from ddiloco_geo.storage.translate import safe_url


class Store:
    """Retries, error translation and stats over one raw :class:`Backend`. Thread-safe."""

    def __init__(
        self,
        backend: Backend,
        *,
        retry_attempts: int = 8,
        retry_initial_s: float = 0.1,
        retry_max_s: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._retry = RetryPolicy(attempts=retry_attempts, initial_s=retry_initial_s, max_s=retry_max_s, sleep=sleep)
        self.backend = backend
        self.url = safe_url(backend.url)
        self.stats = StoreStats()
        self._closed = False
        self._close_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: str, key: str, fn: Callable[[], Any]) -> Any:
        if self._closed:
            raise StorageError(f"{op} {key!r}: store {self.url} is closed")
        return self._retry.call(op, key, fn, self.stats)

    # -- operations --

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist. False = it existed (possibly our own earlier
        attempt whose response was lost); callers that care read it back and compare."""
        check_key(key)
        data = bytes(data)
        created = self._call("put_if_absent", key, lambda: self.backend.create(key, data))
        if created:
            self.stats.add_up(len(data))
        return bool(created)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The whole object, or bytes [start, end) (clamped to the object). NotFoundError."""
        check_key(key)
        if (start is not None and start < 0) or (end is not None and end < 0):
            raise ValueError(f"get {key!r}: negative offsets are not supported (start={start}, end={end})")
        data = self._call("get", key, lambda: self.backend.get(key, start or 0, end))
        self.stats.add_down(len(data))
        return data

    def read_token(self, key: str) -> tuple[bytes, str]:
        """Content and an opaque version token for :meth:`cas`. NotFoundError."""
        check_key(key)
        data, token = self._call("read_token", key, lambda: self.backend.read_token(key))
        self.stats.add_down(len(data))
        return data, token

    def cas(self, key: str, data: bytes, token: str | None) -> str:
        """Replace ``key`` only if its version is still ``token`` (None: only if absent).
        Returns the new token; PreconditionFailedError if another writer got there first."""
        check_key(key)
        data = bytes(data)
        new_token = self._call("cas", key, lambda: self.backend.cas(key, data, token))
        self.stats.add_up(len(data))
        return new_token

    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None) -> list[str]:
        """Keys under ``prefix`` (a plain string prefix), sorted, strictly after ``start_after``."""
        check_prefix(prefix)
        if limit is not None and limit < 0:
            raise ValueError(f"list {prefix!r}: limit must be >= 0")
        if limit == 0:
            return []
        return self._call("list", prefix, lambda: self.backend.list(prefix, start_after, limit))

    def list_prefixes(self, prefix: str = "") -> list[str]:
        """The distinct "directories" one level below ``prefix``, each ending in ``/`` and relative
        to the root (S3 ``Delimiter="/"`` semantics): ``list_prefixes("learners/")`` ->
        ``["learners/a/", "learners/b/"]``. Only prefixes with at least one object are shown."""
        check_prefix(prefix)
        return self._call("list_prefixes", prefix, lambda: self.backend.list_prefixes(prefix))

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is fine."""
        check_key(key)
        self._call("delete", key, lambda: self.backend.delete(key))

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.backend.close()


def make_backend(cfg: StorageConfig) -> Backend:
    """The raw backend for ``cfg.url``'s scheme."""
    url = cfg.url
    if url.startswith("file://"):
        return LocalBackend(url[len("file://"):] or ".")
    if url.startswith("memory://"):
        name = url[len("memory://"):].strip("/")
        if not name:
            raise StorageError("storage.url 'memory://': add a name, e.g. memory://run-1")
        return MemoryBackend(name)
    if url.startswith("s3://"):
        return S3Backend(cfg)
    if url.startswith("gs://") or url.startswith("gcs://"):
        if url.startswith("gcs://"):
            cfg = cfg.model_copy(update={"url": "gs://" + url[len("gcs://"):]})
        return GCSBackend(cfg)
    if "://" not in url:
        return LocalBackend(url)
    raise StorageError(
        f"storage.url {safe_url(url)!r}: unsupported scheme; use file://DIR, memory://NAME, "
        "s3://BUCKET/PREFIX or gs://BUCKET/PREFIX"
    )


def open_store(cfg: StorageConfig, *, faults: FaultPlan | None = None) -> Store:
    """Open the store named by ``cfg.url``; with ``faults``, inject them under the retry layer."""
    backend = make_backend(cfg)
    if faults is None and cfg.fault_rate > 0:
        faults = FaultPlan(seed=cfg.fault_seed, rate=cfg.fault_rate)
    if faults is not None:
        backend = FaultInjectingBackend(backend, faults)
    return Store(
        backend,
        retry_attempts=cfg.retry_attempts,
        retry_initial_s=cfg.retry_initial_s,
        retry_max_s=cfg.retry_max_s,
    )
