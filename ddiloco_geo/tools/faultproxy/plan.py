"""Which request fails, and how: a pure function of (seed, method, target, occurrence).

A request is keyed by its method, its target (path and query, as sent, with the bucket name left
out so a seed behaves the same on a fresh bucket) and its occurrence: the n-th time this proxy has
seen that method and target (0-based). A retry of the same request is
the next occurrence, so it gets a fresh decision and a fault never repeats forever. The decision
is ``blake2b(seed, method, target, occurrence)``: below ``rate`` the request fails, and the same
digest picks the kind (weighted by ``weights``) and, for latency spikes, the delay. No other
randomness; concurrency only changes which of several identical concurrent requests is the n-th.

Kinds (see :mod:`ddiloco_geo.tools.faultproxy.proxy` for how each is applied):

* ``slowdown_503``, ``throttle_429``, ``internal_500``: the proxy reads the request and answers
  with the server's own error shape (S3 XML or GCS JSON); the server never sees it;
* ``reset_request``: part of the request (half the body, or a partial head) reaches the server,
  then both connections are reset: a torn upload;
* ``reset_response``: the server answers in full; the client gets the head and half the body,
  then a reset;
* ``lost_response``: the server answers in full (a write is committed); the client gets a reset;
* ``latency``: the request is held ``latency_s`` scaled by the digest (0.5x to 1.5x), then passed;
* ``stall``: the request is read and held, unanswered, until the client gives up (its timeout).

``write_kinds`` limits the kinds a write (PUT/POST/PATCH) may get: the contract profile keeps the
answer of every conditional write visible (no ``reset_response``/``lost_response`` on writes),
because the contract's exact answers ("created", "one winner") assume the caller sees them; the
full profile loses them too, as a real network does. ``schedule`` pins faults explicitly:
``{("PUT", "/bucket/run/x", 0): "lost_response"}`` (a target may be a prefix ending in ``*``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

ERROR_KINDS = ("slowdown_503", "throttle_429", "internal_500")
RESET_KINDS = ("reset_request", "reset_response", "lost_response")
FAULT_KINDS = ERROR_KINDS + RESET_KINDS + ("latency", "stall")
WRITE_METHODS = ("PUT", "POST", "PATCH")
# kinds after which the server may have committed a write the client never heard about
ANSWER_LOSING_KINDS = ("reset_response", "lost_response")

DEFAULT_WEIGHTS: Mapping[str, float] = {
    "slowdown_503": 3, "throttle_429": 2, "internal_500": 2, "reset_request": 3, "reset_response": 2,
    "lost_response": 2, "latency": 2, "stall": 1,
}


@dataclass(frozen=True)
class Fault:
    """One decision: the kind, and the delay for ``latency``."""

    kind: str
    delay_s: float = 0.0


@dataclass(frozen=True)
class HttpFaultPlan:
    """Which requests fail, and how. See the module docstring."""

    seed: int = 0
    rate: float = 0.0
    kinds: tuple[str, ...] = FAULT_KINDS
    write_kinds: tuple[str, ...] | None = None
    weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    latency_s: float = 0.5
    schedule: Mapping[tuple[str, str, int], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"HttpFaultPlan.rate={self.rate}: must be in [0, 1]")
        named = [*self.kinds, *(self.write_kinds or ()), *self.schedule.values()]
        for kind in named:
            if kind not in FAULT_KINDS:
                raise ValueError(f"unknown fault kind {kind!r}: expected one of {FAULT_KINDS}")
        if self.latency_s < 0:
            raise ValueError(f"HttpFaultPlan.latency_s={self.latency_s}: must be >= 0")

    @classmethod
    def contract(cls, seed: int, rate: float, **kwargs) -> HttpFaultPlan:
        """Every kind, except that a write always gets its answer (see the module docstring)."""
        return cls(seed=seed, rate=rate,
                   write_kinds=tuple(k for k in FAULT_KINDS if k not in ANSWER_LOSING_KINDS), **kwargs)

    def decide(self, method: str, target: str, occurrence: int) -> Fault | None:
        pinned = self._pinned(method, target, occurrence)
        if pinned is not None:
            return Fault(pinned, self.latency_s)
        if self.rate <= 0:
            return None
        keyed = without_bucket(target)
        digest = hashlib.blake2b(f"{self.seed}\0{method}\0{keyed}\0{occurrence}".encode(), digest_size=24).digest()
        if _unit(digest[0:8]) >= self.rate:
            return None
        kinds = self.write_kinds if method in WRITE_METHODS and self.write_kinds is not None else self.kinds
        kinds = tuple(k for k in kinds if self.weights.get(k, 0) > 0)
        if not kinds:
            return None
        pick = _unit(digest[8:16]) * sum(self.weights[k] for k in kinds)
        for kind in kinds:
            pick -= self.weights[kind]
            if pick < 0:
                break
        return Fault(kind, self.latency_s * (0.5 + _unit(digest[16:24])))

    def _pinned(self, method: str, target: str, occurrence: int) -> str | None:
        for (m, t, n), kind in self.schedule.items():
            if m == method and n == occurrence and (t == target or (t.endswith("*") and target.startswith(t[:-1]))):
                return kind
        return None


_BUCKET_RE = re.compile(r"^(/(?:upload/|download/)?storage/v1/b/|/)([^/?]+)")


def without_bucket(target: str) -> str:
    """The target with its bucket name replaced by ``{bucket}`` (S3 path style and the GCS JSON
    API), so that a seed gives the same decisions on a fresh bucket."""
    return _BUCKET_RE.sub(lambda m: m.group(1) + "{bucket}", target, count=1)


def _unit(b: bytes) -> float:
    return int.from_bytes(b, "big") / 2.0**64
