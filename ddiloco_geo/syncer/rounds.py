"""Rounds: when a fragment is merged (quorum, merge spacing, adaptive grace) and what a merge is.

Decoupled DiLoCo (arXiv 2604.21428), per fragment p:

1. **quorum**: at least K distinct learners have a pending delta;
2. **merge spacing**: a round opens at most once per ``merge_spacing`` fragment periods
   (H · ξ_step) after the fragment's last merge (the first round: at its first delta). With K = 1
   and learners whose step counts drift apart, merging each arrival alone steps the outer Nesterov
   optimizer M times a period with single contributors, which over-drives it (PAPER-NOTES 5.6);
   learners never wait for it;
3. **adaptive grace window** ξ_grace = γ · max(0, τ·ξ_step − ξ_quorum − ξ_sync), counted from when
   the open round has its quorum (ξ_quorum: from the opening to the K-th learner's first delta, 0
   when they were already there): stragglers join only inside the slack the learners' τ-step
   overlap leaves (ξ_step: the median of each learner's EMA of the step times in its delta headers,
   :class:`~ddiloco_geo.syncer.state.StepTimes`; ξ_sync the time a merge and publish take). Until
   2026-12-04 the window ran from the first delta's arrival, usually long before the round opened,
   so it had passed by the time the merge was allowed and a delta arriving just after the opening
   waited a whole period; and ξ_quorum counted the wait for the spacing, which took the slack to 0.
   A round whose quorum the syncer's first poll met (a backlog delivered while it was not serving:
   a restart or a failover) merges without a grace window: the stragglers had the whole outage
   (chaos seed 39: a replacement syncer's grace kept work waiting past three fragment periods).

A merge (:func:`build_merge`): of several deltas of one learner on the same base the newest
supersedes the older (deltas are cumulative since the learner adopted that base); each delta is
**anchored** (:func:`anchoring_of`: applied as progress, or pulled, Δ_m = (Θ_current − Θ_base) +
pseudo_grad_m; a resend on a merged base by its new part, :func:`resend_share`); weights are
w = tokens · (tokens / steps); each entry of the merge record also carries the learner's step (its
schedule position: a joining learner reads the run's progress from it); token-weighted RDA (weighted mean for embeddings) or a robust
average; then one outer step (:func:`ddiloco_geo.core.outer.merge_and_step`). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ddiloco_geo.core import merge
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.merge import anchor
from ddiloco_geo.core.outer import OuterOptimizer, merge_and_step
from ddiloco_geo.syncer.state import Ema, FragmentState, PendingDelta, StepTimes


@dataclass
class RoundPolicy:
    """Quorum K, grace γ and spacing, over the syncer's EMA-smoothed timings."""

    quorum: int
    grace_gamma: float
    merge_spacing: float
    overlap: int        # τ
    sync_every: int     # H
    step_times: StepTimes
    ema_quorum: Ema
    ema_sync: Ema

    def grace_s(self) -> float:
        slack = self.overlap * self.step_times.get() - self.ema_quorum.get() - self.ema_sync.get()
        return self.grace_gamma * max(0.0, slack)

    def ready(self, state: FragmentState, now: float, draining: bool = False,
              on_quorum: Callable[[float], None] | None = None) -> bool:
        """Quorum reached and the grace window spent (or draining with anything pending)."""
        if not state.pending:
            return False
        if draining:
            return True
        first: dict[str, float] = {}  # learner -> when its first pending delta arrived
        for d in state.pending:
            first[d.learner] = min(d.arrived_s, first.get(d.learner, d.arrived_s))
        if len(first) < self.quorum:
            return False
        if state.quorum_s is None:
            arrivals = sorted(first.values())
            reached = arrivals[self.quorum - 1]
            opens = arrivals[0] if state.last_merge_s is None else \
                state.last_merge_s + self.merge_spacing * self.sync_every * self.step_times.get()  # spacing allows a merge
            state.quorum_s = max(reached, opens)  # the grace window runs from here
            waited = max(0.0, reached - opens)
            self.ema_quorum.update(waited)
            if on_quorum is not None:
                on_quorum(waited)
        backlog = len({d.learner for d in state.pending if d.backlog}) >= self.quorum
        return backlog or now >= state.quorum_s + self.grace_s()


