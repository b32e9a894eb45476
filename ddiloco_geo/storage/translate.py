"""Error translation: every backend exception becomes one of ours, once, with no credentials in it.

Backends raise whatever fsspec, botocore, aiohttp, requests, gcsfs or the OS raise;
:func:`translate` maps each into :mod:`ddiloco_geo.core.errors` and attaches ``reason``, a short
label that stats and the ``storage_retry`` log line use:

* missing -> :class:`NotFoundError` (``FileNotFoundError``, ``NoSuchKey``, HTTP 404);
* a lost conditional write -> :class:`PreconditionFailedError` (``FileExistsError``, HTTP 412);
* 5xx, 408, 429, SlowDown and the other throttling codes, timeouts and connection failures
  (including gcsfs's status-less ``ProxyError`` for a 502) -> :class:`TransientStorageError`,
  the only class the retry layer retries;
* anything else (403, other 4xx, local I/O errors) -> :class:`StorageError`.

A missing S3 bucket (``NoSuchBucket``) is a plain StorageError, never "not found": it is a
configuration error, not an object that does not exist yet.

Messages name the operation and the key and never contain credentials: :func:`scrub` removes
signatures, access keys, tokens, ``Authorization`` headers and ``user:password@`` from URLs, and
every literal registered with :func:`register_secret` (the S3 backend registers the credentials it
resolved). :func:`safe_url` is a root URL fit to print.
"""

from __future__ import annotations

import errno
import functools
import re
import threading

from ddiloco_geo.core.errors import NotFoundError, PreconditionFailedError, StorageError, TransientStorageError

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


def safe_url(url: str) -> str:
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


@functools.cache
def _transient_exception_types() -> tuple[type[BaseException], ...]:
    # Client libraries are imported late, on the first error: local runs never need them.
    types: list[type[BaseException]] = [TimeoutError, ConnectionError]
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


def status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
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
    status, code = status_and_code(exc)
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
    elif isinstance(exc, _transient_exception_types()):
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


def _proxy_error(exc: BaseException) -> bool:
    # gcsfs turns a 502 into requests.exceptions.ProxyError without a status.
    return type(exc).__name__ == "ProxyError"


def transient_error(message: str, reason: str) -> TransientStorageError:
    """A retryable error raised by this package itself (injected faults), labelled ``reason``."""
    exc = TransientStorageError(message)
    exc.reason = reason  # type: ignore[attr-defined]
    return exc
