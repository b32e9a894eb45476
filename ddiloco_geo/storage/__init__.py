"""The storage protocol: a small, synchronous, thread-safe domain API over fsspec (habit 5).

Every byte this system moves goes through :class:`Store`, over one of four raw backends
(``file://``, ``memory://``, ``s3://``, ``gs://``). Keys are relative to the root URL and use ``/``
as separator; they may not contain ``..``, ``.``, empty segments, a leading ``/``, backslashes or
the reserved ``.ddiloco-`` name prefix (temp and lock files of the local backend).

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

* local: create = temp file + fsync + ``os.link`` (atomic, fails if the name exists; readers never
  see a partial object). CAS = ``fcntl.flock`` on a per-key lock file under ``.ddiloco-locks/``,
  compare the sha256 of the current content, temp file + ``os.replace``. Safe across threads and
  processes on one host (not across hosts sharing an NFS mount).
* memory: fsspec's MemoryFileSystem under one process-wide lock; token = sha256 of the content.
* s3: PutObject with ``If-None-Match: *`` (create) or ``If-Match: <ETag>`` (CAS); token = ETag.
* gcs: single-request (multipart) upload with ``ifGenerationMatch=0`` or ``=<generation>``;
  token = generation. Resumable uploads are never used: emulators ignore preconditions there.

Failure semantics. Errors are translated once, here, into :mod:`ddiloco_geo.core.errors`:
missing -> :class:`NotFoundError`; a lost CAS -> :class:`PreconditionFailedError`; 5xx, SlowDown,
throttling, timeouts and connection failures -> :class:`TransientStorageError`; anything else
(403, other 4xx, local I/O errors) -> :class:`StorageError`. Only transient errors are retried
(tenacity: ``retry_attempts`` attempts, full-jitter exponential backoff from ``retry_initial_s``
capped at ``retry_max_s``; one ``storage_retry`` log line per retry). ``Store.stats`` counts every
attempt by operation and every retry by its reason (``SlowDown``, ``EndpointConnectionError``,
``http_503``, an injected fault kind, ...). Messages name the operation and the key and never
contain credentials (see :func:`scrub`). The library's own retry loops are switched off
(botocore ``max_attempts=1``; gcsfs's decorated ``_request`` is bypassed) so that retries happen
once, here. A missing S3 bucket (``NoSuchBucket``) is a plain StorageError, never "not found".

A create-only put whose response was lost and then retried finds its own object and returns
False: "already exists" is an answer, and callers that care read the object and compare. The same
holds for a CAS whose response was lost: the retry raises PreconditionFailedError although the
write landed; callers re-read the pointer and see their own value.

Fault injection (habit 9): :class:`FaultPlan` decides, from ``hash(seed, op, key, attempt)`` or an
explicit schedule, whether an attempt fails and how; :class:`FaultInjectingBackend` applies it to
the raw backend, under the retry layer, so retries, stats and error paths run for real.
"""

from __future__ import annotations

import contextvars
import errno
import fcntl
import hashlib
import logging
import os
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import tenacity

from ddiloco_geo.core.config import StorageConfig
from ddiloco_geo.core.errors import (
    LayoutError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    TransientStorageError,
)

log = logging.getLogger(__name__)

OPS = ("put_if_absent", "get", "read_token", "cas", "list", "list_prefixes", "delete")
PUT_OPS = ("put_if_absent", "cas")
FAULT_KINDS = ("slowdown", "timeout", "lost_response", "torn_write")
RESERVED_PREFIX = ".ddiloco-"

# The attempt number (1-based) of the operation running in this thread/task; set by Store so the
# fault injector can key its decisions by attempt without widening the backend interface.
_ATTEMPT: contextvars.ContextVar[int] = contextvars.ContextVar("ddiloco_storage_attempt", default=1)


# --- keys ----------------------------------------------------------------------------------------


def check_key(key: str, *, what: str = "key") -> str:
    """Return ``key`` if it is a valid relative object key, else raise LayoutError."""
    if not isinstance(key, str) or not key:
        raise LayoutError(f"invalid {what} {key!r}: must be a non-empty string")
    _check_segments(key.split("/"), key, what)
    return key


def check_prefix(prefix: str) -> str:
    """A listing prefix: empty, or a key, or a key ending in ``/``."""
    if not isinstance(prefix, str):
        raise LayoutError(f"invalid prefix {prefix!r}: must be a string")
    if prefix == "":
        return prefix
    parts = prefix.split("/")
    if parts[-1] == "":
        parts = parts[:-1]
    _check_segments(parts, prefix, "prefix")
    return prefix


