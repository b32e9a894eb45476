"""Vector clocks (algebra, order, JSON) and the fake time source."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco_geo.core.clocks import FakeClock, MonotonicClock, Order, VectorClock
from ddiloco_geo.core.errors import CodecError

pytestmark = pytest.mark.unit  # no servers, no subprocesses

ACTORS = ["a", "b", "c", "l-1", "syncer"]
clocks = st.dictionaries(st.sampled_from(ACTORS), st.integers(0, 5)).map(VectorClock)
fast = settings(max_examples=100, derandomize=True, deadline=None)


@fast
@given(clocks, clocks)
def test_merge_is_commutative(a, b):
    assert a.merge(b) == b.merge(a)


@fast
@given(clocks, clocks, clocks)
def test_merge_is_associative(a, b, c):
    assert a.merge(b).merge(c) == a.merge(b.merge(c))


@fast
@given(clocks)
def test_merge_is_idempotent(a):
    assert a.merge(a) == a


@fast
@given(clocks, clocks)
def test_merge_is_an_upper_bound_and_compare_agrees(a, b):
    m = a.merge(b)
    assert a <= m and b <= m
    assert m.compare(a) in (Order.AFTER, Order.EQUAL)
    # a <= b exactly when merging b into a changes nothing to b.
    assert (a <= b) == (a.merge(b) == b)


@fast
@given(clocks, clocks, clocks)
def test_compare_is_a_partial_order(a, b, c):
    assert a <= a
    if a <= b and b <= a:
        assert a == b
    if a <= b and b <= c:
        assert a <= c
    opposite = {Order.BEFORE: Order.AFTER, Order.AFTER: Order.BEFORE}
    assert b.compare(a) == opposite.get(a.compare(b), a.compare(b))


@fast
@given(clocks)
def test_json_round_trips_and_is_stable(a):
    text = a.to_json()
    assert " " not in text
    back = VectorClock.from_json(text)
    assert back == a and hash(back) == hash(a) and back.to_json() == text


@fast
@given(clocks, st.sampled_from(ACTORS), st.integers(1, 3))
def test_tick_moves_after(a, actor, n):
    t = a.tick(actor, n)
    assert t.compare(a) is Order.AFTER and a < t
    assert t[actor] == a[actor] + n


def test_missing_entries_are_zero_and_zeros_are_not_stored():
    assert VectorClock()["nobody"] == 0
    assert VectorClock({"a": 0}) == VectorClock()
    assert VectorClock({"a": 0, "b": 2}).to_json() == '{"b":2}'
    assert VectorClock({"b": 1, "a": 2}).to_json() == '{"a":2,"b":1}'


def test_concurrent_clocks():
    a, b = VectorClock({"a": 1}), VectorClock({"b": 1})
    assert a.compare(b) is Order.CONCURRENT and a.concurrent_with(b)
    assert not a <= b and not b <= a


@pytest.mark.parametrize(
    "text",
    [
        "[]", '{"a": -1}', '{"a": 1.5}', '{"a": true}', '{"a": "1"}', '{"Bad": 1}', '{"a/b": 1}',
        '{"": 1}', "{", "", "null", '{"a": 99999999999999999999999}', "1" * 2_000_000,
    ],
)
def test_from_json_rejects_garbage_with_bad_clock(text):
    with pytest.raises(CodecError) as err:
        VectorClock.from_json(text)
    assert err.value.reason == "bad_clock"


def test_constructor_and_tick_validate():
    with pytest.raises(ValueError):
        VectorClock({"UPPER": 1})
    with pytest.raises(ValueError):
        VectorClock().tick("a", -1)


def test_fake_clock_sleep_wakes_only_when_advanced_past_deadline():
    async def main():
        clock = FakeClock(start=10.0)
        woke = []

        async def sleeper(name, s):
            await clock.sleep(s)
            woke.append((name, clock.now()))

        tasks = [asyncio.create_task(sleeper("short", 1.0)), asyncio.create_task(sleeper("long", 5.0))]
        await asyncio.sleep(0)
        assert clock.num_sleepers == 2 and clock.next_deadline() == 11.0
        clock.advance(0.5)
        await asyncio.sleep(0)
        assert woke == []
        clock.advance(0.5)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert woke == [("short", 11.0)]
        clock.advance(10)
        await asyncio.gather(*tasks)
        assert woke[1] == ("long", 21.0)
        await clock.sleep(0)  # zero sleep returns without advancing
        with pytest.raises(ValueError):
            clock.advance(-1)

    asyncio.run(main())


def test_fake_clock_cancelled_sleeper_is_dropped():
    async def main():
        clock = FakeClock()
        task = asyncio.create_task(clock.sleep(3))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert clock.num_sleepers == 0
        clock.advance(5)  # resolving a cancelled future must not raise

    asyncio.run(main())


def test_monotonic_clock():
    clock = MonotonicClock()
    t0 = clock.now()
    asyncio.run(clock.sleep(0))
    assert clock.now() >= t0
