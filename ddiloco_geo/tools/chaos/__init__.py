"""``ddiloco-geo chaos``: a seeded chaos run on real processes and a real S3 server.

A real job (one syncer and M learners as OS processes, as ``ddiloco-geo local`` runs them) against a
real S3 server (moto on 127.0.0.1, started here unless ``--set storage.endpoint_url=...`` points at
one, e.g. LocalStack), while a schedule that is a pure function of ``--seed`` (``random.Random``)

* SIGKILLs and SIGTERMs learners and restarts them with the same ``--id`` (a SIGTERMed learner
  flushes, checkpoints and resumes; a SIGKILLed one loses its unflushed work), restarting one of
  them as a straggler (``learner.slow_step_s``);
* SIGKILLs the syncer and restarts it, and runs a second syncer for a while (the create-only
  global write decides every race);
* injects storage faults into some processes (``storage.fault_rate``/``fault_seed``: SlowDown,
  timeouts, lost responses, torn uploads, under each process's retry layer);
* puts the WAN emulator (one :class:`~ddiloco_geo.tools.wanproxy.WanProxyThread` per "region": one-way
  delay plus a shared bandwidth cap) between some learners and the bucket.

Triggers are learner steps (``{"learner": id, "step": s}``: the target's current incarnation has
reached step s) or offsets after an earlier action (``{"after": action_id, "delay_s": d}``,
counted from that action, or from the exit of the process it signalled), so the plan is the same
for a seed on any machine; only the times it executes at differ. The harness samples every
learner's heartbeat (``step``, ``time``, ``deltas_sent``) every ``--sample-s``; when every learner
has finished its ``learner.max_steps`` it SIGTERMs the syncer(s) so they drain, then reads the
bucket and reports (definitions in ``docs/chaos.md``):

``downtime_s``   time during which at least one learner had joined and not yet stopped, yet no
                 learner was stepping (a learner steps between two of its heartbeats whose step
                 advanced); plus ``stalls``: stretches longer than three fragment periods
                 (H x median step time) with no version published while a syncer was serving and
                 a delivered delta was waiting.
``goodput``      share of learner steps whose work reached a merged delta: per learner incarnation
                 and fragment, the steps up to the highest step covered by a merged delta, over
                 P x steps taken.
``deltas_*``     the ledger: written = merged (incl. superseded) + rejected; unaccounted must be 0.
``loss_ratio``   final eval loss of the global model / that of a fault-free run with the same
                 settings (M, steps, model and data seed) run by the same command (``--no-baseline``
                 skips it).
``recovery_s``   ``notice_to_exit`` (SIGTERM -> exit, learners), ``restart_to_first_merge``
                 (restart -> ``published_at`` of the first merge record holding a delta of the new
                 incarnation), and more.

A hard overall ``--timeout`` kills everything by PID. Every process started is stopped by its PID
(learners, syncers, and the moto server if the harness started it). Progress goes to stderr; the
report is written to ``--out``/chaos.json and, with ``--json``, printed on stdout.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# What a short run uses unless the command line, the environment or a settings file says otherwise.
CHAOS_DEFAULTS: dict[str, Any] = {
    "model.name": "nano",
    "data.max_bytes": 400_000,
    "fragments.num_fragments": 8,
    "fragments.sync_every": 8,
    "learner.heartbeat_s": 1.0,  # a heartbeat is a blocking write in the learner's step loop: not too often
    "learner.log_every": 10,
    "storage.retry_initial_s": 0.05,
    "storage.retry_max_s": 1.0,
}
SHORT = {"learners": 3, "steps": 120, "rounds": 1, "timeout": 900.0}
LONG = {"learners": 4, "steps": 400, "rounds": 3, "timeout": 3600.0}
LOSS_GOAL = 1.03          # chaos final loss within 3 % of the fault-free baseline
STALL_PERIODS = 3.0       # a stall: longer than this many fragment periods without a publish
DEFAULT_BUCKET_REGION = "us-east-1"
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


# --- the schedule (a pure function of the seed) --------------------------------------------------


def plan_schedule(seed: int, learners: int = 3, steps: int = 120, rounds: int = 1) -> dict[str, Any]:
    """The chaos schedule for ``seed``: regions, fault injection and an ordered list of actions.

    Learner ``learner-0`` .. ``learner-{M-1}``; one of them (``reference``) is never killed, and the
    syncer events are triggered by its steps. Each round picks two other learners: one is SIGKILLed
    and restarted, the other SIGTERMed and restarted as a straggler. Every round also kills and
    restarts the syncer and runs a second syncer for 10-20 s. Steps are spread over the first ~70 %
    of the run so every restarted learner has work left to deliver.
    """
    if learners < 3:
        from ddiloco_geo.core.errors import ConfigError

        raise ConfigError(f"chaos needs at least 3 learners (got {learners}): one reference learner and two victims")
    if steps < 20 * rounds:
        from ddiloco_geo.core.errors import ConfigError

        raise ConfigError(f"chaos needs at least 20 steps per round (got --steps {steps} for {rounds} round(s))")
    rng = random.Random(seed)
    ids = [f"learner-{i}" for i in range(learners)]
    order = list(ids)
    rng.shuffle(order)
    reference, others = order[0], order[1:]

    regions = {
        "region-a": {"delay_s": round(rng.uniform(0.01, 0.03), 3), "rate_bps": rng.choice([50e6, 100e6])},
        "region-b": {"delay_s": round(rng.uniform(0.04, 0.08), 3), "rate_bps": rng.choice([10e6, 20e6])},
    }
    placement = {lid: rng.choice(["home", "region-a", "region-b"]) for lid in ids}
    if all(r == "home" for r in placement.values()):
        placement[rng.choice(ids)] = "region-b"
    faults: dict[str, dict[str, Any]] = {}
    for lid in sorted(rng.sample(ids, max(1, learners // 3))):
        faults[lid] = {"rate": round(rng.uniform(0.03, 0.08), 3), "seed": rng.randrange(1, 2**31)}
    faults["syncer"] = {"rate": round(rng.uniform(0.02, 0.05), 3), "seed": rng.randrange(1, 2**31)}
    faults["syncer-2"] = {"rate": round(rng.uniform(0.02, 0.05), 3), "seed": rng.randrange(1, 2**31)}

    actions: list[dict[str, Any]] = []

    def add(action: str, target: str, when: dict[str, Any], **extra: Any) -> str:
        aid = f"a{len(actions)}"
        actions.append({"id": aid, "action": action, "target": target, "when": when, **extra})
        return aid

    span = 0.7 * steps / rounds  # each round's triggers fall inside its share of the first 70 %
    for r in range(rounds):
        lo = r * span
        def at(a: float, b: float) -> int:
            return max(2, int(lo + rng.uniform(a, b) * span))
        kill_id, term_id = rng.sample(others, 2)
        k = add("sigkill", kill_id, {"learner": kill_id, "step": at(0.15, 0.4)})
        add("restart", kill_id, {"after": k, "delay_s": round(rng.uniform(1.0, 4.0), 1)})
        t = add("sigterm", term_id, {"learner": term_id, "step": at(0.35, 0.75)})
        add("restart", term_id, {"after": t, "delay_s": round(rng.uniform(1.0, 4.0), 1)},
            settings={"learner.slow_step_s": rng.choice([0.1, 0.15, 0.2])})
        s = add("sigkill", "syncer", {"learner": reference, "step": at(0.3, 0.5)})
        add("restart", "syncer", {"after": s, "delay_s": round(rng.uniform(1.0, 4.0), 1)})
        s2 = add("start", "syncer-2", {"learner": reference, "step": at(0.75, 0.95)})
        add("sigterm", "syncer-2", {"after": s2, "delay_s": round(rng.uniform(10.0, 20.0), 1)})
    return {
        "seed": seed, "learners": learners, "steps": steps, "rounds": rounds, "reference": reference,
        "regions": regions, "placement": placement, "faults": faults, "actions": actions,
    }


# --- interval arithmetic and the report's computations (pure; unit-tested) -----------------------


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract(base: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``union(base)`` minus ``union(cut)``."""
    out = []
    cut = union(cut)
    for a, b in union(base):
        cur = a
        for c, d in cut:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
            if cur >= b:
                break
        if cur < b:
            out.append((cur, b))
    return out


