"""The syncer: merges learners' fragment deltas and publishes new global fragment versions.

Decoupled DiLoCo (arXiv 2604.21428, section "syncer"), over a bucket. For every fragment p it owns
(``--shard i/S``: the fragments with p % S == i) the syncer

1. polls each learner's delta prefix (one list call per learner, ``start_after`` its cursor),
   fetches new deltas with bounded concurrency and decodes them defensively; a delta that fails
   any check is **rejected**: one log line, a counter, and a create-only record under
   ``syncer/rejected/`` (reasons: the codec's, plus ``wrong_learner``, ``wrong_fragment``,
   ``wrong_seq``, ``stale``, ``future_base``, ``no_steps``, ``norm``, ``unknown_base``);
2. waits for a **quorum** of K distinct learners, then an **adaptive grace window**
   ξ_grace = γ · max(0, τ·ξ_step − ξ_quorum − ξ_sync) (EMA-smoothed timings), so stragglers join
   only inside the slack the learners' τ-step overlap leaves;
3. **anchors** each delta at the current global: θ_m = Θ_base − pseudo_grad_m, so
   Δ_m = Θ_current − θ_m = (Θ_current − Θ_base) + pseudo_grad_m (stale learners folded in correctly);
4. merges with **token weights** w = tokens · (tokens / steps), **RDA** for non-embedding tensors
   and the weighted mean for embeddings (`ddiloco_geo.core.merge`);
5. applies **SGD + Nesterov** per fragment in fp32 (`ddiloco_geo.core.outer`);
6. **publishes**: a create-only outer-state object (momentum, per-learner cursors), then the
   create-only global ``globals/fPPP/vVVVVVVVVVV.st`` whose header holds the merge record and the
   state key, then the event tape entry, then the ``globals/HEAD`` index (compare-and-swap).

Failure semantics. The global object's create-only write is the commit point: a version exists
once that object exists, and no two objects can exist for one version (split brain is impossible
by construction). If the create loses (another syncer, or our own lost response), the syncer reads
the winner; if the winner's state key is not ours it adopts the winner's state and re-derives its
pending deltas. A restarted syncer lists each fragment's versions, loads the newest global and the
state it names, and resumes: cursors in the state say exactly which deltas are accounted for, so
none is merged twice; a delta is accounted for only by a published merge record or a rejection
record, so none is dropped. On SIGTERM it drains: one last poll, merges everything pending even
below quorum, then exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import statistics
import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ddiloco_geo import codec

from ddiloco_geo.core import layout

from ddiloco_geo.core import merge

from ddiloco_geo import protocol
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.errors import CodecError, ConfigError, DdilocoError, NotFoundError, StorageError
from ddiloco_geo.metrics import Registry, export_store_stats, syncer_metrics
from ddiloco_geo.core.merge import anchor
from ddiloco_geo.core.outer import OuterOptimizer, merge_and_step
from ddiloco_geo.protocol.publish import (
    RESIDUAL, commit_version, compress_update, outer_state_from_wire, outer_state_to_wire,
)
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)

SYNCER_ACTOR = "syncer"
HISTORY_VERSIONS = 4
MAX_HEADER_BYTES = 2**20  # a delta's safetensors header: names, shapes, clock, counters


@dataclass
class PendingDelta:
    key: str
    learner: str
    seq: int
    header: codec.Header
    pseudo_grad: dict[str, torch.Tensor]
    arrived_s: float


@dataclass
class FragmentState:
    fragment: int
    version: int
    params: dict[str, torch.Tensor]
    outer: OuterOptimizer
    clock: VectorClock = field(default_factory=VectorClock)
    consumed: dict[str, int] = field(default_factory=dict)  # learner -> highest seq accounted for
    pending: list[PendingDelta] = field(default_factory=list)
    history: OrderedDict = field(default_factory=OrderedDict)  # version -> params
    norms: dict = field(default_factory=lambda: defaultdict(lambda: deque(maxlen=8)))  # learner -> per-step norms
    round_open_s: float | None = None
    quorum_s: float | None = None
    last_merge_s: float | None = None
    residual: dict[str, torch.Tensor] = field(default_factory=dict)  # error feedback of update objects


class Ema:
    def __init__(self, decay: float, value: float | None = None) -> None:
        self.decay = decay
        self.value = value

    def update(self, x: float) -> float:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x
        return self.value

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


class Syncer:
    def __init__(
        self,
        store: Store,
        spec: protocol.RunSpec,
        *,
        quorum: int,
        grace_gamma: float,
        ema_decay: float,
        outer_lr: float,
        outer_momentum: float,
        nesterov: bool,
        max_staleness: int,
        merge_spacing: float,
        max_norm_ratio: float,
        poll_s: float,
        fetch_concurrency: int,
        shard: str,
        is_embedding: Callable[[str], bool],
        update_codec: str = "int4",
        max_deltas_per_min: int = 1200,
        robust: str = "none",
        trim_ratio: float = 0.25,
        quarantine_after: int = 20,
        signer: Any = None,
        verifier: Any = None,
        require_signatures: bool = False,
        now: Callable[[], float] = time.monotonic,
        **_ignored: Any,
    ) -> None:
        self.store = store
        self.spec = spec
        self.plan = spec.plan
        self.quorum = quorum
        self.grace_gamma = grace_gamma
        self.outer_kwargs = {"lr": outer_lr, "momentum": outer_momentum, "nesterov": nesterov}
        self.max_staleness = max_staleness
        self.merge_spacing = merge_spacing
        self.max_norm_ratio = max_norm_ratio
        self.poll_s = poll_s
        self.fetch_concurrency = fetch_concurrency
        self.shard_index, self.num_shards = (int(x) for x in shard.split("/"))
        self.is_embedding = is_embedding
        self.update_codec = update_codec
        self.max_deltas_per_min = max_deltas_per_min
        self.robust, self.trim_ratio = robust, trim_ratio
        self.quarantine_after = quarantine_after
        self.signer, self.verifier, self.require_signatures = signer, verifier, require_signatures
        self.now = now
        self.recent: dict[str, deque] = defaultdict(deque)  # learner -> arrival times (rate limit)
        self.strikes: dict[str, int] = defaultdict(int)  # learner -> rejections in a row
        self.quarantined: set[str] = set()
        self.last_clock: dict[str, int] = {}  # learner -> its own clock entry in its newest accepted delta
        self.seen_checksums: dict[str, deque] = defaultdict(lambda: deque(maxlen=256))
        self.owned = [p for p in range(self.plan.num_fragments) if p % self.num_shards == self.shard_index]
        self.fragments: dict[int, FragmentState] = {}
        self.list_cursor: dict[str, str | None] = {}
        self.bad_keys: set[str] = set()
        self.ema_step = Ema(ema_decay)
        self.ema_quorum = Ema(ema_decay)
        self.ema_sync = Ema(ema_decay)
        self.counters: dict[str, Any] = {
            "deltas_seen": 0, "deltas_merged": 0, "deltas_superseded": 0, "deltas_rejected": 0,
            "rejected_by_reason": defaultdict(int), "versions_published": 0, "publish_races_lost": 0,
            "merges": 0, "contributors_total": 0, "grace_s_total": 0.0,
        }
        self.last_merge: dict[int, dict[str, Any]] = {}
        self.registry = Registry()
        self.metrics = syncer_metrics(self.registry)
        self._stopping = False
        self._draining = False
        self.ready_at: float | None = None
        self._status_token: str | None = None
        self._last_status_s = 0.0

    # --- bootstrap and resume --------------------------------------------------------------------

    def bootstrap(self, initial_params: dict[str, torch.Tensor]) -> None:
        """Resume every owned fragment from the bucket, publishing version 0 where none exists."""
        index, _ = protocol.read_index(self.store)
        for p in self.owned:
            latest = protocol.latest_version(self.store, p, hint=index.get(p))
            if latest is None:
                names = self.plan.fragments[p]
                params = {n: initial_params[n].detach().to(torch.float32).clone() for n in names}
                state = FragmentState(p, -1, params, OuterOptimizer(**self.outer_kwargs))
                self.fragments[p] = state
                self._publish(state, params, state.outer, {
                    "kind": "init", "merged": [], "torch": torch.__version__,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability()}, dict(state.consumed), VectorClock())
            else:
                self._adopt_published(p, latest)
        protocol.advance_index(self.store, {p: s.version for p, s in self.fragments.items()})
        learners = set().union(*(s.consumed for s in self.fragments.values()))
        for learner in learners:
            # resume listing after the lowest high-water mark over our fragments; later keys are
            # filtered per fragment, so nothing is fetched twice
            low = min(s.consumed.get(learner, -1) for s in self.fragments.values())
            self.list_cursor[learner] = layout.delta_key(learner, low, 999) if low >= 0 else None
        self.ready_at = time.time()
        log.info("syncer_ready shard=%d/%d fragments=%d versions=%s", self.shard_index, self.num_shards,
                 len(self.owned), {p: s.version for p, s in self.fragments.items()})

    def _read_global(self, p: int, version: int):
        return protocol.read_global(self.store, self.spec, p, version, verify=self.verifier,
                                  require_signature=self.require_signatures)

    def _adopt_published(self, p: int, version: int) -> None:
        header, params = self._read_global(p, version)
        outer = OuterOptimizer(**self.outer_kwargs)
        consumed: dict[str, int] = {}
        residual: dict[str, torch.Tensor] = {}
        state_key = header.extra.get("state_key")
        if state_key:
            st_header, st_tensors = codec.decode(
                self.store.get(state_key), kind="state", run_id=self.spec.run_id, verify=self.verifier,
                require_signature=self.require_signatures,
                expected_signer="syncer" if self.verifier is not None else None)
            residual = {k[len(RESIDUAL):]: v for k, v in st_tensors.items() if k.startswith(RESIDUAL)}
            outer.load_state_dict(outer_state_from_wire(
                {k: v for k, v in st_tensors.items() if not k.startswith(RESIDUAL)}, st_header))
            consumed = {str(k): int(v) for k, v in st_header.extra.get("consumed", {}).items()}
        old = self.fragments.get(p)
        state = FragmentState(p, version, params, outer, clock=header.clock, consumed=consumed, residual=residual)
        state.history[version] = params
        if old is not None:  # keep deltas the winner did not account for
            state.pending = [d for d in old.pending if d.seq > consumed.get(d.learner, -1)]
            state.norms = old.norms
        self.fragments[p] = state
        log.info("fragment_adopted fragment=%d version=%d state=%s", p, version, state_key)

    # --- polling ---------------------------------------------------------------------------------

    async def poll_once(self) -> int:
        """List and fetch new deltas; returns how many new delta keys were seen."""
        prefixes = await asyncio.to_thread(self.store.list_prefixes, layout.LEARNERS)
        qkeys = await asyncio.to_thread(self.store.list, layout.SYNCER + "quarantine/")
        listed = {k.rsplit("/", 1)[-1][: -len(".json")] for k in qkeys}
        for lifted in self.quarantined - listed:  # an operator deleted the record: a fresh start
            self.strikes[lifted] = 0
            log.info("quarantine_lifted learner=%s", lifted)
        self.quarantined = listed
        learners = []
        for prefix in prefixes:
            name = prefix[len(layout.LEARNERS):].strip("/")
            if layout.ID_PATTERN.match(name):
                learners.append(name)
            elif prefix not in self.bad_keys:
                self.bad_keys.add(prefix)
                self._count_reject("bad_key", prefix, None)
        sem = asyncio.Semaphore(self.fetch_concurrency)
        listings = await asyncio.gather(*(self._list_learner(l, sem) for l in learners))
        todo = [k for keys_ in listings for k in keys_]
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
                    self._count_reject("bad_key", key, None)
                continue
            if dk.fragment not in self.fragments:
                if dk.fragment >= self.plan.num_fragments:
                    self._reject_delta(key, dk, "wrong_fragment", f"fragment {dk.fragment} not in plan")
                continue
            if dk.seq <= self.fragments[dk.fragment].consumed.get(dk.learner, -1):
                continue
            if any(d.key == key for d in self.fragments[dk.fragment].pending):
                continue
            if self._rate_limited(dk.learner):
                self._reject_delta(key, dk, "rate_limit", f"more than {self.max_deltas_per_min} deltas a minute")
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
        limit = 4 * self.plan.numel(dk.fragment) + MAX_HEADER_BYTES
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
            self._reject_delta(key, dk, outcome.reason, outcome.detail)
            return
        header, pseudo_grad = outcome
        state = self.fragments[dk.fragment]
        reason, detail = self._validate(dk, header, pseudo_grad, state)
        if reason:
            self._reject_delta(key, dk, reason, detail)
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
        # the reference is the median over learners of each learner's own recent median, so one
        # learner (sending tiny or huge deltas) cannot move the bar for the others
        others = [statistics.median(h) for l, h in state.norms.items() if h]
        if sum(len(h) for h in state.norms.values()) >= 8:
            reference = statistics.median(others)
            if reference > 0 and norm > self.max_norm_ratio * reference:
                return "norm", f"per-step norm {norm:.3g} > {self.max_norm_ratio} x reference {reference:.3g}"
        state.norms[dk.learner].append(norm)
        self.seen_checksums[dk.learner].append(header.checksum)
        self.last_clock[dk.learner] = own
        return None, ""

    def _reject_delta(self, key: str, dk: layout.DeltaKey, reason: str, detail: str) -> None:
        self._count_reject(reason, key, detail)
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

    def _count_reject(self, reason: str, key: str, detail: str | None) -> None:
        self.metrics.deltas_rejected_total.inc(reason=reason)
        self.counters["deltas_rejected"] += 1
        self.counters["rejected_by_reason"][reason] += 1
        log.warning("delta_rejected reason=%s key=%s detail=%s", reason, key, detail or "")

    # --- merging ---------------------------------------------------------------------------------

    def grace_s(self, state: FragmentState) -> float:
        slack = self.spec.overlap * self.ema_step.get() - self.ema_quorum.get() - self.ema_sync.get()
        return self.grace_gamma * max(0.0, slack)

    def ready(self, state: FragmentState, now: float) -> bool:
        """Quorum reached and the grace window spent (or draining with anything pending)."""
        if not state.pending:
            return False
        if self._draining:
            return True
        contributors = {d.learner for d in state.pending}
        if len(contributors) < self.quorum:
            return False
        if state.quorum_s is None:
            state.quorum_s = now
            waited = now - (state.round_open_s or now)
            self.ema_quorum.update(waited)
            self.metrics.quorum_wait_seconds.observe(waited)
        if now < state.quorum_s + self.grace_s(state):
            return False
        # keep each fragment's effective sync period near H: merging one fragment many times per
        # period with few contributors over-drives the outer Nesterov step (PAPER-NOTES 5.6)
        spacing = self.merge_spacing * self.spec.sync_every * self.ema_step.get()
        return state.last_merge_s is None or now >= state.last_merge_s + spacing

    def merge_ready(self) -> int:
        merged = 0
        for p in self.owned:
            state = self.fragments[p]
            if self.ready(state, self.now()):
                self.merge_fragment(state)
                merged += 1
        return merged

    def _base_params(self, state: FragmentState, version: int) -> dict[str, torch.Tensor]:
        if version in state.history:
            return state.history[version]
        _, params = self._read_global(state.fragment, version)
        return params

    def merge_fragment(self, state: FragmentState) -> bool:
        start = self.now()
        grace = 0.0 if state.quorum_s is None else max(0.0, start - state.quorum_s)
        newest: dict[tuple[str, int], PendingDelta] = {}
        superseded = []
        for d in sorted(state.pending, key=lambda d: (d.learner, d.seq)):
            slot = (d.learner, d.header.base_version)
            if slot in newest:  # counters and pseudo-gradient are cumulative since the last adoption
                superseded.append(newest[slot])
            newest[slot] = d
        contribs = list(newest.values())
        anchored, weights, entries = [], [], []
        for d in contribs:
            try:
                base = self._base_params(state, d.header.base_version)
            except (DdilocoError, OSError) as exc:
                self._reject_delta(d.key, layout.parse_delta_key(d.key), "unknown_base", str(exc))
                continue
            anchored.append(anchor(state.params, base, d.pseudo_grad))
            w = merge.token_weight(d.header.num_tokens, d.header.num_steps)
            weights.append(w)
            entries.append({"key": d.key, "learner": d.learner, "seq": d.seq, "base_version": d.header.base_version,
                            "num_steps": d.header.num_steps, "num_tokens": d.header.num_tokens, "weight": w})
        consumed = dict(state.consumed)
        for d in state.pending:
            consumed[d.learner] = max(d.seq, consumed.get(d.learner, -1))
        if not anchored or sum(weights) <= 0:
            state.pending.clear()
            state.consumed = consumed
            state.quorum_s = None
            return False
        new_params, outer = merge_and_step(state.params, state.outer, anchored, weights, self.is_embedding,
                                           self.outer_kwargs, self.robust, self.trim_ratio)
        clock = state.clock
        for d in contribs:
            clock = clock.merge(d.header.clock)
        record = {
            "kind": "merge", "merged": entries, "superseded": [d.key for d in superseded],
            "contributors": len({e["learner"] for e in entries}), "grace_s": grace,
            "quorum_wait_s": self.ema_quorum.get(), "staleness": [state.version - e["base_version"] for e in entries],
            "outer": self.outer_kwargs, "update_codec": self.update_codec,
            "robust": self.robust, "trim_ratio": self.trim_ratio,
        }
        won = self._publish(state, new_params, outer, record, consumed, clock)
        if won:
            self.counters["deltas_merged"] += len(entries)
            self.counters["deltas_superseded"] += len(superseded)
            self.counters["merges"] += 1
            self.counters["contributors_total"] += record["contributors"]
            self.counters["grace_s_total"] += grace
            self.ema_sync.update(self.now() - start)
            m = self.metrics
            m.deltas_merged_total.inc(len(entries) + len(superseded))
            m.versions_published_total.inc()
            m.contributors_per_merge.observe(record["contributors"])
            m.grace_window_seconds.observe(grace)
            m.publish_seconds.observe(self.now() - start)
            for stale in record["staleness"]:
                m.staleness_versions.observe(stale)
            self.last_merge[state.fragment] = {k: record[k] for k in ("contributors", "grace_s", "staleness")}
            self.last_merge[state.fragment]["weights"] = {e["learner"]: e["weight"] for e in entries}
        return won

    def _publish(self, state: FragmentState, params: dict[str, torch.Tensor], outer: OuterOptimizer,
                 record: dict[str, Any], consumed: dict[str, int], clock: VectorClock) -> bool:
        """Commit a new version (``commit_version``) and move this fragment's in-memory state to it."""
        p, version = state.fragment, state.version + 1
        clock = clock.tick(SYNCER_ACTOR)
        update, residual = None, state.residual
        if record.get("kind") == "merge" and self.update_codec != "none":
            update, params, residual = self._compress_update(state, params, version, clock)
        tensors, outer_steps = outer_state_to_wire(outer)
        tensors.update({RESIDUAL + n: t for n, t in residual.items()})
        state_key = commit_version(
            self.store, run_id=self.spec.run_id, fragment=p, version=version, params=params,
            state_tensors=tensors, state_extra={"consumed": consumed, "outer_num_steps": outer_steps},
            record=record, clock=clock, signer=self.signer,
            after_commit={layout.global_update_key(p, version): update} if update is not None else None,
            advance_index=record.get("kind") == "merge",
        )
        if state_key is None:
            self.counters["publish_races_lost"] += 1
            log.warning("publish_race_lost fragment=%d version=%d action=adopt_winner", p, version)
            self._adopt_published(p, version)
            return False
        state.history[version] = params
        while len(state.history) > HISTORY_VERSIONS:
            state.history.popitem(last=False)
        state.version, state.params, state.outer, state.clock = version, params, outer, clock
        state.consumed, state.residual = consumed, residual
        state.pending = [d for d in state.pending if d.seq > consumed.get(d.learner, -1)]
        state.quorum_s = None
        if record.get("kind") == "merge":
            state.last_merge_s = self.now()
        state.round_open_s = min((d.arrived_s for d in state.pending), default=None)
        self.counters["versions_published"] += 1
        if record.get("kind") == "merge":
            log.info("published fragment=%d version=%d contributors=%d weights=%s grace_s=%.3f",
                     p, version, record["contributors"], [round(e["weight"]) for e in record["merged"]],
                     record["grace_s"])
        return True

    def _compress_update(self, state: FragmentState, new_params: dict[str, torch.Tensor], version: int,
                         clock: VectorClock) -> tuple[bytes, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        header = codec.Header(kind="update", run_id=self.spec.run_id, fragment=state.fragment, version=version,
                              base_version=state.version, clock=clock)
        return compress_update(state.params, new_params, state.residual, header, self.update_codec,
                               self.spec.block_size, signer=self.signer)

    # --- status ----------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        c = dict(self.counters)
        c["rejected_by_reason"] = dict(c["rejected_by_reason"])
        return {
            "shard": f"{self.shard_index}/{self.num_shards}",
            "time": time.time(), "pid": os.getpid(), "host": socket.gethostname(), "ready_at": self.ready_at,
            "versions": {str(p): s.version for p, s in self.fragments.items()},
            "pending": {str(p): len(s.pending) for p, s in self.fragments.items() if s.pending},
            "ema_step_s": self.ema_step.get(), "ema_quorum_s": self.ema_quorum.get(),
            "ema_sync_s": self.ema_sync.get(), "grace_gamma": self.grace_gamma,
            "counters": c, "last_merge": {str(p): m for p, m in self.last_merge.items()},
            "storage": self.store.stats.snapshot(),
            "draining": self._draining, "quarantined": sorted(self.quarantined),
        }

    def write_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_status_s < 2.0:
            return
        self.metrics.pending_deltas.set(sum(len(s.pending) for s in self.fragments.values()))
        export_store_stats(self.registry, "syncer", self.store.stats.snapshot())
        self._last_status_s = now
        key = layout.syncer_status_key(self.shard_index, self.num_shards)
        body = json.dumps(self.status(), default=str).encode()
        for _ in range(3):
            try:
                self._status_token = self.store.cas(key, body, self._status_token)
                return
            except StorageError:
                try:
                    _, self._status_token = self.store.read_token(key)
                except NotFoundError:
                    self._status_token = None

    # --- service loop ----------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stopping = True

    async def run(self, idle_exit_s: float | None = None) -> None:
        last_activity = time.monotonic()
        while not self._stopping:
            try:
                seen = await self.poll_once()
                merged = await asyncio.to_thread(self.merge_ready)
            except StorageError as exc:  # outage beyond the retry budget: keep serving, try again
                log.warning("syncer_poll_failed error=%s action=retry", exc)
                seen = merged = 0
            if seen or merged:
                last_activity = time.monotonic()
            elif idle_exit_s and time.monotonic() - last_activity > idle_exit_s:
                log.info("syncer_idle_exit idle_s=%.0f", idle_exit_s)
                break
            self.write_status()
            await asyncio.sleep(self.poll_s)
        await self.drain()

    async def drain(self) -> None:
        """Account for every delta already written: one last poll, merge all pending."""
        self._draining = True
        for _ in range(3):
            try:
                await self.poll_once()
                await asyncio.to_thread(self.merge_ready)
                break
            except StorageError as exc:
                log.warning("syncer_drain_retry error=%s", exc)
                await asyncio.sleep(self.poll_s)
        self.write_status(force=True)
        log.info("syncer_stopped counters=%s", json.dumps(self.status()["counters"]))


# --- the merge as pure functions (shared with replay) ---------------------------------------------


# --- command line --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quorum", type=int, help="minimum distinct learners K per merge")
    p.add_argument("--shard", help="'i/S': own fragments p with p %% S == i")
    p.add_argument("--grace-gamma", type=float, help="share of slack spent waiting for stragglers (0: no grace)")
    p.add_argument("--idle-exit", type=float, help="exit after this many seconds without activity")


def security_kwargs(security) -> dict[str, Any]:
    """The syncer's signer (its own key) and a verifier for every learner's key and its own."""
    if security.run_secret is None:
        if security.required():
            raise ConfigError("security.require_signatures is set but no security.run_secret: "
                              "set DDILOCO_SECURITY__RUN_SECRET on every learner and syncer")
        return {}
    from ddiloco_geo.core import signing

    secret = security.run_secret.get_secret_value()
    return {"signer": signing.signer_for(secret, "syncer"), "verifier": signing.run_verifier(secret),
            "require_signatures": security.required()}


def run(args: argparse.Namespace) -> int:
    from ddiloco_geo.cli.settings import settings_from
    from ddiloco_geo.core.model import is_embedding
    from ddiloco_geo.storage import open_store

    settings, _ = settings_from(args, {
        "syncer.quorum": args.quorum, "syncer.shard": args.shard,
        "syncer.grace_gamma": args.grace_gamma, "syncer.idle_exit_s": args.idle_exit,
    })
    cfg = settings.syncer
    store = open_store(settings.storage)
    spec, params = protocol.build_spec(settings)
    spec = protocol.create_or_load_spec(store, spec)
    patterns = settings.model.embedding_patterns
    syncer = Syncer(store, spec, **cfg.model_dump(), is_embedding=lambda n: is_embedding(n, patterns),
                    **security_kwargs(settings.security))
    syncer.bootstrap(params)
    from ddiloco_geo.metrics import serve_from_config

    server = serve_from_config(settings.metrics, syncer.registry,
                               lambda: {"ok": not syncer._stopping, "versions": syncer.status()["versions"]})

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, syncer.request_stop)
        await syncer.run(idle_exit_s=cfg.idle_exit_s)

    try:
        asyncio.run(main())
    finally:
        if server is not None:
            server.stop()
    if args.json:
        print(json.dumps(syncer.status(), default=str))
    store.close()
    return 0
