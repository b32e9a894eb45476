"""Balanced Tensor Fragmentation (paper §4.8) and the per-fragment sync schedule (§5.6).

``plan_fragments`` splits a model's tensors into P fragments of similar size, whole tensors only,
with Graham's LPT greedy: tensors in order of numel descending (ties: name ascending), each into the
fragment with the smallest running total (ties: lowest fragment index; a fragment that is still
empty comes first among equals, so zero-size tensors cannot leave one empty). P = min(requested,
number of tensors). The largest fragment, which sets peak bandwidth, is at most (4/3 - 1/(3P))
of the optimum. The plan depends only on names and shapes (never on dict order or the hash seed),
so every learner and the syncer derive the same one; its ``digest`` goes into ``run.json`` and a
learner refuses a run whose plan differs.

``Schedule``: fragment p is due at inner step t (t counts from 1) when (t - offset_p) mod H == 0.
Offsets default to ``(p * H) // P``: with P == H exactly one fragment is due per step; with P < H
some steps have none; with P > H some have several. Each fragment is due exactly once every H steps.
``AlignedSchedule`` (``learner.send_schedule = aligned``, the default) times each send to the
syncer's merges instead, starting from the fixed offsets.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddiloco_geo.core.errors import CodecError

PLAN_FORMAT = 1


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class FragmentPlan:
    fragments: tuple[tuple[str, ...], ...]  # tensor names per fragment, each sorted by name
    shapes: dict[str, tuple[int, ...]] = field(hash=False)  # every tensor's shape
    _index: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", _validate(self.fragments, self.shapes))

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def numel(self, p: int) -> int:
        return sum(_numel(self.shapes[name]) for name in self.fragments[p])

    def fragment_of(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is in no fragment of this plan") from None

    def expect(self, p: int) -> dict[str, tuple[int, ...]]:
        """{name: shape} of fragment p, as ``codec.decode(expect=...)`` takes it."""
        return {name: self.shapes[name] for name in self.fragments[p]}

    def to_json(self) -> str:
        doc = {
            "format": PLAN_FORMAT,
            "fragments": [list(f) for f in self.fragments],
            "shapes": {name: list(shape) for name, shape in self.shapes.items()},
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> FragmentPlan:
        try:
            doc = json.loads(text)
        except (ValueError, TypeError, RecursionError) as exc:
            raise CodecError("bad_plan", f"fragment plan is not JSON: {exc}"[:300]) from None
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
            raise CodecError("bad_plan", f"expected a JSON object with format {PLAN_FORMAT}")
        fragments, shapes = doc.get("fragments"), doc.get("shapes")
        if not isinstance(fragments, list) or not all(isinstance(f, list) for f in fragments):
            raise CodecError("bad_plan", "'fragments' must be a list of lists of tensor names")
        if not isinstance(shapes, dict) or not all(
            isinstance(s, list) and all(type(d) is int for d in s) for s in shapes.values()
        ):
            raise CodecError("bad_plan", "'shapes' must map tensor names to lists of integers")
        try:
            return cls(tuple(tuple(f) for f in fragments), {n: tuple(s) for n, s in shapes.items()})
        except ValueError as exc:
            raise CodecError("bad_plan", str(exc)) from None

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def _validate(fragments: Any, shapes: Any) -> dict[str, int]:
    """Name -> fragment index; ValueError unless every tensor is in exactly one non-empty,
    name-sorted fragment and has a non-negative shape."""
    if not isinstance(fragments, tuple) or not fragments:
        raise ValueError("a fragment plan needs at least one fragment")
    if not isinstance(shapes, dict):
        raise ValueError("shapes must be a dict of name -> shape")
    for name, shape in shapes.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name {name!r}: expected a non-empty string")
        if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a tuple of integers >= 0")
    index: dict[str, int] = {}
    for p, names in enumerate(fragments):
        if not isinstance(names, tuple) or not names:
            raise ValueError(f"fragment {p} is empty")
        if list(names) != sorted(names):
            raise ValueError(f"fragment {p}: tensor names must be sorted")
        for name in names:
            if name in index:
                raise ValueError(f"tensor {name!r} is in fragments {index[name]} and {p}")
            if name not in shapes:
                raise ValueError(f"tensor {name!r} (fragment {p}) has no shape")
            index[name] = p
    if missing := sorted(set(shapes) - set(index)):
        raise ValueError(f"tensors in no fragment: {missing[:5]}")
    return index


def plan_fragments(shapes: Mapping[str, tuple[int, ...]], num_fragments: int) -> FragmentPlan:
    """LPT bin-packing of whole tensors into min(num_fragments, len(shapes)) fragments."""
    if type(num_fragments) is not int or num_fragments < 1:
        raise ValueError(f"num_fragments {num_fragments!r}: expected an integer >= 1")
    if not shapes:
        raise ValueError("cannot fragment a model with no tensors")
    shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
    num = min(num_fragments, len(shapes))
    order = sorted(shapes, key=lambda name: (-_numel(shapes[name]), name))
    # Heap key (total, has_tensors, index): lightest first, empty before non-empty, lowest index.
    heap = [(0, False, p) for p in range(num)]
    members: list[list[str]] = [[] for _ in range(num)]
    for name in order:
        total, _, p = heapq.heappop(heap)
        members[p].append(name)
        heapq.heappush(heap, (total + _numel(shapes[name]), True, p))
    return FragmentPlan(tuple(tuple(sorted(m)) for m in members), dict(sorted(shapes.items())))


class Schedule:
    """Which fragments are due at an inner step: (step - offset_p) % H == 0, step >= 1."""

    def __init__(self, num_fragments: int, sync_every: int, offsets: list[int] | None = None) -> None:
        if type(num_fragments) is not int or num_fragments < 1:
            raise ValueError(f"num_fragments {num_fragments!r}: expected an integer >= 1")
        if type(sync_every) is not int or sync_every < 1:
            raise ValueError(f"sync_every (H) {sync_every!r}: expected an integer >= 1")
        if offsets is None:
            offsets = [(p * sync_every) // num_fragments for p in range(num_fragments)]
        offsets = list(offsets)
        if len(offsets) != num_fragments or not all(
            type(o) is int and 0 <= o < sync_every for o in offsets
        ):
            raise ValueError(
                f"offsets {offsets!r}: expected {num_fragments} integers in [0, {sync_every})"
            )
        self.num_fragments = num_fragments
        self.sync_every = sync_every
        self._offsets = tuple(offsets)
        self._by_residue: dict[int, list[int]] = {}
        for p, o in enumerate(offsets):
            self._by_residue.setdefault(o, []).append(p)

    def offset(self, p: int) -> int:
        return self._offsets[p]

    timing = None  # no lead to judge (see :class:`AlignedSchedule`)

    def adopted(self, p: int, step: int, merged_step: int | None = None) -> None:
        """Adoptions do not move a fixed schedule (see :class:`AlignedSchedule`)."""

    def due(self, step: int) -> list[int]:
        if step < 1:
            return []
        return list(self._by_residue.get(step % self.sync_every, ()))

    def __repr__(self) -> str:
        return f"Schedule(num_fragments={self.num_fragments}, sync_every={self.sync_every}, offsets={list(self._offsets)})"


class AlignedSchedule:
    """Sends timed to the syncer's merges (``learner.send_schedule = aligned``, the default).

    With the fixed :class:`Schedule` a learner sends fragment p every H of its own steps, whenever
    the merge of p happens. The syncer merges p about once per fragment period (merge spacing), and
    learners drift out of phase with it (step-time jitter, slower and faster hardware, restarts):
    measured on the harness, a learner had taken on average 10 steps of 24 past its send when the
    merge holding that delta arrived, steps made on a model the merge then moved (out of step;
    a lock-step run has none). The paper's syncer avoids this by pulling each learner's fragment when
    it merges; through a bucket the learner can instead time its sends: after adopting a new global
    of p at its step a, it sends p next at a + period - lead, where period is its own steps between
    two merges of a fragment (an EMA of the gaps between consecutive adoptions, each gap kept within
    [H/2, 2H]) and lead is the steps a delta needs to reach the syncer. So every learner's delta
    arrives just before the merge, whatever its speed.

    The lead starts at τ (``fragments.overlap``, at least 1) and follows what the merges say: a
    send that the merge it was timed for did not take (the learner's next adoption of p holds no
    delta of it at or after that send) was late, and the lead grows by a step (up to H − 1, a send
    right after the adoption; once for the sends of one lead, which all come back late within a
    period); after 4·P sends in a row that made their merge it tries one step less (not below τ),
    and a try that comes back late doubles the sends it waits before the next (up to 64·P), so a
    lead that fits stays. What a delta needs is the time from a merge to the learner's adoption of it
    (its poll interval, the download) plus the upload and the syncer's intake, in steps: with short
    steps that is more than τ = 2, and most deltas missed their merge and waited a whole period (2026-12-04, the chaos settings without
    faults, three runs each: final loss 2.641 on the moto S3 server, 2.526 on a local directory;
    with this lead, and the grace window counted from the round's opening, 2.500 and 2.463).

    Until the first adoption of p (and after a send that no merge follows) p is due as in the fixed
    schedule: every H steps from the fixed offset, so a learner never sends less often than there;
    never more often than once per H/2 steps either, so frequent merges cannot make it flood, and at
    least once per 2H steps, so a stream of merges cannot silence it. The state is a function of the
    steps and the adoptions, so every rank of a learner computes the same schedule.
    """

    def __init__(self, num_fragments: int, sync_every: int, lead: int) -> None:
        self.fixed = Schedule(num_fragments, sync_every)
        self.sync_every, self.lead = sync_every, max(1, int(lead))
        self.min_lead, self.max_lead = self.lead, max(self.lead, sync_every - 1)
        self.timing = {"lead": self.lead, "on_time": 0, "late": 0}  # sends judged by the merges (status)
        self.streak, self.patience = 0, 4 * num_fragments  # sends in a row that made their merge; before a try
        self.probe: int | None = None  # the lead being tried, until a send timed with it is judged
        self.sent_lead = [self.lead] * num_fragments  # the lead each fragment's last send was timed with
        self.period = float(sync_every)  # own steps per merge period, EMA
        self.next_due: list[int] | None = None
        self.last_sent = [0] * num_fragments
        self.last_adopted: list[int | None] = [None] * num_fragments

    def _start(self, step: int) -> list[int]:
        """First due steps from ``step`` on: the fixed schedule's (t - offset_p) % H == 0, t >= 1."""
        H = self.sync_every
        return [max(step, 0) + 1 + (self.fixed.offset(p) - max(step, 0) - 1) % H
                for p in range(self.fixed.num_fragments)]

    def adopted(self, p: int, step: int, merged_step: int | None = None) -> None:
        """A new global of fragment p was adopted before inner step ``step``; ``merged_step``: this
        learner's newest step in the merges it holds (-1: none took its delta; None: not known)."""
        if self.next_due is None:
            self.next_due = self._start(step - 1)
        H, last = self.sync_every, self.last_adopted[p]
        if merged_step is not None and last is not None and self.last_sent[p] > last:
            self._judged(p, merged_step >= self.last_sent[p])
        if last is not None and H / 2 <= step - last <= 2 * H:
            self.period = 0.8 * self.period + 0.2 * (step - last)
        self.last_adopted[p] = step
        self.next_due[p] = min(max(step + round(self.period) - self.lead, self.last_sent[p] + H // 2, step),
                               self.last_sent[p] + 2 * H)

    def _judged(self, p: int, on_time: bool) -> None:
        """The lead's feedback: a step more after a late send, a step less tried after enough on time."""
        self.timing["on_time" if on_time else "late"] += 1
        if self.probe is not None and self.sent_lead[p] == self.probe:  # a send timed with the lead tried
            if not on_time:
                self.patience = min(2 * self.patience, 64 * self.fixed.num_fragments)
            self.probe = None
        self.streak = self.streak + 1 if on_time else 0
        if not on_time and self.sent_lead[p] >= self.lead:  # not raised since this send was timed
            self.lead = min(self.lead + 1, self.max_lead)
        elif on_time and self.streak >= self.patience and self.lead > self.min_lead:
            self.lead, self.probe, self.streak = self.lead - 1, self.lead - 1, 0
        self.timing["lead"] = self.lead

    def due(self, step: int) -> list[int]:
        if step < 1:
            return []
        if self.next_due is None:
            self.next_due = self._start(step - 1)
        out = [p for p, t in enumerate(self.next_due) if step >= t]
        for p in out:  # if no merge follows, the fixed period
            self.last_sent[p], self.sent_lead[p] = step, self.lead
            self.next_due[p] = step + self.sync_every
        return out


def send_schedule(kind: str, num_fragments: int, sync_every: int, lead: int) -> Schedule | AlignedSchedule:
    """``learner.send_schedule``: ``fixed`` (:class:`Schedule`) or ``aligned`` (:class:`AlignedSchedule`)."""
    if kind == "fixed":
        return Schedule(num_fragments, sync_every)
    if kind == "aligned":
        return AlignedSchedule(num_fragments, sync_every, lead)
    raise ValueError(f"send schedule {kind!r}: expected 'fixed' or 'aligned'")