def measure(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in union(intervals))


def compute_downtime(series: list[dict[str, Any]], gap_s: float = 10.0) -> tuple[float, list[tuple[float, float]]]:
    """Global downtime from heartbeat observations of every learner incarnation.

    ``series``: one dict per incarnation with ``obs`` = [(heartbeat time, step), ...] (running
    heartbeats only, in time order), ``end`` (when it stopped counting as alive: the signal time, its
    last step at ``max_steps``, or its exit; default its last observation) and optionally
    ``signalled_at``. An incarnation is alive from its first heartbeat (after joining) to ``end``; it
    is stepping between two consecutive observations whose step advanced (at most ``gap_s`` before
    the later one, so a long silence is not taken for progress), and, if it was signalled while
    stepping, from its last observation up to the signal (at most ``gap_s``). Downtime is the time
    some incarnation was alive and none was stepping. Returns (seconds, intervals).
    """
    alive, stepping = [], []
    for s in series:
        obs = sorted(s.get("obs") or [])
        if not obs:
            continue
        end = s.get("end")
        end = obs[-1][0] if end is None else end
        alive.append((obs[0][0], end))
        for (t0, s0), (t1, s1) in zip(obs, obs[1:]):
            if s1 > s0:
                stepping.append((max(t0, t1 - gap_s), t1))
        sig = s.get("signalled_at")
        if sig is not None and len(obs) >= 2 and obs[-1][1] > obs[-2][1]:
            stepping.append((obs[-1][0], min(sig, obs[-1][0] + gap_s)))
    down = subtract(alive, stepping)
    return sum(b - a for a, b in down), down


def find_stalls(publish_times: list[float], delivery_times: list[float], syncer_up: list[tuple[float, float]],
                period_s: float, factor: float = STALL_PERIODS) -> list[dict[str, float]]:
    """Stretches longer than ``factor`` fragment periods with no version published while a syncer
    was serving and delivered work was waiting.

    Within each stretch of syncer uptime, between two consecutive publishes (or the stretch's
    ends), work waits from the first delta delivered after the earlier publish (from the start of
    the stretch if a delta delivered since the last publish before it was already waiting). A
    stall is such a wait that lasts longer than ``factor * period_s`` before the next publish (or
    the end of the stretch).
    """
    pubs = sorted(publish_times)
    deliveries = sorted(delivery_times)
    limit = factor * period_s
    stalls = []

    def first_delivery(after: float, before: float) -> float | None:
        i = bisect.bisect_right(deliveries, after)
        return deliveries[i] if i < len(deliveries) and deliveries[i] < before else None

    for u0, u1 in union(syncer_up):
        inside = [p for p in pubs if u0 < p < u1]
        bounds = [u0, *inside, u1]
        for i, (x, y) in enumerate(zip(bounds, bounds[1:])):
            waiting = first_delivery(x, y)
            if i == 0:
                j = bisect.bisect_right(pubs, u0)
                last_pub = pubs[j - 1] if j else -math.inf
                k = bisect.bisect_right(deliveries, last_pub)
                if k < len(deliveries) and deliveries[k] <= u0:
                    waiting = u0
            if waiting is not None and y - waiting > limit:
                stalls.append({"start": waiting, "end": y, "length_s": y - waiting, "limit_s": limit})
    return stalls


