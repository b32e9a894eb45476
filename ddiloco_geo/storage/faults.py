"""Deterministic storage fault injection (habit 9): which attempt fails, and how.

:class:`FaultPlan` decides, from ``hash(seed, op, key, attempt)`` or an explicit schedule, whether
an attempt fails and how; :class:`FaultInjectingBackend` applies it to the raw backend, under the
retry layer, so retries, stats and error paths run for real. ``open_store(cfg, faults=plan)`` or
``storage.fault_rate``/``storage.fault_seed`` in the settings switch it on; chaos runs use it.

Kinds: ``slowdown`` and ``timeout`` raise a transient error before the operation;
``lost_response`` performs the operation and then raises (so a retried create answers "already
exists" and a retried CAS loses to its own write); ``torn_write`` (puts only) leaves what an
interrupted write would leave, never a visible object, and raises.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ddiloco_geo.storage.backend import Backend
from ddiloco_geo.storage.retry import current_attempt
from ddiloco_geo.storage.translate import transient_error

OPS = ("put_if_absent", "get", "read_token", "cas", "list", "list_prefixes", "delete")
PUT_OPS = ("put_if_absent", "cas")
FAULT_KINDS = ("slowdown", "timeout", "lost_response", "torn_write")


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
        attempt = current_attempt()
        kind = self.plan.decide(op, key, attempt)
        if kind == "torn_write" and op not in PUT_OPS:
            kind = None
        if kind is None:
            return action()
        with self._lock:
            self.injected.append((op, key, attempt, kind))
        message = f"{op} {key!r}: injected {kind} (attempt {attempt})"
        if kind == "slowdown":
            raise transient_error(message + ": SlowDown: please reduce your request rate", "slowdown")
        if kind == "timeout":
            raise transient_error(message + ": read timeout", "timeout")
        if kind == "torn_write":
            self.inner.torn_write(key, data or b"")
            raise transient_error(message + ": connection reset during upload", "torn_write")
        action()  # lost_response: the operation happened, the answer did not arrive
        raise transient_error(message + ": connection reset before the response", "lost_response")

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
