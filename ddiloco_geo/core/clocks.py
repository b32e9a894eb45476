"""Vector clocks (who has seen how much of whom) and time sources (real and fake).

``VectorClock`` is an immutable map from actor id to a non-negative counter (paper §4.9: "every
worker keeps a vector clock of its own and others' progress"). Actors are learner ids
(``keys.ID_PATTERN``) and the reserved actor ``"syncer"``. A missing entry counts as 0, and zero
entries are never stored, so ``{"a": 0}`` and ``{}`` are the same clock with the same JSON.

- ``merge`` is the element-wise maximum (commutative, associative, idempotent).
- ``compare`` gives the causal order: BEFORE (every entry <=, one <), AFTER, EQUAL, or CONCURRENT.
- ``to_json`` is stable (sorted keys, no spaces) so that a clock inside a wire header or a
  snapshot manifest is byte-for-byte reproducible; ``from_json`` validates and raises
  ``CodecError("bad_clock", ...)`` on anything else.

Time sources: services take a clock object with ``now()`` and an async ``sleep(s)``.
``MonotonicClock`` is the real one; ``FakeClock`` only moves when a test calls ``advance``, and its
sleepers wake when the time passes their deadline, so tests of timing logic never sleep.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import json
import time
from collections.abc import Iterator, Mapping
from typing import Protocol

from ddiloco_geo.core.errors import CodecError
from ddiloco_geo.core.layout import ID_PATTERN

SYNCER_ACTOR = "syncer"
MAX_COUNT = 2**63 - 1  # counters stay inside a signed 64-bit integer everywhere they are stored
MAX_CLOCK_JSON_BYTES = 1 << 20


class Order(enum.Enum):
    BEFORE = "before"
    AFTER = "after"
    EQUAL = "equal"
    CONCURRENT = "concurrent"


def _check_actor(actor: object) -> str:
    if not isinstance(actor, str) or not (actor == SYNCER_ACTOR or ID_PATTERN.match(actor)):
        raise ValueError(
            f"invalid clock actor {actor!r}: use a learner id (1-63 of a-z, 0-9, '_', '-') "
            f"or {SYNCER_ACTOR!r}"
        )
    return actor


def _check_count(count: object, actor: str) -> int:
    if type(count) is not int or not 0 <= count <= MAX_COUNT:
        raise ValueError(f"clock entry {actor!r}: {count!r} is not an integer in [0, 2^63)")
    return count


class VectorClock(Mapping[str, int]):
    """Immutable vector clock; ``clock[actor]`` is 0 for an actor it has never seen."""

    __slots__ = ("_entries", "_hash")

    def __init__(self, entries: Mapping[str, int] | None = None) -> None:
        items = {}
        for actor, count in (entries or {}).items():
            _check_count(count, _check_actor(actor))
            if count:
                items[actor] = count
        self._entries: dict[str, int] = dict(sorted(items.items()))
        self._hash: int | None = None

    # --- mapping ---------------------------------------------------------------------------------

    def __getitem__(self, actor: str) -> int:
        return self._entries.get(actor, 0)

    def __contains__(self, actor: object) -> bool:
        return actor in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, VectorClock):
            return NotImplemented
        return self._entries == other._entries

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self._entries.items()))
        return self._hash

    def __repr__(self) -> str:
        return f"VectorClock({self._entries!r})"

    # --- algebra ---------------------------------------------------------------------------------

    def tick(self, actor: str, n: int = 1) -> VectorClock:
        """A clock with ``actor``'s counter advanced by ``n`` (n >= 0)."""
        if type(n) is not int or n < 0:
            raise ValueError(f"tick by {n!r}: expected a non-negative integer")
        return VectorClock({**self._entries, actor: self[_check_actor(actor)] + n})

    def merge(self, other: VectorClock) -> VectorClock:
        """Element-wise maximum: the clock of someone who has seen both."""
        merged = dict(self._entries)
        for actor, count in other._entries.items():
            if count > merged.get(actor, 0):
                merged[actor] = count
        return VectorClock(merged)

    def compare(self, other: VectorClock) -> Order:
        less = greater = False
        for actor in self._entries.keys() | other._entries.keys():
            a, b = self[actor], other[actor]
            less |= a < b
            greater |= a > b
        if less and greater:
            return Order.CONCURRENT
        if less:
            return Order.BEFORE
        if greater:
            return Order.AFTER
        return Order.EQUAL

    def __le__(self, other: VectorClock) -> bool:
        return self.compare(other) in (Order.BEFORE, Order.EQUAL)

    def __lt__(self, other: VectorClock) -> bool:
        return self.compare(other) is Order.BEFORE

    def __ge__(self, other: VectorClock) -> bool:
        return self.compare(other) in (Order.AFTER, Order.EQUAL)

    def __gt__(self, other: VectorClock) -> bool:
        return self.compare(other) is Order.AFTER

    def concurrent_with(self, other: VectorClock) -> bool:
        return self.compare(other) is Order.CONCURRENT

    # --- serialization ---------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(self._entries, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> VectorClock:
        try:
            if len(text) > MAX_CLOCK_JSON_BYTES:
                raise ValueError(f"{len(text)} bytes is more than a clock can need")
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, got {type(data).__name__}")
            return cls(data)
        except CodecError:
            raise
        except Exception as exc:  # noqa: BLE001 - anything malformed is one stable reason
            raise CodecError("bad_clock", f"{type(exc).__name__}: {exc}"[:300]) from None


# --- time sources --------------------------------------------------------------------------------


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """Real time: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """Time that moves only when ``advance`` is called.

    ``sleep(s)`` returns once the clock has been advanced to at least ``now() + s`` (a sleep of
    0 or less returns after one loop iteration). ``advance`` is synchronous: it resolves the
    sleepers that are due, and they resume the next time the event loop runs them.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._counter = itertools.count()

    def now(self) -> float:
        return self._now

    @property
    def num_sleepers(self) -> int:
        """Sleepers still waiting (cancelled ones excluded)."""
        return sum(1 for _, _, fut in self._sleepers if not fut.done())

    def next_deadline(self) -> float | None:
        pending = [deadline for deadline, _, fut in self._sleepers if not fut.done()]
        return min(pending) if pending else None

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot advance time by {seconds!r}: time only moves forward")
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._counter), fut))
        await fut
