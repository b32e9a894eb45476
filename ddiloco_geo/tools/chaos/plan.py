"""The shape of a chaos run and its schedule, a pure function of the seed.

``SHORT`` (the test and the default) and ``LONG`` (``--long``, the benchmark) give the number of
learners, steps per learner, rounds of events and the hard timeout; ``CHAOS_DEFAULTS`` are the
settings a short run uses unless the command line, the environment or a settings file says
otherwise. :func:`plan_schedule` draws everything random about a run from ``random.Random(seed)``:
the WAN regions and which learner sits where, which processes get storage faults, and the ordered
actions (kills, terminations, restarts, a second syncer) with their triggers:

- ``{"learner": id, "step": s}``: the target's current incarnation has reached step ``s`` (a signal
  to a syncer also waits until it serves, and ``serving_s`` more while learners still train);
- ``{"after": action_id, "delay_s": d}``: ``d`` seconds after an earlier action (or after the exit
  of the process it signalled).

So the plan is the same for a seed on any machine; only the times it executes at differ.
"""

from __future__ import annotations

import random
from typing import Any

from ddiloco_geo.core.errors import ConfigError

# What a short run uses unless the command line, the environment or a settings file says otherwise.
CHAOS_DEFAULTS: dict[str, Any] = {
    "model.name": "nano",
    "data.max_bytes": 400_000,
    "fragments.num_fragments": 8,
    "fragments.sync_every": 8,
    "learner.heartbeat_s": 1.0,  # a heartbeat is a blocking write in the learner's step loop: not too often
    "learner.log_every": 10,
    "storage.retry_initial_s": 0.05,
    "storage.retry_max_s": 1.0,
}
SHORT = {"learners": 3, "steps": 120, "rounds": 1, "timeout": 900.0}
LONG = {"learners": 4, "steps": 400, "rounds": 3, "timeout": 3600.0}


def plan_schedule(seed: int, learners: int = 3, steps: int = 120, rounds: int = 1) -> dict[str, Any]:
    """The chaos schedule for ``seed``: regions, fault injection and an ordered list of actions.

    Learner ``learner-0`` .. ``learner-{M-1}``; one of them (``reference``) is never killed, and the
    syncer events are triggered by its steps. Each round picks two other learners: one is SIGKILLed
    and restarted, the other SIGTERMed and restarted as a straggler. Every round also kills and
    restarts the syncer and runs a second syncer, SIGTERMed some of the reference's steps later. Steps
    are spread over the first ~70 % of the run (the second syncer's stop over the first ~90 %) so
    every restarted learner has work left to deliver.
    """
    if learners < 3:
        raise ConfigError(f"chaos needs at least 3 learners (got {learners}): one reference learner and two victims")
    if steps < 20 * rounds:
        raise ConfigError(f"chaos needs at least 20 steps per round (got --steps {steps} for {rounds} round(s))")
    rng = random.Random(seed)
    ids = [f"learner-{i}" for i in range(learners)]
    order = list(ids)
    rng.shuffle(order)
    reference, others = order[0], order[1:]

    regions = {
        "region-a": {"delay_s": round(rng.uniform(0.01, 0.03), 3), "rate_bps": rng.choice([50e6, 100e6])},
        "region-b": {"delay_s": round(rng.uniform(0.04, 0.08), 3), "rate_bps": rng.choice([10e6, 20e6])},
    }
    placement = {lid: rng.choice(["home", "region-a", "region-b"]) for lid in ids}
    if all(r == "home" for r in placement.values()):
        placement[rng.choice(ids)] = "region-b"
    faults: dict[str, dict[str, Any]] = {}
    for lid in sorted(rng.sample(ids, max(1, learners // 3))):
        faults[lid] = {"rate": round(rng.uniform(0.03, 0.08), 3), "seed": rng.randrange(1, 2**31)}
    faults["syncer"] = {"rate": round(rng.uniform(0.02, 0.05), 3), "seed": rng.randrange(1, 2**31)}
    faults["syncer-2"] = {"rate": round(rng.uniform(0.02, 0.05), 3), "seed": rng.randrange(1, 2**31)}

    actions: list[dict[str, Any]] = []

    def add(action: str, target: str, when: dict[str, Any], **extra: Any) -> str:
        aid = f"a{len(actions)}"
        actions.append({"id": aid, "action": action, "target": target, "when": when, **extra})
        return aid

    span = 0.7 * steps / rounds  # each round's triggers fall inside its share of the first 70 %
    for r in range(rounds):
        lo = r * span
        def at(a: float, b: float) -> int:
            return max(2, int(lo + rng.uniform(a, b) * span))
        kill_id, term_id = rng.sample(others, 2)
        k = add("sigkill", kill_id, {"learner": kill_id, "step": at(0.15, 0.4)})
        add("restart", kill_id, {"after": k, "delay_s": round(rng.uniform(1.0, 4.0), 1)})
        t = add("sigterm", term_id, {"learner": term_id, "step": at(0.35, 0.75)})
        add("restart", term_id, {"after": t, "delay_s": round(rng.uniform(1.0, 4.0), 1)},
            settings={"learner.slow_step_s": rng.choice([0.1, 0.15, 0.2])})
        s = add("sigkill", "syncer", {"learner": reference, "step": at(0.3, 0.5)})
        add("restart", "syncer", {"after": s, "delay_s": round(rng.uniform(1.0, 4.0), 1)})
        s2_step = at(0.6, 0.8)
        add("start", "syncer-2", {"learner": reference, "step": s2_step})
        # stopped at a later step of the reference, once it has served serving_s (not only some
        # seconds after it serves: a slow machine ended the short run before that, CI stop 34); a
        # signal still waiting when the learners finish fires as soon as the syncer serves
        stop_step = s2_step + max(4, int(rng.uniform(0.25, 0.45) * span))
        add("sigterm", "syncer-2", {"learner": reference, "step": stop_step,
                                    "serving_s": round(rng.uniform(5.0, 10.0), 1)})
    return {
        "seed": seed, "learners": learners, "steps": steps, "rounds": rounds, "reference": reference,
        "regions": regions, "placement": placement, "faults": faults, "actions": actions,
    }
