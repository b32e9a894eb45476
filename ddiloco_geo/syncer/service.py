"""The syncer service: merges learners' fragment deltas and publishes new global fragment versions.

Decoupled DiLoCo (arXiv 2604.21428, section "syncer"), over a bucket. For every fragment p it owns
(``shard = "i/S"``: the fragments with p % S == i) the syncer loops:

1. **intake** (:mod:`~ddiloco_geo.syncer.intake`): list, fetch, validate; reject with a record;
2. **rounds** (:mod:`~ddiloco_geo.syncer.rounds`): quorum, adaptive grace, merge spacing; anchor,
   token-weighted RDA, one outer Nesterov step (fp32, one state per fragment; the learners' models averaged
   in a merge holding a final delta);
3. **publish** (:func:`ddiloco_geo.protocol.publish.commit_version`): a create-only state object
   (momentum, residual, per-learner cursors), then the create-only global (the commit point) with
   the merge record, the int4 update object, the tape entry and the index.

Failure semantics. The global object's create-only write is the commit point: a version exists once that object
exists, and no two objects can exist for one version (split brain is impossible by construction). If the create
loses (another syncer, or our own lost response), the syncer reads the winner and adopts its state, keeping the
deltas the winner did not account for. A restarted syncer loads the newest global of each fragment and the state
it names: cursors say exactly which deltas are accounted for, so none is merged twice; a delta is accounted for
only by a published merge record or a rejection record, so none is dropped.

Shutdown: stop intake (``request_stop``), drain (one last poll, merge everything pending even below quorum) within
``drain_timeout_s``, write the final status; :meth:`close` is idempotent; the caller closes the store."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections import defaultdict
from typing import Any, Callable

import torch

from ddiloco_geo import codec, protocol
from ddiloco_geo.core import layout
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.errors import CodecError, DdilocoError, NotFoundError, StorageError
from ddiloco_geo.core.outer import OuterOptimizer
from ddiloco_geo.metrics import Registry, export_store_stats, syncer_metrics
from ddiloco_geo.core.signing import sign_record
from ddiloco_geo.protocol.publish import RESIDUAL, commit_version, compress_update, outer_state_to_wire
from ddiloco_geo.protocol.verified import record_forged
from ddiloco_geo.storage import Store
from ddiloco_geo.syncer.intake import Intake
from ddiloco_geo.syncer.rounds import RoundPolicy, after_merge, build_merge, select_contributors
from ddiloco_geo.syncer.state import Ema, FragmentState, StepTimes, load_fragment

log = logging.getLogger(__name__)

SYNCER_ACTOR = "syncer"
MAX_FORGED_IN_A_ROW = 16  # forged globals skipped in a row before the syncer stops and says what to delete


class ForgedObjectError(DdilocoError):
    """Forged globals the syncer cannot publish past; the message says what to delete."""


class Syncer:
    """One syncer shard. Keyword arguments are exactly the fields of ``SyncerConfig`` (an unknown
    key is a ``TypeError``), plus the model's embedding rule, the keys and a clock."""

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
        nesterov: bool, outer_warmup: int,
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
        sparse_average: str = "auto",
        anchoring: str = "current", final_merge: str = "outer", resends: str = "pull", stale_damping: str = "none",
        clip_ratio: float | None = 4.0,
        quarantine_after: int = 20,
        max_seq_ahead: int = 100_000,
        idle_exit_s: float | None = None,
        drain_timeout_s: float = 60.0,
        signer: Any = None,
        verifier: Any = None,
        require_signatures: bool = False,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.spec, self.plan = store, spec, spec.plan
        self.outer_kwargs = {"lr": outer_lr, "momentum": outer_momentum, "nesterov": nesterov, "warmup": outer_warmup}
        self.poll_s, self.idle_exit_s, self.drain_timeout_s = poll_s, idle_exit_s, drain_timeout_s
        self.shard_index, self.num_shards = (int(x) for x in shard.split("/"))
        self.is_embedding, self.update_codec = is_embedding, update_codec
        self.robust, self.trim_ratio, self.anchoring, self.clip_ratio, self.final_merge, self.resends, self.stale_damping = \
            robust, trim_ratio, anchoring, clip_ratio, final_merge, resends, stale_damping
        self.sparse_average = ("per_index" if spec.codec == "topk" else "dense") if sparse_average == "auto" else sparse_average
        self.signer, self.verifier, self.require_signatures = signer, verifier, require_signatures
        self.now = now
        self.owned = [p for p in range(self.plan.num_fragments) if p % self.num_shards == self.shard_index]
        self.fragments: dict[int, FragmentState] = {}
        self.step_times, self.ema_quorum, self.ema_sync = StepTimes(ema_decay, spec.sync_every, now), Ema(ema_decay), Ema(ema_decay)
        self.policy = RoundPolicy(quorum, grace_gamma, merge_spacing, spec.overlap, spec.sync_every,
                                  self.step_times, self.ema_quorum, self.ema_sync)
        self.counters: dict[str, Any] = {
            "deltas_seen": 0, "deltas_merged": 0, "deltas_superseded": 0, "deltas_rejected": 0, "final_merges": 0,
            "rejected_by_reason": defaultdict(int), "versions_published": 0, "publish_races_lost": 0, "merges": 0,
            "contributors_total": 0, "grace_s_total": 0.0, "contributions_clipped": 0, "contributions_damped": 0, "stale_contributions": 0}
        self.last_merge: dict[int, dict[str, Any]] = {}
        self.registry = Registry()
        self.metrics = syncer_metrics(self.registry)
        self.intake = Intake(
            store, spec, self.fragments, max_staleness=max_staleness, max_norm_ratio=max_norm_ratio,
            max_deltas_per_min=max_deltas_per_min, quarantine_after=quarantine_after,
            fetch_concurrency=fetch_concurrency, verifier=verifier, require_signatures=require_signatures,
            counters=self.counters, metrics=self.metrics, step_times=self.step_times, now=now, signer=signer,
            max_seq_ahead=max_seq_ahead, adopt_newer=self._newest_adoptable)
        self.stopping = False
        self.draining = False
        self.closed = False
        self.ready_at: float | None = None
        self._status_token: str | None = None
        self._last_status_s = 0.0

    # --- bootstrap and resume --------------------------------------------------------------------

    def bootstrap(self, initial_params: dict[str, torch.Tensor]) -> None:
        """Resume every owned fragment from its newest version that verifies (forged or corrupt
        newer ones are set aside: recorded under ``syncer/forged/``, never adopted, and the next
        publish goes above them); publish version 0 where no version exists at all."""
        for p in self.owned:
            latest = self._newest_adoptable(p)
            if latest is None:
                names = self.plan.fragments[p]
                params = {n: initial_params[n].detach().to(torch.float32).clone() for n in names}
                state = FragmentState(p, -1, params, OuterOptimizer(**self.outer_kwargs))
                self.fragments[p] = state
                self._publish(state, params, state.outer, {
                    "kind": "init", "merged": [], "torch": torch.__version__,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability()}, dict(state.consumed), VectorClock())
        self._advance_index()
        self.intake.resume_cursors()
        self.ready_at = time.time()
        log.info("syncer_ready shard=%d/%d fragments=%d versions=%s", self.shard_index, self.num_shards,
                 len(self.owned), {p: s.version for p, s in self.fragments.items()})

    def _newest_adoptable(self, p: int, above: int = -1) -> int | None:
        """Adopt the newest version of fragment ``p`` above ``above`` whose global and state verify;
        None if there is none. The listing is read, not ``globals/HEAD`` (unsigned)."""
        versions = [v for v in sorted(protocol.list_versions(self.store, p), reverse=True) if v > above]
        for version in versions:
            try:
                self._adopt_published(p, version)
                return version
            except NotFoundError:
                continue  # listed, then gone (or its state object is): try the one before
            except CodecError as exc:
                record_forged(self.store, p, version, f"{exc.reason}: {exc.detail}", self.signer)
        if versions and above < 0:
            raise ForgedObjectError(
                f"fragment {p}: none of its {len(versions)} published versions verifies with this syncer's keys. "
                "If this is the run's syncer, check security.run_secret (it must be the run's); otherwise every "
                f"global under {layout.fragment_dir(p)} is forged: delete them (see syncer/forged/) and restart")
        return None

    def _advance_index(self) -> None:
        """Every owned fragment's version into ``globals/HEAD`` (signed; a forged index is replaced)."""
        protocol.advance_index(self.store, {p: s.version for p, s in self.fragments.items()},
                               signer=self.signer, verifier=self.verifier)

    def _adopt_published(self, p: int, version: int) -> None:
        """Load a published version (global and state, both verified) as fragment ``p``'s state;
        CodecError if either fails verification (nothing changes then)."""
        state, state_key = load_fragment(self.store, self.spec, p, version, outer_kwargs=self.outer_kwargs,
                                         verifier=self.verifier, require_signatures=self.require_signatures)
        old = self.fragments.get(p)
        if old is not None:  # keep deltas the winner did not account for
            state.pending = [d for d in old.pending if d.seq > state.consumed.get(d.learner, -1)]
            state.norms = old.norms
        self.fragments[p] = state
        log.info("fragment_adopted fragment=%d version=%d state=%r", p, version, state_key)

    # --- intake and rounds -----------------------------------------------------------------------

    async def poll_once(self) -> int:
        """List and fetch new deltas (:class:`~ddiloco_geo.syncer.intake.Intake`)."""
        return await self.intake.poll_once()

    @property
    def quarantined(self) -> set[str]:
        return self.intake.quarantined

    def grace_s(self, state: FragmentState) -> float:
        return self.policy.grace_s()

    def ready(self, state: FragmentState, now: float) -> bool:
        return self.policy.ready(state, now, self.draining, self.metrics.quorum_wait_seconds.observe)

    def merge_ready(self) -> int:
        merged = 0
        for p in self.owned:
            state = self.fragments[p]
            if self.ready(state, self.now()):
                self.merge_fragment(state)
                merged += 1
        return merged

    def _bases(self, state: FragmentState, contributors: list) -> tuple[dict[int, dict[str, torch.Tensor]], list]:
        """Parameters of every contributor's base version; contributors whose base is unreadable
        are rejected (``unknown_base``) and left out."""
        bases, usable = {}, []
        for d in contributors:
            v = d.header.base_version
            try:
                if v not in bases:
                    bases[v] = state.history[v] if v in state.history else protocol.read_global(
                        self.store, self.spec, state.fragment, v, verify=self.verifier,
                        require_signature=self.require_signatures)[1]
                usable.append(d)
            except (DdilocoError, OSError) as exc:
                self.intake.reject(d.key, layout.parse_delta_key(d.key), "unknown_base", str(exc))
        return bases, usable

    def merge_fragment(self, state: FragmentState) -> bool:
        start = self.now()
        grace = 0.0 if state.quorum_s is None else max(0.0, start - state.quorum_s)
        contributors, superseded = select_contributors(state.pending)
        bases, contributors = self._bases(state, contributors)
        consumed = dict(state.consumed)
        for d in state.pending:
            consumed[d.learner] = max(d.seq, consumed.get(d.learner, -1))
        merged = build_merge(state, contributors, bases, is_embedding=self.is_embedding,
                             outer_kwargs=self.outer_kwargs, robust=self.robust, trim_ratio=self.trim_ratio,
                             sparse=self.sparse_average, anchoring=self.anchoring, clip_ratio=self.clip_ratio, final_merge=self.final_merge,
                             resends=self.resends, damping=self.stale_damping)
        if merged is None:
            state.pending.clear()
            state.consumed = consumed
            state.quorum_s = None
            return False
        entries = merged.entries
        record = {
            "kind": "merge", "merged": entries, "superseded": [d.key for d in superseded],
            "contributors": len({e["learner"] for e in entries}), "grace_s": grace,
            "quorum_wait_s": self.ema_quorum.get(), "staleness": [state.version - e["base_version"] for e in entries],
            "outer": self.outer_kwargs, **(merged.final_record() or state.outer.ramp_record()),
            "update_codec": self.update_codec, "robust": self.robust, "trim_ratio": self.trim_ratio, "anchoring": self.anchoring,
            "sparse_average": self.sparse_average, "clipped": sum(1 for e in entries if "clip" in e), "stale_damping": self.stale_damping,
        }
        won = self._publish(state, merged.params, merged.outer, record, consumed, merged.clock)
        if won:
            self._count_merge(state, record, len(superseded), start)
        return won

    def _count_merge(self, state: FragmentState, record: dict[str, Any], num_superseded: int, start: float) -> None:
        entries, grace = record["merged"], record["grace_s"]
        self.counters["deltas_merged"] += len(entries)
        self.counters["deltas_superseded"] += num_superseded
        self.counters["merges"] += 1
        self.counters["contributors_total"] += record["contributors"]
        self.counters["grace_s_total"] += grace
        self.counters["contributions_clipped"] += record["clipped"]
        self.counters["contributions_damped"] += sum(1 for e in entries if "damp" in e)
        self.counters["stale_contributions"] += sum(1 for s in record["staleness"] if s > 0)
        self.counters["final_merges"] += record.get("final", False)
        self.ema_sync.update(self.now() - start)
        m = self.metrics
        m.deltas_merged_total.inc(len(entries) + num_superseded)
        m.versions_published_total.inc()
        m.contributors_per_merge.observe(record["contributors"])
        m.grace_window_seconds.observe(grace)
        m.publish_seconds.observe(self.now() - start)
        for stale in record["staleness"]:
            m.staleness_versions.observe(stale)
        self.last_merge[state.fragment] = {**{k: record[k] for k in ("contributors", "grace_s", "staleness")},
                                           "weights": {e["learner"]: e["weight"] for e in entries}}

    # --- publishing ------------------------------------------------------------------------------

    def _publish_above_forged(self, state: FragmentState, params: dict[str, torch.Tensor], outer: OuterOptimizer,
                              record: dict[str, Any], consumed: dict[str, int], clock: VectorClock,
                              forged: int) -> bool:
        """After a forged winner at ``forged``: publish the same content at the next version number
        (at most :data:`MAX_FORGED_IN_A_ROW` tries, then stop with what to delete)."""
        state.forged_skips += 1
        skips = state.forged_skips
        if skips > MAX_FORGED_IN_A_ROW:
            raise ForgedObjectError(
                f"fragment {state.fragment}: {skips - 1} forged globals in a row up to {layout.global_key(state.fragment, forged)}; "
                f"someone without the run secret writes globals/: revoke that access, delete the globals listed "
                f"under syncer/forged/ and restart the syncer")
        return self._publish(state, params, outer, record, consumed, clock, version=forged + 1)

    def _publish(self, state: FragmentState, params: dict[str, torch.Tensor], outer: OuterOptimizer,
                 record: dict[str, Any], consumed: dict[str, int], clock: VectorClock,
                 version: int | None = None) -> bool:
        """Commit a new version (``commit_version``) and move this fragment's in-memory state to it
        (``version``: the number to try, above a forged one; default the next)."""
        p = state.fragment
        version = state.version + 1 if version is None else version
        ticked = clock.tick(SYNCER_ACTOR)
        is_merge = record.get("kind") == "merge"
        update, published, residual = None, params, state.residual
        if is_merge and self.update_codec != "none":
            header = codec.Header(kind="update", run_id=self.spec.run_id, fragment=p, version=version,
                                  base_version=state.version, clock=ticked,  # contributors' steps: learner.schedule=run
                                  extra={"steps": {e["learner"]: e["step"] for e in record["merged"] if e["step"] is not None}})
            update, published, residual = compress_update(state.params, params, state.residual, header,
                                                          self.update_codec, signer=self.signer,
                                                          **self.spec.codec_args(self.update_codec))
        tensors, outer_steps = outer_state_to_wire(outer)
        merged_base, counts, finalized = after_merge(state, record["merged"]) if is_merge else (state.merged_base, state.merged_counts, state.finalized)
        tensors.update({RESIDUAL + n: t for n, t in residual.items()})
        state_key = commit_version(
            self.store, run_id=self.spec.run_id, fragment=p, version=version, params=published,
            state_tensors=tensors, state_extra={"consumed": consumed, "outer_num_steps": outer_steps,
                                                "merged_base": merged_base, "merged_counts": counts, "finalized": sorted(finalized)},
            record=record, clock=ticked, signer=self.signer,
            after_commit={layout.global_update_key(p, version): update} if update is not None else None,
            advance_index=False, verifier=self.verifier,
        )
        if state_key is None:
            self.counters["publish_races_lost"] += 1
            try:
                self._adopt_published(p, version)
                log.warning("publish_race_lost fragment=%d version=%d action=adopt_winner", p, version)
                return False
            except CodecError as exc:  # a forged or corrupt winner: set it aside, publish above it
                record_forged(self.store, p, version, f"{exc.reason}: {exc.detail}", self.signer)
            # the same merge again, from the same inputs (not from what this try compressed)
            return self._publish_above_forged(state, params, outer, record, consumed, clock, version)
        state.forged_skips = 0
        state.remember(version, published)
        state.version, state.params, state.outer, state.clock = version, published, outer, ticked
        state.consumed, state.residual, state.finalized, state.merged_base, state.merged_counts = consumed, residual, finalized, merged_base, counts
        state.pending = [d for d in state.pending if d.seq > consumed.get(d.learner, -1)]
        state.quorum_s = None
        if is_merge:
            state.last_merge_s = self.now()
            self._advance_index()
        self.counters["versions_published"] += 1
        if is_merge:
            log.info("published fragment=%d version=%d contributors=%d weights=%s grace_s=%.3f",
                     p, version, record["contributors"], [round(e["weight"]) for e in record["merged"]],
                     record["grace_s"])
        return True

    # --- status ----------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        c = dict(self.counters)
        c["rejected_by_reason"] = dict(c["rejected_by_reason"])
        return {
            "shard": f"{self.shard_index}/{self.num_shards}",
            "time": time.time(), "pid": os.getpid(), "host": socket.gethostname(), "ready_at": self.ready_at,
            "versions": {str(p): s.version for p, s in self.fragments.items()},
            "pending": {str(p): len(s.pending) for p, s in self.fragments.items() if s.pending},
            "ema_step_s": self.step_times.get(), "ema_quorum_s": self.ema_quorum.get(),
            "ema_sync_s": self.ema_sync.get(), "grace_gamma": self.policy.grace_gamma,
            "counters": c, "last_merge": {str(p): m for p, m in self.last_merge.items()},
            "storage": self.store.stats.snapshot(),
            "draining": self.draining, "quarantined": sorted(self.quarantined),
        }

    def health(self) -> dict[str, Any]:
        return {"ok": not self.stopping, "versions": self.status()["versions"]}

    def write_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_status_s < 2.0:
            return
        self.metrics.pending_deltas.set(sum(len(s.pending) for s in self.fragments.values()))
        export_store_stats(self.registry, "syncer", self.store.stats.snapshot())
        self._last_status_s = now
        key = layout.syncer_status_key(self.shard_index, self.num_shards)
        body = json.dumps(sign_record(json.loads(json.dumps(self.status(), default=str)), self.signer)).encode()
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
        """Stop intake; :meth:`run` then drains and returns."""
        self.stopping = True

    async def run(self) -> None:
        last_activity = time.monotonic()
        while not self.stopping:
            try:
                seen = await self.poll_once()
                merged = await asyncio.to_thread(self.merge_ready)
            except StorageError as exc:  # outage beyond the retry budget: keep serving, try again
                log.warning("syncer_poll_failed error=%s action=retry", exc)
                seen = merged = 0
            if seen or merged:
                last_activity = time.monotonic()
            elif self.idle_exit_s and time.monotonic() - last_activity > self.idle_exit_s:
                log.info("syncer_idle_exit idle_s=%.0f", self.idle_exit_s)
                break
            self.write_status()
            await asyncio.sleep(self.poll_s)
        await self.close()

    async def drain(self) -> None:
        """Account for every delta already written: one last poll, merge all pending, within
        ``drain_timeout_s`` (what is left is picked up by the next syncer from the cursors)."""
        self.draining = True
        deadline = time.monotonic() + self.drain_timeout_s
        while True:
            try:
                await asyncio.wait_for(self._drain_once(), timeout=max(0.1, deadline - time.monotonic()))
                break
            except StorageError as exc:
                log.warning("syncer_drain_retry error=%s", exc)
            except asyncio.TimeoutError:
                pass
            if time.monotonic() >= deadline:
                log.warning("syncer_drain_timeout timeout_s=%.0f pending=%d", self.drain_timeout_s,
                            sum(len(s.pending) for s in self.fragments.values()))
                break
            await asyncio.sleep(self.poll_s)

    async def _drain_once(self) -> None:
        await self.poll_once()
        await asyncio.to_thread(self.merge_ready)

    async def close(self) -> None:
        """Drain, then write the final status. Idempotent."""
        if self.closed:
            return
        self.closed = True
        await self.drain()
        self.write_status(force=True)
        log.info("syncer_stopped counters=%s", json.dumps(self.status()["counters"]))