def compute_goodput(incarnations: dict[str, list[dict[str, Any]]], merged: list[dict[str, Any]],
                    num_fragments: int) -> dict[str, Any]:
    """Share of learner compute (steps) that ended up in a merged delta.

    ``incarnations[learner]``: its processes in start order, each with ``s0`` (step it started or
    resumed at), ``s1`` (its last step), ``first_seq`` (first delta sequence number it wrote) and
    ``parent`` (index of the incarnation whose checkpoint it resumed from, or None).
    ``merged``: every merged delta (superseded ones are contained in a merged one) with
    ``learner``, ``seq``, ``fragment``, ``step`` (the learner's step counter when it was taken) and
    ``num_steps`` (steps since the learner last adopted that fragment): it covers steps
    (step - num_steps, step] of its fragment; steps at or below its incarnation's ``s0`` belong to
    the incarnation whose checkpoint was resumed (the counters were restored with it).

    For each incarnation k and fragment p, the steps up to the highest step whose fragment-p work
    is covered by a merged delta are delivered (the tau-step overlap between a send and the next
    adoption counts as delivered: it is the algorithm's own cost, the same without faults); the rest
    (work lost to a SIGKILL, or in deltas that were rejected or never merged) is lost.
    goodput = delivered / (P x steps taken), overall and per learner.
    """
    high: dict[tuple[str, int, int], int] = {}
    for d in merged:
        incs = incarnations.get(d["learner"])
        if not incs:
            continue
        k = max((i for i, inc in enumerate(incs) if inc["first_seq"] <= d["seq"]), default=0)
        hi, lo = int(d["step"]), int(d["step"]) - int(d["num_steps"])
        seen = set()
        while k is not None and k not in seen:
            seen.add(k)
            inc = incs[k]
            top = min(hi, inc["s1"])
            if top > inc["s0"]:
                slot = (d["learner"], k, int(d["fragment"]))
                high[slot] = max(high.get(slot, inc["s0"]), top)
            if lo >= inc["s0"] or inc.get("parent") is None:
                break
            hi, k = inc["s0"], inc["parent"]
    by_learner = {}
    taken_all = delivered_all = 0
    for learner, incs in incarnations.items():
        taken = sum(max(0, inc["s1"] - inc["s0"]) for inc in incs)
        delivered = sum(high.get((learner, k, p), inc["s0"]) - inc["s0"]
                        for k, inc in enumerate(incs) for p in range(num_fragments))
        by_learner[learner] = {"steps_taken": taken, "fragment_steps_delivered": delivered,
                               "goodput": delivered / (num_fragments * taken) if taken else None}
        taken_all += taken
        delivered_all += delivered
    return {"goodput": delivered_all / (num_fragments * taken_all) if taken_all else None,
            "steps_taken": taken_all, "fragment_steps_delivered": delivered_all, "by_learner": by_learner}


def first_merge_after(records: list[dict[str, Any]], learner: str, first_seq: int) -> float | None:
    """``published_at`` of the first merge record holding a delta of ``learner`` with seq >= first_seq."""
    from ddiloco_geo.core import layout

    times = []
    for r in records:
        if r.get("kind") != "merge" or r.get("published_at") is None:
            continue
        seqs = [e["seq"] for e in r.get("merged", []) if e.get("learner") == learner]
        for key in r.get("superseded", []):
            try:
                dk = layout.parse_delta_key(key)
            except layout.LayoutError:
                continue
            if dk.learner == learner:
                seqs.append(dk.seq)
        if any(s >= first_seq for s in seqs):
            times.append(float(r["published_at"]))
    return min(times) if times else None


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str                # log name, e.g. learner-1.0, syncer.1, syncer-2.0
    role: str                # learner | syncer
    target: str              # learner id, "syncer" or "syncer-2"
    incarnation: int
    popen: subprocess.Popen
    started: float
    argv: list[str]
    log_path: Path
    settings: dict[str, Any] = field(default_factory=dict)
    signal: str | None = None
    signalled_at: float | None = None
    exit_time: float | None = None
    ready_at: float | None = None       # syncer: its syncer_ready line
    first_seq: int = 0                  # learner: first delta seq this incarnation writes
    s0: int = 0                         # learner: step it resumes at
    resumed_checkpoint: str | None = None
    obs: list[tuple[float, int, int, float | None]] = field(default_factory=list)  # (hb time, step, sent, step_s)
    last_hb: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.exit_time is None and self.popen.poll() is None


