"""`ddiloco-geo report` on real recorded runs: a finished `ddiloco-geo local` run (recorded once per
module) and a live run (a syncer and one learner still training). The report reads the bucket only:
the store's full listing and object sizes are compared before and after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import deadline, wait_until

pytestmark = pytest.mark.slow

SMALL = ["--model", "nano", "--set", "data.max_bytes=400000", "--set", "fragments.num_fragments=8",
         "--set", "fragments.sync_every=8", "--set", "learner.schedule=own"]  # own: each learner takes exactly --steps
CHARTS = ("eval_loss", "throughput", "merges", "bytes", "timeline")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def ddiloco(*argv: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ddiloco_geo", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=deadline(timeout))


def listing(root: Path) -> dict[str, int]:
    """Every file under the store (objects, temp files and lock files) with its size."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()} | {
        str(p.relative_to(root)) + "/": 0 for p in sorted(root.rglob("*")) if p.is_dir()}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recorded")
    proc = ddiloco("local", "--learners", "2", "--steps", "40", *SMALL, "--store", f"file://{tmp / 'store'}",
                   "--out", str(tmp / "out"), "--no-live", cwd=tmp, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp


@pytest.fixture(scope="module")
def reported(recorded):
    """One report of the finished run, with the store listed before and after."""
    store = recorded / "store"
    before = listing(store)
    proc = ddiloco("report", f"file://{store}", "--out", str(recorded / "report"), "--json", "--eval-points", "5",
                   "--eval-batches", "4", "--set", "data.max_bytes=400000", cwd=recorded)
    assert proc.returncode == 0, proc.stderr[-4000:]
    after = listing(store)
    return {"dir": recorded / "report", "summary": json.loads(proc.stdout), "stderr": proc.stderr,
            "before": before, "after": after}


def test_report_writes_every_chart_and_the_page(reported):
    out = reported["dir"]
    for name in CHARTS:
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, name
        assert png.stat().st_size > 10_000, (name, png.stat().st_size)
    md = (out / "report.md").read_text()
    assert md.startswith("# ddiloco-geo run")
    for name in CHARTS:
        assert f"]({name}.png)" in md
    assert "learner-0" in md and "learner-1" in md and "exit" in md
    assert "<img src='eval_loss.png'" in (out / "report.html").read_text()
    assert json.loads((out / "report.json").read_text())["run_id"] == reported["summary"]["run_id"]


def test_json_summary_has_the_expected_keys_and_sensible_values(reported):
    s = reported["summary"]
    for key in ("url", "run_id", "state", "global_evals", "initial_eval_loss", "final_eval_loss", "learners",
                "merges", "merge_stats", "bytes", "events", "ledger", "charts", "page", "tokens_total", "num_params"):
        assert key in s, key
    assert s["state"] == "finished"
    evals = s["global_evals"]
    assert len(evals) == 5
    assert evals[0]["tokens"] == 0 and evals[0]["time"] == 0
    assert [e["time"] for e in evals] == sorted(e["time"] for e in evals)
    assert [e["tokens"] for e in evals] == sorted(e["tokens"] for e in evals)
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
    assert 0 < evals[-1]["tokens"] <= s["tokens_total"] == 2 * 40 * 8 * 128
    assert s["merge_stats"]["count"] > 0 and all(m["contributors"] >= 1 for m in s["merges"])
    assert s["merge_stats"]["staleness_max"] >= 0
    b = s["bytes"]
    assert b["learner_up"] > 0 and b["learner_down"] > 0 and b["syncer_up"] > 0 and b["total"] > 0
    assert b["dp_allreduce"] > 0 and b["dp_ratio"] > 0
    assert s["ledger"]["deltas_written"] > 0 and s["ledger"]["deltas_unaccounted"] == 0
    assert set(s["learners"]) == {"learner-0", "learner-1"}
    for name, l in s["learners"].items():
        assert l["state"] == "exited" and l["reason"] == "max_steps"
        assert len(l["incarnations"]) == 1 and len(l["checkpoints"]) == 1
        assert l["throughput_history"] and all(r["tokens_per_s"] > 0 for r in l["throughput_history"])
        kinds = [e["kind"] for e in s["events"] if e["learner"] == name]
        assert kinds.count("join") == 1 and "exit" in kinds and "checkpoint" in kinds
    # progress lines on stderr, the summary alone on stdout
    assert reported["stderr"].count("report_eval point=") == 5


def test_the_report_does_not_modify_the_store(reported):
    assert reported["after"] == reported["before"]


def test_summary_json_still_draws_the_local_run_plot(recorded, tmp_path):
    proc = ddiloco("report", str(recorded / "out" / "summary.json"), "--out", str(tmp_path), "--json",
                   cwd=recorded, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    plot = Path(json.loads(proc.stdout)["plot"])
    assert plot == tmp_path / "training.png"
    assert plot.read_bytes()[:8] == PNG_MAGIC and plot.stat().st_size > 10_000


def test_refuses_a_directory_without_a_run_and_an_out_inside_the_run(recorded, tmp_path):
    empty = tmp_path / "nothing"
    proc = ddiloco("report", f"file://{empty}", "--out", str(tmp_path / "r"), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "run.json" in proc.stderr
    assert not empty.exists()
    before = listing(recorded / "store")
    proc = ddiloco("report", f"file://{recorded / 'store'}", "--out", str(recorded / "store" / "report"),
                   cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "never writes there" in proc.stderr
    assert listing(recorded / "store") == before


def test_report_of_a_live_run(tmp_path):
    store = tmp_path / "store"
    settings = tmp_path / "settings.toml"
    settings.write_text(
        '[model]\nname = "nano"\n[data]\nmax_bytes = 400000\n[fragments]\nnum_fragments = 8\nsync_every = 8\n'
        '[learner]\nmax_steps = 100000\nlog_every = 5\n'
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = ["--config", str(settings), "--store", f"file://{store}"]
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in ("syncer", "learner")}
    syncer = subprocess.Popen([sys.executable, "-m", "ddiloco_geo", "syncer", *common], cwd=tmp_path, env=env,
                              stdout=logs["syncer"], stderr=subprocess.STDOUT)
    learner = subprocess.Popen([sys.executable, "-m", "ddiloco_geo", "learner", "--id", "live-0", *common],
                               cwd=tmp_path, env=env, stdout=logs["learner"], stderr=subprocess.STDOUT)
    try:
        def training_with_merges() -> bool:  # a few merges published, and both processes alive
            tape = list((store / "syncer" / "tape").rglob("v*.json")) if store.exists() else []
            merges = [p for p in tape if not p.name.endswith("0000000000.json")]
            assert learner.poll() is None and syncer.poll() is None, (tmp_path / "learner.log").read_text()[-3000:]
            return len(merges) >= 4 and (store / "learners" / "live-0" / "heartbeat.json").exists()

        wait_until(training_with_merges, 180, interval_s=0.5, what="four merges published")
        proc = ddiloco("report", f"file://{store}", "--out", str(tmp_path / "report"), "--json", "--eval-points", "3",
                       "--eval-batches", "1", *common[:2], cwd=tmp_path)
        assert learner.poll() is None, "the learner stopped before the report finished"
    finally:
        for p in (learner, syncer):  # learner first (it flushes), then the syncer (it drains)
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=deadline(90))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for f in logs.values():
            f.close()
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = json.loads(proc.stdout)
    assert s["state"] == "live"
    assert s["learners"]["live-0"]["state"] == "alive"
    assert s["learners"]["live-0"]["incarnations"][0].get("open") is True
    assert s["merge_stats"]["count"] >= 4
    assert len(s["global_evals"]) == 3 and s["global_evals"][0]["tokens"] == 0
    assert s["global_evals"][-1]["tokens"] > 0
    assert s["bytes"]["learner_up"] > 0 or s["bytes"]["syncer_up"] > 0
    for name in CHARTS:
        assert (tmp_path / "report" / f"{name}.png").stat().st_size > 10_000