def _check_segments(parts: list[str], whole: str, what: str) -> None:
    if "\\" in whole:
        raise LayoutError(f"invalid {what} {whole!r}: backslashes are not allowed; use '/'")
    if whole.startswith("/"):
        raise LayoutError(f"invalid {what} {whole!r}: keys are relative to the store root; drop the leading '/'")
    for part in parts:
        if part == "":
            raise LayoutError(f"invalid {what} {whole!r}: empty path segment ('//' or trailing '/')")
        if part in (".", ".."):
            raise LayoutError(f"invalid {what} {whole!r}: '.' and '..' segments are not allowed")
        if part.startswith(RESERVED_PREFIX):
            raise LayoutError(f"invalid {what} {whole!r}: names starting with {RESERVED_PREFIX!r} are reserved")
        if any(ord(c) < 32 for c in part):
            raise LayoutError(f"invalid {what} {whole!r}: control characters are not allowed")


# --- stats ---------------------------------------------------------------------------------------


class StoreStats:
    """Thread-safe counters: bytes moved, attempts by operation, retries and errors by class."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_up = 0
        self.bytes_down = 0
        self.requests: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()

    def count_request(self, op: str) -> None:
        with self._lock:
            self.requests[op] += 1

    def count_retry(self, reason: str) -> None:
        with self._lock:
            self.retries[reason] += 1

    def count_error(self, reason: str) -> None:
        with self._lock:
            self.errors[reason] += 1

    def add_up(self, num_bytes: int) -> None:
        with self._lock:
            self.bytes_up += num_bytes

    def add_down(self, num_bytes: int) -> None:
        with self._lock:
            self.bytes_down += num_bytes

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "bytes_up": self.bytes_up,
                "bytes_down": self.bytes_down,
                "requests": dict(self.requests),
                "retries": dict(self.retries),
                "errors": dict(self.errors),
            }


# --- error translation ---------------------------------------------------------------------------

_SECRET_PATTERNS = [
    re.compile(r"(X-Amz-[A-Za-z-]+=)[^&\s'\"]+", re.IGNORECASE),
    re.compile(r"(Signature=|Credential=|access_token=|sig=)[^&\s,'\"]+", re.IGNORECASE),
    re.compile(
        r"((?:aws_)?(?:secret|access)[_-]?(?:access[_-]?)?(?:key(?:[_-]?id)?|token)?[\"']?\s*[=:]\s*[\"']?)[^\s&,'\"]+",
        re.IGNORECASE,
    ),
    re.compile(r"(Authorization[\"']?\s*[=:]\s*[\"']?)[^\n'\"]+", re.IGNORECASE),
    re.compile(r"(://)[^/@\s:]+:[^/@\s]+@"),  # user:password@ in URLs
]
_known_secrets: set[str] = set()
_known_secrets_lock = threading.Lock()


def register_secret(value: str | None) -> None:
    """Scrub this literal value from every storage error message (resolved credentials)."""
    if value and len(value) >= 6:
        with _known_secrets_lock:
            _known_secrets.add(value)


def scrub(text: str) -> str:
    """Remove anything that looks like a credential from a message."""
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + "<redacted>" if m.lastindex else "<redacted>", text)
    with _known_secrets_lock:
        secrets = list(_known_secrets)
    for secret in secrets:
        text = text.replace(secret, "<redacted>")
    return text


def _safe_url(url: str) -> str:
    """The root URL without userinfo or query string."""
    url = re.sub(r"^([a-z0-9+.-]+://)[^/@]*@", r"\1", url, flags=re.IGNORECASE)
    return url.split("?", 1)[0].split("#", 1)[0]


_THROTTLE_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestLimitExceeded",
    "TooManyRequests", "TooManyRequestsException", "RequestThrottled", "RequestThrottledException",
    "ProvisionedThroughputExceededException", "BandwidthLimitExceeded", "ServiceUnavailable",
    "InternalError", "RequestTimeout", "RequestTimeoutException", "ConditionalRequestConflict",
    "PriorRequestNotComplete", "OperationAborted",
}
_NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404", "NoSuchVersion"}
_PRECONDITION_CODES = {"PreconditionFailed", "412"}
_TRANSIENT_STATUS = {408, 429} | set(range(500, 600))


def _transient_exception_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [TimeoutError, ConnectionError]
    try:
        import asyncio

        types.append(asyncio.TimeoutError)
    except ImportError:  # pragma: no cover
        pass
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError]
    except ImportError:  # pragma: no cover
        pass
    try:
        import botocore.exceptions as bx

        types += [bx.HTTPClientError, bx.ConnectionError, bx.ReadTimeoutError, bx.ConnectTimeoutError]
    except ImportError:  # pragma: no cover
        pass
    try:
        import requests.exceptions as rx

        types += [rx.ConnectionError, rx.Timeout, rx.ChunkedEncodingError]
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


_TRANSIENT_TYPES: tuple[type[BaseException], ...] | None = None


def _status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    """HTTP status and service error code of a botocore, gcsfs or aiohttp error, if any."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:  # botocore ClientError
        code = str(response.get("Error", {}).get("Code") or "") or None
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return (int(status) if status else None), code
    code = getattr(exc, "code", None)  # gcsfs HttpError
    if isinstance(code, int):
        return code, None
    status = getattr(exc, "status", None)  # aiohttp ClientResponseError
    if isinstance(status, int):
        return status, None
    return None, None


