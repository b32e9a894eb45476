"""Storage counters: bytes moved, attempts by operation, retries and final errors by reason.

One :class:`StoreStats` per :class:`~ddiloco_geo.storage.store.Store`. The retry layer counts
every attempt by operation (``put_if_absent``, ``get``, ...), every retry by its reason
(``SlowDown``, ``EndpointConnectionError``, ``http_503``, an injected fault kind, ...) and every
error that reached the caller (not-found and lost compare-and-swaps are answers, not errors).
The store counts bytes up and down. ``snapshot()`` is what metrics and status export.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any


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