def learner_step(header) -> int | None:
    """The learner's inner step count when it sent the delta (its schedule position), if sane."""
    step = header.extra.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2**40 else None


def clip_factor(state: FragmentState, d: PendingDelta, clip_ratio: float | None) -> float:
    """The merge guard: a contributor whose per-step norm exceeds ``clip_ratio`` times the fragment's
    reference (the median over learners of each learner's recent per-step norms, as intake keeps
    them) is scaled down to it, so no single delta (a learner restarted at full learning rate while
    the others are at the end of their schedule, a bad batch) can move the global much more than an
    ordinary merge. 1.0 when there is no reference yet (fewer than 8 norms) or no guard."""
    reference = state.norm_reference() if clip_ratio else None
    if reference is None or reference <= 0 or d.step_norm <= clip_ratio * reference:
        return 1.0
    return clip_ratio * reference / d.step_norm


STALE_DAMPING_MODES = ("inverse", "none")
DAMP_FROM = 2  # versions behind: fault-free chaos baselines merge at 0 or 1, runs with slow links and restarts up to 8


def stale_damping(mode: str, staleness: int) -> float:
    """The factor a contributor ``staleness`` versions behind the fragment is scaled by: ``inverse``,
    1/staleness from :data:`DAMP_FROM` on (the staleness-aware learning rate of asynchronous SGD,
    Zhang et al. 2016), 1 below it; ``none``: 1. A learner two or more versions behind sends work
    its peers' merges since its base have mostly made already (its link is slower than the merges,
    or it restarted from an old checkpoint): applied at full size, one such merge took a chaos run's
    loss from 2.90 to 3.30 (docs/benchmarks.md, Chaos, stop 48)."""
    if mode not in STALE_DAMPING_MODES:
        raise ValueError(f"stale damping {mode!r}: expected one of {STALE_DAMPING_MODES}")
    return 1.0 / staleness if mode == "inverse" and staleness >= DAMP_FROM else 1.0


def anchoring_of(state: FragmentState, d: PendingDelta, anchoring: str) -> str:
    """How one contributor is anchored. ``base`` applies the learner's progress Θ_base − θ_learner as
    it is, except for a delta whose base is at or below the base of this learner's newest merged
    delta on the fragment and that is not marked ``first_on_base``: the learner sent again before
    adopting the version that holds its earlier delta, so its progress still carries the merged part,
    and it is anchored at the current global (a pull, which never applies anything twice). A delta
    marked ``first_on_base`` (the learner's first send since it adopted or joined at that base: a
    learner restarted from the latest globals, whose earlier incarnation's delta on the same base was
    merged) holds no earlier delta's work and is applied as it is. An increment (a delta marked
    ``increment``: the learner's progress since its previous send, with error feedback) is always
    applied as it is: it holds no earlier delta's work, and pulling would undo what the residual
    carries."""
    if is_increment(d):
        return "base"
    if anchoring == "base" and d.header.base_version <= state.merged_base.get(d.learner, -1) \
            and d.header.extra.get("first_on_base") is not True:
        return "current"
    return anchoring


def after_merge(state: FragmentState, entries: list[dict[str, Any]]
                ) -> tuple[dict[str, int], dict[str, tuple[int, int]], frozenset[str]]:
    """What a merge of ``entries`` leaves of the fragment's per-learner bookkeeping: each learner's
    newest merged base version, the counters (steps, tokens) of its newest merged delta on that base
    (what a resend on the same base already had merged: :func:`resend_share`), and the learners whose
    final mark has been honored."""
    merged_base, merged_counts = dict(state.merged_base), dict(state.merged_counts)
    for e in entries:
        if e["base_version"] >= merged_base.get(e["learner"], -1):
            merged_base[e["learner"]] = e["base_version"]
            merged_counts[e["learner"]] = (e["num_steps"], e["num_tokens"])
    return merged_base, merged_counts, state.finalized | {e["learner"] for e in entries if e.get("final") is True}