def translate(exc: BaseException, op: str, key: str) -> StorageError:
    """Map any backend exception to the project's tree. Attaches ``reason`` (a short label)."""
    if isinstance(exc, StorageError):
        if not hasattr(exc, "reason"):
            exc.reason = type(exc).__name__  # type: ignore[attr-defined]
        return exc
    detail = scrub(f"{type(exc).__name__}: {exc}")[:500]
    where = f"{op} {key!r}"
    status, code = _status_and_code(exc)
    cls: type[StorageError]
    if code == "NoSuchBucket":  # a configuration error, not a missing object: never "not yet"
        cls, reason = StorageError, code
        detail += " (check storage.url and storage.endpoint_url)"
    elif isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)) or code in _NOT_FOUND_CODES or status == 404:
        cls, reason = NotFoundError, "not_found"
    elif isinstance(exc, FileExistsError) or code in _PRECONDITION_CODES or status == 412:
        cls, reason = PreconditionFailedError, "precondition_failed"
    elif code in _THROTTLE_CODES or (code or "").startswith("Throttl") or status in _TRANSIENT_STATUS:
        cls, reason = TransientStorageError, code or f"http_{status}"
    elif isinstance(exc, _TRANSIENT_TYPES or _load_transient_types()):
        cls, reason = TransientStorageError, type(exc).__name__
    elif _proxy_error(exc):
        cls, reason = TransientStorageError, "http_502"
    elif isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE):
        cls, reason = TransientStorageError, errno.errorcode.get(exc.errno or 0, "oserror")
    else:
        cls, reason = StorageError, code or (f"http_{status}" if status else type(exc).__name__)
    out = cls(f"{where}: {detail}")
    out.reason = reason  # type: ignore[attr-defined]
    return out


def _load_transient_types() -> tuple[type[BaseException], ...]:
    global _TRANSIENT_TYPES
    _TRANSIENT_TYPES = _transient_exception_types()  # imported late: local runs never need them
    return _TRANSIENT_TYPES


def _proxy_error(exc: BaseException) -> bool:
    # gcsfs turns a 502 into requests.exceptions.ProxyError without a status.
    return type(exc).__name__ == "ProxyError"


def _transient(message: str, reason: str) -> TransientStorageError:
    exc = TransientStorageError(message)
    exc.reason = reason  # type: ignore[attr-defined]
    return exc


