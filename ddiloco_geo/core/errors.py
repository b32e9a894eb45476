"""The project's exception tree.

Storage errors are translated once, at the storage boundary (`ddiloco_geo.storage`); codec errors
carry a short machine-readable ``reason`` that the syncer uses as a counter label. Messages never
contain credentials.
"""

from __future__ import annotations


class DdilocoError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(DdilocoError):
    """Invalid or unknown configuration; the message says how to fix it."""


class StorageError(DdilocoError):
    """A storage operation failed for a reason that retrying will not fix."""


class TransientStorageError(StorageError):
    """5xx, SlowDown/throttling, connection reset, timeout: retried with backoff, then raised."""


class NotFoundError(StorageError):
    """The object does not exist. Never retried."""


class PreconditionFailedError(StorageError):
    """A compare-and-swap lost: the object changed since it was read. Never retried."""


class CodecError(DdilocoError):
    """An object could not be decoded or failed validation.

    ``reason`` is a short stable label (``truncated``, ``bad_header``, ``checksum``, ``nonfinite``,
    ``shape``, ...) used for logs and counters.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class LayoutError(DdilocoError, ValueError):
    """A key or identifier that does not fit the bucket layout (`ddiloco_geo.core.layout`)."""
