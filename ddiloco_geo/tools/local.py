"""``ddiloco-geo local``: the main job on one machine, as real OS processes.

Starts one syncer and M learners as separate processes (``python -m ddiloco_geo syncer|learner``,
through :mod:`ddiloco_geo.tools.processes`) on one store (a local directory by default; any
``s3://`` or ``gs://`` URL works the same), shows a live view built from the bucket (heartbeats and
the globals index), evaluates the global model at the start, periodically and at the end
(:class:`~ddiloco_geo.tools.evaluate.Evaluator`), then writes ``summary.json`` and
``training.png`` to ``settings.local.out``.

Children get the resolved settings as a file (``--config OUT/settings.json``) and the environment
the caller passes (default: this process's), plus the run secret, which never goes into a file.

Shutdown order: learners finish their steps and flush (they exit by themselves); then the syncer
gets SIGTERM and drains (merges everything pending); then the final evaluation and the ledger are
read from the bucket. Every child is stopped by its PID; if the orchestrator is interrupted, the
children get SIGTERM, then SIGKILL after a timeout.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddiloco_geo import protocol
from ddiloco_geo.core import layout
from ddiloco_geo.core.config import Settings
from ddiloco_geo.core.errors import ConfigError, DdilocoError
from ddiloco_geo.ops.report import plot_local_run
from ddiloco_geo.ops.status import LiveView
from ddiloco_geo.protocol import RunSpec
from ddiloco_geo.storage import Store, open_store
from ddiloco_geo.tools import processes
from ddiloco_geo.core.signing import tool_keys
from ddiloco_geo.tools.evaluate import Evaluator

log = logging.getLogger(__name__)

SYNCER_DRAIN_S = 180.0   # a SIGTERMed syncer merges everything pending before it exits
STOP_ALL_S = 30.0        # SIGTERM -> SIGKILL for whatever still runs at the end


class LocalRun:
    """One syncer and ``settings.local.learners`` learners as processes; :meth:`run` returns the summary.

    ``env``: the environment the children start from (default: this process's)."""

    def __init__(self, settings: Settings, *, eval_every_s: float = 20.0, live: bool = True,
                 env: Mapping[str, str] | None = None) -> None:
        self.settings = settings
        self.eval_every_s = eval_every_s
        self.live = live
        self.out = Path(settings.local.out).resolve()
        self.logs = self.out / "logs"
        self.env = env
        self.procs: dict[str, processes.Child] = {}
        self.exit_codes: dict[str, int] = {}
        self.global_evals: list[dict[str, float]] = []
        self.verifier = None  # set from settings.security in run(): what tools read must be signed

    # --- setup -----------------------------------------------------------------------------------

    def _prepare_store(self) -> None:
        url = self.settings.storage.url
        if url.startswith("memory://"):
            raise ConfigError("memory:// lives inside one process; `local` runs processes: use file://DIR, s3:// or gs://")
        if url.startswith("file://") and self.settings.local.fresh:
            path = Path(url[len("file://"):]).resolve()
            if path.exists() and any(path.iterdir()):
                if not (path / "run.json").exists() and not (path / "globals").exists():
                    raise ConfigError(f"{path} is not empty and is not a ddiloco-geo run: choose another --store")
                shutil.rmtree(path)
            path.mkdir(parents=True, exist_ok=True)

    def _child_env(self) -> dict[str, str]:
        secret = self.settings.security.run_secret
        extra = {} if secret is None else {"DDILOCO_SECURITY__RUN_SECRET": secret.get_secret_value()}
        return processes.child_env(self.env, extra=extra)

    def _spawn(self, name: str, args: list[str]) -> None:
        self.procs[name] = processes.start(name, [*args, "--config", str(self.out / "settings.json")],
                                           log_path=self.logs / f"{name}.log", env=self._child_env())
        log.info("process_started name=%s pid=%d", name, self.procs[name].pid)

    # --- the run ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        s = self.settings
        self.out.mkdir(parents=True, exist_ok=True)
        self._prepare_store()
        # the run secret reaches the children through their environment, never through a file
        (self.out / "settings.json").write_text(s.model_dump_json(indent=1, exclude={"security": {"run_secret"}}))
        started = time.time()
        self._spawn("syncer", ["syncer"])
        M = s.local.learners
        for i in range(M):
            self._spawn(f"learner-{i}", ["learner", "--id", f"learner-{i}", "--shard", f"{i}/{M}"])
        store = open_store(s.storage)
        self.verifier, _ = tool_keys(s.security)
        try:
            evaluator = Evaluator.from_settings(s)
            initial = evaluator.initial()
            self.global_evals.append({"time": 0.0, "tokens": 0, "loss": initial})
            log.info("eval initial_loss=%.4f", initial)
            self._watch(store, evaluator, started)
            self._stop_syncer()
            spec = protocol.load_spec(store)
            final, versions = evaluator.global_loss(store, spec)
            tokens = self._tokens(store)
            self.global_evals.append({"time": time.time() - started, "tokens": tokens, "loss": final})
            summary = self._summary(store, spec, initial, final, versions, started)
            summary["skipped_unverified"] = {"final_eval": evaluator.last_skipped, "ledger": summary.pop("_ledger_skipped")}
        finally:
            self._terminate_all()
            store.close()
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        plot_local_run(summary, self.out / "training.png")
        log.info("summary_written path=%s plot=%s", self.out / "summary.json", self.out / "training.png")
        return summary

    def kill_all(self) -> None:
        """SIGKILL every child now (a caller's hard timeout)."""
        processes.kill_all(self.procs.values())

    def _learner_names(self) -> list[str]:
        return [n for n in self.procs if n.startswith("learner-")]

    def _watch(self, store: Store, evaluator: Evaluator, started: float) -> None:
        view = LiveView(store, live=self.live, verifier=self.verifier)
        last_eval = time.monotonic()
        with view:
            while True:
                for name, proc in self.procs.items():
                    if name not in self.exit_codes and proc.poll() is not None:
                        self.exit_codes[name] = proc.returncode
                        level = logging.INFO if proc.returncode == 0 else logging.WARNING
                        log.log(level, "process_exited name=%s code=%d log=%s", name, proc.returncode, proc.log_path)
                if all(n in self.exit_codes for n in self._learner_names()):
                    break
                if "syncer" in self.exit_codes:
                    log.warning("syncer_exited_early code=%d: learners keep training; deltas wait in the bucket",
                                self.exit_codes["syncer"])
                view.refresh(global_evals=self.global_evals)
                if self.eval_every_s and time.monotonic() - last_eval > self.eval_every_s:
                    last_eval = time.monotonic()
                    self._eval_now(store, evaluator, started)
                time.sleep(1.0)

    def _eval_now(self, store: Store, evaluator: Evaluator, started: float) -> None:
        try:
            spec = protocol.load_spec(store)
            loss, _ = evaluator.global_loss(store, spec, quick=True)
            self.global_evals.append({"time": time.time() - started, "tokens": self._tokens(store), "loss": loss})
        except (DdilocoError, OSError) as exc:
            log.debug("eval_skipped error=%s", exc)

    def _tokens(self, store: Store) -> int:
        total = 0
        for name in self._learner_names():
            rec = (protocol.exit_record(store, name, self.verifier)
                   or protocol.heartbeat(store, name, self.verifier) or {})
            total += rec.get("tokens") or 0
        return total

    def _stop_syncer(self) -> None:
        proc = self.procs["syncer"]
        if not processes.stop(proc, SYNCER_DRAIN_S):
            log.error("syncer_drain_timeout pid=%d action=kill", proc.pid)
        self.exit_codes["syncer"] = proc.returncode

    def _terminate_all(self) -> None:
        processes.stop_all(self.procs.values(), STOP_ALL_S)

    # --- the summary -----------------------------------------------------------------------------

    def _summary(self, store: Store, spec: RunSpec, initial: float, final: float, versions: dict[int, int],
                 started: float) -> dict[str, Any]:
        led = protocol.ledger(store, self.verifier)
        learners = {}
        bytes_up = bytes_down = 0
        steps_total = trained = discarded = past_send = 0
        for name in self._learner_names():
            rec = protocol.exit_record(store, name, self.verifier) or {}
            st = rec.get("storage") or {}
            bytes_up += int(st.get("bytes_up", 0))
            bytes_down += int(st.get("bytes_down", 0))
            steps_total += rec.get("step") or 0
            trained += (rec.get("fragment_steps") or {}).get("trained") or 0
            discarded += (rec.get("fragment_steps") or {}).get("discarded") or 0
            past_send += (rec.get("fragment_steps") or {}).get("past_send") or 0
            learners[name] = {
                "tokens": rec.get("tokens") or 0, "steps": rec.get("step") or 0, "final_loss": rec.get("loss"),
                "tokens_per_s": rec.get("tokens_per_s"), "deltas_sent": (rec.get("uploads") or {}).get("deltas_sent") or 0,
                "exit_code": self.exit_codes.get(name), "history": rec.get("history", []),
                "bytes_up": st.get("bytes_up", 0), "bytes_down": st.get("bytes_down", 0),
                "send_timing": rec.get("send_timing"),  # the aligned send lead and how its sends fared
            }
        syncer_status = protocol.syncer_status(store, layout.syncer_status_key(0, 1), self.verifier) or {}
        sst = syncer_status.get("storage") if isinstance(syncer_status.get("storage"), dict) else {}
        sst = {k: v for k, v in sst.items() if isinstance(v, int) and not isinstance(v, bool)}
        num_params = sum(spec.plan.numel(p) for p in range(spec.plan.num_fragments))
        M = len(learners)
        # what a ring all-reduce of fp32 gradients every step would have moved for the same steps
        dp_bytes = int(2 * (M - 1) / M * 4 * num_params * steps_total) if M > 1 else 0
        moved = bytes_up + bytes_down + int(sst.get("bytes_up", 0)) + int(sst.get("bytes_down", 0))
        failed = sum(1 for code in self.exit_codes.values() if code not in (0, None))
        return {
            "store": store.url, "learners": learners, "num_learners": M, "num_params": num_params,
            "num_fragments": spec.plan.num_fragments, "wall_s": time.time() - started,
            "initial_eval_loss": initial, "final_eval_loss": final,
            "tokens_total": sum(int(l["tokens"] or 0) for l in learners.values()),
            # fragment-steps trained and then overwritten on adoption before a delta carried them
            "discarded_fragment_steps_ratio": discarded / trained if trained else None,
            # fragment-steps trained past a send when the merge holding it arrived (out of step with the merges)
            "out_of_step_fragment_steps_ratio": past_send / trained if trained else None,
            "versions_published": {str(p): v for p, v in sorted(led["versions_published"].items())},
            "final_versions": {str(p): v for p, v in versions.items()},
            "deltas_written": led["deltas_written"], "deltas_merged": led["deltas_merged"],
            "deltas_superseded": led["deltas_superseded"], "deltas_rejected": led["deltas_rejected"],
            "rejected_by_reason": led["rejected_by_reason"], "deltas_unaccounted": led["deltas_unaccounted"],
            "unaccounted_keys": led["unaccounted_keys"],
            "bytes_up": bytes_up + int(sst.get("bytes_up", 0)),
            "bytes_down": bytes_down + int(sst.get("bytes_down", 0)),
            "learner_bytes_up": bytes_up, "learner_bytes_down": bytes_down,
            "dp_allreduce_bytes": dp_bytes,
            "dp_allreduce_ratio": (dp_bytes / moved) if moved else None,
            "syncer": {k: syncer_status.get(k) for k in ("counters", "ema_step_s", "ema_quorum_s", "ema_sync_s")},
            "merges": led["merges"],
            "global_evals": self.global_evals,
            "processes_failed": failed, "exit_codes": self.exit_codes,
            "_ledger_skipped": led["skipped_unverified"], "junk_keys": led["junk_keys"],
        }