def _hash_token(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- raw backends --------------------------------------------------------------------------------


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


def _filter_keys(keys, prefix: str, start_after: str | None, limit: int | None) -> list[str]:
    out = sorted(k for k in keys if k.startswith(prefix) and (start_after is None or k > start_after))
    return out if limit is None else out[:limit]


def _common_prefixes(keys, prefix: str) -> list[str]:
    """S3 ``Delimiter="/"`` semantics: the distinct ``prefix + segment + "/"`` of deeper keys."""
    out = set()
    for key in keys:
        if key.startswith(prefix):
            cut = key.find("/", len(prefix))
            if cut >= 0:
                out.add(key[: cut + 1])
    return sorted(out)


class LocalBackend(Backend):
    """A directory on a POSIX filesystem. Hidden ``.ddiloco-`` names are temp files (next to their
    object, so that link/replace stay on one filesystem) and ``.ddiloco-locks/`` at the root (one
    CAS lock file per pointer key; kept forever, since unlinking a lock file races with lockers).
    Delete prunes directories it empties, so a deleted tree leaves nothing behind."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = f"file://{self.root}"
        self.lock_dir = os.path.join(self.root, f"{RESERVED_PREFIX}locks")
        os.makedirs(self.lock_dir, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _temp(self, path: str, data: bytes) -> str:
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f"{RESERVED_PREFIX}tmp-{name}-{uuid.uuid4().hex}")
        for _ in range(10):  # a concurrent delete may prune the directory between the two calls
            os.makedirs(directory, exist_ok=True)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileNotFoundError:
                continue
        else:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        return tmp

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        tmp = self._temp(path, data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def get(self, key: str, start: int, end: int | None) -> bytes:
        with open(self._path(key), "rb") as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(max(0, end - start))

    def read_token(self, key: str) -> tuple[bytes, str]:
        with open(self._path(key), "rb") as f:
            data = f.read()
        return data, _hash_token(data)

    def cas(self, key: str, data: bytes, token: str | None) -> str:
        path = self._path(key)
        lock_name = hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock"
        lock_fd = os.open(os.path.join(self.lock_dir, lock_name), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                with open(path, "rb") as f:
                    current: str | None = _hash_token(f.read())
            except FileNotFoundError:
                current = None
            if current != token:
                state = "exists" if token is None else ("is gone" if current is None else "changed")
                raise PreconditionFailedError(f"cas {key!r}: object {state} since the token was read")
            tmp = self._temp(path, data)
            try:
                if token is None:
                    os.link(tmp, path)  # also loses against a concurrent put_if_absent
                else:
                    os.replace(tmp, path)
                    tmp = ""
            except FileExistsError:
                raise PreconditionFailedError(f"cas {key!r}: object was created concurrently") from None
            finally:
                if tmp:
                    os.unlink(tmp)
            return _hash_token(data)
        finally:
            os.close(lock_fd)  # releases the flock

    def list(self, prefix: str, start_after: str | None, limit: int | None) -> list[str]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self._path(base) if base else self.root
        keys = []
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if not d.startswith(RESERVED_PREFIX)]
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            rel = "" if rel == "." else rel + "/"
            keys += [rel + n for n in filenames if not n.startswith(RESERVED_PREFIX)]
        return _filter_keys(keys, prefix, start_after, limit)

    def list_prefixes(self, prefix: str) -> list[str]:
        base, _, stem = prefix.rpartition("/")
        top = self._path(base) if base else self.root
        head = base + "/" if base else ""
        try:
            entries = sorted(os.scandir(top), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [
            f"{head}{e.name}/" for e in entries
            if e.name.startswith(stem) and not e.name.startswith(RESERVED_PREFIX)
            and e.is_dir(follow_symlinks=False) and self._has_object(e.path)
        ]

    @staticmethod
    def _has_object(directory: str) -> bool:
        # S3 shows a prefix only while an object lives under it; emptied directories stay here.
        for _, dirnames, filenames in os.walk(directory):
            dirnames[:] = [d for d in dirnames if not d.startswith(RESERVED_PREFIX)]
            if any(not n.startswith(RESERVED_PREFIX) for n in filenames):
                return True
        return False

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        directory = os.path.dirname(path)
        while directory != self.root and directory.startswith(self.root + os.sep):
            try:
                os.rmdir(directory)  # only succeeds on an empty directory
            except OSError:
                break
            directory = os.path.dirname(directory)

    def torn_write(self, key: str, data: bytes) -> None:
        self._temp(self._path(key), data[: len(data) // 2])  # the stray temp file stays


_MEMORY_LOCK = threading.RLock()


class MemoryBackend(Backend):
    """fsspec's process-wide MemoryFileSystem; one lock makes create and CAS atomic."""

    def __init__(self, name: str) -> None:
        from fsspec.implementations.memory import MemoryFileSystem

        self.fs = MemoryFileSystem()
        self.root = MemoryFileSystem._strip_protocol(f"memory://{name}").rstrip("/")
        self.url = f"memory://{self.root.lstrip('/')}"

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _exists(self, path: str) -> bool:
        return path in self.fs.store

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        with _MEMORY_LOCK:
            if self._exists(path):
                return False
            self.fs.pipe_file(path, bytes(data))
            return True

    def get(self, key: str, start: int, end: int | None) -> bytes:
        with _MEMORY_LOCK:
            data = self.fs.cat_file(self._path(key))
        return data[start:end]

    def read_token(self, key: str) -> tuple[bytes, str]:
        with _MEMORY_LOCK:
            data = self.fs.cat_file(self._path(key))
        return data, _hash_token(data)

    def cas(self, key: str, data: bytes, token: str | None) -> str:
        path = self._path(key)
        with _MEMORY_LOCK:
            current = _hash_token(self.fs.cat_file(path)) if self._exists(path) else None
            if current != token:
                raise PreconditionFailedError(f"cas {key!r}: object changed since the token was read")
            self.fs.pipe_file(path, bytes(data))
        return _hash_token(data)

    def list(self, prefix: str, start_after: str | None, limit: int | None) -> list[str]:
        head = self.root + "/"
        with _MEMORY_LOCK:
            keys = [p[len(head):] for p in self.fs.store if p.startswith(head + prefix)]
        return _filter_keys(keys, prefix, start_after, limit)

    def list_prefixes(self, prefix: str) -> list[str]:
        return _common_prefixes(self.list(prefix, None, None), prefix)

    def delete(self, key: str) -> None:
        with _MEMORY_LOCK:
            if self._exists(self._path(key)):
                self.fs.rm_file(self._path(key))


def _split_bucket(url: str, scheme: str) -> tuple[str, str]:
    rest = url[len(scheme):].split("?", 1)[0]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise StorageError(f"storage.url {_safe_url(url)!r}: missing bucket name, e.g. {scheme}my-bucket/run-1")
    prefix = prefix.strip("/")
    if prefix:
        check_prefix(prefix)
    return bucket, (prefix + "/" if prefix else "")


class S3Backend(Backend):
    """S3 and S3-compatible servers through s3fs's aiobotocore client (raw API calls)."""

    def __init__(self, cfg: StorageConfig) -> None:
        from fsspec.asyn import sync
        from s3fs import S3FileSystem

        self._sync = sync
        self.bucket, self.prefix = _split_bucket(cfg.url, "s3://")
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        config_kwargs: dict[str, Any] = {
            "retries": {"max_attempts": 1, "mode": "standard"},  # retries are ours, once
            "connect_timeout": cfg.timeout_s,
            "read_timeout": cfg.timeout_s,
            "max_pool_connections": 64,
        }
        if cfg.endpoint_url:
            config_kwargs["s3"] = {"addressing_style": "path"}
        client_kwargs = {"region_name": cfg.region} if cfg.region else {}
        self.fs = S3FileSystem(
            anon=cfg.anonymous,
            endpoint_url=cfg.endpoint_url,
            client_kwargs=client_kwargs,
            config_kwargs=config_kwargs,
            skip_instance_cache=True,
            use_listings_cache=False,
        )
        self._client_lock = threading.Lock()
        self._client: Any = None

    def _run(self, coro_fn: Callable[..., Any], *args: Any) -> Any:
        return self._sync(self.fs.loop, coro_fn, *args)

    def _s3(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._run(self.fs.set_session)
                self._register_credentials()
            return self._client

    def _register_credentials(self) -> None:
        try:
            creds = self._client._request_signer._credentials
            if creds is not None:
                register_secret(getattr(creds, "secret_key", None))
                register_secret(getattr(creds, "token", None))
        except AttributeError:
            pass

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _put(self, key: str, data: bytes, **cond: str) -> dict:
        client = self._s3()

        async def call() -> dict:
            return await client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **cond)

        return self._run(call)

    def create(self, key: str, data: bytes) -> bool:
        try:
            self._put(key, data, IfNoneMatch="*")
            return True
        except Exception as exc:
            if translate(exc, "put_if_absent", key).__class__ is PreconditionFailedError:
                return False
            raise

    def _get_object(self, key: str, range_header: str | None) -> tuple[bytes, str]:
        client = self._s3()
        kwargs = {"Range": range_header} if range_header else {}

        async def call() -> tuple[bytes, str]:
            resp = await client.get_object(Bucket=self.bucket, Key=self._key(key), **kwargs)
            async with resp["Body"] as body:
                data = await body.read()
            return data, resp["ETag"]

        return self._run(call)

    def get(self, key: str, start: int, end: int | None) -> bytes:
        if end is not None and end <= start:
            self._head(key)
            return b""
        if start == 0 and end is None:
            return self._get_object(key, None)[0]
        range_header = f"bytes={start}-" + ("" if end is None else str(end - 1))
        try:
            return self._get_object(key, range_header)[0]
        except Exception as exc:
            _, code = _status_and_code(exc)
            if code == "InvalidRange":  # start at or past the end of the object
                return b""
            raise

    def _head(self, key: str) -> dict:
        client = self._s3()

        async def call() -> dict:
            return await client.head_object(Bucket=self.bucket, Key=self._key(key))

        return self._run(call)

    def read_token(self, key: str) -> tuple[bytes, str]:
        return self._get_object(key, None)

    def cas(self, key: str, data: bytes, token: str | None) -> str:
        cond = {"IfNoneMatch": "*"} if token is None else {"IfMatch": token}
        try:
            return self._put(key, data, **cond)["ETag"]
        except Exception as exc:
            err = translate(exc, "cas", key)
            if isinstance(err, NotFoundError):  # If-Match on a deleted object
                raise PreconditionFailedError(f"cas {key!r}: object is gone since the token was read") from None
            raise

    def list(self, prefix: str, start_after: str | None, limit: int | None) -> list[str]:
        client = self._s3()
        out: list[str] = []

        async def call() -> None:
            token = None
            while limit is None or len(out) < limit:
                kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._key(prefix)}
                if limit is not None:
                    kwargs["MaxKeys"] = min(1000, limit - len(out))
                if token:
                    kwargs["ContinuationToken"] = token
                elif start_after is not None:
                    kwargs["StartAfter"] = self._key(start_after)
                page = await client.list_objects_v2(**kwargs)
                out.extend(o["Key"][len(self.prefix):] for o in page.get("Contents", []))
                token = page.get("NextContinuationToken")
                if not page.get("IsTruncated") or not token:
                    break

        self._run(call)
        return _filter_keys(out, prefix, start_after, limit)

    def list_prefixes(self, prefix: str) -> list[str]:
        client = self._s3()
        out: list[str] = []

        async def call() -> None:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._key(prefix), "Delimiter": "/"}
            while True:
                page = await client.list_objects_v2(**kwargs)
                out.extend(p["Prefix"][len(self.prefix):] for p in page.get("CommonPrefixes", []))
                token = page.get("NextContinuationToken")
                if not page.get("IsTruncated") or not token:
                    break
                kwargs["ContinuationToken"] = token

        self._run(call)
        return sorted(set(out))

    def delete(self, key: str) -> None:
        client = self._s3()

        async def call() -> None:
            await client.delete_object(Bucket=self.bucket, Key=self._key(key))

        try:
            self._run(call)
        except Exception as exc:
            if not isinstance(translate(exc, "delete", key), NotFoundError):
                raise

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                self._run(client.close)
            except Exception:  # closing is best effort; the loop may be gone at exit
                pass


