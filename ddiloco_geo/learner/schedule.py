"""The learner's inner learning-rate schedule: linear warm-up, then cosine decay to a tenth of the
peak at ``max_steps``; where a joining learner starts on it (``learner.follow_run``: the run's
progress, read from the newest merge records, so a restarted or newly joined learner does not
restart its warm-up at full rate while the others are near the end of theirs); and, with
``learner.schedule = run``, where every learner is on it at each step: the mean over the run's
learners of their latest steps (:class:`RunClock`: the median over the learners heard from lately,
at most the mean over every learner seen),
so learners of different speeds anneal together and the run stops when its total budget of
M x ``max_steps`` steps is spent (:func:`joining_step`: where a joining learner starts)."""

from __future__ import annotations

import math
import statistics

from ddiloco_geo.codec import Header


def lr_schedule(step: int, lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup, then cosine decay to a tenth of ``lr`` at ``max_steps``."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _sane(step: object) -> bool:
    return isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2**40


def merged_steps(extra: dict) -> dict[str, int]:
    """learner -> its step when it sent, from a global's merge record (``merged`` entries) or an
    update object's ``steps`` (malformed entries are skipped)."""
    entries = extra.get("merged") if isinstance(extra.get("merged"), list) else []
    pairs = [(e.get("learner"), e.get("step")) for e in entries if isinstance(e, dict)]
    if isinstance(extra.get("steps"), dict):
        pairs += list(extra["steps"].items())
    out: dict[str, int] = {}
    for learner, step in pairs:
        if isinstance(learner, str) and _sane(step):
            out[learner] = max(step, out.get(learner, 0))
    return out


def run_position(own_step: int, others: list[int]) -> int:
    """``learner.schedule = run``: the median of this learner's step and the other learners' latest
    merged steps. For a symmetric mix of speeds it is the mean, and M x the mean is the run's total
    steps (its tokens / tokens per step); unlike the mean, one learner that reports an absurd step (a
    bug, or an insider) cannot move every learner to the end of the schedule."""
    return int(statistics.median([own_step, *others]))


class RunClock:
    """A learner's position under ``learner.schedule = run``: the median (:func:`run_position`) of its
    step and the latest merged steps of the learners **heard from lately**, held below ``max_steps``
    until the **mean** of the same steps reaches it too.

    Heard from lately: a learner whose merged step has not advanced for ``live_periods`` of its own
    usual intervals (at least ``sync_every`` of this learner's steps) has stopped, ended its schedule
    or been preempted, and drops out; without this, a learner whose peers had stopped below the end
    held their last steps in its median forever (chaos seed 21 took one learner to step 6,080 of 120).
    The mean: M x the mean is the steps the run has taken, so a learner restarted behind peers that
    have finished trains its share of the budget instead of stopping with them (chaos seed 24 under
    the median alone: a learner restarted at 53 stopped at 60, the run took 323 of its 360 steps and
    ended 10% worse). The median still decides the learning rate and guards the end: one learner
    reporting an absurd step cannot end the others' schedules. Counted in this learner's own steps,
    so it holds on simulated time.

    Heard from lately needs merges to hear from: while this learner's own deltas are not being merged
    either (its merged step has not advanced for ``live_periods`` of ``sync_every``: the syncer is
    down, or this learner is cut off from it) nobody's silence says anything, and the others keep
    their places, up to this learner's own ``max_steps``. Without this a learner left running alone
    through a syncer restart dropped its peers, took the median of its own step and finished the
    whole schedule alone (chaos seed 22: steps 27 to 123 of 120 in 7 s while the others restarted,
    its final merges setting every fragment to its model; the run ended 3-6% worse than fault-free).
    While held, the position is at least the **mean** of its step and the held steps (each at most
    ``max_steps``): those frozen steps and its own are all the run's progress it can see, and their
    median alone froze it (chaos seed 39: a learner trained steps 40 to 140 at position 16, near the
    peak learning rate, while the syncer restarted and both its peers were restarting; the run ended
    6% worse than fault-free). And the position never goes back: the run's progress does not shrink
    when this learner stops hearing from a peer (a peer that finished drops out, a hold ends) and a
    learning rate that rose again late in the run undid its annealing (seed 13: a restarted learner
    went from position 89 to 69 when its finished peers dropped out, and trained its last 50 steps
    alone on a rising, then falling, rate).

    Dropping out of the median is not leaving the run: the steps a silent learner took are the run's
    (a restarting peer, one that finished), so while this learner's own deltas are merged its position
    is at most the **mean** of its step and the latest steps of every learner it has seen. Without this
    a fast learner whose two peers were restarting on a loaded machine took its own step as the median
    (chaos seed 49: position 58 to 97 in 20 steps) and, never going back, trained 140 of its 252
    steps near the end of the schedule; the run ended 4.7% worse than fault-free. A learner reporting
    an absurd step raises the mean, so it cannot lift this bound; the median still guards against it."""

    def __init__(self, me: str, sync_every: int, max_steps: int, live_periods: float = 3.0) -> None:
        self.me, self.floor, self.max_steps, self.live_periods = me, max(1, sync_every), max_steps, live_periods
        self.seen: dict[str, tuple[int, int, int]] = {}  # learner -> (its step, our step when it advanced, the gap before)
        self.mine: tuple[int, int] | None = None  # (our newest merged step, our step when it advanced)
        self.last = 0  # the position returned last: it never goes back

    def position(self, own_step: int, steps: dict[str, int]) -> int:
        merged = steps.get(self.me, 0)
        if self.mine is None or merged > self.mine[0]:
            self.mine = (merged, own_step)
        unmerged = own_step - self.mine[1] > self.live_periods * self.floor  # this learner is not merged either
        held = unmerged and own_step < self.max_steps
        if held:
            self.seen = {learner: (step, own_step, gap) for learner, (step, _, gap) in self.seen.items()}
        for learner, step in steps.items():
            prev = self.seen.get(learner)
            if learner != self.me and (prev is None or step > prev[0]):
                self.seen[learner] = (step, own_step, 0 if prev is None else own_step - prev[1])
        live = [step for step, at, gap in self.seen.values()
                if own_step - at <= self.live_periods * max(self.floor, gap)]
        median = run_position(own_step, live)
        if held:
            median = max(median, (own_step + sum(min(step, self.max_steps) for step in live)) // (1 + len(live)))
        if not unmerged:
            everyone = [step for step, _, _ in self.seen.values()]
            median = min(median, (own_step + sum(everyone)) // (1 + len(everyone)))
        if own_step + sum(live) < self.max_steps * (1 + len(live)):
            median = min(median, self.max_steps - 1)
        self.last = max(self.last, median)
        return self.last


def joining_step(headers: list[Header], me: str, schedule: str, newest: Header | None = None) -> int:
    """Where a joining or restarted learner starts, from the merge records of the globals it loads
    and ``newest``, the header of its own newest delta if it wrote any.

    ``own`` (with ``learner.follow_run``): the run's progress, the largest learner step merged, so it
    does not restart its warm-up at full rate while the others anneal. ``run``: the step of its own
    newest delta (or its newest merged step, if larger): the steps it trained and sent before are in
    the run's budget already, so a restart at 0 would count them twice (one learner took 278 steps of
    a 120-step run that way), while jumping to the largest step would skip its share (chaos seed 21:
    two restarted learners jumped to the end a third had reached and stopped at once). Its place on
    the learning-rate schedule is the run's position either way (:class:`RunClock`)."""
    steps = [merged_steps(h.extra) for h in headers]
    if schedule == "run":
        sent = newest.extra.get("step") if newest is not None else None
        return max([s.get(me, 0) for s in steps] + [sent if _sane(sent) else 0])
    return max((max(s.values(), default=0) for s in steps), default=0)