def resend_share(merged_base: dict[str, int], merged_counts: dict[str, tuple[int, int]], learner: str,
                 header) -> tuple[float, int, int] | None:
    """A resend's new part, for ``syncer.resends = "share"``: (share, steps, tokens), or None.

    A delta is cumulative since its base, so one sent again on the base of the learner's newest merged
    delta (before the learner adopted the version holding that delta) carries the merged steps again.
    Anchored at the current global (a pull), it counted all its tokens and moved the global toward the
    learner's model, taking back by its weight what the other learners had merged since that base
    (after a syncer outage, a learner behind a slow link sent such resends of 49-68 steps).
    Its new part is the steps beyond the merged delta's: it is applied as progress, the delta scaled
    by ``share = new steps / its steps`` (the new steps taken along the delta's mean direction), with
    the weight of the new steps and tokens only. None when this is not such a resend, its counters are
    not above the merged delta's, or those are not known (a state from before this setting): it is
    then pulled."""
    prev = merged_counts.get(learner)
    if prev is None or header.base_version != merged_base.get(learner):
        return None
    steps, tokens = header.num_steps - prev[0], header.num_tokens - prev[1]
    if steps <= 0 or tokens <= 0:
        return None
    return steps / header.num_steps, steps, tokens


def is_increment(d: PendingDelta) -> bool:
    return d.header.extra.get("increment") is True


def select_contributors(pending: list[PendingDelta]) -> tuple[list[PendingDelta], list[PendingDelta]]:
    """(contributors, superseded): the newest delta per (learner, base version); increments hold
    disjoint work, so every one of them contributes."""
    newest: dict[tuple[str, int, int], PendingDelta] = {}
    superseded = []
    for d in sorted(pending, key=lambda d: (d.learner, d.seq)):
        slot = (d.learner, d.header.base_version, d.seq if is_increment(d) else -1)
        if slot in newest:
            superseded.append(newest[slot])
        newest[slot] = d
    return list(newest.values()), superseded


def final_marks(state: FragmentState, contributors: list[PendingDelta]) -> set[str]:
    """The learners among ``contributors`` whose final mark counts: a final delta is a learner's exit
    flush at the end of its schedule, sent once per fragment, so a mark counts once per learner and
    fragment (``state.finalized``, kept in the fragment's state object across syncer restarts). A
    learner marking every delta final turns at most one merge per fragment into an average. One
    marked contributor makes the merge final, not all of them: a learner whose last regular send fell
    on its last step has nothing left to flush, and its last delta joins the others' final ones
    unmarked."""
    return {d.learner for d in contributors
            if d.header.extra.get("final") is True and d.learner not in state.finalized}


@dataclass
class Merge:
    params: dict[str, torch.Tensor]
    outer: OuterOptimizer
    clock: VectorClock
    entries: list[dict[str, Any]]
    final: float = 0.0  # > 0: the learners' models averaged, this share of the way (see build_merge)

    def final_record(self) -> dict[str, Any]:
        """What a final merge adds to its merge record (``final``, and ``final_share`` below 1)."""
        if not self.final:
            return {}
        return {"final": True, **({"final_share": self.final} if self.final < 1 else {})}


def final_share(state: FragmentState, contributors: list[PendingDelta]) -> float:
    """How far a final merge moves the fragment to the mean of its contributors' models: their
    number over that of every learner averaged into the fragment so far (``state.finalized``) or now.
    The learners' final deltas rarely reach one merge together: the first final merge averages the
    models it holds in full, and a learner that finishes later joins that average with its share
    (1/3 for the third) instead of replacing it with its own model."""
    here = {d.learner for d in contributors}
    return len(here) / len(here | state.finalized)