class GCSBackend(Backend):
    """Google Cloud Storage (or fake-gcs-server) through gcsfs's authenticated JSON API session.

    Requests go through gcsfs's undecorated ``_request`` so that gcsfs's own retry loop (up to six
    attempts with sleeps up to 32 s) does not stack under ours. Uploads are single-request
    multipart uploads: preconditions are enforced there by GCS and by the emulator.
    """

    def __init__(self, cfg: StorageConfig) -> None:
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        import aiohttp
        import gcsfs
        from fsspec.asyn import sync

        self._sync = sync
        self.bucket, self.prefix = _split_bucket(cfg.url, "gs://")
        self.url = f"gs://{self.bucket}/{self.prefix}".rstrip("/")
        kwargs: dict[str, Any] = {
            "requests_timeout": aiohttp.ClientTimeout(total=cfg.timeout_s),
            "skip_instance_cache": True,
            "use_listings_cache": False,
        }
        if cfg.endpoint_url:
            kwargs["endpoint_url"] = cfg.endpoint_url.rstrip("/")
        if cfg.anonymous:
            kwargs["token"] = "anon"
        self.fs = gcsfs.GCSFileSystem(project="ddiloco", **kwargs)
        self._raw_request = gcsfs.GCSFileSystem._request.__wrapped__
        self._quote = gcsfs.core.quote

    def _request(self, method: str, path: str, *args: Any, **kwargs: Any) -> tuple[int, Any, bytes]:
        async def call() -> tuple[int, Any, bytes]:
            status, headers, _info, contents = await self._raw_request(self.fs, method, path, *args, **kwargs)
            return status, headers, contents

        return self._sync(self.fs.loop, call)

    def _name(self, key: str) -> str:
        return self.prefix + key

    def _upload(self, key: str, data: bytes, generation: str) -> dict:
        import json

        meta = json.dumps({"name": self._name(key)})
        body = (
            b'--==0==\nContent-Type: application/json; charset=UTF-8\n\n' + meta.encode()
            + b"\n--==0==\nContent-Type: application/octet-stream\n\n" + bytes(data) + b"\n--==0==--"
        )
        url = f"{self.fs._location}/upload/storage/v1/b/{self._quote(self.bucket)}/o"
        _, _, contents = self._request(
            "POST", url, uploadType="multipart", ifGenerationMatch=generation,
            headers={"Content-Type": 'multipart/related; boundary="==0=="'}, data=body,
        )
        return json.loads(contents)

    def create(self, key: str, data: bytes) -> bool:
        try:
            self._upload(key, data, "0")
            return True
        except FileExistsError:  # gcsfs maps 412 to FileExistsError
            return False

    def _media(self, key: str, headers: dict[str, str] | None = None) -> tuple[bytes, Any]:
        _, resp_headers, contents = self._request(
            "GET", "b/{}/o/{}", self.bucket, self._name(key), alt="media", headers=headers,
        )
        return contents, resp_headers

    def get(self, key: str, start: int, end: int | None) -> bytes:
        if end is not None and end <= start:
            self._request("GET", "b/{}/o/{}", self.bucket, self._name(key))
            return b""
        if start == 0 and end is None:
            return self._media(key)[0]
        rng = f"bytes={start}-" + ("" if end is None else str(end - 1))
        try:
            return self._media(key, {"Range": rng})[0]
        except Exception as exc:
            if _status_and_code(exc)[0] == 416:
                return b""
            raise

    def read_token(self, key: str) -> tuple[bytes, str]:
        data, headers = self._media(key)
        generation = headers.get("x-goog-generation")
        if generation:
            return data, str(generation)
        # No generation header: read metadata, then exactly that generation.
        import json

        _, _, meta = self._request("GET", "b/{}/o/{}", self.bucket, self._name(key))
        generation = str(json.loads(meta)["generation"])
        _, _, data = self._request(
            "GET", "b/{}/o/{}", self.bucket, self._name(key), alt="media", generation=generation,
        )
        return data, generation

    def cas(self, key: str, data: bytes, token: str | None) -> str:
        try:
            return str(self._upload(key, data, "0" if token is None else token)["generation"])
        except FileExistsError:
            raise PreconditionFailedError(f"cas {key!r}: object changed since the token was read") from None
        except FileNotFoundError:
            raise PreconditionFailedError(f"cas {key!r}: object is gone since the token was read") from None

    def list(self, prefix: str, start_after: str | None, limit: int | None) -> list[str]:
        import json

        out: list[str] = []
        page_token = None
        while limit is None or len(out) < limit:
            params: dict[str, Any] = {"prefix": self._name(prefix), "pageToken": page_token}
            if start_after is not None:
                params["startOffset"] = self._name(start_after)
            if limit is not None:
                params["maxResults"] = min(1000, limit - len(out) + 1)
            _, _, contents = self._request("GET", "b/{}/o", self.bucket, **params)
            page = json.loads(contents)
            out.extend(
                item["name"][len(self.prefix):] for item in page.get("items", [])
                if start_after is None or item["name"][len(self.prefix):] > start_after
            )
            page_token = page.get("nextPageToken")
            if not page_token:
                break
        return _filter_keys(out, prefix, start_after, limit)

    def list_prefixes(self, prefix: str) -> list[str]:
        import json

        out: list[str] = []
        page_token = None
        while True:
            _, _, contents = self._request(
                "GET", "b/{}/o", self.bucket, prefix=self._name(prefix), delimiter="/", pageToken=page_token,
            )
            page = json.loads(contents)
            out.extend(p[len(self.prefix):] for p in page.get("prefixes", []))
            page_token = page.get("nextPageToken")
            if not page_token:
                break
        return sorted(set(out))

    def delete(self, key: str) -> None:
        try:
            self._request("DELETE", "b/{}/o/{}", self.bucket, self._name(key))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        try:
            session = getattr(self.fs, "_session", None)
            if session is not None and not session.closed:
                self._sync(self.fs.loop, session.close)
        except Exception:  # best effort
            pass


