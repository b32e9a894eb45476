"""The learner's inner learning-rate schedule: linear warm-up, then cosine decay to a tenth of the
peak at ``max_steps``; where a joining learner starts on it (``learner.follow_run``: the run's
progress, read from the newest merge records, so a restarted or newly joined learner does not
restart its warm-up at full rate while the others are near the end of theirs); and, with
``learner.schedule = run``, where every learner is on it at each step: the mean over the run's
learners of their latest steps (:class:`RunClock`: every learner seen, silent ones too), so
learners of different speeds anneal together and the run stops when its total budget of
M x ``max_steps`` steps is spent (:func:`joining_step`: where a joining learner starts)."""

from __future__ import annotations

import math

from ddiloco_geo.codec import Header

# A learner whose base of a fragment is HOLD_LAG or more versions behind the newest the index names
# (a slow link: it has not downloaded them yet) holds that fragment's send while less than
# HOLD_PERIODS x H steps of it are unsent: work trained on an old base, applied as progress on the
# current global (or, resent on a base already merged, pulled back toward the old model) undoes what
# the others merged since (chaos seed 22, a learner behind a 10 Mbit/s link six versions behind);
# kept on top of the model at the adoption (``learner.adopt = keep_progress``), it is sent from the
# fresher base. The exit flush never waits.
HOLD_LAG = 2
HOLD_PERIODS = 3


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


class RunClock:
    """A learner's position under ``learner.schedule = run``: the **mean** of its own step and the
    latest merged step of every other learner it has seen in the run, never going back. M x the mean
    is the steps the run has taken (its tokens / tokens per step), so the position is the run's
    progress and the run ends when M x ``max_steps`` steps are spent, whoever took them: a fast
    learner takes more, a slow one fewer, one restarted behind peers that finished trains what is left
    of the budget (none, if they spent it). Counted in this learner's own steps, so it holds on
    simulated time.

    Every learner seen counts, silent ones included: a learner that stopped, finished or is
    restarting has taken its steps. Earlier clocks took the median over the learners heard from
    lately and went wrong each time a peer fell silent: a learner whose two peers were restarting on a
    loaded machine dropped them, took its own step as the median (chaos seed 49: position 58 to 97 in
    20 steps) and trained most of its steps near the end of the schedule; a learner restarted after
    the others had finished took its own step as the run's and trained 70 steps alone from 83% of
    the peak learning rate (seed 13, quiet); a median over frozen peers froze the rate near its peak
    (seed 39). The position never goes back, because the run's progress does not shrink: when a new
    learner is first seen, the mean falls, and a rising learning rate late in a run undid its
    annealing (seed 13, stop 39).

    Bounds: a peer's step counts up to ``2 x max_steps`` (a learner reporting an absurd step can
    spend at most two shares of the budget, as a learner four times faster than two peers could; an
    honest one faster still is undercounted and the others train longer, never shorter). A learner
    whose own deltas have not been merged for ``live_periods`` x ``sync_every`` of its steps (the
    syncer is down, or it is cut off from it) sees nobody's progress, its peers' steps frozen: past
    its own ``max_steps`` it stops instead of training on toward the run's whole budget alone."""

    def __init__(self, me: str, sync_every: int, max_steps: int, live_periods: float = 3.0) -> None:
        self.me, self.window, self.max_steps = me, live_periods * max(1, sync_every), max_steps
        self.seen: dict[str, int] = {}  # learner -> its latest merged step
        self.mine: tuple[int, int] | None = None  # (our newest merged step, our step when it advanced)
        self.last = 0  # the position returned last: it never goes back

    def position(self, own_step: int, steps: dict[str, int]) -> int:
        merged = steps.get(self.me, 0)
        if self.mine is None or merged > self.mine[0]:
            self.mine = (merged, own_step)
        for learner, step in steps.items():
            if learner != self.me and step > self.seen.get(learner, -1):
                self.seen[learner] = step
        cap = 2 * self.max_steps
        mean = (own_step + sum(min(step, cap) for step in self.seen.values())) // (1 + len(self.seen))
        if own_step >= self.max_steps and own_step - self.mine[1] > self.window:
            mean = max(mean, self.max_steps)  # cut off past its own share: stop
        self.last = max(self.last, mean)
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
