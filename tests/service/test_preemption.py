"""Spot learners as real processes: a preemption notice (fake AWS/GCE metadata server) or SIGTERM
makes a learner flush, checkpoint and exit 0; a restarted learner resumes from its checkpoint; a
never-seen learner joins a running job and is merged within two fragment periods."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import deadline, free_port, wait_until

from ddiloco_geo.core import config

from ddiloco_geo.core import layout

from ddiloco_geo import protocol
from ddiloco_geo.storage import open_store
from tests.agent.fake_metadata import FakeMetadata

pytestmark = pytest.mark.slow

SETTINGS = (
    '[model]\nname = "nano"\n[data]\nmax_bytes = 400000\n[fragments]\nnum_fragments = 8\nsync_every = 8\n'
    '[learner]\nmax_steps = 100000\nlog_every = 4\nheartbeat_s = 0.3\n'
)


class Job:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.url = f"file://{tmp_path / 'store'}"
        self.settings = tmp_path / "settings.toml"
        self.settings.write_text(SETTINGS)
        self.env = dict(os.environ, OMP_NUM_THREADS="1")
        self.procs: list[subprocess.Popen] = []
        self.store = open_store(config.load(cli={"storage": {"url": self.url}}, environ={})[0].storage)

    def start(self, role: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{role}-{len(self.procs)}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "ddiloco_geo", role, "--config", str(self.settings),
                                 "--store", self.url, *args], cwd=self.tmp, env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        return proc

    def heartbeat(self, learner: str) -> dict:
        try:
            return json.loads(self.store.get(layout.heartbeat_key(learner)))
        except Exception:
            return {}

    def wait_step(self, learner: str, step: int, timeout_s: float = 300) -> None:
        wait_until(lambda: (self.heartbeat(learner).get("step") or 0) >= step, timeout_s, interval_s=0.2,
                   what=lambda: f"{learner} at step {step}; log: {self.logs()}")

    def exit_record(self, learner: str) -> dict:
        return json.loads(self.store.get(layout.exit_key(learner)))

    def logs(self) -> str:
        return "\n".join(p.read_text()[-1500:] for p in sorted(self.tmp.glob("*.log")))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=deadline(120))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.store.close()


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    j.stop()


def test_spot_notice_flushes_checkpoints_and_exits_zero_then_resumes(job):
    metadata = FakeMetadata(cloud="aws").start()
    try:
        syncer = job.start("syncer")
        learner = job.start("learner", "--id", "spot-1", "--set", "agent.provider=aws",
                            "--set", f"agent.metadata_url={metadata.url}", "--set", "agent.poll_s=0.2")
        job.wait_step("spot-1", 20)
        metadata.trigger_spot(action="terminate")
        assert learner.wait(timeout=deadline(60)) == 0, job.logs()
        first = job.exit_record("spot-1")
        assert first["reason"] == "aws-spot"
        assert first["flushed"] is True  # within its own flush_deadline_s (how fast: bench, not here)
        assert first["checkpoint"].startswith("learners/spot-1/checkpoints/")
        # every fragment's unsent work was flushed: its last delta is at the last step, unless a global
        # adopted at that very step left it nothing unsent; the checkpoint's last_sent_step says which
        headers = [protocol.read_header(job.store, k) for k in job.store.list(layout.deltas_dir("spot-1"))]
        last = {}
        for h in headers:
            last[h.fragment] = max(last.get(h.fragment, 0), h.extra["step"])
        ckpt = protocol.read_header(job.store, first["checkpoint"])
        assert ckpt.extra["last_sent_step"] == [first["step"]] * 8
        assert set(last) == set(range(8)) and max(last.values()) == first["step"]

        # the same learner restarted (a new spot VM) resumes from its checkpoint
        again = job.start("learner", "--id", "spot-1")
        job.wait_step("spot-1", first["step"] + 10)
        again.send_signal(signal.SIGTERM)
        assert again.wait(timeout=deadline(60)) == 0, job.logs()
        second = job.exit_record("spot-1")
        assert second["resumed_from"] == first["checkpoint"]
        assert second["reason"] == "sigterm"
        assert second["step"] > first["step"]
        seqs = [layout.parse_delta_key(k).seq for k in job.store.list(layout.deltas_dir("spot-1"))]
        assert seqs == list(range(len(seqs)))  # the sequence continues across incarnations
        syncer.send_signal(signal.SIGTERM)
        assert syncer.wait(timeout=deadline(120)) == 0, job.logs()
        ledger = protocol.ledger(job.store)
        assert ledger["deltas_unaccounted"] == 0 and ledger["deltas_merged"] == len(seqs)
    finally:
        metadata.stop()


def test_gce_preemption_notice(job):
    metadata = FakeMetadata(cloud="gce").start()
    try:
        job.start("syncer")
        learner = job.start("learner", "--id", "gce-1", "--set", "agent.provider=gce",
                            "--set", f"agent.metadata_url={metadata.url}")
        job.wait_step("gce-1", 10)
        metadata.preempt()
        assert learner.wait(timeout=deadline(60)) == 0, job.logs()
        assert job.exit_record("gce-1")["reason"] == "gce-preempted"
    finally:
        metadata.stop()


def test_scavenged_learner_is_merged_within_two_fragment_periods(job):
    job.start("syncer")
    job.start("learner", "--id", "base-1")
    job.wait_step("base-1", 24)
    job.start("learner", "--id", "scavenged-1")  # capacity that appears mid-run
    job.wait_step("scavenged-1", 2 * 8 + 4)  # two fragment periods (H = 8) and a little slack

    def first_accounted() -> list[dict] | None:
        """The merge records once its first delta (seq 0) is in one: merged, or superseded by its own
        newer delta on the same base (deltas are cumulative; a syncer slower than H steps sees both in
        one round). Each fragment's rounds close on their own: seq 1 may be merged first (CI saw it)."""
        records = protocol.merge_records(job.store)
        superseded = [layout.parse_delta_key(k) for r in records for k in r.get("superseded", [])]
        merged = [(e["learner"], e["seq"]) for r in records for e in r.get("merged", [])]
        first = ("scavenged-1", 0)
        return records if first in merged or first in [(d.learner, d.seq) for d in superseded] else None

    def rejected() -> list[str]:
        return job.store.list(f"{layout.SYNCER}rejected/scavenged-1/")

    records = wait_until(first_accounted, 60, interval_s=0.3, what=lambda: f"a merge of scavenged-1's seq 0 (rejected: {rejected()}); log: {job.logs()}")
    assert rejected() == []
    merged = [e for r in records for e in r.get("merged", []) if e["learner"] == "scavenged-1"]
    # its first delta was taken against a version newer than 0: it joined from the latest globals
    assert any(e["base_version"] > 0 for e in merged)


