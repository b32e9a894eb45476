"""What the syncer holds per fragment, and how it loads a published version back from the bucket.

A :class:`FragmentState` is the syncer's view of one fragment it owns: the current global
(version, parameters, vector clock), its outer-optimizer state, the update codec's error-feedback
residual, the per-learner sequence numbers already accounted for (``consumed``), the deltas waiting
for a merge, a few recent versions kept for anchoring stale deltas, and the round timings.

:func:`load_fragment` rebuilds a fragment's state from a published global and the state object
its header names (outer momentum, residual, cursors): a restarted syncer, or the loser of a
publish race, continues exactly where the winner left off.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ddiloco_geo import codec, protocol
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.outer import OuterOptimizer
from ddiloco_geo.protocol.publish import RESIDUAL, outer_state_from_wire
from ddiloco_geo.storage import Store

HISTORY_VERSIONS = 4  # in-memory globals kept for anchoring; older bases are read from the bucket


@dataclass
class PendingDelta:
    key: str
    learner: str
    seq: int
    header: codec.Header
    pseudo_grad: dict[str, torch.Tensor]
    arrived_s: float
    step_norm: float  # ||pseudo_grad|| / num_steps, computed once by intake's norm check
    backlog: bool = False  # found by this syncer's first poll: delivered before it served (rounds.RoundPolicy.ready)


@dataclass
class FragmentState:
    fragment: int
    version: int
    params: dict[str, torch.Tensor]
    outer: OuterOptimizer
    clock: VectorClock = field(default_factory=VectorClock)
    consumed: dict[str, int] = field(default_factory=dict)  # learner -> highest seq accounted for
    merged_base: dict[str, int] = field(default_factory=dict)  # learner -> base version of its newest merged delta
    merged_counts: dict[str, tuple[int, int]] = field(default_factory=dict)  # learner -> that delta's (steps, tokens)
    finalized: frozenset[str] = frozenset()  # learners whose final mark a merge has honored (rounds.final_marks)
    pending: list[PendingDelta] = field(default_factory=list)
    history: OrderedDict = field(default_factory=OrderedDict)  # version -> params
    norms: dict = field(default_factory=lambda: defaultdict(lambda: deque(maxlen=8)))  # learner -> per-step norms
    quorum_s: float | None = None
    last_merge_s: float | None = None
    residual: dict[str, torch.Tensor] = field(default_factory=dict)  # error feedback of update objects
    forged_skips: int = 0  # forged globals published past in a row (service._publish_above_forged)

    def norm_reference(self) -> float | None:
        """The median over learners of each learner's recent per-step norms (None before 8 norms):
        one learner sending tiny or huge deltas cannot move it for the others."""
        if sum(len(h) for h in self.norms.values()) < 8:
            return None
        return statistics.median(statistics.median(h) for h in self.norms.values() if h)

    def remember(self, version: int, params: dict[str, torch.Tensor]) -> None:
        self.history[version] = params
        while len(self.history) > HISTORY_VERSIONS:
            self.history.popitem(last=False)


class Ema:
    """Exponential moving average of a timing (``decay`` is the weight on the old value)."""

    def __init__(self, decay: float, value: float | None = None) -> None:
        self.decay = decay
        self.value = value

    def update(self, x: float) -> float:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x
        return self.value

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


class StepTimes:
    """The learners' step time ξ_step, which sets the merge spacing (H · ξ_step) and the grace window.

    Each learner's own EMA of the ``step_s`` its deltas carry, combined as the **median over the
    learners heard from lately** (within ``live_periods`` fragment periods of their own step time,
    so a learner that stopped drops out; all known learners if none is). One EMA over every header
    in arrival order swings with whichever learner sent last: with half the learners 18% slower it
    moved the merge period by about ±1.3 s of 26 (standard deviation), and the slower learners'
    aligned sends, two steps before the expected merge, missed about one merge in ten. The median
    per learner holds still, and one learner (a bad clock, a liar) cannot move it for the others.
    """

    def __init__(self, decay: float, sync_every: int, now: Callable[[], float], live_periods: float = 3.0) -> None:
        self.decay, self.window_steps, self.now = decay, live_periods * sync_every, now
        self.per: dict[str, Ema] = {}
        self.seen: dict[str, float] = {}

    def update(self, learner: str, step_s: float) -> None:
        self.per.setdefault(learner, Ema(self.decay)).update(step_s)
        self.seen[learner] = self.now()

    def get(self, default: float = 0.0) -> float:
        if not self.per:
            return default
        now = self.now()
        live = [e.get() for name, e in self.per.items() if now - self.seen[name] <= self.window_steps * e.get()]
        return statistics.median(live or [e.get() for e in self.per.values()])


def load_fragment(store: Store, spec: protocol.RunSpec, fragment: int, version: int, *,
                  outer_kwargs: dict[str, Any], verifier: Any = None,
                  require_signatures: bool = False) -> tuple[FragmentState, str | None]:
    """A published version as a fresh :class:`FragmentState`, and the state key it names."""
    header, params = protocol.read_global(store, spec, fragment, version, verify=verifier,
                                          require_signature=require_signatures)
    outer = OuterOptimizer(**outer_kwargs)
    consumed: dict[str, int] = {}
    merged_base: dict[str, int] = {}
    merged_counts: dict[str, tuple[int, int]] = {}
    finalized: frozenset[str] = frozenset()
    residual: dict[str, torch.Tensor] = {}
    state_key = header.extra.get("state_key")
    if state_key:
        st_header, st_tensors = codec.decode(
            store.get(state_key), kind="state", run_id=spec.run_id, verify=verifier,
            require_signature=require_signatures, expected_signer="syncer" if verifier is not None else None)
        residual = {k[len(RESIDUAL):]: v for k, v in st_tensors.items() if k.startswith(RESIDUAL)}
        outer.load_state_dict(outer_state_from_wire(
            {k: v for k, v in st_tensors.items() if not k.startswith(RESIDUAL)}, st_header))
        consumed = {str(k): int(v) for k, v in st_header.extra.get("consumed", {}).items()}
        merged_base, merged_counts = merged_bookkeeping(st_header.extra)
        marks = st_header.extra.get("finalized")
        finalized = frozenset(x for x in marks if isinstance(x, str)) if isinstance(marks, list) else frozenset()
    state = FragmentState(fragment, version, params, outer, clock=header.clock, consumed=consumed,
                          merged_base=merged_base, merged_counts=merged_counts, finalized=finalized, residual=residual)
    state.remember(version, params)
    return state, state_key


def merged_bookkeeping(extra: dict[str, Any]) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """A state object's ``merged_base`` (learner -> base version of its newest merged delta) and
    ``merged_counts`` (learner -> [steps, tokens] of that delta), as the syncer and ``replay`` read
    them. A malformed entry is left out: that learner's next resend on a merged base is then not
    recognised as one (applied as progress, or pulled without counters), never a crash."""
    def natural(x: Any) -> bool:
        return type(x) is int and x >= 0

    base, counts = extra.get("merged_base"), extra.get("merged_counts")
    base = {str(k): v for k, v in base.items() if natural(v)} if isinstance(base, dict) else {}
    counts = {str(k): (v[0], v[1]) for k, v in counts.items()
              if isinstance(v, list) and len(v) == 2 and all(natural(x) for x in v)} if isinstance(counts, dict) else {}
    return base, counts
