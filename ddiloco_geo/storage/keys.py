"""Object keys: what a valid key or listing prefix is, and how a bucket URL splits into bucket and prefix.

Keys are relative to the store's root URL and use ``/`` as separator; they may not contain ``..``,
``.``, empty segments, a leading ``/``, backslashes, control characters or the reserved
``.ddiloco-`` name prefix (temp and lock files of the local backend). Every :class:`Store`
operation checks its key here before any I/O, so a bad key is a :class:`LayoutError` with a
message that says how to fix it, never a request.
"""

from __future__ import annotations

from ddiloco_geo.core.errors import LayoutError, StorageError
from ddiloco_geo.storage.translate import safe_url

RESERVED_PREFIX = ".ddiloco-"


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


def split_bucket(url: str, scheme: str) -> tuple[str, str]:
    """``s3://bucket/run-1`` -> ``("bucket", "run-1/")``; the prefix is checked like a key prefix."""
    rest = url[len(scheme):].split("?", 1)[0]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise StorageError(f"storage.url {safe_url(url)!r}: missing bucket name, e.g. {scheme}my-bucket/run-1")
    prefix = prefix.strip("/")
    if prefix:
        check_prefix(prefix)
    return bucket, (prefix + "/" if prefix else "")
