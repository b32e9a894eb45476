"""The chaos run's process supervision: start, watch, signal and restart the job's processes as
the plan says, and record what happened.

Processes: one syncer (``syncer``), a second syncer for a while (``syncer-2``) and learners
``learner-0`` .. ``learner-{M-1}``, each ``python -m ddiloco_geo syncer|learner`` started through
:mod:`ddiloco_geo.tools.processes` with the run's settings file, the plan's per-process settings
as ``--set`` flags (storage faults, a straggler's ``learner.slow_step_s``, the WAN proxy of the
learner's region as its ``storage.endpoint_url``) and the testbed's environment. A restarted
learner keeps its ``--id``; the supervisor derives where it resumes (next delta sequence number,
newest checkpoint) as the learner itself does.

Every ``sample_s`` it reads each learner's heartbeat (``step``, ``time``, ``deltas_sent``; the
observations the report's downtime and stalls are computed from), notices syncers becoming ready
(their ``syncer_ready`` log line) and fires the plan's actions that are due. An action whose
trigger can no longer happen is skipped and recorded. When every learner has finished, pending
syncer restarts still happen, then every syncer is SIGTERMed and drains. A hard deadline
(``timed_out``) stops the loop; :meth:`Supervisor.stop_all` stops every process by its PID.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco_geo import protocol
from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import CodecError, NotFoundError, StorageError
from ddiloco_geo.storage import Store
from ddiloco_geo.tools import processes

log = logging.getLogger(__name__)

SYNCER_DRAIN_S = 180.0   # longest wait for a SIGTERMed syncer to merge what is pending and exit
STOP_ALL_S = 30.0        # SIGTERM (or SIGKILL after a timeout) -> SIGKILL for whatever still runs


@dataclass(eq=False)
class Proc:
    """One incarnation of a chaos target, and what was seen of it."""

    name: str                # log name, e.g. learner-1.0, syncer.1, syncer-2.0
    role: str                # learner | syncer
    target: str              # learner id, "syncer" or "syncer-2"
    incarnation: int
    child: processes.Child
    settings: dict[str, Any] = field(default_factory=dict)
    signal: str | None = None
    signalled_at: float | None = None
    ready_at: float | None = None       # syncer: its syncer_ready line
    first_seq: int = 0                  # learner: first delta seq this incarnation writes
    s0: int = 0                         # learner: step it resumes at
    resumed_checkpoint: str | None = None
    obs: list[tuple[float, int, int, float | None]] = field(default_factory=list)  # (hb time, step, sent, step_s)
    done_at: float | None = None        # learner: first heartbeat at the end of its schedule (position >= max_steps)
    last_hb: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.child.pid

    @property
    def started(self) -> float:
        return self.child.started

    @property
    def exit_time(self) -> float | None:
        return self.child.exit_time

    @property
    def returncode(self) -> int | None:
        return self.child.returncode

    @property
    def log_path(self) -> Path:
        return self.child.log_path

    def alive(self) -> bool:
        return self.child.is_running()


class Supervisor:
    """Runs the plan's processes against ``store`` until the learners finish or ``deadline``
    (``time.monotonic()``, ``timeout_s`` after the run started) passes. ``proxy_urls``: region ->
    the URL of its WAN proxy; ``t0``: when the run started (``time.time()``)."""

    def __init__(self, plan: dict[str, Any], *, store: Store, out: Path, env: dict[str, str],
                 proxy_urls: dict[str, str], sample_s: float, timeout_s: float, deadline: float, t0: float) -> None:
        self.plan = plan
        self.store = store
        self.out = out
        self.logs = out / "logs"
        self.env = env
        self.proxy_urls = proxy_urls
        self.sample_s = sample_s
        self.timeout_s = timeout_s
        self.t0 = t0
        self.deadline = deadline
        self.timed_out = False
        self.procs: list[Proc] = []
        self.events: list[dict[str, Any]] = []
        self.action_state: dict[str, dict[str, Any]] = {a["id"]: {"status": "pending"} for a in plan["actions"]}
        self.syncer_status: list[dict[str, Any]] = []

    def run(self) -> None:
        """Start the syncer and the learners, play the plan, drain the syncers; stop everything."""
        self._spawn("syncer", "syncer")
        for i in range(self.plan["learners"]):
            self._spawn("learner", f"learner-{i}")
        try:
            self._watch()
            self._finish_syncers()
        finally:
            self.stop_all()

    def stop_all(self) -> None:
        processes.stop_all([p.child for p in self.procs], STOP_ALL_S,
                           signal.SIGKILL if self.timed_out else signal.SIGTERM)

    # --- processes -------------------------------------------------------------------------------

    def _now(self) -> float:
        return time.time() - self.t0

    def _event(self, action: str, target: str, proc: Proc | None = None, plan_id: str | None = None, **detail: Any) -> None:
        ev = {"t": round(self._now(), 3), "action": action, "target": target}
        if proc is not None:
            ev.update(pid=proc.pid, process=proc.name)
        if plan_id:
            ev["plan_id"] = plan_id
        ev.update(detail)
        self.events.append(ev)
        log.info("chaos_event %s", json.dumps(ev, default=str))

    def _spawn(self, role: str, target: str, extra: dict[str, Any] | None = None, plan_id: str | None = None,
               restart: bool = False) -> Proc:
        incarnation = sum(1 for p in self.procs if p.target == target)
        name = f"{target}.{incarnation}"
        overrides: dict[str, Any] = {}
        args = [role]
        fault_key = target if role == "learner" else (target if incarnation == 0 or target == "syncer-2" else None)
        fault = self.plan["faults"].get(fault_key) if fault_key else None
        if fault:
            overrides["storage.fault_rate"] = fault["rate"]
            overrides["storage.fault_seed"] = fault["seed"]
        first_seq, s0, ckpt = 0, 0, None
        if role == "learner":
            i = int(target.rsplit("-", 1)[1])
            args += ["--id", target, "--shard", f"{i}/{self.plan['learners']}"]
            region = self.plan["placement"].get(target, "home")
            args += ["--region", region]
            if region in self.proxy_urls:
                overrides["storage.endpoint_url"] = self.proxy_urls[region]
            if incarnation:  # a fresh prefix: the first incarnation starts at seq 0, step 0
                first_seq, s0, ckpt = self._resume_point(target)
        overrides.update(extra or {})
        for k, v in overrides.items():
            args += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
        args += ["--config", str(self.out / "settings.json")]
        child = processes.start(name, args, log_path=self.logs / f"{name}.log", env=self.env, cwd=self.out)
        proc = Proc(name=name, role=role, target=target, incarnation=incarnation, child=child, settings=overrides,
                    first_seq=first_seq, s0=s0, resumed_checkpoint=ckpt)
        self.procs.append(proc)
        detail = {k: v for k, v in overrides.items() if k != "storage.endpoint_url"}
        if role == "learner":
            detail.update(region=self.plan["placement"].get(target, "home"), first_seq=first_seq, resume_step=s0)
        self._event("restart" if restart else "start", target, proc, plan_id, **detail)
        return proc

    def _resume_point(self, learner: str) -> tuple[int, int, str | None]:
        """(first delta seq, step, checkpoint) a (re)started learner resumes at, as the learner
        itself derives them: the next free sequence number and its newest decodable checkpoint."""
        first_seq = protocol.next_delta_seq(self.store, learner)
        for key in reversed(self.store.list(layout.checkpoints_dir(learner))):
            try:
                header = protocol.read_header(self.store, key)
                if header.kind == "checkpoint":
                    return first_seq, int(header.num_steps), key
            except (CodecError, NotFoundError):
                continue
        return first_seq, 0, None

    def _alive(self, target: str) -> Proc | None:
        for p in reversed(self.procs):
            if p.target == target and p.alive():
                return p
        return None

    def _latest(self, target: str) -> Proc | None:
        for p in reversed(self.procs):
            if p.target == target:
                return p
        return None

    def _signal(self, proc: Proc, sig: signal.Signals, plan_id: str | None = None) -> None:
        if not proc.alive():
            return
        step = proc.obs[-1][1] if proc.obs else None
        proc.signal, proc.signalled_at = sig.name, time.time()
        proc.child.send_signal(sig)
        self._event(sig.name.lower(), proc.target, proc, plan_id, step=step)

    # --- observation -----------------------------------------------------------------------------

    def _sample(self) -> None:
        for lid in (f"learner-{i}" for i in range(self.plan["learners"])):
            try:
                hb = json.loads(self.store.get(layout.heartbeat_key(lid)))
            except (NotFoundError, StorageError, ValueError):
                continue
            for p in self.procs:
                if p.target == lid and p.pid == hb.get("pid"):
                    p.last_hb = hb
                    if hb.get("state") == "running" and (not p.obs or hb["time"] > p.obs[-1][0]):
                        if p.done_at is None and int(hb.get("position", hb["step"])) >= self.plan["steps"]:
                            p.done_at = float(hb["time"])
                        p.obs.append((float(hb["time"]), int(hb["step"]),
                                      int(hb.get("uploads", {}).get("deltas_sent", 0)), hb.get("step_s")))
                    elif hb.get("state") == "exited":
                        p.last_hb = hb
        for p in self.procs:
            if p.role == "syncer" and p.ready_at is None and p.exit_time is None:
                try:
                    if "syncer_ready" in p.child.log_text():  # not an earlier run's line in the same file
                        p.ready_at = time.time()
                        self._event("ready", p.target, p)
                except OSError:
                    pass
        try:
            st = json.loads(self.store.get(layout.syncer_status_key(0, 1)))
            self.syncer_status.append({"time": st.get("time"), "storage": st.get("storage", {})})
        except (NotFoundError, StorageError, ValueError):
            pass

    def _step_of(self, target: str) -> int | None:
        p = self._alive(target)
        if p is None or not p.obs:
            return None
        return p.obs[-1][1]

    def _progress(self) -> None:
        parts = []
        for i in range(self.plan["learners"]):
            p = self._latest(f"learner-{i}")
            state = "up" if p and p.alive() else "down"
            parts.append(f"learner-{i}:{state}:step={p.obs[-1][1] if p and p.obs else '-'}")
        syncers = [p.name for p in self.procs if p.role == "syncer" and p.alive()]
        log.info("chaos_progress t=%.0fs %s syncers=%s", self._now(), " ".join(parts), ",".join(syncers) or "none")

    # --- the plan's actions ----------------------------------------------------------------------

    def _can_still_fire(self, action: dict[str, Any]) -> bool:
        when = action["when"]
        if self.action_state[action["id"]].get("triggered"):  # due, waiting for its target (a syncer serving)
            return True
        if "learner" in when:
            lid = when["learner"]
            return self._alive(lid) is not None or any(
                a["target"] == lid and a["action"] == "restart" and self.action_state[a["id"]]["status"] == "pending"
                for a in self.plan["actions"])
        dep = self.action_state[when["after"]]
        return dep["status"] != "skipped"

    def _due(self, action: dict[str, Any]) -> bool:
        when = action["when"]
        if "learner" in when:
            step = self._step_of(when["learner"])
            if step is not None and step >= when["step"]:
                self.action_state[action["id"]]["triggered"] = True
            return bool(self.action_state[action["id"]].get("triggered"))
        dep = self.action_state[when["after"]]
        if dep["status"] != "done":
            return False
        since = dep["time"]
        proc = dep.get("proc")
        if proc is not None and action["action"] in ("restart", "start"):
            if proc.exit_time is None:
                return False  # never two incarnations of one id at once
            since = max(since, proc.exit_time)
        elif proc is not None and proc.alive():  # a signal some time after a start: counted from serving
            ready = proc.ready_at if proc.role == "syncer" else (proc.obs[0][0] if proc.obs else None)
            if ready is None:
                return False
            since = max(since, ready)
        return time.time() >= since + when["delay_s"]

    def _fire(self, action: dict[str, Any], ending: bool = False) -> None:
        """Carry out a due action. A signal to a syncer waits until it serves, and for ``serving_s``
        more (its ``when``) unless the learners have finished (``ending``)."""
        st = self.action_state[action["id"]]
        target, kind = action["target"], action["action"]
        role = "syncer" if target.startswith("syncer") else "learner"
        if kind in ("sigkill", "sigterm"):
            proc = self._alive(target)
            if proc is None:
                st.update(status="skipped", reason="target not running")
                self._event("skipped", target, plan_id=action["id"], planned=kind, reason="target not running")
                return
            if kind == "sigterm" and role == "syncer" and proc.ready_at is None:
                return  # let it finish starting (its SIGTERM handler is installed after bootstrap)
            serving_s = action["when"].get("serving_s", 0.0)
            if role == "syncer" and not ending and time.time() < (proc.ready_at or 0.0) + serving_s:
                return  # let it serve beside the other syncer a while
            self._signal(proc, signal.SIGKILL if kind == "sigkill" else signal.SIGTERM, action["id"])
            st.update(status="done", time=time.time(), proc=proc)
        elif kind in ("restart", "start"):
            if self._alive(target) is not None:
                return
            proc = self._spawn(role, target, action.get("settings"), action["id"], restart=kind == "restart")
            st.update(status="done", time=time.time(), proc=proc)

    def _skip(self, action: dict[str, Any], reason: str) -> None:
        self.action_state[action["id"]].update(status="skipped", reason=reason)
        self._event("skipped", action["target"], plan_id=action["id"], planned=action["action"], reason=reason)

    def _pending(self) -> list[dict[str, Any]]:
        """Pending actions whose earlier actions on the same target are all settled."""
        out, blocked = [], set()
        for a in self.plan["actions"]:
            if self.action_state[a["id"]]["status"] != "pending":
                continue
            if a["target"] not in blocked:
                out.append(a)
            blocked.add(a["target"])
        return out

    def _play(self) -> None:
        """Fire the pending actions that are due; skip those whose trigger can no longer happen."""
        for action in self._pending():
            if not self._can_still_fire(action):
                self._skip(action, "trigger can no longer happen")
            elif self._due(action):
                self._fire(action)

    def _learners_done(self) -> bool:
        if any(p.role == "learner" and p.alive() for p in self.procs):
            return False
        return not any(a["target"].startswith("learner") and self.action_state[a["id"]]["status"] == "pending"
                       and self._can_still_fire(a) for a in self.plan["actions"])

    # --- the loop --------------------------------------------------------------------------------

    def _watch(self) -> None:
        last_progress = 0.0
        while True:
            self._sample()
            self._play()
            if self._learners_done():
                break
            if time.monotonic() > self.deadline:
                self.timed_out = True
                log.error("chaos_timeout after %.0fs: killing every process", self.timeout_s)
                return
            if time.monotonic() - last_progress > 5.0:
                last_progress = time.monotonic()
                self._progress()
            time.sleep(self.sample_s)

    def _finish_syncers(self) -> None:
        """Let pending syncer restarts and signals already due happen, make sure one syncer serves,
        then SIGTERM every syncer (each drains: merges everything pending) and wait for them."""
        while not self.timed_out:
            pending = [a for a in self._pending() if a["target"].startswith("syncer")]
            # restarts of what was stopped, and signals already due whose syncer is still starting
            waiting = [a for a in pending if self.action_state[a["id"]].get("triggered") or (
                a["action"] in ("restart", "start") and "after" in a["when"]
                and self.action_state[a["when"]["after"]]["status"] == "done")]
            for a in pending:
                if a not in waiting:
                    self._skip(a, "learners finished first")
            if not waiting:
                break
            for a in waiting:
                if self._due(a):
                    self._fire(a, ending=True)
            self._sample()
            time.sleep(self.sample_s)
            if time.monotonic() > self.deadline:
                self.timed_out = True
        if self.timed_out:
            return
        if self._alive("syncer") is None and self._alive("syncer-2") is None:
            self._spawn("syncer", "syncer", restart=True)
        while any(p.role == "syncer" and p.alive() and p.ready_at is None for p in self.procs):
            if time.monotonic() > self.deadline:
                self.timed_out = True
                return
            self._sample()
            time.sleep(self.sample_s)
        time.sleep(1.0)  # the SIGTERM handler is installed right after syncer_ready
        for p in self.procs:
            if p.role == "syncer" and p.alive():
                self._signal(p, signal.SIGTERM)
        for p in self.procs:
            if p.role == "syncer":
                try:
                    p.child.wait(max(1.0, min(SYNCER_DRAIN_S, self.deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    log.error("chaos_syncer_drain_timeout pid=%d", p.pid)
                    self.timed_out = True
                    return
