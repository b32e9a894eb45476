"""Intake: how deltas get from learners' prefixes into a fragment's pending list, or get rejected.

Each poll lists every learner's delta prefix after that learner's cursor (one list call per
learner, ``start_after``), fetches new deltas with bounded concurrency and a bounded ranged read
(an honest delta is at most its fragment in fp32 plus a header), decodes them defensively and
validates them. A delta that fails any check is **rejected**: one log line, a counter, and a
create-only record under ``syncer/rejected/`` (reasons: the codec's, plus ``wrong_learner``,
``wrong_fragment``, ``wrong_seq``, ``clock_backwards``, ``replay``, ``stale``, ``future_base``,
``no_steps``, ``norm``, ``rate_limit``, ``unknown_base``). A learner with ``quarantine_after``
rejections in a row is quarantined: a durable record under ``syncer/quarantine/`` that an operator
lifts by deleting it; until then its prefix is not listed (the ledger counts its deltas).

The norm check is per inner step, against the median over learners of each learner's own recent
median, so one learner sending tiny or huge deltas cannot move the bar for the others.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from collections import defaultdict, deque
from typing import Any, Callable

import torch

from ddiloco_geo import codec, protocol
from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import CodecError, NotFoundError, StorageError
from ddiloco_geo.storage import Store
from ddiloco_geo.syncer.state import Ema, FragmentState, PendingDelta

log = logging.getLogger(__name__)


class Intake:
    """Listing cursors, fetch, validation, rejection records and quarantine for one syncer.

    ``fragments`` (owned fragment -> state), ``counters``, ``metrics`` and ``ema_step`` are the
    syncer's own objects, shared by reference.
    """

    def __init__(self, store: Store, spec: protocol.RunSpec, fragments: dict[int, FragmentState], *,
                 max_staleness: int, max_norm_ratio: float, max_deltas_per_min: int, quarantine_after: int,
                 fetch_concurrency: int, verifier: Any, require_signatures: bool, counters: dict[str, Any],
                 metrics: Any, ema_step: Ema, now: Callable[[], float]) -> None:
        self.store, self.spec, self.plan, self.fragments = store, spec, spec.plan, fragments
        self.max_staleness, self.max_norm_ratio = max_staleness, max_norm_ratio
        self.max_deltas_per_min, self.quarantine_after = max_deltas_per_min, quarantine_after
        self.fetch_concurrency = fetch_concurrency
        self.verifier, self.require_signatures = verifier, require_signatures
        self.counters, self.metrics, self.ema_step, self.now = counters, metrics, ema_step, now
        self.recent: dict[str, deque] = defaultdict(deque)  # learner -> arrival times (rate limit)
        self.strikes: dict[str, int] = defaultdict(int)  # learner -> rejections in a row
        self.quarantined: set[str] = set()
        self.last_clock: dict[str, int] = {}  # learner -> its own clock entry in its newest accepted delta
        self.seen_checksums: dict[str, deque] = defaultdict(lambda: deque(maxlen=256))
        self.list_cursor: dict[str, str | None] = {}
        self.bad_keys: set[str] = set()

    def resume_cursors(self) -> None:
        """After a restart: list each known learner after the lowest high-water mark over our
        fragments; later keys are filtered per fragment, so nothing is fetched twice."""
        learners = set().union(*(s.consumed for s in self.fragments.values()))
        for learner in learners:
            low = min(s.consumed.get(learner, -1) for s in self.fragments.values())
            self.list_cursor[learner] = layout.delta_key(learner, low, 999) if low >= 0 else None

    async def poll_once(self) -> int:
        """List and fetch new deltas; returns how many new delta keys were seen."""
        learners, bad_prefixes = await asyncio.to_thread(protocol.learner_ids, self.store)
        listed = await asyncio.to_thread(protocol.quarantined_learners, self.store)
        for lifted in self.quarantined - listed:  # an operator deleted the record: a fresh start
            self.strikes[lifted] = 0
            log.info("quarantine_lifted learner=%s", lifted)
        self.quarantined = listed
        for prefix in bad_prefixes:
            if prefix not in self.bad_keys:
                self.bad_keys.add(prefix)
                self.count_reject("bad_key", prefix, None)
        sem = asyncio.Semaphore(self.fetch_concurrency)
        listings = await asyncio.gather(*(self._list_learner(name, sem) for name in learners))
        todo = [k for found in listings for k in found]
        results = await asyncio.gather(*(self._fetch(k, sem) for k in todo))
        for key, outcome in zip(todo, results):
            self._accept_or_reject(key, outcome)
        return len(todo)

    async def _list_learner(self, learner: str, sem: asyncio.Semaphore) -> list[str]:
        if learner in self.quarantined:
            return []  # ignored until an operator lifts the quarantine (the ledger counts them)
        async with sem:
            found = await asyncio.to_thread(
                self.store.list, layout.deltas_dir(learner), self.list_cursor.get(learner)
            )
        out = []
        for key in found:
            self.list_cursor[learner] = key
            try:
                dk = layout.parse_delta_key(key)
            except layout.LayoutError:
                if key not in self.bad_keys:
                    self.bad_keys.add(key)
                    self.count_reject("bad_key", key, None)
                continue
            if dk.fragment not in self.fragments:
                if dk.fragment >= self.plan.num_fragments:
                    self.reject(key, dk, "wrong_fragment", f"fragment {dk.fragment} not in plan")
                continue
            if dk.seq <= self.fragments[dk.fragment].consumed.get(dk.learner, -1):
                continue
            if any(d.key == key for d in self.fragments[dk.fragment].pending):
                continue
            if self._rate_limited(dk.learner):
                self.reject(key, dk, "rate_limit", f"more than {self.max_deltas_per_min} deltas a minute")
                continue
            out.append(key)
        return out

    def _rate_limited(self, learner: str) -> bool:
        now = time.monotonic()
        times = self.recent[learner]
        while times and times[0] < now - 60.0:
            times.popleft()
        times.append(now)
        return len(times) > self.max_deltas_per_min

    async def _fetch(self, key: str, sem: asyncio.Semaphore) -> Any:
        dk = layout.parse_delta_key(key)
        # an honest delta is at most the fragment in fp32 plus its header: never download more
        limit = 4 * self.plan.numel(dk.fragment) + codec.MAX_HEADER_BYTES
        async with sem:
            try:
                data = await asyncio.to_thread(self.store.get, key, 0, limit + 1)
            except NotFoundError:
                return CodecError("vanished", "listed but gone")
            except StorageError as exc:
                return exc
        if len(data) > limit:
            return CodecError("too_large", f"more than {limit} bytes for fragment {dk.fragment}")
        try:
            return await asyncio.to_thread(
                codec.decode, data, kind="delta", run_id=self.spec.run_id, expect=self.plan.expect(dk.fragment),
                verify=self.verifier, require_signature=self.require_signatures,
                expected_signer=f"learner:{dk.learner}" if self.verifier is not None else None,
            )
        except CodecError as exc:
            return exc

    def _accept_or_reject(self, key: str, outcome: Any) -> None:
        dk = layout.parse_delta_key(key)
        self.counters["deltas_seen"] += 1
        if isinstance(outcome, StorageError) and not isinstance(outcome, NotFoundError):
            # transient trouble after retries: leave it for the next poll, do not account it yet
            self.counters["deltas_seen"] -= 1
            self.list_cursor[dk.learner] = None if dk.seq == 0 else layout.delta_key(dk.learner, dk.seq - 1, 999)
            log.warning("delta_fetch_failed key=%s error=%s action=retry_next_poll", key, outcome)
            return
        if isinstance(outcome, CodecError):
            self.reject(key, dk, outcome.reason, outcome.detail)
            return
        header, pseudo_grad = outcome
        state = self.fragments[dk.fragment]
        reason, detail = self._validate(dk, header, pseudo_grad, state)
        if reason:
            self.reject(key, dk, reason, detail)
            return
        step_s = header.extra.get("step_s")
        if isinstance(step_s, (int, float)) and 0 < step_s < 3600:
            self.ema_step.update(float(step_s))
        self.strikes[dk.learner] = 0
        now = self.now()
        if not state.pending:
            state.round_open_s = now
        state.pending.append(PendingDelta(key, dk.learner, dk.seq, header, pseudo_grad, now))

    def _validate(self, dk: layout.DeltaKey, header: codec.Header, pg: dict[str, torch.Tensor],
                  state: FragmentState) -> tuple[str | None, str]:
        if header.checksum in self.seen_checksums[dk.learner]:
            return "replay", "same payload as an earlier delta of this learner"
        if header.learner != dk.learner:
            return "wrong_learner", f"header says {header.learner!r}, prefix says {dk.learner!r}"
        if header.fragment != dk.fragment:
            return "wrong_fragment", f"header says {header.fragment}, key says {dk.fragment}"
        if header.seq != dk.seq:
            return "wrong_seq", f"header says {header.seq}, key says {dk.seq}"
        own = header.clock[dk.learner]
        if own <= self.last_clock.get(dk.learner, 0) or own != dk.seq + 1:
            return "clock_backwards", f"own clock entry {own} after {self.last_clock.get(dk.learner, 0)} (seq {dk.seq})"
        if header.num_steps < 1 or header.num_tokens < 1:
            return "no_steps", f"steps={header.num_steps} tokens={header.num_tokens}"
        if header.base_version > state.version:
            return "future_base", f"base {header.base_version} > current {state.version}"
        if header.base_version < max(0, state.version - self.max_staleness):
            return "stale", f"base {header.base_version} older than {state.version} - {self.max_staleness}"
        # per inner step: a delta after 24 steps is larger than one after 1, but by at most ~24x
        norm = float(torch.sqrt(sum((t.double() ** 2).sum() for t in pg.values()))) / header.num_steps
        others = [statistics.median(h) for h in state.norms.values() if h]
        if sum(len(h) for h in state.norms.values()) >= 8:
            reference = statistics.median(others)
            if reference > 0 and norm > self.max_norm_ratio * reference:
                return "norm", f"per-step norm {norm:.3g} > {self.max_norm_ratio} x reference {reference:.3g}"
        state.norms[dk.learner].append(norm)
        self.seen_checksums[dk.learner].append(header.checksum)
        self.last_clock[dk.learner] = own
        return None, ""

    def reject(self, key: str, dk: layout.DeltaKey, reason: str, detail: str) -> None:
        """Record a rejection (log line, counter, create-only record), count a strike against the
        learner (quarantine after ``quarantine_after`` in a row) and account the delta."""
        self.count_reject(reason, key, detail)
        self.strikes[dk.learner] += 1
        if self.strikes[dk.learner] >= self.quarantine_after and dk.learner not in self.quarantined:
            self.quarantined.add(dk.learner)
            record = {"learner": dk.learner, "at": time.time(), "last_reason": reason,
                      "strikes": self.strikes[dk.learner], "lift": f"delete {layout.quarantine_key(dk.learner)}"}
            try:
                self.store.put_if_absent(layout.quarantine_key(dk.learner), json.dumps(record).encode())
            except StorageError as exc:
                log.warning("quarantine_record_failed learner=%s error=%s", dk.learner, exc)
            log.warning("learner_quarantined learner=%s strikes=%d last_reason=%s", dk.learner,
                        self.strikes[dk.learner], reason)
        record = {"key": key, "learner": dk.learner, "seq": dk.seq, "fragment": dk.fragment,
                  "reason": reason, "detail": detail[:500], "at": time.time()}
        try:
            self.store.put_if_absent(layout.rejected_key(dk.learner, dk.seq, dk.fragment), json.dumps(record).encode())
        except StorageError as exc:
            log.warning("reject_record_failed key=%s error=%s", key, exc)
        state = self.fragments.get(dk.fragment)
        if state is not None:
            state.consumed[dk.learner] = max(dk.seq, state.consumed.get(dk.learner, -1))

    def count_reject(self, reason: str, key: str, detail: str | None) -> None:
        self.metrics.deltas_rejected_total.inc(reason=reason)
        self.counters["deltas_rejected"] += 1
        self.counters["rejected_by_reason"][reason] += 1
        log.warning("delta_rejected reason=%s key=%s detail=%s", reason, key, detail or "")