def build_merge(state: FragmentState, contributors: list[PendingDelta], bases: dict[int, dict[str, torch.Tensor]],
                *, is_embedding: Callable[[str], bool], outer_kwargs: dict[str, Any], robust: str,
                trim_ratio: float, sparse: str = "dense", anchoring: str = "current",
                clip_ratio: float | None = None, final_merge: str = "outer", resends: str = "pull",
                damping: str = "none") -> Merge | None:
    """Anchor, weigh, merge and step; None when no contributor carries weight.

    ``bases`` maps each contributor's base version to that global's parameters. ``anchoring``:
    ``current`` (the paper's: Δ_m = Θ_current − θ_m, a stale learner pulls the global toward its
    model) or ``base`` (Δ_m = pseudo_grad_m: a stale learner's progress is applied as it is, without
    pulling back what others merged since its base). ``clip_ratio``: the merge guard, see
    :func:`clip_factor`; a clipped contributor's entry records the factor (``clip``). ``sparse``:
    ``dense`` or ``per_index`` (:func:`ddiloco_geo.core.merge.per_index_mean`, for top-k deltas).
    ``final_merge``: ``average`` averages the learners' models in a merge holding a final delta, every
    contribution but an increment pulled (anchored at the current global, whatever ``anchoring`` says:
    a learner on an older base counts as its model, that base minus its progress)
    (:func:`final_marks`, whose entries record ``final``; ``final`` in
    :func:`~ddiloco_geo.core.outer.merge_and_step`, by :func:`final_share`): at the end of the run
    the outer momentum would carry the global past where the learners are; ``outer`` steps every
    merge alike. ``resends``: ``share`` applies a resend's new part only (:func:`resend_share`,
    recorded per entry as ``resent``, the merged delta's counters, and ``share``); ``pull`` anchors
    it at the current global. ``damping``: a stale contributor's anchored delta scaled by
    :func:`stale_damping` (recorded per entry as ``damp``), except in a final merge, which averages
    models.
    """
    anchored, weights, entries = [], [], []
    marks = final_marks(state, contributors) if final_merge == "average" else set()
    merge_anchoring = "current" if marks else anchoring  # a final merge averages models: pulled (entries say so)
    for d in contributors:
        factor = clip_factor(state, d, clip_ratio)
        pg = d.pseudo_grad if factor == 1.0 else {n: t * factor for n, t in d.pseudo_grad.items()}
        how = anchoring_of(state, d, merge_anchoring)
        steps, tokens, resent = d.header.num_steps, d.header.num_tokens, None
        if how == "current" and merge_anchoring == "base" and resends == "share":
            resent = resend_share(state.merged_base, state.merged_counts, d.learner, d.header)
        if resent is not None:
            how, (share, steps, tokens) = "base", resent
            pg = {n: t * share for n, t in pg.items()}
        x = pg if how == "base" else anchor(state.params, bases[d.header.base_version], pg)
        damp = 1.0 if marks else stale_damping(damping, state.version - d.header.base_version)
        anchored.append(x if damp == 1.0 else {n: t * damp for n, t in x.items()})
        w = merge.token_weight(tokens, steps)
        weights.append(w)
        entries.append({"key": d.key, "learner": d.learner, "seq": d.seq, "base_version": d.header.base_version,
                        "num_steps": d.header.num_steps, "num_tokens": d.header.num_tokens, "weight": w,
                        "step": learner_step(d.header), **({"clip": factor} if factor < 1.0 else {}),
                        **({"anchor": how} if how != anchoring else {}), **({"damp": damp} if damp < 1.0 else {}),
                        **({"resent": list(state.merged_counts[d.learner]), "share": resent[0]} if resent else {}),
                        **({"final": True} if d.learner in marks else {})})
    if not anchored or sum(weights) <= 0:
        return None
    share = final_share(state, contributors) if marks else 0.0
    params, outer = merge_and_step(state.params, state.outer, anchored, weights, is_embedding,
                                   outer_kwargs, robust, trim_ratio, sparse, share)
    clock = state.clock
    for d in contributors:
        clock = clock.merge(d.header.clock)
    return Merge(params, outer, clock, entries, share)