class ChaosRun:
    def __init__(self, settings, plan: dict[str, Any], *, out: Path, sample_s: float = 0.5,
                 timeout_s: float = 900.0, baseline: bool = True, base_url: str | None = None,
                 endpoint: str | None = None) -> None:
        self.settings = settings
        self.plan = plan
        self.out = out
        self.logs = out / "logs"
        self.sample_s = sample_s
        self.timeout_s = timeout_s
        self.baseline = baseline
        self.base_url = base_url
        self.endpoint = endpoint
        self.procs: list[Proc] = []
        self.events: list[dict[str, Any]] = []
        self.action_state: dict[str, dict[str, Any]] = {a["id"]: {"status": "pending"} for a in plan["actions"]}
        self.proxies: dict[str, Any] = {}
        self.moto: subprocess.Popen | None = None
        self.t0 = time.time()
        self.deadline = time.monotonic() + timeout_s
        self.timed_out = False
        self.syncer_status: list[dict[str, Any]] = []
        self.child_env: dict[str, str] = {}

    # --- setup -----------------------------------------------------------------------------------

    def _start_moto(self) -> str:
        from ddiloco_geo.core.errors import DdilocoError

        self.logs.mkdir(parents=True, exist_ok=True)
        last = None
        for _ in range(3):
            port = _free_port()
            logfile = open(self.logs / "moto.log", "ab")
            proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                    stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            logfile.close()
            url = f"http://127.0.0.1:{port}"
            if _wait_http(url + "/moto-api/", 30, proc):
                self.moto = proc
                log.info("chaos_moto_started pid=%d endpoint=%s", proc.pid, url)
                return url
            last = proc.returncode
            _stop(proc, 5)
        raise DdilocoError(f"could not start the moto S3 server (exit code {last}); see {self.logs / 'moto.log'}")

    def _setup_store(self) -> None:
        """Choose the endpoint and bucket; the chaos and baseline runs get fresh prefixes."""
        from ddiloco_geo.core.errors import ConfigError

        s = self.settings.storage
        endpoint = s.endpoint_url
        env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}
        env.setdefault("OMP_NUM_THREADS", "1")
        if endpoint is None:
            if self.base_url:
                raise ConfigError(f"--store {self.base_url}: chaos needs an S3 endpoint; add --set storage.endpoint_url=URL "
                                  "(moto, LocalStack, MinIO) or drop --store to use a moto server started here")
            endpoint = self._start_moto()
        host = urllib.parse.urlsplit(endpoint).hostname or ""
        if self.moto is not None or host in ("127.0.0.1", "localhost", "::1"):
            for k, v in DUMMY_CREDENTIALS.items():  # an emulator on this machine: dummy credentials only
                env.setdefault(k, v)
                os.environ.setdefault(k, v)
        self.child_env = env
        region = s.region or DEFAULT_BUCKET_REGION
        if self.base_url:
            if not self.base_url.startswith("s3://"):
                raise ConfigError(f"--store {self.base_url}: chaos runs on an S3 server: use s3://BUCKET[/PREFIX]")
            base = self.base_url.rstrip("/")
        else:
            bucket = f"ddiloco-chaos-{uuid.uuid4().hex[:12]}"
            _create_bucket(endpoint, bucket, region)
            base = f"s3://{bucket}"
        tag = f"s{self.plan['seed']}-{uuid.uuid4().hex[:8]}"
        self.endpoint = endpoint
        self.url = f"{base}/chaos-{tag}"
        self.baseline_url = f"{base}/baseline-{tag}"
        self.settings.storage.url = self.url
        self.settings.storage.endpoint_url = endpoint
        self.settings.storage.region = region
        self.settings.local.learners = self.plan["learners"]
        self.settings.learner.max_steps = self.plan["steps"]

    def _start_proxies(self) -> None:
        from ddiloco_geo.tools.wanproxy import WanProxyThread

        parts = urllib.parse.urlsplit(self.endpoint)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        used = sorted({r for r in self.plan["placement"].values() if r != "home"})
        for i, region in enumerate(used):
            spec = self.plan["regions"][region]
            proxy = WanProxyThread(parts.hostname, port, delay_s=spec["delay_s"], rate_bps=spec["rate_bps"],
                                   seed=self.plan["seed"] * 100 + i).start()
            self.proxies[region] = proxy
            log.info("chaos_wan_proxy region=%s url=%s delay_s=%.3f rate_mbps=%.0f", region, proxy.url,
                     spec["delay_s"], spec["rate_bps"] / 1e6)

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
        argv = [sys.executable, "-m", "ddiloco_geo", role]
        fault_key = target if role == "learner" else (target if incarnation == 0 or target == "syncer-2" else None)
        fault = self.plan["faults"].get(fault_key) if fault_key else None
        if fault:
            overrides["storage.fault_rate"] = fault["rate"]
            overrides["storage.fault_seed"] = fault["seed"]
        first_seq, s0, ckpt = 0, 0, None
        if role == "learner":
            i = int(target.rsplit("-", 1)[1])
            argv += ["--id", target, "--shard", f"{i}/{self.plan['learners']}"]
            region = self.plan["placement"].get(target, "home")
            argv += ["--region", region]
            if region in self.proxies:
                overrides["storage.endpoint_url"] = self.proxies[region].url
            if incarnation:  # a fresh prefix: the first incarnation starts at seq 0, step 0
                first_seq, s0, ckpt = self._resume_point(target)
        overrides.update(extra or {})
        for k, v in overrides.items():
            argv += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
        argv += ["--config", str(self.out / "settings.json")]
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{name}.log"
        logfile = open(log_path, "ab")
        popen = subprocess.Popen(argv, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=self.child_env, cwd=self.out)
        logfile.close()
        proc = Proc(name=name, role=role, target=target, incarnation=incarnation, popen=popen, started=time.time(),
                    argv=argv, log_path=log_path, settings=overrides, first_seq=first_seq, s0=s0,
                    resumed_checkpoint=ckpt)
        self.procs.append(proc)
        threading.Thread(target=self._reap, args=(proc,), daemon=True, name=f"reap-{name}").start()
        detail = {k: v for k, v in overrides.items() if k != "storage.endpoint_url"}
        if role == "learner":
            detail.update(region=self.plan["placement"].get(target, "home"), first_seq=first_seq, resume_step=s0)
        self._event("restart" if restart else "start", target, proc, plan_id, **detail)
        return proc

    def _reap(self, proc: Proc) -> None:
        proc.popen.wait()
        proc.exit_time = time.time()

    def _resume_point(self, learner: str) -> tuple[int, int, str | None]:
        """(first delta seq, step, checkpoint) a (re)started learner resumes at, as the learner
        itself derives them: the next free sequence number and its newest decodable checkpoint."""
        from ddiloco_geo.core import layout
        from ddiloco_geo import protocol
        from ddiloco_geo.core.errors import CodecError, NotFoundError

        seqs = []
        for key in self.store.list(layout.deltas_dir(learner)):
            try:
                seqs.append(layout.parse_delta_key(key).seq)
            except layout.LayoutError:
                continue
        first_seq = max(seqs) + 1 if seqs else 0
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
        proc.popen.send_signal(sig)
        self._event(sig.name.lower(), proc.target, proc, plan_id, step=step)

    # --- the loop --------------------------------------------------------------------------------

    def _sample(self) -> None:
        from ddiloco_geo.core import layout
        from ddiloco_geo.core.errors import NotFoundError, StorageError

        for lid in (f"learner-{i}" for i in range(self.plan["learners"])):
            try:
                hb = json.loads(self.store.get(layout.heartbeat_key(lid)))
            except (NotFoundError, StorageError, ValueError):
                continue
            for p in self.procs:
                if p.target == lid and p.pid == hb.get("pid"):
                    p.last_hb = hb
                    if hb.get("state") == "running" and (not p.obs or hb["time"] > p.obs[-1][0]):
                        p.obs.append((float(hb["time"]), int(hb["step"]),
                                      int(hb.get("uploads", {}).get("deltas_sent", 0)), hb.get("step_s")))
                    elif hb.get("state") == "exited":
                        p.last_hb = hb
        for p in self.procs:
            if p.role == "syncer" and p.ready_at is None and p.exit_time is None:
                try:
                    if "syncer_ready" in p.log_path.read_text(errors="replace"):
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

    def _can_still_fire(self, action: dict[str, Any]) -> bool:
        when = action["when"]
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
            return step is not None and step >= when["step"]
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

    def _fire(self, action: dict[str, Any]) -> None:
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
            self._signal(proc, signal.SIGKILL if kind == "sigkill" else signal.SIGTERM, action["id"])
            st.update(status="done", time=time.time(), proc=proc)
        elif kind in ("restart", "start"):
            if self._alive(target) is not None:
                return
            proc = self._spawn(role, target, action.get("settings"), action["id"], restart=kind == "restart")
            st.update(status="done", time=time.time(), proc=proc)

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

    def _learners_done(self) -> bool:
        if any(p.role == "learner" and p.alive() for p in self.procs):
            return False
        return not any(a["target"].startswith("learner") and self.action_state[a["id"]]["status"] == "pending"
                       and self._can_still_fire(a) for a in self.plan["actions"])

    def _progress(self) -> None:
        parts = []
        for i in range(self.plan["learners"]):
            p = self._latest(f"learner-{i}")
            state = "up" if p and p.alive() else "down"
            parts.append(f"learner-{i}:{state}:step={p.obs[-1][1] if p and p.obs else '-'}")
        syncers = [p.name for p in self.procs if p.role == "syncer" and p.alive()]
        log.info("chaos_progress t=%.0fs %s syncers=%s", self._now(), " ".join(parts), ",".join(syncers) or "none")

    def _watch(self) -> None:
        last_progress = 0.0
        while True:
            self._sample()
            for action in self._pending():
                if not self._can_still_fire(action):
                    self.action_state[action["id"]].update(status="skipped", reason="trigger can no longer happen")
                    self._event("skipped", action["target"], plan_id=action["id"], planned=action["action"],
                                reason="trigger can no longer happen")
                elif self._due(action):
                    self._fire(action)
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
        """Let pending syncer restarts happen, make sure one syncer serves, then SIGTERM every
        syncer (each drains: merges everything pending) and wait for them."""
        while not self.timed_out:
            pending = [a for a in self._pending() if a["target"].startswith("syncer")]
            restarts = [a for a in pending if a["action"] in ("restart", "start") and "after" in a["when"]
                        and self.action_state[a["when"]["after"]]["status"] == "done"]
            for a in pending:
                if a not in restarts:
                    self.action_state[a["id"]].update(status="skipped", reason="learners finished first")
                    self._event("skipped", a["target"], plan_id=a["id"], planned=a["action"],
                                reason="learners finished first")
            if not restarts:
                break
            for a in restarts:
                if self._due(a):
                    self._fire(a)
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
                    p.popen.wait(timeout=max(1.0, min(180.0, self.deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    log.error("chaos_syncer_drain_timeout pid=%d", p.pid)
                    self.timed_out = True
                    return
        time.sleep(0.2)  # reaper threads record exit times

    def _stop_all(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGKILL if self.timed_out else signal.SIGTERM)
        for p in self.procs:
            _stop(p.popen, 30)
        for proxy in self.proxies.values():
            proxy.stop()

    # --- the whole command -----------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from ddiloco_geo.storage import open_store

        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        try:
            self._setup_store()
            (self.out / "settings.json").write_text(self.settings.model_dump_json(indent=1))
            (self.out / "plan.json").write_text(json.dumps(self.plan, indent=1))
            self.store = open_store(self.settings.storage)
            try:
                self._start_proxies()
                log.info("chaos_start seed=%d store=%s learners=%d steps=%d actions=%d", self.plan["seed"], self.url,
                         self.plan["learners"], self.plan["steps"], len(self.plan["actions"]))
                self._spawn("syncer", "syncer")
                for i in range(self.plan["learners"]):
                    self._spawn("learner", f"learner-{i}")
                try:
                    self._watch()
                    self._finish_syncers()
                finally:
                    self._stop_all()
                report = self._report()
            finally:
                self.store.close()
            if self.baseline and not self.timed_out:
                self._run_baseline(report)
            report["wall_s"] = round(time.time() - self.t0, 1)
            report["goals"] = goals(report)
            report["ok"] = all(report["goals"].values())
        finally:
            if self.moto is not None:
                _stop(self.moto, 10)
        (self.out / "chaos.json").write_text(json.dumps(report, indent=1, default=str))
        log.info("chaos_report_written path=%s", self.out / "chaos.json")
        return report

    # --- the report ------------------------------------------------------------------------------

    def _delta_headers(self) -> dict[str, dict[str, Any]]:
        from concurrent.futures import ThreadPoolExecutor

        from ddiloco_geo.core import layout

        from ddiloco_geo import protocol
        from ddiloco_geo.core.errors import CodecError, StorageError

        all_keys = [k for i in range(self.plan["learners"]) for k in self.store.list(layout.deltas_dir(f"learner-{i}"))]

        def one(key: str):
            try:
                h = protocol.read_header(self.store, key)
                return key, {"learner": h.learner, "seq": h.seq, "fragment": h.fragment, "num_steps": h.num_steps,
                             "step": int(h.extra.get("step", 0))}
            except (CodecError, StorageError):
                return key, None

        with ThreadPoolExecutor(16) as pool:
            return {k: v for k, v in pool.map(one, all_keys) if v is not None}

    def _rejected_then_superseded(self, records: list[dict[str, Any]]) -> list[dict[str, str]]:
        """Deltas one syncer rejected (e.g. ``future_base`` while it lagged) whose work reached the
        model anyway, through a newer cumulative delta another syncer merged. ``run.ledger`` counts
        them once, as merged; this list is for the report only."""
        from ddiloco_geo.core import layout
        from ddiloco_geo.core.errors import NotFoundError

        merged = {e["key"] for r in records for e in r.get("merged", [])}
        accounted = {k for r in records for k in r.get("superseded", [])} - merged
        out = []
        for key in self.store.list(layout.SYNCER + "rejected/"):
            try:
                rec = json.loads(self.store.get(key))
            except (NotFoundError, ValueError):
                continue
            if rec.get("key") in accounted:
                out.append({"key": rec["key"], "reason": rec.get("reason")})
        return out

    def _report(self) -> dict[str, Any]:
        from ddiloco_geo.core import layout
        from ddiloco_geo import protocol
        from ddiloco_geo.core.errors import NotFoundError
        from ddiloco_geo.tools.local import Evaluator

        t_read = time.monotonic()
        log.info("chaos_report reading the ledger, merge records and delta headers from %s", self.url)
        led = protocol.ledger(self.store)
        records = protocol.merge_records(self.store)
        double = self._rejected_then_superseded(records)
        spec = protocol.load_spec(self.store)
        P = spec.plan.num_fragments
        H = spec.sync_every
        headers = self._delta_headers()
        log.info("chaos_report read %d merge records and %d delta headers in %.1fs", len(records), len(headers),
                 time.monotonic() - t_read)
        exits = {}
        for i in range(self.plan["learners"]):
            try:
                exits[f"learner-{i}"] = json.loads(self.store.get(layout.exit_key(f"learner-{i}")))
            except (NotFoundError, ValueError):
                pass

        learners = [p for p in self.procs if p.role == "learner"]
        # each incarnation's last step: its exit record if it wrote one, else what was seen of it
        exit_steps: dict[int, int] = {}
        for p in learners:
            rec = exits.get(p.target)
            if rec and rec.get("pid") == p.pid:
                exit_steps[p.pid] = int(rec["step"])
        incs: dict[str, list[dict[str, Any]]] = {}
        for lid in sorted({p.target for p in learners}):
            mine = [p for p in learners if p.target == lid]
            rows = []
            for k, p in enumerate(mine):
                nxt = mine[k + 1].first_seq if k + 1 < len(mine) else None
                own = [h for h in headers.values() if h["learner"] == lid and h["seq"] >= p.first_seq
                       and (nxt is None or h["seq"] < nxt)]
                seen = max([o[1] for o in p.obs] + [int(p.last_hb.get("step", 0) or 0)] +
                           [h["step"] for h in own] + [p.s0])
                s1 = exit_steps.get(p.pid, seen)
                parent = None
                if p.resumed_checkpoint:
                    # checkpoints are written on a clean exit only: the newest one is the latest
                    # earlier incarnation's that was not SIGKILLed
                    clean = [j for j, q in enumerate(mine[:k]) if q.signal != "SIGKILL"]
                    parent = clean[-1] if clean else None
                rows.append({"pid": p.pid, "incarnation": k, "s0": p.s0, "s1": s1, "first_seq": p.first_seq,
                             "parent": parent, "resumed_checkpoint": p.resumed_checkpoint})
            incs[lid] = rows

        merged_entries = []
        for r in records:
            for e in r.get("merged", []):
                h = headers.get(e["key"])
                if h is not None:
                    merged_entries.append({**h, "num_steps": e.get("num_steps", h["num_steps"])})
        gp = compute_goodput(incs, merged_entries, P)

        # downtime from heartbeats
        max_steps = self.plan["steps"]
        step_times = [o[3] for p in learners for o in p.obs if o[3]]
        step_s = statistics.median(step_times) if step_times else 0.5
        gap_s = max(10.0, 10 * step_s)
        series = []
        for p in learners:
            obs = [(o[0], o[1]) for o in p.obs]
            if p.signalled_at is not None:
                end = p.signalled_at
            else:
                done = [t for t, s in obs if s >= max_steps]
                end = done[0] if done else (min(p.exit_time, obs[-1][0]) if (obs and p.exit_time) else None)
            series.append({"obs": obs, "end": end, "signalled_at": p.signalled_at})
        downtime, down_iv = compute_downtime(series, gap_s)
        (self.out / "heartbeats.json").write_text(json.dumps(
            {p.name: [[round(o[0] - self.t0, 3), o[1], o[2], o[3]] for o in p.obs] for p in learners}))

        # stalls
        period = H * step_s
        pubs = [float(r["published_at"]) for r in records if r.get("kind") == "merge" and r.get("published_at")]
        deliveries = []
        for p in learners:
            for (t0, _, n0, _), (t1, _, n1, _) in zip(p.obs, p.obs[1:]):
                if n1 > n0:
                    deliveries.append(t1)
            if p.last_hb.get("state") == "exited" and p.obs:
                sent = int(p.last_hb.get("uploads", {}).get("deltas_sent", 0))
                if sent > p.obs[-1][2]:
                    deliveries.append(float(p.last_hb.get("time", p.obs[-1][0])))
        syncer_up = []
        for p in self.procs:
            if p.role == "syncer" and p.ready_at is not None:
                end = p.signalled_at or p.exit_time or time.time()
                syncer_up.append((p.ready_at, end))
        stalls = find_stalls(pubs, deliveries, syncer_up, period)

        # recovery
        notice = []
        restart_merge, restart_detail = [], []
        for p in learners:
            if p.signal == "SIGTERM" and p.exit_time is not None:
                notice.append(round(p.exit_time - p.signalled_at, 3))
        restarted_merged = {}
        for p in learners:
            if p.incarnation == 0:
                continue
            first = first_merge_after(records, p.target, p.first_seq)
            first_step = p.obs[0][0] if p.obs else None
            d = {"learner": p.target, "process": p.name, "restarted_at": round(p.started - self.t0, 3),
                 "first_seq": p.first_seq, "resume_step": p.s0,
                 "restart_to_first_step": None if first_step is None else round(first_step - p.started, 3),
                 "restart_to_first_merge": None if first is None else round(first - p.started, 3)}
            restart_detail.append(d)
            restarted_merged[p.name] = first is not None
            if first is not None:
                restart_merge.append(d["restart_to_first_merge"])
        syncer_ready, syncer_publish, drains = [], [], []
        for p in self.procs:
            if p.role != "syncer":
                continue
            if p.ready_at is not None:
                syncer_ready.append(round(p.ready_at - p.started, 3))
                after = [t for t in pubs if t >= p.ready_at]
                if after and (p.incarnation > 0 or p.target == "syncer-2"):
                    syncer_publish.append(round(min(after) - p.started, 3))
            if p.signal == "SIGTERM" and p.exit_time is not None:
                drains.append(round(p.exit_time - p.signalled_at, 3))

        # storage faults actually seen (retries by reason, from heartbeats / exit records / syncer status)
        faults_seen: dict[str, dict[str, int]] = {}
        for p in learners:
            if "storage.fault_rate" in p.settings:
                retries = (p.last_hb.get("storage") or {}).get("retries", {})
                faults_seen[p.name] = dict(retries)
        syncer_retries: dict[str, int] = {}
        for st in self.syncer_status:
            for k, v in (st["storage"].get("retries") or {}).items():
                syncer_retries[k] = max(syncer_retries.get(k, 0), int(v))
        faults_seen["syncer(status)"] = syncer_retries
        faults_configured = [{"process": p.name, "pid": p.pid, "rate": p.settings["storage.fault_rate"],
                              "seed": p.settings["storage.fault_seed"]} for p in self.procs if "storage.fault_rate" in p.settings]
        wan = {"regions": self.plan["regions"], "placement": self.plan["placement"],
               "proxies": {r: {"url": px.url, **px.stats()} for r, px in self.proxies.items()},
               "proxied_learners": sorted(l for l, r in self.plan["placement"].items() if r != "home")}

        evaluator = Evaluator(self.settings)
        initial = evaluator.initial()
        final, versions = evaluator.global_loss(self.store, spec)
        failed = [{"process": p.name, "code": p.popen.returncode} for p in self.procs
                  if p.popen.returncode not in (0, None) and p.signal != "SIGKILL"]
        return {
            "seed": self.plan["seed"], "store": self.url, "endpoint": self.endpoint,
            "learners": self.plan["learners"], "steps": self.plan["steps"], "rounds": self.plan["rounds"],
            "timed_out": self.timed_out,
            "downtime_s": round(downtime, 3),
            "downtime_intervals": [(round(a - self.t0, 3), round(b - self.t0, 3)) for a, b in down_iv],
            "stalls": [{**s, "start": round(s["start"] - self.t0, 3), "end": round(s["end"] - self.t0, 3)} for s in stalls],
            "step_s_median": round(step_s, 4), "fragment_period_s": round(period, 3), "stepping_gap_s": round(gap_s, 3),
            "goodput": None if gp["goodput"] is None else round(gp["goodput"], 4),
            "goodput_by_learner": gp["by_learner"], "steps_taken": gp["steps_taken"],
            "deltas_written": led["deltas_written"], "deltas_merged": led["deltas_merged"],
            "deltas_superseded": led["deltas_superseded"], "deltas_rejected": led["deltas_rejected"],
            "rejected_by_reason": led["rejected_by_reason"], "deltas_unaccounted": led["deltas_unaccounted"],
            "unaccounted_keys": led["unaccounted_keys"],
            "deltas_rejected_then_superseded": len(double), "rejected_then_superseded": double[:20],
            "versions_published": sum(1 for r in records if r.get("kind") == "merge"),
            "final_versions": {str(p): v for p, v in versions.items()},
            "initial_eval_loss": initial, "final_eval_loss": final,
            "baseline_eval_loss": None, "loss_ratio": None, "goodput_baseline": None,
            "recovery_s": {"notice_to_exit": notice, "restart_to_first_merge": restart_merge,
                           "restart_to_first_step": [d["restart_to_first_step"] for d in restart_detail
                                                     if d["restart_to_first_step"] is not None],
                           "syncer_start_to_ready": syncer_ready, "syncer_restart_to_first_publish": syncer_publish,
                           "syncer_drain": drains},
            "restarts": restart_detail, "restarted_merged_after_restart": restarted_merged,
            "faults_configured": faults_configured, "fault_retries_seen": faults_seen, "wan": wan,
            "incarnations": incs,
            "processes": [{"process": p.name, "pid": p.pid, "started": round(p.started - self.t0, 3),
                           "signal": p.signal, "exit_code": p.popen.returncode,
                           "exited": None if p.exit_time is None else round(p.exit_time - self.t0, 3)} for p in self.procs],
            "processes_failed": failed,
            "events": self.events,
            "plan": self.plan,
            "actions": {aid: {k: v for k, v in st.items() if k != "proc"} | (
                {"time": round(st["time"] - self.t0, 3)} if "time" in st else {}) for aid, st in self.action_state.items()},
        }

    def _run_baseline(self, report: dict[str, Any]) -> None:
        """The same job without chaos (same settings, M, steps) on a fresh prefix, via ``local``."""
        from ddiloco_geo.core import layout
        from ddiloco_geo import protocol
        from ddiloco_geo.core.errors import NotFoundError
        from ddiloco_geo.tools.local import LocalRun
        from ddiloco_geo.storage import open_store

        settings = self.settings.model_copy(deep=True)
        settings.storage.url = self.baseline_url
        settings.local.out = str(self.out / "baseline")
        log.info("chaos_baseline_start store=%s", self.baseline_url)
        lr = LocalRun(settings, eval_every_s=0, live=False)
        result: dict[str, Any] = {}

        def go() -> None:
            try:
                result["summary"] = lr.run()
            except Exception as exc:  # reported, not raised: the chaos report stands on its own
                result["error"] = f"{type(exc).__name__}: {exc}"

        old_env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("DDILOCO_")}
        try:
            thread = threading.Thread(target=go, name="baseline", daemon=True)
            thread.start()
            while thread.is_alive():
                thread.join(1.0)
                if time.monotonic() > self.deadline:
                    log.error("chaos_baseline_timeout: killing its processes")
                    self.timed_out = True
                    for proc in list(lr.procs.values()):
                        if proc.poll() is None:
                            proc.kill()
                    thread.join(60)
                    break
        finally:
            os.environ.update(old_env)
        if "summary" not in result:
            report["baseline_error"] = result.get("error", "timed out")
            return
        s = result["summary"]
        report["baseline_store"] = self.baseline_url
        report["baseline_eval_loss"] = s["final_eval_loss"]
        report["loss_ratio"] = round(report["final_eval_loss"] / s["final_eval_loss"], 4)
        report["baseline_deltas_unaccounted"] = s["deltas_unaccounted"]
        store = open_store(settings.storage)
        try:
            spec = protocol.load_spec(store)
            incs, merged = {}, []
            for lid in s["learners"]:
                try:
                    rec = json.loads(store.get(layout.exit_key(lid)))
                except (NotFoundError, ValueError):
                    continue
                incs[lid] = [{"s0": 0, "s1": int(rec["step"]), "first_seq": 0, "parent": None}]
            for r in protocol.merge_records(store):
                for e in r.get("merged", []):
                    h = protocol.read_header(store, e["key"])
                    merged.append({"learner": h.learner, "seq": h.seq, "fragment": h.fragment,
                                   "num_steps": h.num_steps, "step": int(h.extra.get("step", 0))})
            gp = compute_goodput(incs, merged, spec.plan.num_fragments)
            report["goodput_baseline"] = None if gp["goodput"] is None else round(gp["goodput"], 4)
        finally:
            store.close()


def goals(report: dict[str, Any]) -> dict[str, bool]:
    out = {
        "completed": not report["timed_out"],
        "zero_downtime": report["downtime_s"] == 0,
        "no_stalls": not report["stalls"],
        "ledger_balanced": report["deltas_unaccounted"] == 0 and report["deltas_written"]
        == report["deltas_merged"] + report["deltas_rejected"],
        "restarted_learners_merged": all(report["restarted_merged_after_restart"].values()),
        "no_process_failed": not report["processes_failed"],
    }
    if report.get("loss_ratio") is not None:
        out["loss_within_3pct"] = report["loss_ratio"] <= LOSS_GOAL
    return out


# --- helpers -------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> bool:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status < 500:
                    return True
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False


def _create_bucket(endpoint: str, bucket: str, region: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name=region)
    kwargs: dict[str, Any] = {"Bucket": bucket}
    if region != "us-east-1":
        kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
    client.create_bucket(**kwargs)


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _settings(args: argparse.Namespace, shape: dict[str, Any]):
    """Resolve settings: CLI > env > file > the chaos defaults > the project's defaults."""
    from ddiloco_geo.core import config
    from ddiloco_geo.cli.settings import cli_overrides

    extra = {"learner.max_steps": args.steps, "local.learners": shape["learners"]}
    _, origin = config.load(cli=cli_overrides(args, extra), config_file=args.config)
    tree: dict[str, Any] = {}
    defaults = dict(CHAOS_DEFAULTS, **{"learner.max_steps": shape["steps"]})
    for dotted, value in defaults.items():
        if dotted in origin:
            continue
        section, name = dotted.split(".")
        tree.setdefault(section, {})[name] = value
    user = cli_overrides(args, extra)
    for section, values in user.items():
        if isinstance(values, dict):
            tree.setdefault(section, {}).update(values)
        else:
            tree[section] = values
    settings, _ = config.load(cli=tree, config_file=args.config)
    return settings


# --- command line --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="seed of the chaos schedule (default 0)")
    p.add_argument("--learners", type=int, help="learner processes M (default 3; --long 4)")
    p.add_argument("--steps", type=int, help="inner steps per learner (default 120; --long 400)")
    p.add_argument("--rounds", type=int, help="rounds of chaos events (default 1; --long 3)")
    p.add_argument("--long", action="store_true", help="the benchmark: more learners, steps and rounds")
    p.add_argument("--out", default="chaos-out", help="directory for chaos.json, plan.json and logs (default ./chaos-out)")
    p.add_argument("--no-baseline", action="store_true", help="skip the fault-free baseline run (no loss_ratio)")
    p.add_argument("--timeout", type=float, help="hard overall timeout in seconds (default 900; --long 3600)")
    p.add_argument("--sample-s", type=float, default=0.5, help="heartbeat sampling interval (default 0.5 s)")
    p.add_argument("--plan-only", action="store_true", help="print the schedule for --seed and exit")


def run(args: argparse.Namespace) -> int:
    shape = dict(LONG if args.long else SHORT)
    for key in ("learners", "steps", "rounds", "timeout"):
        if getattr(args, key, None) is not None:
            shape[key] = getattr(args, key)
    plan = plan_schedule(args.seed, shape["learners"], shape["steps"], shape["rounds"])
    if args.plan_only:
        print(json.dumps(plan, indent=1))
        return 0
    settings = _settings(args, shape)
    if settings.learner.max_steps != plan["steps"]:
        plan = plan_schedule(args.seed, shape["learners"], settings.learner.max_steps, shape["rounds"])
    base_url = args.store or (settings.storage.url if settings.storage.url.startswith("s3://") else None)
    chaos = ChaosRun(settings, plan, out=Path(args.out).resolve(), sample_s=args.sample_s,
                     timeout_s=shape["timeout"], baseline=not args.no_baseline, base_url=base_url)
    report = chaos.run()
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        keys_ = ("downtime_s", "stalls", "goodput", "goodput_baseline", "deltas_written", "deltas_merged",
                 "deltas_rejected", "deltas_unaccounted", "final_eval_loss", "baseline_eval_loss", "loss_ratio",
                 "recovery_s", "goals")
        for k in keys_:
            print(f"{k}: {json.dumps(report.get(k), default=str)}")
        print(f"report: {Path(args.out).resolve() / 'chaos.json'}")
    return 0 if report["ok"] else 1