def scrape(port: int, path: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=deadline(5)) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_and_health_endpoints_are_scraped_from_live_processes(job):
    sport, lport = free_port(), free_port()
    job.start("syncer", "--set", f"metrics.address=127.0.0.1:{sport}")
    job.start("learner", "--id", "metered", "--set", f"metrics.address=127.0.0.1:{lport}")
    job.wait_step("metered", 30)

    def syncer_has_merged() -> bool:  # its counters are exported once per status period
        code, text = scrape(sport, "/metrics")
        merged = [l for l in text.splitlines() if l.startswith("ddiloco_syncer_deltas_merged_total")]
        return code == 200 and bool(merged) and float(merged[0].split(" ")[-1]) > 0

    wait_until(syncer_has_merged, 60, interval_s=0.3, what=lambda: f"a merge on the syncer's /metrics; log: {job.logs()}")
    code, text = scrape(lport, "/metrics")
    assert code == 200
    values = {line.split(" ")[0]: float(line.split(" ")[-1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["ddiloco_learner_steps_total"] >= 30
    assert values["ddiloco_learner_tokens_total"] >= 30 * 8 * 128
    assert sum(v for k, v in values.items() if k.startswith("ddiloco_learner_deltas_sent_total")) >= 8
    assert values["ddiloco_learner_storage_bytes_up_total"] > 0
    assert scrape(lport, "/healthz")[0] == 200
    code, text = scrape(sport, "/metrics")
    assert code == 200
    assert "ddiloco_syncer_contributors_per_merge_count" in text
    merged = [l for l in text.splitlines() if l.startswith("ddiloco_syncer_deltas_merged_total")]
    assert merged and float(merged[0].split(" ")[-1]) > 0
    assert scrape(sport, "/healthz")[0] == 200
