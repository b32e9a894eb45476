"""M learners and a syncer in one process, on simulated time: the quality benchmark's engine.

The same :class:`~ddiloco_geo.learner.Learner` and :class:`~ddiloco_geo.syncer.Syncer` as the real
processes, over a real store (``memory://`` by default), but driven by a discrete-event loop: each
learner has a step time (a speed factor with seeded variance), the learner whose step completes
next takes it, its deltas are written inline, and the syncer polls and merges at that simulated
instant. Timings the algorithm sees (step times, quorum waits, grace windows) are simulated, so a
run is deterministic for a seed and independent of how busy the machine is, while the tensors,
the wire codec, the merge and the outer optimizer are exactly the production code.

Network latency is modelled as zero (deltas arrive the instant they are written); the real
processes (``ddiloco-geo local``) and the WAN proxy cover the network.

Faults (:class:`Fault`): a learner is killed at one of its steps (nothing flushed, no checkpoint,
like SIGKILL) and a new incarnation with the same id joins ``down_steps`` of its step times later,
as a restarted process would (from the latest globals, or its last checkpoint if it had one).
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ddiloco_geo import protocol
from ddiloco_geo.core.model import embedding_rule
from ddiloco_geo.learner import Learner
from ddiloco_geo.storage import open_store
from ddiloco_geo.syncer import Syncer

log = logging.getLogger(__name__)


@dataclass
class Fault:
    learner: int      # index of the learner killed
    at_step: int      # its step count when it is killed
    down_steps: int   # how many of its step times pass before it restarts


@dataclass
class LearnerSpeed:
    step_s: float = 1.0      # mean simulated step time
    jitter_ratio: float = 0.0  # std of the step time as a fraction of the mean


class InProcessRun:
    def __init__(self, settings, speeds: list[LearnerSpeed], *, seed: int = 0, store_url: str | None = None,
                 faults: list[Fault] | None = None) -> None:
        self.now = 0.0
        self.rng = random.Random(seed)
        M = len(speeds)
        url = store_url or f"memory://inproc-{uuid.uuid4().hex[:12]}"
        self.settings = settings.model_copy(update={"storage": settings.storage.model_copy(update={"url": url})})
        self.store = open_store(self.settings.storage)
        spec, params = protocol.build_spec(self.settings)
        self.spec = protocol.create_or_load_spec(self.store, spec)
        self.syncer = Syncer(self.store, self.spec, **self.settings.syncer.model_dump(),
                             is_embedding=embedding_rule(self.settings.model), now=lambda: self.now)
        self.syncer.bootstrap(params)
        self.speeds = speeds
        self.faults = list(faults or [])
        self.retired: list[Learner] = []  # killed incarnations (their tokens still count)
        self.learners = [self._start_learner(i) for i in range(M)]
        self.loop = asyncio.new_event_loop()

    def _start_learner(self, i: int) -> Learner:
        M = len(self.speeds)
        lcfg = self.settings.learner.model_copy(update={"id": f"learner-{i}"})
        dcfg = self.settings.data.model_copy(update={"shard": f"{i}/{M}"})
        s_i = self.settings.model_copy(update={"learner": lcfg, "data": dcfg})
        # each learner its own Store on the same bucket, so its bytes are counted on their own
        learner = Learner.from_settings(s_i, open_store(s_i.storage), inline_io=True)
        learner.join()
        learner.start_clock()
        return learner

    def _share_of_fragment_steps(self, counter: str) -> float:
        everyone = self.learners + self.retired
        return sum(getattr(ln, counter) for ln in everyone) / max(1, sum(ln.frag_steps_trained for ln in everyone))

    def discarded_ratio(self) -> float:
        """Share of trained fragment-steps thrown away by overwriting adoptions, over all learners."""
        return self._share_of_fragment_steps("frag_steps_discarded")

    def out_of_step_ratio(self) -> float:
        """Share of trained fragment-steps that were past a send when a merge of the fragment was adopted."""
        return self._share_of_fragment_steps("frag_steps_past_send")

    def tokens_total(self) -> int:
        """Tokens trained by every incarnation of every learner."""
        return sum(ln.tokens_total for ln in self.learners) + sum(ln.tokens_total for ln in self.retired)

    def _draw_step(self, i: int) -> float:
        sp = self.speeds[i]
        return max(0.05 * sp.step_s, self.rng.gauss(sp.step_s, sp.jitter_ratio * sp.step_s))

    def run(self, progress: Callable[[int], None] | None = None, every: int = 200) -> dict[str, Any]:
        """Run every learner to its max_steps; the syncer drains at the end. ``progress(step)`` is
        called each ``every`` steps of learner 0."""
        upcoming = {i: self._draw_step(i) for i in range(len(self.learners))}
        last_end = {i: 0.0 for i in upcoming}
        active = set(upcoming)
        while active:
            i = min(active, key=lambda j: (upcoming[j], j))
            self.now = upcoming[i]
            learner = self.learners[i]
            fault = next((f for f in self.faults if f.learner == i and learner.step >= f.at_step), None)
            if fault is not None:  # SIGKILL: nothing flushed; a new incarnation joins later
                self.faults.remove(fault)
                self.retired.append(learner)
                learner.poller.stop()
                upcoming[i] = self.now + fault.down_steps * self.speeds[i].step_s
                self.learners[i] = self._start_learner(i)
                last_end[i] = upcoming[i] - self._draw_step(i)
                continue
            learner.poller.poll_once()
            dt, last_end[i] = self.now - last_end[i], self.now
            if not learner.step_once(step_s=dt):
                learner.finish()
                active.discard(i)
                continue
            upcoming[i] = self.now + self._draw_step(i)
            if progress is not None and i == 0 and learner.step % every == 0:
                progress(learner.step)
            self.loop.run_until_complete(self.syncer.poll_once())
            self.syncer.merge_ready()
        self.syncer.draining = True
        self.loop.run_until_complete(self.syncer.poll_once())
        self.syncer.merge_ready()
        return self.syncer.status()

    def global_params(self):
        params, _ = protocol.read_global_params(self.store, self.spec)
        return params

    def close(self) -> None:
        self.loop.close()
        for learner in self.learners + self.retired:
            learner.store.close()
        self.store.close()
