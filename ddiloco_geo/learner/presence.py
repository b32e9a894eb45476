"""What a learner tells the bucket about itself: heartbeats and the exit record.

Rank 0 writes ``learners/<id>/heartbeat.json`` every ``heartbeat_s`` from its own thread (a slow
link or a storage retry never delays a step; the in-process harness calls :meth:`Presence.beat`
itself) and ``learners/<id>/exit.json`` once on a clean exit, both compare-and-swap and signed with
the learner's key in a signed run. A stale token (an earlier incarnation wrote the object) is
re-read and the next beat wins. Shutdown: :meth:`Presence.stop` stops and joins the thread.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from typing import Any, Callable

from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import NotFoundError, StorageError
from ddiloco_geo.core.signing import sign_record
from ddiloco_geo.metrics import export_store_stats
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)


class Presence:
    """Heartbeats and the exit record of one learner; ``status(state)`` builds the record body."""

    def __init__(self, store: Store, learner_id: str, *, status: Callable[[str], dict[str, Any]], signer: Any,
                 heartbeat_s: float, threaded: bool) -> None:
        self.store, self.learner_id, self.status, self.signer = store, learner_id, status, signer
        self.heartbeat_s = heartbeat_s
        self._token: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.beat()

    def beat(self, state: str = "running") -> None:
        body = json.dumps(sign_record(self.status(state), self.signer), default=str).encode()
        key = layout.heartbeat_key(self.learner_id)
        try:
            self._token = self.store.cas(key, body, self._token)
        except StorageError:  # a stale token (e.g. an earlier incarnation wrote it): re-read, next beat wins
            try:
                _, self._token = self.store.read_token(key)
            except StorageError:
                self._token = None

    def stop(self) -> None:
        """Stop and join the heartbeat thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s + 5)

    def exited(self, summary: dict[str, Any]) -> None:
        """The signed exit record, then a last heartbeat saying ``exited``."""
        try:
            token = None
            try:
                _, token = self.store.read_token(layout.exit_key(self.learner_id))
            except NotFoundError:
                pass
            self.store.cas(layout.exit_key(self.learner_id),
                           json.dumps(sign_record(summary, self.signer), default=str).encode(), token)
            self.beat(state="exited")
        except StorageError as exc:
            log.warning("exit_record_failed error=%s", exc)


def status_record(learner: Any, state: str = "running") -> dict[str, Any]:
    """The body of a learner's heartbeat and exit record (what ``status`` and ``local`` show)."""
    export_store_stats(learner.registry, "learner", learner.store.stats.snapshot())
    elapsed = max(1e-9, learner.train_s if learner.train_s is not None else time.monotonic() - learner.started)
    return {
        "learner": learner.learner_id, "region": learner.cfg.region, "state": state, "step": learner.step,
        "position": learner.position,  # on the lr schedule and toward max_steps (learner.schedule)
        "tokens": learner.tokens_total, "tokens_per_s": learner.tokens_total / elapsed, "loss": learner.loss_ema,
        "step_s": learner.step_ema if state == "running" else None, "versions": learner.base_version,
        "time": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "world_size": learner.world,
        "parallel": "fsdp" if learner.sharded else ("ddp" if learner.world > 1 else "none"),
        "uploads": dict(learner.uploader.counters), "upload_queue": learner.uploader.depth(),
        "poller": dict(learner.poller.counters),
        "send_timing": dict(learner.schedule.timing) if learner.schedule.timing else None,  # the aligned lead
        "fragment_steps": {"trained": learner.frag_steps_trained, "past_send": learner.frag_steps_past_send,
                           "discarded": learner.frag_steps_discarded},
        "sends_held": learner.sends_held,  # sends that waited for a base HOLD_LAG versions behind (loop)
        "storage": learner.store.stats.snapshot(),
    }


def default_learner_id() -> str:
    """``<hostname>-<pid>``, the hostname cut to what a learner id allows."""
    host = re.sub(r"[^a-z0-9-]", "-", socket.gethostname().lower())[:40].strip("-") or "host"
    return f"{host}-{os.getpid()}"
