"""The learner: an inner AdamW loop that never waits on the network.

Decoupled DiLoCo (arXiv 2604.21428, "learner loop"). Each inner step:

1. adopt the global fragment versions the background poller (:mod:`~ddiloco_geo.learner.poller`)
   has downloaded (``learner.adopt``: keep the unsent local progress on top, or overwrite);
2. take one AdamW step on the learner's own data shard (under ``torchrun``: DDP or FSDP ranks,
   :mod:`~ddiloco_geo.learner.ranks`), counting steps and tokens per fragment;
3. for each fragment due (``learner.send_schedule``: every H steps, or timed to the merges), hand the progress
   ``base − local`` (or, with error feedback, the increment since the previous send) to the
   bounded background uploader (:mod:`~ddiloco_geo.learner.uploader`), which encodes and writes it.

Only rank 0 talks to storage. Nothing in the step waits for storage: polling, downloads, encoding,
uploads and heartbeats run in threads. On SIGTERM (or a preemption notice) the learner stops
stepping and :meth:`Learner.finish` shuts down in this order: flush a delta for every fragment
with unsent work, drain the uploader within ``flush_deadline_s``, write the checkpoint
(:mod:`~ddiloco_geo.learner.checkpoint`) and the signed exit record, stop and join the poller and
heartbeat threads. A killed learner loses only its unflushed work. The caller owns the store.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ddiloco_geo import codec, protocol
from ddiloco_geo.core import layout
from ddiloco_geo.core import model as modelmod
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.config import DataConfig, FragmentConfig, LearnerConfig, ModelConfig, RunConfig, SecurityConfig
from ddiloco_geo.core.errors import DdilocoError, StorageError
from ddiloco_geo.core.fragments import send_schedule
from ddiloco_geo.core.signing import learner_keys
from ddiloco_geo.learner import checkpoint as ckpt
from ddiloco_geo.learner import ranks
from ddiloco_geo.learner.data import make_reader
from ddiloco_geo.learner.poller import GlobalPoller
from ddiloco_geo.learner.presence import Presence, default_learner_id, status_record
from ddiloco_geo.learner.schedule import HOLD_LAG, HOLD_PERIODS, RunClock, joining_step, lr_schedule
from ddiloco_geo.learner.uploader import Outgoing, Uploader
from ddiloco_geo.metrics import Registry, learner_metrics
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)


class Learner:
    """One learner (one rank of it under torchrun). Takes the settings sections it uses."""

    def __init__(self, store: Store | None, *, learner: LearnerConfig, model: ModelConfig, data: DataConfig,
                 run: RunConfig, fragments: FragmentConfig, security: SecurityConfig, run_id: str,
                 max_staleness: int, rank: int = 0, world: int = 1, inline_io: bool = False) -> None:
        self.cfg = learner
        self.model_cfg, self.data_cfg, self.run_cfg, self.fragments_cfg = model, data, run, fragments
        self.run_id, self.max_staleness = run_id, max_staleness
        self.store, self.rank, self.world, self.inline_io = store, rank, world, inline_io
        self.learner_id = self.cfg.id or default_learner_id()
        layout.check_id(self.learner_id, "learner id")
        self.signer, self.global_verifier, self.own_verifier = learner_keys(security, self.learner_id)
        self.require_signatures = security.required()
        self.device = torch.device(self.cfg.device)
        shard, num_shards = (int(x) for x in data.shard.split("/"))
        torch.manual_seed(model.seed + 1000 * shard + rank)
        self.model = modelmod.build_model(model).to(self.device)
        self.reader = make_reader(
            data, slice_index=shard * world + rank, num_slices=num_shards * world, block_size=model.block_size,
            batch_size=self.cfg.batch_size, seed=model.seed + shard, vocab_size=modelmod.vocab_size(self.model),
        )
        self.spec: protocol.RunSpec | None = None
        self.stop_reason, self.history = None, []  # history: {step, tokens, loss, time} every log_every steps
        self.step = self.position = self.tokens_total = 0  # position: on the lr schedule (learner.schedule)
        self.registry = Registry()
        self.metrics = learner_metrics(self.registry)
        self.closed = False

    @classmethod
    def from_settings(cls, settings, store: Store | None, **kwargs: Any) -> "Learner":
        return cls(store, learner=settings.learner, model=settings.model, data=settings.data, run=settings.run,
                   fragments=settings.fragments, security=settings.security, run_id=settings.run_id,
                   max_staleness=settings.syncer.max_staleness, **kwargs)

    # --- joining ---------------------------------------------------------------------------------

    def join(self) -> None:
        """The only wait: for the run spec and a first version of every fragment."""
        local_spec, _ = protocol.spec_from(run_id=self.run_id, model=self.model_cfg, fragments=self.fragments_cfg,
                                           run=self.run_cfg, net=self.model)  # its names and shapes: no second build
        index: dict[int, int] = {}
        if self.rank == 0:
            spec = protocol.wait_for_spec(self.store, self.cfg.join_timeout_s)
            if spec.plan.digest() != local_spec.plan.digest():
                raise DdilocoError(
                    f"run {spec.run_id} uses fragment plan {spec.plan.digest()[:12]} (model {spec.model}) "
                    f"but this learner's model gives {local_spec.plan.digest()[:12]}: start it with the run's model settings"
                )
            spec.check_settings(self.run_cfg)
            self.spec = spec
            index = self._wait_for_globals(spec)
        else:
            self.spec = local_spec
        P = self.spec.plan.num_fragments
        self.base: dict[int, dict[str, torch.Tensor]] = {}
        self.base_version, self.clock = [0] * P, VectorClock()
        headers = []
        if self.rank == 0:
            for p in range(P):
                header, tensors = self._read_global(p, index[p])
                headers.append(header)
                modelmod.set_tensors(self.model, {n: t.to(self.device) for n, t in tensors.items()})
                self.base[p] = tensors
                self.base_version[p] = index[p]
                self.clock = self.clock.merge(header.clock)
        ranks.broadcast_model(self.model, self.world)
        self.sharded = ranks.shard_model(self.model, self.cfg.parallel, self.world)
        self.schedule = send_schedule(self.cfg.send_schedule, P, self.spec.sync_every, self.spec.overlap)
        self.run_clock = RunClock(self.learner_id, self.spec.sync_every, self.cfg.max_steps)
        self.c_steps, self.c_tokens, self.last_sent_step = [0] * P, [0] * P, [0] * P
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr,
                                           betas=(0.9, 0.95), weight_decay=self.cfg.weight_decay)
        self.resumed_from = self._resume(index)
        newest = protocol.newest_delta(self.store, self.learner_id, self.own_verifier, read_header=True) \
            if headers and self.cfg.schedule == "run" else None
        progress, run_step = ranks.broadcast_object([min(joining_step(headers, self.learner_id, s, newest and newest[1]),
                                                         self.cfg.max_steps) for s in ("own", self.cfg.schedule)], self.world)
        if (self.cfg.follow_run or self.cfg.schedule == "run") and run_step > self.step:
            log.info("learner_follows_run learner=%s step=%d run_step=%d", self.learner_id, self.step, run_step)
            self.step = run_step
        self.fresh_from = self.step if self.resumed_from is None and progress >= self.cfg.warmup_steps > 0 else None
        # per fragment: the tensors and counters at the last send (or adoption); at join all is accounted for
        self.keep_progress = self.cfg.adopt == "keep_progress"
        self.increments = self.cfg.error_feedback == "on" or (self.cfg.error_feedback == "auto" and self.spec.codec == "topk")
        self.ref: dict[int, dict[str, torch.Tensor]] = {}
        if self.keep_progress or self.increments:
            self.ref = {p: modelmod.get_tensors(self.model, self.spec.plan.fragments[p]) for p in range(P)}
        self.c_ref_steps, self.c_ref_tokens = list(self.c_steps), list(self.c_tokens)
        # fragment-steps (one per fragment per step): trained; past a send at adoption; of those, overwritten
        self.frag_steps_trained = self.frag_steps_past_send = self.frag_steps_discarded = self.sends_held = 0
        self.net = ranks.training_module(self.model, replicate=self.world > 1 and not self.sharded,
                                         compile=self.cfg.compile)
        if self.rank == 0:
            self.uploader = Uploader(self.store, self.spec, self.learner_id, maxsize=self.cfg.upload_queue,
                                     codec_name=self.spec.codec, **self.spec.codec_args(self.spec.codec), signer=self.signer,
                                     first_seq=protocol.next_delta_seq(self.store, self.learner_id, self.own_verifier),
                                     inline=self.inline_io, metrics=self.metrics, residual_decay=self.cfg.residual_decay)
            self.uploader.load_residuals(self.resumed_residual)
            self.poller = GlobalPoller(self.store, self.spec, self.cfg.poll_s, dict(enumerate(self.base_version)), dict(self.base),
                                       inline=self.inline_io or not self.cfg.sync_enabled, verify=self.global_verifier,
                                       require_signature=self.require_signatures, me=self.learner_id)
            for header in headers:  # the run's steps as of the globals it joined at (learner.schedule=run)
                self.poller.observe(header.extra)
        log.info("learner_joined learner=%s run=%s fragments=%d versions=%s world=%d", self.learner_id,
                 self.spec.run_id, P, self.base_version, self.world)

    def _wait_for_globals(self, spec: protocol.RunSpec) -> dict[int, int]:
        deadline = time.monotonic() + self.cfg.join_timeout_s
        while True:
            index, _ = protocol.read_index(self.store, self.global_verifier)
            if all(p in index for p in range(spec.plan.num_fragments)):
                return index
            if time.monotonic() > deadline:
                raise DdilocoError(f"run {spec.run_id} has no global version for every fragment yet: is a syncer running?")
            time.sleep(0.5)

    def _read_global(self, p: int, version: int):
        return protocol.read_global(self.store, self.spec, p, version, verify=self.global_verifier,
                                    require_signature=self.require_signatures)

    # --- checkpoints ----------------------------------------------------------------------------

    def write_checkpoint(self, cursors: list[dict], flushed: bool = False) -> str | None:
        """Local parameters, AdamW moments, counters, data cursors, clock, ``flushed`` (rank 0, create-only)."""
        tensors, adam_steps = self._checkpoint_state()
        tensors.update(ckpt.residual_tensors(self.uploader.residuals()))
        header = codec.Header(
            kind="checkpoint", run_id=self.spec.run_id, learner=self.learner_id, seq=self.uploader.next_seq,
            clock=self.clock, num_steps=self.step, num_tokens=self.tokens_total,
            extra={"base_version": self.base_version, "c_steps": self.c_steps, "c_tokens": self.c_tokens,
                   "last_sent_step": self.last_sent_step, "cursors": cursors, "adam_steps": adam_steps,
                   "world": self.world, "plan_digest": self.spec.plan.digest(), "reason": self.stop_reason,
                   "flushed": flushed},
        )
        return ckpt.write_checkpoint(self.store, self.learner_id, tensors, header, signer=self.signer)

    def _checkpoint_state(self):
        """(tensors, AdamW steps) of a checkpoint; a collective when the model is sharded."""
        names = [n for n, _ in self.model.named_parameters()]
        return ckpt.checkpoint_tensors(modelmod.get_tensors(self.model, names), self.model, self.optimizer)

    def _resume(self, index: dict[int, int]) -> str | None:
        """Continue from this learner's newest checkpoint: data cursors, step count and AdamW moments
        always; clock and top-k residuals within the syncer's staleness bound; parameters and counters
        only if also its exit flush did not finish (after a flushed exit the bucket holds every step,
        and old parameters sent that work again as a pull back toward an old model: docs/design.md)."""
        found, self.resumed_residual = None, {}
        if self.rank == 0:
            found = ckpt.latest_checkpoint(self.store, self.learner_id, self.spec.run_id, verifier=self.own_verifier,
                                           require_signature=self.require_signatures)
        plan = None
        if found is not None:
            key, header, _ = found
            ex = header.extra
            usable = ex.get("plan_digest") == self.spec.plan.digest() and ex.get("world") == self.world
            compatible = usable and all(int(ex["base_version"][p]) >= index[p] - self.max_staleness for p in index)
            if not usable:
                log.warning("checkpoint_ignored key=%s reason=plan_or_world_changed", key)
            else:
                plan = {"key": key, "compatible": compatible, "params": compatible and ex.get("flushed") is not True,
                        "step": header.num_steps, "tokens": header.num_tokens, **{k: ex[k] for k in
                        ("cursors", "c_steps", "c_tokens", "last_sent_step", "adam_steps", "base_version")}}
        info = ranks.broadcast_object(plan, self.world)
        if info is None:
            return None
        self.reader.load_state_dict(info["cursors"][self.rank])
        self.step, self.tokens_total = int(info["step"]), int(info["tokens"])
        tensors = found[2] if found is not None else {}
        if info["compatible"] and self.rank == 0:
            self.clock = self.clock.merge(found[1].clock)
            self.resumed_residual = ckpt.residuals_of(found[2], self.spec.plan)
        if info["params"]:
            if self.rank == 0:
                for p, v in enumerate(info["base_version"]):
                    if int(v) != self.base_version[p]:
                        self.base[p] = self._read_global(p, int(v))[1]
                        self.base_version[p] = int(v)
            ranks.load_params(self.model, ckpt.params_of(tensors) if self.rank == 0 else None, self.world)
            self.c_steps = [int(x) for x in info["c_steps"]]
            self.c_tokens = [int(x) for x in info["c_tokens"]]
            self.last_sent_step = [int(x) for x in info["last_sent_step"]]
        ckpt.restore_adam(self.optimizer, self.model, tensors, info["adam_steps"], rank=self.rank, world=self.world,
                          device=self.device)
        log.info("learner_resumed learner=%s checkpoint=%s step=%d params=%s", self.learner_id, info["key"],
                 self.step, "checkpoint" if info["params"] else "latest globals")
        return info["key"]

    # --- the step --------------------------------------------------------------------------------

    def adopt(self, adoptions: dict) -> None:
        """Adopt new global versions (``learner.adopt``): overwrite the fragment, losing the work since its
        last send, or keep the unsent part of it on top of the new global (``keep_progress``)."""
        if adoptions:
            self.metrics.globals_adopted_total.inc(len(adoptions))
        for p, (version, tensors, clock, mine) in adoptions.items():
            self.schedule.adopted(p, self.step, mine)
            unsent_steps, unsent_tokens = self.c_steps[p] - self.c_ref_steps[p], self.c_tokens[p] - self.c_ref_tokens[p]
            self.frag_steps_past_send += unsent_steps  # trained past the send: out of step with this merge
            if self.keep_progress:
                local = modelmod.get_tensors(self.model, tensors.keys())
                target = {n: t + (local[n] - self.ref[p][n]) for n, t in tensors.items()}
                modelmod.set_tensors(self.model, {n: t.to(self.device) for n, t in target.items()}, alpha=self.cfg.alpha)
                self.ref[p] = tensors
                self.c_steps[p], self.c_tokens[p] = unsent_steps, unsent_tokens
            else:
                modelmod.set_tensors(self.model, {n: t.to(self.device) for n, t in tensors.items()}, alpha=self.cfg.alpha)
                self.frag_steps_discarded += unsent_steps
                self.c_steps[p] = self.c_tokens[p] = 0
                self.last_sent_step[p] = self.step
                if self.increments:
                    self.ref[p] = tensors
            self.c_ref_steps[p] = self.c_ref_tokens[p] = 0
            if self.rank == 0:
                self.base[p] = tensors
                self.base_version[p] = version
                self.clock = self.clock.merge(clock)

    def lr_at(self, step: int) -> float:
        # a fresh AdamW joining a run past its warm-up warms up again (its first steps move every weight by about lr)
        ramp = 1.0 if self.fresh_from is None else min(1.0, (self.step - self.fresh_from + 1) / self.cfg.warmup_steps)
        return ramp * lr_schedule(step, self.cfg.lr, self.cfg.warmup_steps, self.cfg.max_steps)

    def train_step(self) -> float:
        x, y, num_tokens = self.reader.next_batch()
        x, y = x.to(self.device), y.to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.position)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16"):
            _, loss = self.net(x, y)
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
        self.frag_steps_trained += len(self.c_steps)
        return float(loss.detach())

    def send(self, p: int, step_s: float) -> None:
        """Rank 0 uploads; every rank records the send (keep_progress needs the same ref everywhere)."""
        if self.c_steps[p] < 1 or self.last_sent_step[p] == self.step:
            return
        names = self.spec.plan.fragments[p]; local = modelmod.get_tensors(self.model, names)
        if self.rank == 0:  # since the base (cumulative), or since the previous send (increments)
            since, c0, t0 = (self.ref[p], self.c_ref_steps[p], self.c_ref_tokens[p]) if self.increments else (self.base[p], 0, 0)
            self.uploader.submit(Outgoing(p, {n: since[n] - local[n] for n in names}, self.base_version[p], self.c_steps[p] - c0,
                                          self.c_tokens[p] - t0, self.step, step_s, self.clock, self.increments,
                                          first_on_base=not self.increments and self.c_ref_steps[p] == 0,  # no send on this base yet
                                          final=self.stop_reason == "max_steps"))  # the exit flush at the schedule's end
        self.last_sent_step[p] = self.step
        if self.keep_progress or self.increments:
            self.ref[p] = local
        self.c_ref_steps[p], self.c_ref_tokens[p] = self.c_steps[p], self.c_tokens[p]

    def discarded_ratio(self) -> float:
        """Share of trained fragment-steps thrown away by overwriting adoptions."""
        return self.frag_steps_discarded / max(1, self.frag_steps_trained)

    # --- the loop --------------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            log.info("learner_stop_requested learner=%s reason=%s step=%d", self.learner_id, reason, self.step)

    def run(self) -> dict[str, Any]:
        self.start_clock()
        while self.step_once():
            continue
        return self.finish()

    def start_clock(self) -> None:
        self.started = time.monotonic()
        self.step_ema: float | None = None
        self.loss_ema: float | None = None
        self._last_hb = 0.0
        self.train_s: float | None = None  # set when the learner stops stepping
        if self.rank == 0:
            self.presence = Presence(self.store, self.learner_id, status=lambda state: status_record(self, state),
                                     signer=self.signer, heartbeat_s=self.cfg.heartbeat_s, threaded=not self.inline_io)

    def step_once(self, step_s: float | None = None) -> bool:
        """One inner step with its adoptions and sends; False once the learner should stop. ``step_s``
        overrides the measured step time (in-process harnesses run on simulated time)."""
        if self.cfg.max_time_s and time.monotonic() - self.started > self.cfg.max_time_s:
            self.request_stop("max_time")
        adoptions = self.poller.take() if self.rank == 0 else {}
        position = self.step if self.cfg.schedule == "own" or self.rank != 0 else \
            self.run_clock.position(self.step, self.poller.run_steps())
        hold = self._stale_bases(adoptions) if self.rank == 0 and self.keep_progress else set()
        adoptions, stop, self.position, hold = ranks.sync_control(adoptions, self.stop_reason is not None, position,
                                                                  self.rank, self.world, self.spec.plan, hold)
        if self.position >= self.cfg.max_steps:  # (the run's budget, with learner.schedule=run)
            self.request_stop("max_steps")
            stop = True
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
        for p in self.schedule.due(self.step) if self.cfg.sync_enabled else ():
            held = p in hold and self.c_steps[p] - self.c_ref_steps[p] < HOLD_PERIODS * self.spec.sync_every
            self.sends_held += held  # a held send waits for the adoption, its work kept on top (keep_progress)
            if not held:
                self.send(p, self.step_ema)
        if self.rank == 0:
            if self.step % self.cfg.log_every == 0:
                self.history.append({"step": self.step, "tokens": self.tokens_total, "loss": self.loss_ema,
                                     "time": time.time()})
                log.info("learner_step learner=%s step=%d position=%d loss=%.4f tok_s=%.0f versions=%d queue=%d",
                         self.learner_id, self.step, self.position, self.loss_ema,
                         self.tokens_total / max(1e-9, time.monotonic() - self.started),
                         sum(self.base_version), self.uploader.depth())
            if self.inline_io and time.monotonic() - self._last_hb > self.cfg.heartbeat_s:
                self._last_hb = time.monotonic()
                self.presence.beat()
        return True

    def _stale_bases(self, adoptions: dict) -> set[int]:
        """Fragments whose base after this step's adoptions is HOLD_LAG versions behind the index's (schedule)."""
        return {p for p, v in self.poller.announced().items()
                if v - adoptions.get(p, (self.base_version[p],))[0] >= HOLD_LAG}

    def _observe_step(self, dt: float, loss: float) -> None:
        m = self.metrics
        m.step_seconds.observe(dt)
        m.steps_total.inc()
        m.tokens_total.set_total(self.tokens_total)
        m.loss.set(loss)
        m.tokens_per_second.set(self.tokens_total / max(1e-9, time.monotonic() - self.started))
        if self.rank == 0:
            m.upload_queue_depth.set(self.uploader.depth())
            for p, lag in self.poller.lag().items():
                m.adoption_lag_versions.set(lag, fragment=str(p))

    def health(self) -> dict[str, Any]:
        return {"ok": self.stop_reason is None, "learner": self.learner_id, "step": self.step,
                "stop_reason": self.stop_reason}

    # --- shutdown --------------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """Shut down in order within ``flush_deadline_s``: flush a delta for every fragment with unsent
        work, drain the uploader (deltas carry the work into the model), checkpoint (not created if it
        cannot finish: a restart then takes the latest globals), deregister; join the threads. Idempotent."""
        if self.closed:
            return {}
        self.closed = True
        cursors = ranks.gather_objects(self.reader.state_dict(), self.world) if self.cfg.checkpoint_on_exit else []
        if self.rank != 0:
            if self.sharded:  # rank 0's final sends and checkpoint gather whole tensors: take part
                self._flush_sends()
                if self.cfg.checkpoint_on_exit:
                    self._checkpoint_state()
            return {}
        self.train_s = time.monotonic() - self.started  # throughput excludes the exit path
        t0 = time.monotonic()
        try:
            self._flush_sends()
            flushed = self.uploader.close(self.cfg.flush_deadline_s)
            self.poller.stop()
            checkpoint = self._exit_checkpoint(cursors, t0, flushed)
        finally:
            self.presence.stop()
        summary = status_record(self, "exited")
        summary.update({"reason": self.stop_reason, "flushed": flushed, "flush_s": time.monotonic() - t0,
                        "checkpoint": checkpoint, "resumed_from": self.resumed_from, "history": self.history})
        self.presence.exited(summary)
        log.info("learner_exit learner=%s reason=%s steps=%d tokens=%d deltas_sent=%d flushed=%s",
                 self.learner_id, self.stop_reason, self.step, self.tokens_total,
                 self.uploader.counters["deltas_sent"], flushed)
        return summary

    def _flush_sends(self) -> None:
        for p in range(len(self.c_steps)) if self.cfg.sync_enabled else ():
            if self.step > self.last_sent_step[p]:
                self.send(p, 0.0)

    def _exit_checkpoint(self, cursors: list[dict], t0: float, flushed: bool) -> str | None:
        if not self.cfg.checkpoint_on_exit:
            return None
        checkpoint = None
        try:
            checkpoint = self.write_checkpoint(cursors, flushed)
        except StorageError as exc:
            log.warning("checkpoint_failed error=%s", exc)
        if time.monotonic() - t0 > self.cfg.flush_deadline_s:
            log.warning("checkpoint_late learner=%s exit_s=%.1f deadline_s=%.1f: a slow link; consider a longer flush "
                        "deadline or learner.checkpoint_on_exit=false", self.learner_id, time.monotonic() - t0, self.cfg.flush_deadline_s)
        return checkpoint
