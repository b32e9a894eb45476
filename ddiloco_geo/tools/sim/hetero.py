"""Heterogeneous learners and the syncer's quorum and grace rule (paper §4.4, §4.5, §4.10.4).

An event simulation of M learners' step completions and the syncer's merge rounds, no failures.

Learners. Learner m's step durations are ``base_m · (1 + cv_m · N(0,1))`` (clipped at 10% of base)
and its first step ends at a random phase. By default 4 learners run at full speed (step 1,
cv 0.02: identical hardware still jitters) and 4 run 18% slower with 10% step-time variance.

Rounds. Each learner step sends one fragment ("every learner step one fragment is sent"): at the
end of a step the learner answers the lowest-numbered round it has not answered that is still
open, opening a new round if none is (rounds are numbered by global step, fragment ``r mod P``).
A round reaches quorum at its K-th answer (``ξ_quorum`` = time from opening to quorum); with grace
it then stays open ``ξ_grace = γ · max(0, τ·ξ_step − ξ_quorum − ξ_sync)`` longer (Eq. 3), with
``ξ_step`` the EMA of the slowest learner's step time (the paper's choice is not known; one
implementation uses the slowest). Answers inside the window join the merge; the merged fragment
reaches every learner ``sync_s`` after the round closes.

Overlap. A learner that answered round r at its step t cannot start step t+τ+1 before it has the
merged fragment of round r (Streaming DiLoCo's τ-step overlap). That is the only way a learner
waits. With K=M this is lock-step: fast learners are throttled to the slowest learner's pace, less
the τ steps of slack. With K=1 nobody waits, but a round closes at its first answer.

Outputs per policy: ``goodput`` = fraction of allocated learner-time spent stepping (the paper's
sense: not blocked), ``mean_learners_per_merge`` (the paper's reason the grace window restores
quality) and ``merged_work_ratio`` = fraction of computed steps whose progress on a fragment reached
a merge before the learner's copy of that fragment was overwritten (with α=0 overwrite, progress
of a learner left out of a merge is discarded: a stricter, quality-side view).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from ddiloco_geo.core.errors import ConfigError

EMA_ALPHA = 0.1
_DONE, _CLOSE = 0, 1  # event kinds; at equal times, step completions are handled before closes


@dataclass(frozen=True)
class HeteroConfig:
    fast_learners: int = 4
    slow_learners: int = 4
    slow_factor: float = 1.18
    slow_cv: float = 0.10
    fast_cv: float = 0.02
    tau: int = 2
    fragments: int = 24
    sync_s: float = 0.25  # transfer + merge, in full-speed steps
    gamma: float = 0.5
    horizon_steps: float = 3000.0  # simulated time, in full-speed steps

    def __post_init__(self) -> None:
        if min(self.fast_learners, self.slow_learners) < 0 or self.fast_learners + self.slow_learners < 1:
            raise ConfigError("need at least one learner (--fast-learners / --slow-learners)")
        if self.tau < 1 or self.fragments < 1 or self.horizon_steps < 10 * self.fragments:
            raise ConfigError("need tau >= 1, fragments >= 1 and horizon_steps >= 10 * fragments")
        if not 0 <= self.gamma < 1:
            raise ConfigError(f"gamma={self.gamma}: the grace safety factor must be in [0, 1)")
        if self.slow_factor <= 0 or self.slow_cv < 0 or self.fast_cv < 0 or self.sync_s < 0:
            raise ConfigError("slow_factor must be > 0; cv values and sync_s must be >= 0")

    @property
    def learners(self) -> int:
        return self.fast_learners + self.slow_learners


@dataclass
class _Round:
    answers: list[tuple[int, int, float]] = field(default_factory=list)  # (learner, step, time)
    is_closed: bool = False
    arrive: float = np.inf
    waiters: list[int] = field(default_factory=list)


@dataclass
class _Learner:
    base_s: float
    cv: float
    ends: list[float] = field(default_factory=list)
    durs: list[float] = field(default_factory=list)
    target: int = 0
    needs: dict[int, int] = field(default_factory=dict)  # step index -> round it must have first
    ema_s: float = 0.0


def simulate_policy(cfg: HeteroConfig, *, quorum: int, grace: bool, seed: int = 0) -> dict:
    if not 1 <= quorum <= cfg.learners:
        raise ConfigError(f"quorum K={quorum} must be between 1 and M={cfg.learners}")
    rng = np.random.default_rng([seed, cfg.learners])
    bases = [1.0] * cfg.fast_learners + [cfg.slow_factor] * cfg.slow_learners
    cvs = [cfg.fast_cv] * cfg.fast_learners + [cfg.slow_cv] * cfg.slow_learners
    learners = [_Learner(b, c, ema_s=b) for b, c in zip(bases, cvs)]
    rounds: list[_Round] = []
    events: list[tuple[float, int, int]] = []

    def start_step(m: int, at: float) -> None:
        lr = learners[m]
        dur = max(0.1 * lr.base_s, lr.base_s * (1.0 + lr.cv * rng.standard_normal()))
        lr.ends.append(at + dur)
        lr.durs.append(dur)
        lr.ema_s += EMA_ALPHA * (dur - lr.ema_s)
        heapq.heappush(events, (at + dur, _DONE, m))

    def try_next_step(m: int, now: float) -> None:
        r = learners[m].needs.pop(len(learners[m].ends), None)
        if r is not None and not rounds[r].is_closed:
            rounds[r].waiters.append(m)
            return
        start_step(m, max(now, rounds[r].arrive) if r is not None else now)

    for m, lr in enumerate(learners):  # first steps end at a random phase
        phase = rng.uniform(0.0, lr.base_s)
        lr.ends.append(phase)
        lr.durs.append(phase)
        heapq.heappush(events, (phase, _DONE, m))

    while events:
        now, kind, idx = heapq.heappop(events)
        if now > cfg.horizon_steps:
            break
        if kind == _CLOSE:
            rnd = rounds[idx]
            rnd.is_closed, rnd.arrive = True, now + cfg.sync_s
            for m in rnd.waiters:
                start_step(m, rnd.arrive)
            rnd.waiters.clear()
            continue
        lr = learners[idx]
        r = lr.target
        while r < len(rounds) and rounds[r].is_closed:
            r += 1
        if r == len(rounds):
            rounds.append(_Round())
        rnd = rounds[r]
        step = len(lr.ends) - 1
        rnd.answers.append((idx, step, now))
        lr.target = r + 1
        lr.needs[step + cfg.tau + 1] = r
        if len(rnd.answers) == quorum:
            opened = rnd.answers[0][2]
            window = 0.0
            if grace:
                step_s = max(x.ema_s for x in learners)
                window = cfg.gamma * max(0.0, cfg.tau * step_s - (now - opened) - cfg.sync_s)
            heapq.heappush(events, (now + window, _CLOSE, r))
        try_next_step(idx, now)

    return _summarise(cfg, quorum, grace, learners, [x for x in rounds if x.is_closed])


def _summarise(cfg: HeteroConfig, quorum: int, grace: bool, learners: list[_Learner],
               closed: list[_Round]) -> dict:
    horizon = cfg.horizon_steps
    ends = [np.asarray(x.ends) for x in learners]
    cum = [np.concatenate(([0.0], np.cumsum(x.durs))) for x in learners]

    def work(m: int, lo: float, hi: float) -> float:  # compute time of steps ending in (lo, hi]
        i, j = np.searchsorted(ends[m], [lo, hi], side="right")
        return float(cum[m][j] - cum[m][i])

    busy = sum(work(m, -np.inf, horizon) for m in range(len(learners)))
    received = np.zeros((len(learners), cfg.fragments))
    merged = 0.0
    members = 0
    for r, rnd in sorted(enumerate(closed), key=lambda x: x[1].arrive):
        p = r % cfg.fragments
        members += len(rnd.answers)
        for m, _, t in rnd.answers:
            merged += work(m, received[m, p], t)
        received[:, p] = rnd.arrive
    return {
        "policy": f"K={quorum}" + ("+grace" if grace else ""),
        "quorum": quorum,
        "grace": grace,
        "learners": cfg.learners,
        "goodput": round(busy / (len(learners) * horizon), 4),
        "mean_learners_per_merge": round(members / max(1, len(closed)), 3),
        "merged_work_ratio": round(merged / cfg.fragments / busy, 4),
        "merges": len(closed),
    }


def simulate_hetero(cfg: HeteroConfig | None = None, seed: int = 0) -> list[dict]:
    """The paper's comparison: K=M (wait for all), K=1, and K=1 with the adaptive grace window."""
    cfg = cfg or HeteroConfig()
    return [simulate_policy(cfg, quorum=cfg.learners, grace=False, seed=seed),
            simulate_policy(cfg, quorum=1, grace=False, seed=seed),
            simulate_policy(cfg, quorum=1, grace=True, seed=seed)]