# --- fault injection -----------------------------------------------------------------------------


@dataclass(frozen=True)
class FaultPlan:
    """Which attempts fail, and how; a pure function of (seed, op, key, attempt).

    ``schedule`` pins faults explicitly: ``{("cas", "globals/f000/HEAD", 1): "lost_response"}``.
    Otherwise an attempt of an op in ``ops`` fails when ``hash(seed, op, key, attempt) < rate``,
    with a kind drawn from the same hash among ``kinds`` (``torn_write`` only for puts).

    Kinds: ``slowdown`` and ``timeout`` raise before the operation; ``lost_response`` performs it
    and then raises; ``torn_write`` (puts) leaves only what an interrupted write would leave.
    """

    seed: int = 0
    rate: float = 0.0
    kinds: tuple[str, ...] = FAULT_KINDS
    ops: tuple[str, ...] = OPS
    schedule: Mapping[tuple[str, str, int], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"FaultPlan.rate={self.rate}: must be in [0, 1]")
        for kind in list(self.kinds) + list(self.schedule.values()):
            if kind not in FAULT_KINDS:
                raise ValueError(f"unknown fault kind {kind!r}: expected one of {FAULT_KINDS}")
        for op in list(self.ops) + [k[0] for k in self.schedule]:
            if op not in OPS:
                raise ValueError(f"unknown storage op {op!r}: expected one of {OPS}")

    def decide(self, op: str, key: str, attempt: int) -> str | None:
        if (op, key, attempt) in self.schedule:
            return self.schedule[(op, key, attempt)]
        if self.rate <= 0 or op not in self.ops:
            return None
        digest = hashlib.sha256(f"{self.seed}\0{op}\0{key}\0{attempt}".encode()).digest()
        if int.from_bytes(digest[:8], "big") / 2**64 >= self.rate:
            return None
        kinds = [k for k in self.kinds if k != "torn_write" or op in PUT_OPS]
        if not kinds:
            return None
        return kinds[int.from_bytes(digest[8:16], "big") % len(kinds)]


