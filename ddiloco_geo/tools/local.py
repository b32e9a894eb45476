"""``ddiloco-geo local``: the main job on one machine, as real OS processes.

Starts one syncer and M learners as separate processes (``python -m ddiloco_geo syncer|learner``)
on one store (a local directory by default; any ``s3://`` or ``gs://`` URL works the same), shows a
live view built from the bucket (heartbeats and the globals index), evaluates the global model at
the start, periodically and at the end, then writes ``summary.json`` and ``training.png`` to
``--out``.

Shutdown order: learners finish their steps and flush (they exit by themselves); then the syncer
gets SIGTERM and drains (merges everything pending); then the final evaluation and the ledger are
read from the bucket. Every child is stopped by its PID; if the orchestrator is interrupted, the
children get SIGTERM, then SIGKILL after a timeout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--learners", type=int, help="number of learner processes M (default 3)")
    p.add_argument("--out", help="directory for summary.json, training.png and logs (default ./out)")
    p.add_argument("--steps", type=int, help="inner steps per learner")
    p.add_argument("--model", help="built-in model size (nano, tiny, small, ...)")
    p.add_argument("--quorum", type=int, help="syncer quorum K")
    p.add_argument("--join", action="store_true", help="join the existing run at --store instead of starting fresh")
    p.add_argument("--eval-every", type=float, default=20.0, help="seconds between global evaluations (0: start and end only)")
    p.add_argument("--no-live", action="store_true", help="plain progress lines instead of the live table")


def run(args: argparse.Namespace) -> int:
    from ddiloco_geo.cli.settings import settings_from

    settings, _ = settings_from(args, {
        "local.learners": args.learners, "local.out": args.out, "learner.max_steps": args.steps,
        "model.name": args.model, "syncer.quorum": args.quorum, "local.fresh": False if args.join else None,
    })
    summary = LocalRun(settings, eval_every_s=args.eval_every, live=not args.no_live and not args.json).run()
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        print_summary(summary, Path(settings.local.out))
    ok = summary["deltas_unaccounted"] == 0 and summary["processes_failed"] == 0
    return 0 if ok else 1


def print_summary(summary: dict[str, Any], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="ddiloco-geo local: summary", show_header=False)
    ratio = summary.get("dp_allreduce_ratio")
    rows = [
        ("global eval loss", f"{summary['initial_eval_loss']:.3f} -> {summary['final_eval_loss']:.3f}"),
        ("learners / tokens", f"{summary['num_learners']} / {summary['tokens_total']:,}"),
        ("versions published", f"{sum(summary['versions_published'].values())} over {summary['num_fragments']} fragments"),
        ("deltas written / merged / rejected / unaccounted",
         f"{summary['deltas_written']} / {summary['deltas_merged']} / {summary['deltas_rejected']} / "
         f"{summary['deltas_unaccounted']}"),
        ("bytes up / down", f"{summary['bytes_up'] / 2**20:.1f} MiB / {summary['bytes_down'] / 2**20:.1f} MiB"),
        ("data-parallel all-reduce would move", f"{summary['dp_allreduce_bytes'] / 2**20:.1f} MiB"
         + (f" ({ratio:.1f}x more)" if ratio else "")),
        ("wall time", f"{summary['wall_s']:.0f} s"),
        ("written", f"{out / 'summary.json'}, {out / 'training.png'}"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)


class LocalRun:
    def __init__(self, settings, *, eval_every_s: float = 20.0, live: bool = True) -> None:
        self.settings = settings
        self.eval_every_s = eval_every_s
        self.live = live
        self.out = Path(settings.local.out).resolve()
        self.logs = self.out / "logs"
        self.procs: dict[str, subprocess.Popen] = {}
        self.exit_codes: dict[str, int] = {}
        self.global_evals: list[dict[str, float]] = []

    # --- setup -----------------------------------------------------------------------------------

    def _prepare_store(self) -> None:
        url = self.settings.storage.url
        if url.startswith("memory://"):
            from ddiloco_geo.core.errors import ConfigError

            raise ConfigError("memory:// lives inside one process; `local` runs processes: use file://DIR, s3:// or gs://")
        if url.startswith("file://") and self.settings.local.fresh:
            path = Path(url[len("file://"):]).resolve()
            if path.exists() and any(path.iterdir()):
                if not (path / "run.json").exists() and not (path / "globals").exists():
                    from ddiloco_geo.core.errors import ConfigError

                    raise ConfigError(f"{path} is not empty and is not a ddiloco-geo run: choose another --store")
                shutil.rmtree(path)
            path.mkdir(parents=True, exist_ok=True)

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        # M learners and a syncer share the machine's cores: one intra-op thread each by default
        env.setdefault("OMP_NUM_THREADS", "1")
        if self.settings.security.run_secret is not None:
            env["DDILOCO_SECURITY__RUN_SECRET"] = self.settings.security.run_secret.get_secret_value()
        return env

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        logfile = open(self.logs / f"{name}.log", "ab")
        cmd = [sys.executable, "-m", "ddiloco_geo", *argv, "--config", str(self.out / "settings.json")]
        self.procs[name] = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, env=self._child_env())
        logfile.close()
        log.info("process_started name=%s pid=%d", name, self.procs[name].pid)

    # --- the run ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from ddiloco_geo.storage import open_store

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
        try:
            evaluator = Evaluator(s)
            initial = evaluator.initial()
            self.global_evals.append({"time": 0.0, "tokens": 0, "loss": initial})
            log.info("eval initial_loss=%.4f", initial)
            self._watch(store, evaluator, started)
            self._stop_syncer()
            from ddiloco_geo import protocol

            spec = protocol.load_spec(store)
            final, versions = evaluator.global_loss(store, spec)
            tokens = self._tokens(store)
            self.global_evals.append({"time": time.time() - started, "tokens": tokens, "loss": final})
            summary = self._summary(store, spec, initial, final, versions, started)
        finally:
            self._terminate_all()
            store.close()
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        from ddiloco_geo.ops.report import plot_local_run

        plot_local_run(summary, self.out / "training.png")
        log.info("summary_written path=%s plot=%s", self.out / "summary.json", self.out / "training.png")
        return summary

    def _learner_names(self) -> list[str]:
        return [n for n in self.procs if n.startswith("learner-")]

    def _watch(self, store, evaluator: "Evaluator", started: float) -> None:
        from ddiloco_geo.ops.status import LiveView

        view = LiveView(store, live=self.live)
        last_eval = time.monotonic()
        with view:
            while True:
                for name, proc in self.procs.items():
                    if name not in self.exit_codes and proc.poll() is not None:
                        self.exit_codes[name] = proc.returncode
                        level = logging.INFO if proc.returncode == 0 else logging.WARNING
                        log.log(level, "process_exited name=%s code=%d log=%s", name, proc.returncode,
                                self.logs / f"{name}.log")
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

    def _eval_now(self, store, evaluator: "Evaluator", started: float) -> None:
        from ddiloco_geo import protocol
        from ddiloco_geo.core.errors import DdilocoError

        try:
            spec = protocol.load_spec(store)
            loss, _ = evaluator.global_loss(store, spec, quick=True)
            self.global_evals.append({"time": time.time() - started, "tokens": self._tokens(store), "loss": loss})
        except (DdilocoError, OSError) as exc:
            log.debug("eval_skipped error=%s", exc)

    def _tokens(self, store) -> int:
        from ddiloco_geo.core import layout
        from ddiloco_geo.core.errors import NotFoundError

        total = 0
        for name in self._learner_names():
            for key in (layout.exit_key(name), layout.heartbeat_key(name)):
                try:
                    total += int(json.loads(store.get(key)).get("tokens", 0))
                    break
                except (NotFoundError, ValueError):
                    continue
        return total

    def _stop_syncer(self) -> None:
        proc = self.procs["syncer"]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                log.error("syncer_drain_timeout pid=%d action=kill", proc.pid)
                proc.kill()
                proc.wait()
        self.exit_codes["syncer"] = proc.returncode

    def _terminate_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # --- the summary -----------------------------------------------------------------------------

    def _summary(self, store, spec, initial: float, final: float, versions: dict[int, int], started: float) -> dict[str, Any]:
        from ddiloco_geo.core import layout
        from ddiloco_geo import protocol
        from ddiloco_geo.core.errors import NotFoundError

        led = protocol.ledger(store)
        learners = {}
        bytes_up = bytes_down = 0
        steps_total = 0
        for name in self._learner_names():
            try:
                rec = json.loads(store.get(layout.exit_key(name)))
            except NotFoundError:
                rec = {}
            st = rec.get("storage", {})
            bytes_up += int(st.get("bytes_up", 0))
            bytes_down += int(st.get("bytes_down", 0))
            steps_total += int(rec.get("step", 0))
            learners[name] = {
                "tokens": rec.get("tokens", 0), "steps": rec.get("step", 0), "final_loss": rec.get("loss"),
                "tokens_per_s": rec.get("tokens_per_s"), "deltas_sent": rec.get("uploads", {}).get("deltas_sent", 0),
                "exit_code": self.exit_codes.get(name), "history": rec.get("history", []),
                "bytes_up": st.get("bytes_up", 0), "bytes_down": st.get("bytes_down", 0),
            }
        syncer_status = {}
        try:
            syncer_status = json.loads(store.get(layout.syncer_status_key(0, 1)))
        except (NotFoundError, ValueError):
            pass
        sst = syncer_status.get("storage", {})
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
        }


class Evaluator:
    """Evaluates the global model (the outer parameters, as Streaming DiLoCo's Table 3 advises)."""

    def __init__(self, settings) -> None:
        from ddiloco_geo.core import data as datamod
        from ddiloco_geo.core import model as modelmod

        self.settings = settings
        self.modelmod, self.datamod = modelmod, datamod
        corpus = datamod.load_corpus(settings.data.corpus, max_bytes=settings.data.max_bytes)
        _, eval_data = datamod.split(corpus, settings.data.eval_ratio)
        self.batches = datamod.eval_batches(eval_data, settings.model.block_size, settings.learner.batch_size,
                                            settings.data.eval_batches)
        self.model = modelmod.build_model(settings.model)

    def initial(self) -> float:
        return self.datamod.evaluate(self.model, self.batches)

    def global_loss(self, store, spec, quick: bool = False) -> tuple[float, dict[int, int]]:
        from ddiloco_geo import protocol

        params, versions = protocol.read_global_params(store, spec)
        self.modelmod.set_tensors(self.model, params)
        batches = self.batches[: max(1, len(self.batches) // 4)] if quick else self.batches
        return self.datamod.evaluate(self.model, batches), versions
