"""The learner's background poller of new global versions.

Polls ``globals/HEAD`` every ``poll_s`` and downloads every fragment version newer than the one the
learner holds, into an inbox the learner drains at the top of its next step. In a signed run the
index counts only if the syncer signed it (a forged one reads as empty). A global is accepted only
if it decodes, matches the plan and (in a signed run) carries the syncer's signature; anything else
is counted (``globals_rejected``), logged, and skipped without moving what the learner holds: it
keeps training on what it has and takes the next version the index names. Each adoption also says
whether the merges it holds took this learner's delta, and at which of its steps (the aligned send
schedule's feedback on its lead). Shutdown:
:meth:`GlobalPoller.stop` sets the stop event and joins the thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from ddiloco_geo import codec, protocol
from ddiloco_geo.core import layout
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.errors import CodecError, NotFoundError, StorageError
from ddiloco_geo.learner.schedule import merged_steps
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)


class GlobalPoller:
    """Background thread: polls ``globals/HEAD`` and downloads newer fragment versions.

    When it holds version v−k of a fragment (k ≤ ``MAX_UPDATE_CHAIN``) it downloads the syncer's
    compressed update objects (int4 by default, ~1/8 of the bytes) and rebuilds the new version
    from the one it holds; the result is checked bit for bit against the global's checksum, and any
    mismatch or missing update falls back to the full fp32 global.
    """

    MAX_UPDATE_CHAIN = 4

    def __init__(self, store: Store, spec: protocol.RunSpec, poll_s: float, held: dict[int, int],
                 current: dict[int, dict[str, torch.Tensor]], inline: bool = False, verify: Any = None,
                 require_signature: bool = False, me: str | None = None) -> None:
        self.store, self.spec, self.poll_s, self.me = store, spec, poll_s, me
        self.verify, self.require_signature = verify, require_signature
        self.known = dict(held)
        self.current = dict(current)  # the tensors of each known version (shared, never mutated)
        self.newest: dict[int, int] = {}  # the index as last read (the plan's fragments): fragment -> newest version
        self.refused: dict[int, int] = {}  # fragment -> the version the index named that did not verify
        self.steps: dict[str, int] = {}  # learner -> its newest step in a merge this learner downloaded
        # fragment -> (version, tensors, clock, this learner's newest step in the merges since the version
        # it held: -1 if none took its delta, None if unknown: a full global fetched over skipped versions)
        self.inbox: dict[int, tuple[int, dict[str, torch.Tensor], VectorClock, int | None]] = {}
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.counters = {"globals_fetched": 0, "updates_applied": 0, "update_fallbacks": 0,
                         "globals_rejected": 0, "poll_errors": 0}
        self.thread = None
        if not inline:  # inline: the caller runs poll_once() itself
            self.thread = threading.Thread(target=self._loop, name="global-poller", daemon=True)
            self.thread.start()

    def take(self) -> dict[int, tuple[int, dict[str, torch.Tensor], VectorClock, int | None]]:
        with self.lock:
            out, self.inbox = self.inbox, {}
        return out

    def _loop(self) -> None:
        while not self.stop_event.wait(self.poll_s):
            try:
                self.poll_once()
            except StorageError as exc:
                self.counters["poll_errors"] += 1
                log.warning("global_poll_failed error=%s", exc)

    def poll_once(self) -> None:
        index, _ = protocol.read_index(self.store, self.verify)
        self.newest = {p: v for p, v in index.items() if p < self.spec.plan.num_fragments}
        for p, v in sorted(index.items()):
            held = self.known.get(p, -1)
            if v <= held or p >= self.spec.plan.num_fragments or self.refused.get(p) == v:
                continue
            fetched = None
            if held >= 0 and v - held <= self.MAX_UPDATE_CHAIN and p in self.current:
                fetched = self._via_updates(p, held, v)
            if fetched is None:
                try:
                    header, tensors = protocol.read_global(self.store, self.spec, p, v, verify=self.verify,
                                                         require_signature=self.require_signature)
                    fetched = (tensors, header.clock, self.mine(header.extra) if v - held == 1 else None)
                    self.observe(header.extra)
                    self.counters["globals_fetched"] += 1
                except (CodecError, NotFoundError) as exc:
                    self.counters["globals_rejected"] += 1
                    log.warning("global_rejected fragment=%d version=%d reason=%r", p, v, str(exc))
                    self.refused[p] = v  # not fetched again; the next version is, from what we hold
                    continue
            self.known[p] = v
            self.current[p] = fetched[0]
            with self.lock:
                self.inbox[p] = (v, *fetched)

    def lag(self) -> dict[int, int]:
        """Versions each fragment's newest download is behind the index as last read (0: caught up)."""
        return {p: max(0, v - self.known.get(p, v)) for p, v in self.newest.items()}

    def announced(self) -> dict[int, int]:
        """The index as last read (fragment -> newest version), less a version refused as unverifiable
        (forged or corrupt: it will never arrive, so a learner does not wait for it)."""
        return {p: v for p, v in self.newest.items() if self.refused.get(p) != v}

    def observe(self, extra: dict) -> None:
        with self.lock:
            for learner, step in merged_steps(extra).items():
                self.steps[learner] = max(step, self.steps.get(learner, 0))

    def mine(self, extra: dict) -> int:
        """This learner's step in a merge's record (-1: the merge did not take its delta)."""
        return merged_steps(extra).get(self.me, -1) if self.me is not None else -1

    def run_steps(self) -> dict[str, int]:
        with self.lock:
            return dict(self.steps)

    def _via_updates(self, p: int, held: int, version: int):
        tensors, clock, mine = self.current[p], VectorClock(), -1
        try:
            for v in range(held + 1, version + 1):
                data = self.store.get(layout.global_update_key(p, v))
                header, change = codec.decode(data, kind="update", run_id=self.spec.run_id,
                                              expect=self.spec.plan.expect(p), verify=self.verify,
                                              require_signature=self.require_signature,
                                              expected_signer="syncer" if self.verify is not None else None)
                if header.fragment != p or header.version != v or header.base_version != v - 1:
                    raise CodecError("bad_header", f"update {p}/{v} claims {header.fragment}/{header.version}")
                tensors = {n: tensors[n] + change[n] for n in tensors}
                if codec.checksum_of(tensors, header.format) != header.extra.get("global_checksum"):
                    raise CodecError("checksum", f"rebuilt fragment {p} version {v} differs from the global")
                clock = clock.merge(header.clock)
                mine = max(mine, self.mine(header.extra))
                self.observe(header.extra)
        except (CodecError, NotFoundError) as exc:
            self.counters["update_fallbacks"] += 1
            log.debug("update_fallback fragment=%d version=%d reason=%s", p, version, exc)
            return None
        self.counters["updates_applied"] += version - held
        return tensors, clock, mine

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
