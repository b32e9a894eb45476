"""Two syncer processes on one bucket, owning the same fragments (both ``--shard 0/1``), on the moto
S3 server and on fake-gcs-server, with two learner processes feeding them.

No lease: the create-only write of ``globals/fPPP/vVVVVVVVVVV.st`` is the commit point, so both
syncers compute versions and, for each version, exactly one create succeeds. Checked from the
bucket: every fragment's versions are 0..N with no gap, each version has exactly one state object
and it is the one its global names (the loser deleted its own), a second create of a version is
refused, and the ledger balances. Checked from the logs: the loser says ``publish_race_lost`` and
and ``fragment_adopted`` for the same fragment and version.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from ddiloco_geo import protocol
from ddiloco_geo.core import layout
from ddiloco_geo.storage import open_store
from tests.conftest import cli_args_for

pytestmark = pytest.mark.slow

SETTINGS = """\
[model]
name = "custom"
n_layer = 1
n_head = 2
n_embd = 16
block_size = 16
[fragments]
num_fragments = 4
sync_every = 4
[data]
max_bytes = 200000
[learner]
max_steps = 32
log_every = 8
[syncer]
quorum = 1
grace_gamma = 0.0
merge_spacing = 0.0
"""
RACE_RE = re.compile(r"publish_race_lost fragment=(\d+) version=(\d+)")
ADOPT_RE = re.compile(r"fragment_adopted fragment=(\d+) version=(\d+)")


def start(argv: list[str], cwd, log_path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(log_path, "w")
    try:
        return subprocess.Popen([sys.executable, "-m", "ddiloco_geo", *argv], cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        log.close()


def stop(proc: subprocess.Popen, timeout_s: float = 120) -> int:
    """SIGTERM this PID, SIGKILL it after ``timeout_s``; its exit code."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def wait_for_ledger(store, timeout_s: float) -> dict:
    end = time.monotonic() + timeout_s
    while True:
        ledger = protocol.ledger(store)
        if ledger["deltas_unaccounted"] == 0 or time.monotonic() > end:
            return ledger
        time.sleep(0.5)


@pytest.mark.parametrize("server", ["moto", "gcs"])
def test_two_syncer_processes_commit_each_version_once(make_storage_config, server, tmp_path):
    cfg = make_storage_config(server)
    (tmp_path / "settings.toml").write_text(SETTINGS)
    common = ["--config", str(tmp_path / "settings.toml"), *cli_args_for(cfg)]
    syncers = [start(["syncer", *common], tmp_path, tmp_path / f"syncer-{i}.log") for i in range(2)]
    learners = []
    try:
        learners = [start(["learner", "--id", f"learner-{i}", *common], tmp_path, tmp_path / f"learner-{i}.log")
                    for i in range(2)]
        for proc in learners:
            assert proc.wait(timeout=400) == 0, (tmp_path / "learner-0.log").read_text()[-3000:]
        with open_store(cfg) as store:
            wait_for_ledger(store, 120)
    finally:
        codes = [stop(p) for p in learners + syncers]
    logs = [(tmp_path / f"syncer-{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0, 0, 0], (codes, logs[0][-2000:], logs[1][-2000:])

    with open_store(cfg) as store:
        ledger = protocol.ledger(store)
        assert ledger["deltas_unaccounted"] == 0, ledger["unaccounted_keys"]
        assert ledger["deltas_rejected"] == 0, ledger["rejected_by_reason"]
        assert ledger["deltas_written"] == ledger["deltas_merged"] > 0
        commits = 0
        for p, newest in ledger["versions_published"].items():
            versions = sorted(layout.parse_global_key(k)[1] for k in store.list(layout.fragment_dir(p))
                              if k.endswith(".st") and "/v" in k and not k.endswith(".update.st")
                              and _is_global(k))
            assert versions == list(range(newest + 1)), (p, versions)
            states = Counter(int(k.rsplit("/v", 1)[1][:layout.VERSION_DIGITS])
                             for k in store.list(layout.syncer_state_dir(p)))
            assert states == Counter(versions), (p, states)  # the losers' state objects are gone
            for v in versions:
                named = protocol.read_header(store, layout.global_key(p, v)).extra["state_key"]
                assert store.list(layout.syncer_state_dir(p) + f"v{v:0{layout.VERSION_DIGITS}d}-") == [named]
            assert store.put_if_absent(layout.global_key(p, newest), b"a second commit") is False
            commits += len(versions)

    races = [(i, tuple(map(int, m))) for i, log in enumerate(logs) for m in RACE_RE.findall(log)]
    adopted = {(i, tuple(map(int, m))) for i, log in enumerate(logs) for m in ADOPT_RE.findall(log)}
    print(f"{server}: {commits} versions committed, {len(races)} publish races lost "
          f"(syncer-0: {sum(1 for i, _ in races if i == 0)}, syncer-1: {sum(1 for i, _ in races if i == 1)}); "
          f"ledger written={ledger['deltas_written']} merged={ledger['deltas_merged']} unaccounted=0")
    assert races, "the two syncers never raced for a version"
    assert all(race in adopted for race in races), (races, adopted)
    for _, (p, v) in races:
        assert v <= ledger["versions_published"][p]  # every lost race is a version someone committed


def _is_global(key: str) -> bool:
    try:
        layout.parse_global_key(key)
        return True
    except layout.LayoutError:
        return False
