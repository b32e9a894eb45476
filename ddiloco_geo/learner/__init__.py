"""The learner: an inner AdamW loop that never waits on the network.

Decoupled DiLoCo (arXiv 2604.21428, "learner loop"). Each inner step:

1. adopt any global fragment versions the background poller has already downloaded (overwrite by
   default, ``alpha`` mixing optional), reset that fragment's counters, keep the AdamW state;
2. take one AdamW step on the learner's own data shard (under ``torchrun`` with N processes, an
   ordinary DDP step: gloo on CPU, nccl on GPU);
3. count steps and tokens for every fragment since it was last adopted;
4. for each fragment due at this step (``fragments.Schedule``: p is due when
   (t − offset_p) mod H == 0), compute the pseudo-gradient ``base − local`` on the CPU and hand it
   to the bounded background uploader, which encodes it (int4 by default) with the learner's vector
   clock, counters and base version, and writes it create-only.

Only rank 0 talks to storage. Adoptions and the stop flag are broadcast to the other ranks at the
top of each step, so every rank applies the same globals at the same step.

Nothing in the step waits for storage: polling, downloads, encoding and uploads run in daemon
threads. If the upload queue is full, a queued delta for the same fragment is replaced (deltas are
cumulative since the last adoption, so nothing is lost); otherwise the oldest is dropped and
counted. On SIGTERM (or a preemption notice, ``ddiloco_geo.learner.preemption``) the learner stops stepping,
flushes a delta for every fragment with unsent work within ``flush_deadline_s``, writes
``exit.json`` and exits 0. A killed learner loses only its unflushed work.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import os
import socket
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco_geo import codec

from ddiloco_geo.core import layout

from ddiloco_geo import protocol
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.errors import CodecError, ConfigError, DdilocoError, NotFoundError, StorageError
from ddiloco_geo.core.fragments import Schedule
from ddiloco_geo.core.signing import sign_record
from ddiloco_geo.metrics import LearnerMetrics, Registry, export_store_stats, learner_metrics
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)


CKPT_PARAM = "param."
CKPT_EXP_AVG = "adam.exp_avg."
CKPT_EXP_AVG_SQ = "adam.exp_avg_sq."


@dataclass
class Outgoing:
    fragment: int
    pseudo_grad: dict[str, torch.Tensor]
    base_version: int
    num_steps: int
    num_tokens: int
    step: int
    step_s: float
    clock: VectorClock


class Uploader:
    """Bounded background uploader: encodes and writes deltas create-only, in order."""

    def __init__(self, store: Store, spec: protocol.RunSpec, learner: str, *, maxsize: int,
                 codec_name: str, block_size: int, first_seq: int, inline: bool = False,
                 metrics: LearnerMetrics | None = None, signer: Any = None) -> None:
        self.signer = signer
        self.store, self.spec, self.learner = store, spec, learner
        self.inline = inline
        self.metrics = metrics or learner_metrics(Registry())
        self.maxsize, self.codec_name, self.block_size = maxsize, codec_name, block_size
        self.next_seq = first_seq
        self.queue: collections.deque[Outgoing] = collections.deque()
        self.cond = threading.Condition()
        self.busy = False
        self.closed = False
        self.counters = {"deltas_sent": 0, "deltas_coalesced": 0, "deltas_dropped": 0, "upload_errors": 0,
                         "delta_bytes": 0}
        if not inline:
            threading.Thread(target=self._loop, name="uploader", daemon=True).start()

    def submit(self, item: Outgoing) -> None:
        if self.inline:  # in-process harnesses: write now, on the caller's thread
            self._upload(item)
            return
        with self.cond:
            for i, queued in enumerate(self.queue):
                if queued.fragment == item.fragment:
                    self.queue[i] = item
                    self.counters["deltas_coalesced"] += 1
                    self.metrics.upload_drops_total.inc(reason="coalesced")
                    return
            if len(self.queue) >= self.maxsize:
                dropped = self.queue.popleft()
                self.counters["deltas_dropped"] += 1
                self.metrics.upload_drops_total.inc(reason="dropped")
                log.warning("delta_dropped fragment=%d reason=upload_queue_full", dropped.fragment)
            self.queue.append(item)
            self.cond.notify()

    def depth(self) -> int:
        with self.cond:
            return len(self.queue) + int(self.busy)

    def _loop(self) -> None:
        backoff = 0.5
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if not self.queue and self.closed:
                    return
                item = self.queue[0]
                self.busy = True
            try:
                self._upload(item)
                backoff = 0.5
                with self.cond:
                    if self.queue and self.queue[0] is item:
                        self.queue.popleft()
            except StorageError as exc:  # outage beyond the store's retries: keep it, try again
                self.counters["upload_errors"] += 1
                log.warning("delta_upload_failed fragment=%d error=%s action=retry_in=%.1fs", item.fragment, exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()

    def _upload(self, item: Outgoing) -> None:
        while True:
            seq = self.next_seq
            header = codec.Header(
                kind="delta", run_id=self.spec.run_id, fragment=item.fragment, learner=self.learner, seq=seq,
                base_version=item.base_version, clock=item.clock.merge(VectorClock({self.learner: seq + 1})),
                num_steps=item.num_steps, num_tokens=item.num_tokens,
                extra={"step": item.step, "step_s": item.step_s},
            )
            data = codec.encode(item.pseudo_grad, header, codec=self.codec_name, block_size=self.block_size,
                                signer=self.signer)
            key = layout.delta_key(self.learner, seq, item.fragment)
            if self.store.put_if_absent(key, data):
                break
            # the key exists: our own write whose response was lost, or an earlier incarnation's
            if self.store.get(key) == data:
                break
            self.next_seq += 1
        self.next_seq = seq + 1
        self.counters["deltas_sent"] += 1
        self.counters["delta_bytes"] += len(data)
        self.metrics.deltas_sent_total.inc(fragment=str(item.fragment))
        self.metrics.delta_bytes_total.inc(len(data))

    def close(self, deadline_s: float) -> bool:
        """Stop intake, drain within the deadline; True if everything was written."""
        if self.inline:
            return True
        end = time.monotonic() + deadline_s
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            while (self.queue or self.busy) and time.monotonic() < end:
                self.cond.wait(timeout=max(0.0, end - time.monotonic()))
            left = len(self.queue)
        if left:
            log.warning("learner_flush_incomplete deltas_left=%d deadline_s=%.1f", left, deadline_s)
        return left == 0


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
                 require_signature: bool = False) -> None:
        self.store, self.spec, self.poll_s = store, spec, poll_s
        self.verify, self.require_signature = verify, require_signature
        self.known = dict(held)
        self.current = dict(current)  # the tensors of each known version (shared, never mutated)
        self.lag: dict[int, int] = {}  # versions behind the index when last seen
        self.inbox: dict[int, tuple[int, dict[str, torch.Tensor], VectorClock]] = {}
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.counters = {"globals_fetched": 0, "updates_applied": 0, "update_fallbacks": 0,
                         "globals_rejected": 0, "poll_errors": 0}
        self.thread = None
        if not inline:  # inline: the caller runs poll_once() itself
            self.thread = threading.Thread(target=self._loop, name="global-poller", daemon=True)
            self.thread.start()

    def take(self) -> dict[int, tuple[int, dict[str, torch.Tensor], VectorClock]]:
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
        index, _ = protocol.read_index(self.store)
        for p, v in sorted(index.items()):
            held = self.known.get(p, -1)
            if v <= held or p >= self.spec.plan.num_fragments:
                continue
            self.lag[p] = v - held
            fetched = None
            if held >= 0 and v - held <= self.MAX_UPDATE_CHAIN and p in self.current:
                fetched = self._via_updates(p, held, v)
            if fetched is None:
                try:
                    header, tensors = protocol.read_global(self.store, self.spec, p, v, verify=self.verify,
                                                         require_signature=self.require_signature)
                    fetched = (tensors, header.clock)
                    self.counters["globals_fetched"] += 1
                except (CodecError, NotFoundError) as exc:
                    self.counters["globals_rejected"] += 1
                    log.warning("global_rejected fragment=%d version=%d reason=%s", p, v, exc)
                    self.known[p] = v
                    continue
            self.known[p] = v
            self.current[p] = fetched[0]
            with self.lock:
                self.inbox[p] = (v, fetched[0], fetched[1])

    def _via_updates(self, p: int, held: int, version: int):
        tensors, clock = self.current[p], VectorClock()
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
                if codec.checksum_of(tensors) != header.extra.get("global_checksum"):
                    raise CodecError("checksum", f"rebuilt fragment {p} version {v} differs from the global")
                clock = clock.merge(header.clock)
        except (CodecError, NotFoundError) as exc:
            self.counters["update_fallbacks"] += 1
            log.debug("update_fallback fragment=%d version=%d reason=%s", p, version, exc)
            return None
        self.counters["updates_applied"] += version - held
        return tensors, clock

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=5)


class Learner:
    def __init__(self, settings, store: Store | None, *, rank: int = 0, world: int = 1,
                 inline_io: bool = False) -> None:
        from ddiloco_geo.core import data as datamod
        from ddiloco_geo.core import model as modelmod

        self.cfg = settings.learner
        self.settings = settings
        self.store = store
        self.rank, self.world = rank, world
        self.inline_io = inline_io
        self.learner_id = self.cfg.id or default_learner_id()
        layout.check_id(self.learner_id, "learner id")
        self.signer, self.global_verifier, self.own_verifier = _learner_keys(settings.security, self.learner_id)
        self.require_signatures = settings.security.required()
        self.device = torch.device(self.cfg.device)
        torch.manual_seed(settings.model.seed + 1000 * _shard_index(settings.data.shard) + rank)
        self.model = modelmod.build_model(settings.model).to(self.device)
        self.modelmod = modelmod
        corpus = datamod.load_corpus(settings.data.corpus, max_bytes=settings.data.max_bytes)
        train, self.eval_data = datamod.split(corpus, settings.data.eval_ratio)
        shard, num_shards = (int(x) for x in settings.data.shard.split("/"))
        self.reader = datamod.ShardReader(
            train, shard=shard * world + rank, num_shards=num_shards * world,
            block_size=settings.model.block_size, batch_size=self.cfg.batch_size, seed=settings.model.seed + shard,
        )
        self.spec: protocol.RunSpec | None = None
        self.stop_reason: str | None = None
        self.history: list[dict[str, float]] = []
        self.step = 0
        self.tokens_total = 0
        self.registry = Registry()
        self.metrics = learner_metrics(self.registry)

    # --- joining ---------------------------------------------------------------------------------

    def join(self) -> None:
        """The only wait: for the run spec and a first version of every fragment."""
        local_spec, _ = protocol.build_spec(self.settings)
        if self.rank == 0:
            spec = protocol.wait_for_spec(self.store, self.cfg.join_timeout_s)
            if spec.plan.digest() != local_spec.plan.digest():
                raise DdilocoError(
                    f"run {spec.run_id} uses fragment plan {spec.plan.digest()[:12]} (model {spec.model}) "
                    f"but this learner's model gives {local_spec.plan.digest()[:12]}: start it with the run's model settings"
                )
            self.spec = spec
            deadline = time.monotonic() + self.cfg.join_timeout_s
            while True:
                index, _ = protocol.read_index(self.store)
                if all(p in index for p in range(spec.plan.num_fragments)):
                    break
                if time.monotonic() > deadline:
                    raise DdilocoError(f"run {spec.run_id} has no global version for every fragment yet: is a syncer running?")
                time.sleep(0.5)
        else:
            self.spec = local_spec
        P = self.spec.plan.num_fragments
        self.base: dict[int, dict[str, torch.Tensor]] = {}
        self.base_version = [0] * P
        self.clock = VectorClock()
        if self.rank == 0:
            for p in range(P):
                header, tensors = protocol.read_global(self.store, self.spec, p, index[p], verify=self.global_verifier,
                                                     require_signature=self.require_signatures)
                self.modelmod.set_tensors(self.model, {n: t.to(self.device) for n, t in tensors.items()})
                self.base[p] = tensors
                self.base_version[p] = index[p]
                self.clock = self.clock.merge(header.clock)
        self._broadcast_model()
        self.schedule = Schedule(P, self.spec.sync_every)
        self.c_steps = [0] * P
        self.c_tokens = [0] * P
        self.last_sent_step = [0] * P
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr,
                                           betas=(0.9, 0.95), weight_decay=self.cfg.weight_decay)
        self.resumed_from = self._resume(index if self.rank == 0 else {})
        self.ddp = None
        if self.world > 1:
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.model)
        if self.rank == 0:
            first_seq = protocol.next_delta_seq(self.store, self.learner_id)
            self.uploader = Uploader(self.store, self.spec, self.learner_id, maxsize=self.cfg.upload_queue,
                                     codec_name=self.spec.codec, block_size=self.spec.block_size, first_seq=first_seq,
                                     inline=self.inline_io, metrics=self.metrics, signer=self.signer)
            self.poller = GlobalPoller(self.store, self.spec, self.cfg.poll_s, dict(enumerate(self.base_version)),
                                       dict(self.base), inline=self.inline_io or not self.cfg.sync_enabled,
                                       verify=self.global_verifier, require_signature=self.require_signatures)
        log.info("learner_joined learner=%s run=%s fragments=%d versions=%s world=%d", self.learner_id,
                 self.spec.run_id, P, self.base_version, self.world)

    def _broadcast_model(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            for t in self.model.parameters():
                dist.broadcast(t.data, src=0)

    # --- checkpoints ----------------------------------------------------------------------------

    def _gather_cursors(self) -> list[dict]:
        cursor = self.reader.state_dict()
        if self.world == 1:
            return [cursor]
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, cursor)  # between this learner's own ranks, never from a bucket
        return out

    def write_checkpoint(self, cursors: list[dict]) -> str | None:
        """Local parameters, AdamW moments, counters, data cursors and clock (rank 0, create-only)."""
        names = [n for n, _ in self.model.named_parameters()]
        tensors = {CKPT_PARAM + n: t for n, t in self.modelmod.get_tensors(self.model, names).items()}
        adam_steps = {}
        for name, param in self.model.named_parameters():
            st = self.optimizer.state.get(param)
            if st:
                tensors[CKPT_EXP_AVG + name] = st["exp_avg"].detach().float().cpu()
                tensors[CKPT_EXP_AVG_SQ + name] = st["exp_avg_sq"].detach().float().cpu()
                adam_steps[name] = float(st["step"])
        header = codec.Header(
            kind="checkpoint", run_id=self.spec.run_id, learner=self.learner_id, seq=self.uploader.next_seq,
            clock=self.clock, num_steps=self.step, num_tokens=self.tokens_total,
            extra={"base_version": self.base_version, "c_steps": self.c_steps, "c_tokens": self.c_tokens,
                   "last_sent_step": self.last_sent_step, "cursors": cursors, "adam_steps": adam_steps,
                   "world": self.world, "plan_digest": self.spec.plan.digest(), "reason": self.stop_reason},
        )
        data = codec.encode(tensors, header, codec="fp32", signer=self.signer)
        existing = self.store.list(layout.checkpoints_dir(self.learner_id))
        number = len(existing)
        while not self.store.put_if_absent(layout.checkpoint_key(self.learner_id, number), data):
            number += 1
        key = layout.checkpoint_key(self.learner_id, number)
        log.info("checkpoint_written learner=%s key=%s bytes=%d", self.learner_id, key, len(data))
        return key

    def _resume(self, index: dict[int, int]) -> str | None:
        """Continue from this learner's newest checkpoint: its data cursors, step count and AdamW
        moments always; its parameters and counters too when its base versions are within the
        syncer's staleness bound of the current globals (else it keeps the latest globals)."""
        found = self._latest_checkpoint() if self.rank == 0 else None
        plan: list = [None]
        if found is not None:
            key, header, _ = found
            ex = header.extra
            usable = ex.get("plan_digest") == self.spec.plan.digest() and ex.get("world") == self.world
            stale = self.settings.syncer.max_staleness
            compatible = usable and all(int(ex["base_version"][p]) >= index[p] - stale for p in index)
            if not usable:
                log.warning("checkpoint_ignored key=%s reason=plan_or_world_changed", key)
            else:
                plan[0] = {"key": key, "compatible": compatible, "step": header.num_steps,
                           "tokens": header.num_tokens, **{k: ex[k] for k in
                           ("cursors", "c_steps", "c_tokens", "last_sent_step", "adam_steps", "base_version")}}
        if self.world > 1:
            import torch.distributed as dist

            dist.broadcast_object_list(plan, src=0)  # among this learner's own ranks, never from a bucket
        info = plan[0]
        if info is None:
            return None
        self.reader.load_state_dict(info["cursors"][self.rank])
        self.step, self.tokens_total = int(info["step"]), int(info["tokens"])
        tensors = found[2] if found is not None else {}
        if info["compatible"]:
            if self.rank == 0:
                params = {n[len(CKPT_PARAM):]: t for n, t in tensors.items() if n.startswith(CKPT_PARAM)}
                self.modelmod.set_tensors(self.model, {n: t.to(self.device) for n, t in params.items()})
                self.clock = self.clock.merge(found[1].clock)
                for p, v in enumerate(info["base_version"]):
                    if int(v) != self.base_version[p]:
                        self.base[p] = protocol.read_global(self.store, self.spec, p, int(v), verify=self.global_verifier,
                                                          require_signature=self.require_signatures)[1]
                        self.base_version[p] = int(v)
            self._broadcast_model()
            self.c_steps = [int(x) for x in info["c_steps"]]
            self.c_tokens = [int(x) for x in info["c_tokens"]]
            self.last_sent_step = [int(x) for x in info["last_sent_step"]]
        self._restore_adam(tensors, info["adam_steps"])
        log.info("learner_resumed learner=%s checkpoint=%s step=%d params=%s", self.learner_id, info["key"],
                 self.step, "checkpoint" if info["compatible"] else "latest globals")
        return info["key"]

    def _latest_checkpoint(self):
        for key in reversed(self.store.list(layout.checkpoints_dir(self.learner_id))):
            try:
                return (key, *codec.decode(
                    self.store.get(key), kind="checkpoint", run_id=self.spec.run_id, verify=self.own_verifier,
                    require_signature=self.require_signatures,
                    expected_signer=f"learner:{self.learner_id}" if self.own_verifier is not None else None))
            except (CodecError, NotFoundError) as exc:
                log.warning("checkpoint_unusable key=%s reason=%s", key, exc)
        return None

    def _restore_adam(self, tensors: dict[str, torch.Tensor], adam_steps: dict[str, float]) -> None:
        for name, param in self.model.named_parameters():
            if name not in adam_steps:
                continue
            moments = []
            for prefix in (CKPT_EXP_AVG, CKPT_EXP_AVG_SQ):
                t = tensors[prefix + name].to(self.device) if self.rank == 0 else torch.empty_like(param, dtype=torch.float32)
                if self.world > 1:
                    import torch.distributed as dist

                    dist.broadcast(t, src=0)
                moments.append(t.to(param.dtype))
            self.optimizer.state[param] = {"step": torch.tensor(float(adam_steps[name])),
                                           "exp_avg": moments[0], "exp_avg_sq": moments[1]}

    # --- the step --------------------------------------------------------------------------------

    def _sync_control(self, adoptions: dict) -> tuple[dict, bool]:
        """Rank 0 tells every rank which fragments to adopt this step and whether to stop."""
        stop = self.stop_reason is not None
        if self.world == 1:
            return adoptions, stop
        import torch.distributed as dist

        P = self.spec.plan.num_fragments
        ctrl = torch.full((P + 1,), -1, dtype=torch.int64)
        if self.rank == 0:
            for p, (v, _, _) in adoptions.items():
                ctrl[p] = v
            ctrl[P] = int(stop)
        dist.broadcast(ctrl, src=0)
        stop = bool(ctrl[P].item())
        out = {}
        for p in range(P):
            if ctrl[p] < 0:
                continue
            names = self.spec.plan.fragments[p]
            if self.rank == 0:
                tensors = adoptions[p][1]
            else:
                tensors = {n: torch.empty(self.spec.plan.shapes[n], dtype=torch.float32) for n in names}
            for n in names:
                dist.broadcast(tensors[n], src=0)
            out[p] = (int(ctrl[p]), tensors, adoptions[p][2] if self.rank == 0 else VectorClock())
        return out, stop

    def adopt(self, adoptions: dict) -> None:
        if adoptions:
            self.metrics.globals_adopted_total.inc(len(adoptions))
        for p, (version, tensors, clock) in adoptions.items():
            self.modelmod.set_tensors(self.model, {n: t.to(self.device) for n, t in tensors.items()}, alpha=self.cfg.alpha)
            if self.rank == 0:
                self.base[p] = tensors
                self.base_version[p] = version
                self.clock = self.clock.merge(clock)
            self.c_steps[p] = 0
            self.c_tokens[p] = 0
            self.last_sent_step[p] = self.step

    def lr_at(self, step: int) -> float:
        return lr_schedule(step, self.cfg.lr, self.cfg.warmup_steps, self.cfg.max_steps)

    def train_step(self) -> float:
        x, y, num_tokens = self.reader.next_batch()
        x, y = x.to(self.device), y.to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        net = self.ddp or self.model
        _, loss = net(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        step_tokens = num_tokens * self.world
        self.tokens_total += step_tokens
        for p in range(len(self.c_steps)):
            self.c_steps[p] += 1
            self.c_tokens[p] += step_tokens
        return float(loss.detach())

    def send(self, p: int, step_s: float) -> None:
        if self.c_steps[p] < 1 or self.last_sent_step[p] == self.step:
            return
        names = self.spec.plan.fragments[p]
        local = self.modelmod.get_tensors(self.model, names)
        pseudo_grad = {n: self.base[p][n] - local[n] for n in names}
        self.uploader.submit(Outgoing(p, pseudo_grad, self.base_version[p], self.c_steps[p], self.c_tokens[p],
                                      self.step, step_s, self.clock))
        self.last_sent_step[p] = self.step

    # --- the loop --------------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            log.info("learner_stop_requested learner=%s reason=%s step=%d", self.learner_id, reason, self.step)

    def run(self) -> dict[str, Any]:
        self.start_clock()
        while self.step_once():
            pass
        return self.finish()

    def start_clock(self) -> None:
        self.started = time.monotonic()
        self.step_ema: float | None = None
        self.loss_ema: float | None = None
        self._last_hb = 0.0
        self._hb_token: str | None = None
        self._hb_stop = threading.Event()
        self.train_s: float | None = None  # set when the learner stops stepping
        if self.rank == 0 and not self.inline_io:
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()

    def step_once(self, step_s: float | None = None) -> bool:
        """One inner step with its adoptions and sends; False once the learner should stop.

        ``step_s`` overrides the measured step time (in-process harnesses run on simulated time).
        """
        if self.step >= self.cfg.max_steps:
            self.request_stop("max_steps")
        if self.cfg.max_time_s and time.monotonic() - self.started > self.cfg.max_time_s:
            self.request_stop("max_time")
        adoptions = self.poller.take() if self.rank == 0 else {}
        adoptions, stop = self._sync_control(adoptions)
        self.adopt(adoptions)
        if stop:
            return False
        t0 = time.perf_counter()
        loss = self.train_step()
        if self.cfg.slow_step_s:
            time.sleep(self.cfg.slow_step_s)
        dt = time.perf_counter() - t0 if step_s is None else step_s
        self.step_ema = dt if self.step_ema is None else 0.9 * self.step_ema + 0.1 * dt
        self._observe_step(dt, loss)
        self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
        if self.rank == 0:
            for p in self.schedule.due(self.step) if self.cfg.sync_enabled else ():
                self.send(p, self.step_ema)
            if self.step % self.cfg.log_every == 0:
                self.history.append({"step": self.step, "tokens": self.tokens_total, "loss": self.loss_ema,
                                     "time": time.time()})
                log.info("learner_step learner=%s step=%d loss=%.4f tok_s=%.0f versions=%d queue=%d",
                         self.learner_id, self.step, self.loss_ema,
                         self.tokens_total / max(1e-9, time.monotonic() - self.started),
                         sum(self.base_version), self.uploader.depth())
            if self.inline_io and time.monotonic() - self._last_hb > self.cfg.heartbeat_s:
                self._last_hb = time.monotonic()
                self._heartbeat(self.step_ema)
        return True

    def _heartbeat_loop(self) -> None:
        """Heartbeats from their own thread: a slow link or a storage retry never delays a step."""
        while not self._hb_stop.wait(self.cfg.heartbeat_s):
            self._heartbeat(self.step_ema)

    def _observe_step(self, dt: float, loss: float) -> None:
        m = self.metrics
        m.step_seconds.observe(dt)
        m.steps_total.inc()
        m.tokens_total.set_total(self.tokens_total)
        m.loss.set(loss)
        m.tokens_per_second.set(self.tokens_total / max(1e-9, time.monotonic() - self.started))
        if self.rank == 0:
            m.upload_queue_depth.set(self.uploader.depth())
            for p, lag in list(self.poller.lag.items()):
                m.adoption_lag_versions.set(lag, fragment=str(p))

    def health(self) -> dict[str, Any]:
        return {"ok": self.stop_reason is None, "learner": self.learner_id, "step": self.step,
                "stop_reason": self.stop_reason}

    def finish(self) -> dict[str, Any]:
        """Flush a delta for every fragment with unsent work, drain the uploader, then checkpoint
        and deregister, within ``flush_deadline_s``. Deltas go first: they carry the work into the
        model; a checkpoint that cannot finish in time is simply not created (objects are
        create-only), and a restart then starts from the latest globals."""
        cursors = self._gather_cursors() if self.settings.agent.checkpoint else []
        if self.rank != 0:
            return {}
        self.train_s = time.monotonic() - self.started  # throughput excludes the exit path
        t0 = time.monotonic()
        for p in range(len(self.c_steps)) if self.cfg.sync_enabled else ():
            if self.step > self.last_sent_step[p]:
                self.send(p, 0.0)
        flushed = self.uploader.close(self.cfg.flush_deadline_s)
        checkpoint = None
        if self.settings.agent.checkpoint:
            try:
                checkpoint = self.write_checkpoint(cursors)
            except StorageError as exc:
                log.warning("checkpoint_failed error=%s", exc)
            if time.monotonic() - t0 > self.cfg.flush_deadline_s:
                log.warning("checkpoint_late learner=%s exit_s=%.1f deadline_s=%.1f: a slow link; consider "
                            "a longer flush deadline or agent.checkpoint=false", self.learner_id,
                            time.monotonic() - t0, self.cfg.flush_deadline_s)
        self._hb_stop.set()
        summary = self._status(None)
        summary.update({"reason": self.stop_reason, "flushed": flushed, "flush_s": time.monotonic() - t0,
                        "checkpoint": checkpoint, "resumed_from": self.resumed_from, "history": self.history})
        try:
            token = None
            try:
                _, token = self.store.read_token(layout.exit_key(self.learner_id))
            except NotFoundError:
                pass
            self.store.cas(layout.exit_key(self.learner_id),
                           json.dumps(sign_record(summary, self.signer), default=str).encode(), token)
            self._heartbeat(None, state="exited")
        except StorageError as exc:
            log.warning("exit_record_failed error=%s", exc)
        log.info("learner_exit learner=%s reason=%s steps=%d tokens=%d deltas_sent=%d flushed=%s",
                 self.learner_id, self.stop_reason, self.step, self.tokens_total,
                 self.uploader.counters["deltas_sent"], flushed)
        return summary

    def _status(self, step_s: float | None, state: str = "running") -> dict:
        elapsed = max(1e-9, self.train_s if self.train_s is not None else time.monotonic() - self.started)
        return {
            "learner": self.learner_id, "region": self.cfg.region, "state": state, "step": self.step,
            "tokens": self.tokens_total, "tokens_per_s": self.tokens_total / elapsed, "loss": self.loss_ema,
            "step_s": step_s, "versions": self.base_version, "time": time.time(), "host": socket.gethostname(),
            "pid": os.getpid(), "world_size": self.world, "uploads": dict(self.uploader.counters),
            "upload_queue": self.uploader.depth(), "poller": dict(self.poller.counters),
            "storage": self.store.stats.snapshot(),
        }

    def _heartbeat(self, step_s: float | None, state: str = "running") -> None:
        export_store_stats(self.registry, "learner", self.store.stats.snapshot())
        body = json.dumps(sign_record(self._status(step_s, state), self.signer), default=str).encode()
        key = layout.heartbeat_key(self.learner_id)
        try:
            self._hb_token = self.store.cas(key, body, self._hb_token)
        except StorageError:  # a stale token (e.g. an earlier incarnation wrote it): re-read, next beat wins
            try:
                _, self._hb_token = self.store.read_token(key)
            except StorageError:
                self._hb_token = None


def _learner_keys(security, learner_id: str):
    """(signer for this learner's objects, verifier of the syncer's, verifier of its own)."""
    if security.run_secret is None:
        if security.required():
            raise ConfigError("security.require_signatures is set but no security.run_secret: "
                              "set DDILOCO_SECURITY__RUN_SECRET on every learner and syncer")
        return None, None, None
    from ddiloco_geo.core import signing

    secret = security.run_secret.get_secret_value()
    signer = signing.signer_for(secret, "learner", learner_id)
    own_key, own_id = signing.derive_key(secret, "learner", learner_id), signing.key_id("learner", learner_id)
    return (signer, signing.syncer_verifier(signing.derive_key(secret, "syncer")),
            signing.Verifier(lambda kid: own_key if kid == own_id else None))


def lr_schedule(step: int, lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup, then cosine decay to a tenth of ``lr`` at ``max_steps``."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def default_learner_id() -> str:
    host = re.sub(r"[^a-z0-9-]", "-", socket.gethostname().lower())[:40].strip("-") or "host"
    return f"{host}-{os.getpid()}"


def _shard_index(shard: str) -> int:
    return int(shard.split("/")[0])


# --- command line --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--id", help="learner id (default: hostname-pid)")
    p.add_argument("--region", help="region label for status views")
    p.add_argument("--shard", help="data shard 'i/N'")
    p.add_argument("--max-steps", type=int, help="inner steps before exiting")


def run(args: argparse.Namespace) -> int:
    from ddiloco_geo.learner.preemption import PreemptionWatcher
    from ddiloco_geo.cli.settings import settings_from
    from ddiloco_geo.metrics import export_store_stats, serve_from_config
    from ddiloco_geo.storage import open_store

    settings, _ = settings_from(args, {
        "learner.id": args.id, "learner.region": args.region, "data.shard": args.shard,
        "learner.max_steps": args.max_steps,
    })
    rank, world = 0, 1
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        import torch.distributed as dist

        backend = "nccl" if settings.learner.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        if settings.learner.device.startswith("cuda"):
            settings.learner.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    store = open_store(settings.storage) if rank == 0 else None
    learner = Learner(settings, store, rank=rank, world=world)
    agent = settings.agent
    watcher = PreemptionWatcher(provider=agent.provider if rank == 0 else "none", metadata_url=agent.metadata_url,
                                poll_s=agent.poll_s, act_on_rebalance=agent.act_on_rebalance,
                                on_notice=lambda notice: learner.request_stop(notice.source))
    watcher.install_signal_handlers(sigint=True)
    watcher.start()
    server = serve_from_config(settings.metrics, learner.registry, learner.health) if rank == 0 else None
    try:
        learner.join()
        summary = learner.run()
    finally:
        watcher.stop()
        if server is not None:
            export_store_stats(learner.registry, "learner", store.stats.snapshot())
            server.stop()
    if args.json and rank == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "history"}, default=str))
    if store is not None:
        store.close()
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0