class FaultInjectingBackend(Backend):
    """Wraps a raw backend and applies a :class:`FaultPlan`; records every injected fault."""

    def __init__(self, inner: Backend, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self.url = inner.url
        self._lock = threading.Lock()
        self.injected: list[tuple[str, str, int, str]] = []

    def _apply(self, op: str, key: str, action: Callable[[], Any], data: bytes | None = None) -> Any:
        attempt = _ATTEMPT.get()
        kind = self.plan.decide(op, key, attempt)
        if kind == "torn_write" and op not in PUT_OPS:
            kind = None
        if kind is None:
            return action()
        with self._lock:
            self.injected.append((op, key, attempt, kind))
        message = f"{op} {key!r}: injected {kind} (attempt {attempt})"
        if kind == "slowdown":
            raise _transient(message + ": SlowDown: please reduce your request rate", "slowdown")
        if kind == "timeout":
            raise _transient(message + ": read timeout", "timeout")
        if kind == "torn_write":
            self.inner.torn_write(key, data or b"")
            raise _transient(message + ": connection reset during upload", "torn_write")
        action()  # lost_response: the operation happened, the answer did not arrive
        raise _transient(message + ": connection reset before the response", "lost_response")

    def create(self, key: str, data: bytes) -> bool:
        return self._apply("put_if_absent", key, lambda: self.inner.create(key, data), data)

    def get(self, key: str, start: int, end: int | None) -> bytes:
        return self._apply("get", key, lambda: self.inner.get(key, start, end))

    def read_token(self, key: str) -> tuple[bytes, str]:
        return self._apply("read_token", key, lambda: self.inner.read_token(key))

    def cas(self, key: str, data: bytes, token: str | None) -> str:
        return self._apply("cas", key, lambda: self.inner.cas(key, data, token), data)

    def list(self, prefix: str, start_after: str | None, limit: int | None) -> list[str]:
        return self._apply("list", prefix, lambda: self.inner.list(prefix, start_after, limit))

    def list_prefixes(self, prefix: str) -> list[str]:
        return self._apply("list_prefixes", prefix, lambda: self.inner.list_prefixes(prefix))

    def delete(self, key: str) -> None:
        return self._apply("delete", key, lambda: self.inner.delete(key))

    def torn_write(self, key: str, data: bytes) -> None:
        self.inner.torn_write(key, data)

    def close(self) -> None:
        self.inner.close()


# --- the public store ----------------------------------------------------------------------------


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
        if retry_attempts < 1:
            raise ValueError("retry_attempts must be >= 1 (the first attempt counts)")
        self.backend = backend
        self.url = _safe_url(backend.url)
        self.stats = StoreStats()
        self._retry_attempts = retry_attempts
        self._wait = tenacity.wait_random_exponential(multiplier=retry_initial_s, max=retry_max_s)
        self._sleep = sleep
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
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(TransientStorageError),
            stop=tenacity.stop_after_attempt(self._retry_attempts),
            wait=self._wait,
            sleep=self._sleep,
            before_sleep=lambda state: self._on_retry(op, key, state),
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                token = _ATTEMPT.set(attempt.retry_state.attempt_number)
                self.stats.count_request(op)
                try:
                    return fn()
                except Exception as exc:
                    err = translate(exc, op, key)
                    if isinstance(err, TransientStorageError) and attempt.retry_state.attempt_number >= self._retry_attempts:
                        self.stats.count_error(getattr(err, "reason", "transient"))
                    elif not isinstance(err, (TransientStorageError, NotFoundError, PreconditionFailedError)):
                        self.stats.count_error(getattr(err, "reason", "error"))
                    if err is exc:
                        raise
                    raise err from None
                finally:
                    _ATTEMPT.reset(token)
        raise AssertionError("unreachable")  # pragma: no cover

    def _on_retry(self, op: str, key: str, state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        reason = getattr(exc, "reason", type(exc).__name__)
        self.stats.count_retry(reason)
        log.warning(
            "storage_retry op=%s key=%s attempt=%d error=%s sleep_s=%.3f",
            op, key, state.attempt_number, reason, state.upcoming_sleep,
        )

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
        f"storage.url {_safe_url(url)!r}: unsupported scheme; use file://DIR, memory://NAME, "
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
