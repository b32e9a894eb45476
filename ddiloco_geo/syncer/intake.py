"""Intake: how deltas get from learners' prefixes into a fragment's pending list, or get rejected.

Each poll lists every learner's delta prefix after that learner's cursor (one list call per
learner, ``start_after``), fetches new deltas with bounded concurrency and a bounded ranged read
(an honest delta is at most its fragment in fp32 plus a header), decodes them defensively and
validates them. A delta that fails any check is **rejected**: one log line, a counter, and a
create-only record under ``syncer/rejected/`` signed by the syncer (written again at each poll
until the store takes it, when storage trouble outlasts the store's retries; reasons: the codec's, plus
``wrong_learner``, ``wrong_fragment``, ``wrong_seq``, ``clock_backwards``, ``replay``, ``stale``,
``future_base``, ``no_steps``, ``norm``, ``rate_limit``, ``seq_ahead``, ``unknown_base``).

Anyone who can write a learner's prefix can put objects there, so intake separates what the
learner **provably sent** from junk (``docs/security.md``, threat model):

- *provable*: signed by the learner's own key (in an unsigned run: decoded as a valid delta) and
  its signed header names exactly the key it was found under (learner, seq, fragment). Only a
  provable delta moves the listing cursor, consumes its sequence number (``consumed``), counts
  against the rate limit and earns a strike toward quarantine (``quarantine_after`` provable
  rejections in a row; a syncer-signed record under ``syncer/quarantine/`` that an operator lifts
  by deleting it; unsigned or forged quarantine records are ignored with a log line);
- *junk* (unsigned, forged, corrupt, a copy of another key's object, an odd key): recorded once
  with its reason and remembered (at most :data:`MAX_JUNK_KEYS` keys per learner, oldest forgotten)
  so it is not fetched again; it never moves the cursor, consumes nothing and is never held
  against the learner. Junk at the learner's next sequence number therefore drops nothing: the
  learner's uploader moves to the next free number and that delta is merged.

Sequence numbers are bounded by the learner's signed history: a key more than
:data:`MAX_SEQ_AHEAD` beyond the highest provable sequence number of that learner is not fetched
(``seq_ahead``, junk), so no single object can push a learner's numbering to the end of the key
space. The cursor is the highest provable key listed (never past a key whose fetch failed), so a
junk key that sorts last is listed again each poll but skipped from memory, and keys below the
cursor are never listed again.

The norm check is per inner step, against the median over learners of each learner's own recent
median, so one learner sending tiny or huge deltas cannot move the bar for the others. Log lines
quote keys and details (``%r``): a newline in a key cannot forge a log line.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import time
from collections import OrderedDict, defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ddiloco_geo import codec, protocol
from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import CodecError, NotFoundError, StorageError
from ddiloco_geo.core.signing import sign_record
from ddiloco_geo.storage import Store
from ddiloco_geo.syncer.state import FragmentState, PendingDelta, StepTimes

log = logging.getLogger(__name__)


# The default of syncer.max_seq_ahead. An honest learner skips a sequence number only when its key
# is taken (junk, or its own earlier incarnation), so its next delta is at most a few numbers past
# its last; 100k leaves room for any restart while keeping one object from pushing a learner's
# numbering anywhere near the 10^12 key space.
MAX_SEQ_AHEAD = 100_000
MAX_JUNK_KEYS = 4096  # per learner: junk remembered so it is not fetched again
MAX_BAD_PREFIXES = 4096
POST_SIGNATURE_CODEC_REASONS = {"nonfinite"}  # codec checks that run after the signature verified

# Deltas decode on their own pool, one thread per two usable cores (at least one): decoding is CPU
# work that holds the interpreter lock for its Python parts, so more decoding threads than that
# mostly contend for it (on 2 cores, with asyncio's default pool of 6 threads, a round of 96 int4
# deltas cost 0.31-0.33 CPU-seconds against 0.26-0.28 with one thread; docs/benchmarks.md, Syncer
# throughput). Fetches stay on asyncio's default pool: they wait on the network.
DECODE_WORKERS = max(1, len(os.sched_getaffinity(0)) // 2) if hasattr(os, "sched_getaffinity") else 1
_DECODE_POOL: ThreadPoolExecutor | None = None


def _decode_pool() -> ThreadPoolExecutor:
    global _DECODE_POOL
    if _DECODE_POOL is None:
        _DECODE_POOL = ThreadPoolExecutor(max_workers=DECODE_WORKERS, thread_name_prefix="ddiloco-syncer-decode")
    return _DECODE_POOL


@dataclass
class Fetched:
    """A fetched delta: decoded (header, tensors), or the error and, when the signature verified
    before a later codec check failed, the (signed) header."""

    outcome: Any
    header: codec.Header | None = None


class Intake:
    """Listing cursors, fetch, validation, rejection records and quarantine for one syncer.

    ``fragments`` (owned fragment -> state), ``counters``, ``metrics`` and ``step_times`` are the
    syncer's own objects, shared by reference.
    """

    def __init__(self, store: Store, spec: protocol.RunSpec, fragments: dict[int, FragmentState], *,
                 max_staleness: int, max_norm_ratio: float, max_deltas_per_min: int, quarantine_after: int,
                 fetch_concurrency: int, verifier: Any, require_signatures: bool, counters: dict[str, Any],
                 metrics: Any, step_times: StepTimes, now: Callable[[], float], signer: Any = None,
                 max_seq_ahead: int = MAX_SEQ_AHEAD, adopt_newer: Callable[[int, int], Any] | None = None) -> None:
        self.store, self.spec, self.plan, self.fragments = store, spec, spec.plan, fragments
        self.max_staleness, self.max_norm_ratio = max_staleness, max_norm_ratio
        self.max_deltas_per_min, self.quarantine_after = max_deltas_per_min, quarantine_after
        self.fetch_concurrency, self.max_seq_ahead = fetch_concurrency, max_seq_ahead
        self.signer, self.verifier, self.require_signatures = signer, verifier, require_signatures
        self.counters, self.metrics, self.step_times, self.now = counters, metrics, step_times, now
        self.adopt_newer = adopt_newer  # (fragment, version): adopt its newest verified version above that one, if any
        self.polls = 0  # deltas the first poll finds were delivered before this syncer served: a backlog
        self.recent: dict[str, deque] = defaultdict(deque)  # learner -> arrival times (rate limit)
        self.strikes: dict[str, int] = defaultdict(int)  # learner -> provable rejections in a row
        self.quarantined: set[str] = set()
        self.ignored_quarantine: set[str] = set()  # forged quarantine record keys already logged
        self.last_clock: dict[str, int] = {}  # learner -> its own clock entry in its newest accepted delta
        self.seen_checksums: dict[str, deque] = defaultdict(lambda: deque(maxlen=256))
        self.list_cursor: dict[str, str | None] = {}
        self.high_seq: dict[str, int] = {}  # learner -> highest provable sequence number seen
        self.junk: dict[str, OrderedDict] = defaultdict(OrderedDict)  # learner -> junk keys (bounded)
        self.bad_keys: OrderedDict = OrderedDict()  # odd learner prefixes already reported
        self.unwritten: OrderedDict = OrderedDict()  # rejection record key -> body whose write failed
        self._advance: dict[str, str] = {}  # this poll: learner -> highest provable key
        self._blocked: dict[str, str] = {}  # this poll: learner -> lowest key whose fetch failed

    def resume_cursors(self) -> None:
        """After a restart: list each known learner after the lowest high-water mark over our
        fragments; later keys are filtered per fragment, so nothing is fetched twice."""
        learners = set().union(*(s.consumed for s in self.fragments.values()))
        for learner in learners:
            low = min(s.consumed.get(learner, -1) for s in self.fragments.values())
            self.list_cursor[learner] = layout.delta_key(learner, low, 999) if low >= 0 else None
            self.high_seq[learner] = max(s.consumed.get(learner, -1) for s in self.fragments.values())

    async def poll_once(self) -> int:
        """List and fetch new deltas; returns how many new delta keys were seen."""
        learners, bad_prefixes = await asyncio.to_thread(protocol.learner_ids, self.store)
        await asyncio.to_thread(self._refresh_quarantine)
        if self.unwritten:
            await asyncio.to_thread(self._write_records, list(self.unwritten.items()))
        for prefix in bad_prefixes:
            if prefix not in self.bad_keys:
                self._remember(self.bad_keys, prefix, MAX_BAD_PREFIXES)
                self.count_reject("bad_key", prefix, None)
        sem = asyncio.Semaphore(self.fetch_concurrency)
        self._advance, self._blocked = {}, {}
        listings = await asyncio.gather(*(self._list_learner(name, sem) for name in learners))
        todo = [k for found in listings for k in found]
        results = await asyncio.gather(*(self._fetch(k, sem) for k in todo))
        for key, fetched in zip(todo, results):
            self._accept_or_reject(key, fetched)
        self._move_cursors()
        self.polls += 1
        return len(todo)

    def _refresh_quarantine(self) -> None:
        listed, ignored = protocol.quarantine_records(self.store, self.verifier)
        for key in set(ignored) - self.ignored_quarantine:
            log.warning("quarantine_record_ignored key=%r reason=not_signed_by_syncer", key)
        self.ignored_quarantine = set(ignored)
        for lifted in self.quarantined - listed:  # an operator deleted the record: a fresh start
            self.strikes[lifted] = 0
            log.info("quarantine_lifted learner=%s", lifted)
        self.quarantined = listed

    @staticmethod
    def _remember(memory: OrderedDict, key: str, cap: int) -> None:
        memory[key] = True
        while len(memory) > cap:
            memory.popitem(last=False)

    def _move_cursors(self) -> None:
        """Each learner's cursor moves to its highest provable key listed this poll, never past a
        key whose fetch failed (it is listed again next poll)."""
        for learner, key in self._advance.items():
            blocked = self._blocked.get(learner)
            if blocked is not None and key >= blocked:
                continue
            if key > (self.list_cursor.get(learner) or ""):
                self.list_cursor[learner] = key

    def _provable_seen(self, dk: layout.DeltaKey, key: str) -> None:
        self.high_seq[dk.learner] = max(dk.seq, self.high_seq.get(dk.learner, -1))
        if key > self._advance.get(dk.learner, ""):
            self._advance[dk.learner] = key

    async def _list_learner(self, learner: str, sem: asyncio.Semaphore) -> list[str]:
        if learner in self.quarantined:
            return []  # ignored until an operator lifts the quarantine (the ledger counts them)
        async with sem:
            found = await asyncio.to_thread(
                self.store.list, layout.deltas_dir(learner), self.list_cursor.get(learner)
            )
        junk = self.junk[learner]
        out = []
        for key in found:
            if key in junk:
                continue
            try:
                dk = layout.parse_delta_key(key)
            except layout.LayoutError:
                self._remember(junk, key, MAX_JUNK_KEYS)
                self.count_reject("bad_key", key, None)
                continue
            if dk.fragment not in self.fragments:
                if dk.fragment >= self.plan.num_fragments:
                    self.record_junk(key, dk, "wrong_fragment", f"fragment {dk.fragment} not in plan")
                continue  # another shard's fragment
            state = self.fragments[dk.fragment]
            if dk.seq <= state.consumed.get(dk.learner, -1) or any(d.key == key for d in state.pending):
                if dk.seq <= self.high_seq.get(dk.learner, -1):
                    self._provable_seen(dk, key)  # accounted for earlier: the cursor may pass it
                continue
            if dk.seq > self.high_seq.get(dk.learner, -1) + self.max_seq_ahead:
                self.record_junk(key, dk, "seq_ahead", f"seq {dk.seq} is more than {self.max_seq_ahead} past "
                                                       f"the learner's last provable seq {self.high_seq.get(dk.learner, -1)}")
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

    async def _fetch(self, key: str, sem: asyncio.Semaphore) -> Fetched:
        dk = layout.parse_delta_key(key)
        # an honest delta is at most the fragment in fp32 plus its header: never download more
        limit = 4 * self.plan.numel(dk.fragment) + codec.MAX_HEADER_BYTES
        async with sem:
            try:
                data = await asyncio.to_thread(self.store.get, key, 0, limit + 1)
            except NotFoundError:
                return Fetched(CodecError("vanished", "listed but gone"))
            except StorageError as exc:
                return Fetched(exc)
        if len(data) > limit:
            return Fetched(CodecError("too_large", f"more than {limit} bytes for fragment {dk.fragment}"))
        try:
            return Fetched(await asyncio.get_running_loop().run_in_executor(_decode_pool(), functools.partial(
                codec.decode, data, kind="delta", run_id=self.spec.run_id, expect=self.plan.expect(dk.fragment),
                verify=self.verifier, require_signature=self.require_signatures,
                expected_signer=f"learner:{dk.learner}" if self.verifier is not None else None,
            )))
        except CodecError as exc:
            signed = None
            if exc.reason in POST_SIGNATURE_CODEC_REASONS and self.verifier is not None:
                signed = codec.read_header(data)  # the signature over it verified before this check
            return Fetched(exc, signed)

    @staticmethod
    def _names_key(header: codec.Header, dk: layout.DeltaKey) -> tuple[str | None, str]:
        """Why a (signed) header does not name exactly this key, or (None, '')."""
        if header.learner != dk.learner:
            return "wrong_learner", f"header says {header.learner!r}, prefix says {dk.learner!r}"
        if header.fragment != dk.fragment:
            return "wrong_fragment", f"header says {header.fragment}, key says {dk.fragment}"
        if header.seq != dk.seq:
            return "wrong_seq", f"header says {header.seq}, key says {dk.seq}"
        return None, ""

    def _accept_or_reject(self, key: str, fetched: Fetched) -> None:
        dk = layout.parse_delta_key(key)
        outcome = fetched.outcome
        if isinstance(outcome, StorageError) and not isinstance(outcome, NotFoundError):
            # transient trouble after retries: leave it for the next poll, do not account it yet
            if key < self._blocked.get(dk.learner, "\uffff"):
                self._blocked[dk.learner] = key
            log.warning("delta_fetch_failed key=%r error=%s action=retry_next_poll", key, outcome)
            return
        self.counters["deltas_seen"] += 1
        if isinstance(outcome, CodecError):
            provable = fetched.header is not None and self._names_key(fetched.header, dk)[0] is None
            if provable:
                self._provable_seen(dk, key)
                self.reject(key, dk, outcome.reason, outcome.detail)
            else:
                self.record_junk(key, dk, outcome.reason, outcome.detail)
            return
        header, pseudo_grad = outcome
        reason, detail = self._names_key(header, dk)
        if reason:  # a copy of another key's object (or the learner's own mistake): not provable here
            if header.checksum in self.seen_checksums[dk.learner]:
                reason, detail = "replay", f"same payload as an earlier delta of this learner ({detail})"
            self.record_junk(key, dk, reason, detail)
            return
        self._provable_seen(dk, key)
        if self._rate_limited(dk.learner):
            self.reject(key, dk, "rate_limit", f"more than {self.max_deltas_per_min} deltas a minute")
            return
        state = self.fragments[dk.fragment]
        if header.base_version > state.version and self.adopt_newer is not None:
            state = self._catch_up(dk)
            if dk.seq <= state.consumed.get(dk.learner, -1):
                return  # the syncer whose version was adopted has merged this very delta
        reason, detail, step_norm = self._validate(dk, header, pseudo_grad, state)
        if reason:
            self.reject(key, dk, reason, detail)
            return
        step_s = header.extra.get("step_s")
        if isinstance(step_s, (int, float)) and 0 < step_s < 3600:
            self.step_times.update(dk.learner, float(step_s))
        self.strikes[dk.learner] = 0
        state.pending.append(PendingDelta(key, dk.learner, dk.seq, header, pseudo_grad, self.now(), step_norm,
                                          backlog=self.polls == 0))

    def _catch_up(self, dk: layout.DeltaKey) -> FragmentState:
        """A delta's base is newer than this syncer's version: if another syncer published past it (a
        failover, or one still running), adopt the newest version that verifies (one listing; no load
        when nothing newer is published), so the delta is judged against what it was trained on
        instead of rejected as ``future_base``. Returns the fragment's state."""
        try:
            self.adopt_newer(dk.fragment, self.fragments[dk.fragment].version)
        except StorageError as exc:  # judged on what this syncer holds; the learner's next delta catches up
            log.warning("catch_up_failed fragment=%d error=%s", dk.fragment, exc)
        return self.fragments[dk.fragment]

    def _validate(self, dk: layout.DeltaKey, header: codec.Header, pg: dict[str, torch.Tensor],
                  state: FragmentState) -> tuple[str | None, str, float]:
        """(reason, detail, per-step norm); reason None when the delta is accepted."""
        if header.checksum in self.seen_checksums[dk.learner]:
            return "replay", "same payload as an earlier delta of this learner", 0.0
        own = header.clock[dk.learner]
        if own <= self.last_clock.get(dk.learner, 0) or own != dk.seq + 1:
            return "clock_backwards", f"own clock entry {own} after {self.last_clock.get(dk.learner, 0)} (seq {dk.seq})", 0.0
        if header.num_steps < 1 or header.num_tokens < 1:
            return "no_steps", f"steps={header.num_steps} tokens={header.num_tokens}", 0.0
        if header.base_version > state.version:
            return "future_base", f"base {header.base_version} > current {state.version}", 0.0
        if header.base_version < max(0, state.version - self.max_staleness):
            return "stale", f"base {header.base_version} older than {state.version} - {self.max_staleness}", 0.0
        # per inner step: a delta after 24 steps is larger than one after 1, but by at most ~24x
        # Per tensor in float32 (torch's blocked reduction: relative error ~1e-6, ample for a check
        # against 50x the median and for the merge guard's clip factor, which merge records carry
        # for replay), combined in float64: ~40x faster than squaring a float64 copy of the delta.
        norm = math.sqrt(sum(float(torch.linalg.vector_norm(t)) ** 2 for t in pg.values())) / header.num_steps
        reference = state.norm_reference()
        if reference is not None and reference > 0 and norm > self.max_norm_ratio * reference:
            return "norm", f"per-step norm {norm:.3g} > {self.max_norm_ratio} x reference {reference:.3g}", norm
        state.norms[dk.learner].append(norm)
        self.seen_checksums[dk.learner].append(header.checksum)
        self.last_clock[dk.learner] = own
        return None, "", norm

    def _record(self, key: str, dk: layout.DeltaKey, reason: str, detail: str, provable: bool) -> None:
        record = {"key": key, "learner": dk.learner, "seq": dk.seq, "fragment": dk.fragment, "reason": reason,
                  "detail": detail[:500], "at": time.time(), "provable": provable}
        self._write_records([(layout.rejected_key(dk.learner, dk.seq, dk.fragment),
                              json.dumps(sign_record(record, self.signer)).encode())])

    def _write_records(self, records: list[tuple[str, bytes]]) -> None:
        """Write rejection records (create-only); one whose write fails (storage trouble after the
        store's retries) is kept and written again at the start of each poll, so a rejection is
        never left without its record (at most MAX_JUNK_KEYS wait; the oldest is dropped, logged)."""
        for record_key, body in records:
            try:
                self.store.put_if_absent(record_key, body)
                self.unwritten.pop(record_key, None)
            except StorageError as exc:
                log.warning("reject_record_failed key=%r error=%s action=retry_next_poll", record_key, exc)
                self.unwritten[record_key] = body
        while len(self.unwritten) > MAX_JUNK_KEYS:
            dropped, _ = self.unwritten.popitem(last=False)
            log.error("reject_record_dropped key=%r reason=too_many_unwritten", dropped)

    def record_junk(self, key: str, dk: layout.DeltaKey, reason: str, detail: str) -> None:
        """Something in a learner's prefix that the learner provably did not send: recorded once,
        remembered, never held against the learner, consumes nothing."""
        self._remember(self.junk[dk.learner], key, MAX_JUNK_KEYS)
        self.count_reject(reason, key, detail)
        self._record(key, dk, reason, detail, provable=False)

    def reject(self, key: str, dk: layout.DeltaKey, reason: str, detail: str) -> None:
        """Reject a delta the learner provably sent: record it (log line, counter, signed
        create-only record), count a strike against the learner (quarantine after
        ``quarantine_after`` in a row) and account the delta (its sequence number is consumed)."""
        self.count_reject(reason, key, detail)
        self.strikes[dk.learner] += 1
        if self.strikes[dk.learner] >= self.quarantine_after and dk.learner not in self.quarantined:
            self._quarantine(dk.learner, reason)
        self._record(key, dk, reason, detail, provable=True)
        state = self.fragments.get(dk.fragment)
        if state is not None:
            state.consumed[dk.learner] = max(dk.seq, state.consumed.get(dk.learner, -1))

    def _quarantine(self, learner: str, reason: str) -> None:
        self.quarantined.add(learner)
        record = {"learner": learner, "at": time.time(), "last_reason": reason,
                  "strikes": self.strikes[learner], "lift": f"delete {layout.quarantine_key(learner)}"}
        try:
            self.store.put_if_absent(layout.quarantine_key(learner), json.dumps(sign_record(record, self.signer)).encode())
        except StorageError as exc:
            log.warning("quarantine_record_failed learner=%s error=%s", learner, exc)
        log.warning("learner_quarantined learner=%s strikes=%d last_reason=%s", learner, self.strikes[learner], reason)

    def count_reject(self, reason: str, key: str, detail: str | None) -> None:
        self.metrics.deltas_rejected_total.inc(reason=reason)
        self.counters["deltas_rejected"] += 1
        self.counters["rejected_by_reason"][reason] += 1
        log.warning("delta_rejected reason=%s key=%r detail=%r", reason, key, (detail or "")[:300])
