"""``ddiloco-geo fault-proxy`` as a process: prints its URL, relays with faults, prints its counters
on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from urllib.parse import urlsplit

import pytest

from ddiloco_geo.storage import open_store

pytestmark = pytest.mark.slow


def test_fault_proxy_command_relays_with_faults_and_reports(make_storage_config, gcs_endpoint):
    target = urlsplit(gcs_endpoint).netloc
    proc = subprocess.Popen([sys.executable, "-m", "ddiloco_geo", "fault-proxy", "--target", target, "--rate", "0.3",
                             "--seed", "5", "--kinds", "slowdown_503,reset_request,latency", "--latency-ms", "20",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = json.loads(proc.stdout.readline())
        cfg = make_storage_config("gcs").model_copy(update={"endpoint_url": started["url"]})
        with open_store(cfg) as store:
            for i in range(20):
                assert store.put_if_absent(f"k{i}", b"v") is True  # no answer is lost with these kinds
                assert store.get(f"k{i}") == b"v"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["requests"] >= 40 and stats["fault_ratio"] > 0.1, stats
    assert set(stats["faults"]) <= {"slowdown_503", "reset_request", "latency"}
