"""A learner + syncer job (``ddiloco-geo local``: a syncer and two learners as OS processes)
through the fault proxy, on moto, LocalStack and fake-gcs-server, with every fault kind at
:data:`~tests.faults.conftest.FAULT_RATE` (the full profile: answers of committed writes are lost
too). The run must finish, the ledger must balance (every delta written is merged, superseded or
rejected with a reason; none unaccounted, none rejected) and nothing may be lost (each learner's
count of deltas sent equals its delta objects in the bucket, read directly from the server).
"""

from __future__ import annotations

import json

import pytest

from ddiloco_geo import protocol
from ddiloco_geo.core import layout
from ddiloco_geo.storage import open_store
from ddiloco_geo.tools.faultproxy import HttpFaultPlan
from tests.conftest import cli_args_for
from tests.faults.conftest import FAULT_RATE, seed_for
from tests.service.test_local_e2e import ddiloco

pytestmark = pytest.mark.slow

# the tiny custom model of tests/service/conftest.py: seconds of CPU per learner, not minutes
TINY_JOB = [
    "--set", "model.name=custom", "--set", "model.n_layer=1", "--set", "model.n_head=2", "--set", "model.n_embd=16",
    "--set", "model.block_size=16", "--set", "fragments.num_fragments=4", "--set", "fragments.sync_every=4",
    "--set", "data.max_bytes=200000", "--set", "data.eval_batches=2", "--set", "learner.log_every=5",
    "--eval-every", "0", "--no-live",
]
# a stalled request costs timeout_s; ten attempts outlast any run of faults at this rate
JOB_STORAGE = {"retry_attempts": 10, "retry_initial_s": 0.02, "retry_max_s": 0.5, "timeout_s": 3.0}


def run_job(cfg, tmp_path, *, learners: int = 2, steps: int = 32) -> dict:
    proc = ddiloco("local", "--learners", str(learners), "--steps", str(steps), "--out", str(tmp_path / "out"),
                   "--json", *TINY_JOB, *cli_args_for(cfg), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def check_nothing_lost(cfg_direct, summary: dict) -> dict:
    """The ledger read straight from the server (no proxy), and each learner's sent count."""
    with open_store(cfg_direct) as store:
        ledger = protocol.ledger(store)
        assert ledger["deltas_unaccounted"] == 0, ledger["unaccounted_keys"]
        assert ledger["deltas_rejected"] == 0, ledger["rejected_by_reason"]
        assert ledger["deltas_written"] == ledger["deltas_merged"] > 0
        for name, learner in summary["learners"].items():
            assert learner["exit_code"] == 0, (name, learner)
            assert learner["deltas_sent"] == len(store.list(layout.deltas_dir(name))) > 0, name
        assert set(ledger["versions_published"]) == set(range(summary["num_fragments"]))
        assert all(v >= 1 for v in ledger["versions_published"].values()), ledger["versions_published"]
    assert summary["processes_failed"] == 0
    assert summary["deltas_unaccounted"] == 0
    return ledger


@pytest.mark.parametrize("server", ["moto", "localstack", "gcs"])
def test_job_through_the_fault_proxy_balances_the_ledger(make_storage_config, fault_proxies, server, tmp_path, request):
    plan = HttpFaultPlan(seed=seed_for(request.node.nodeid), rate=FAULT_RATE)
    cfg = make_storage_config(f"{server}+faults", plan=plan, **JOB_STORAGE)
    proxy = fault_proxies()[-1]
    summary = run_job(cfg, tmp_path)
    stats = proxy.stats()
    direct = cfg.model_copy(update={"endpoint_url": request.getfixturevalue(f"{server}_endpoint")})
    ledger = check_nothing_lost(direct, summary)
    print(f"{server}: proxy {json.dumps(stats)}; ledger written={ledger['deltas_written']} "
          f"merged={ledger['deltas_merged']} superseded={ledger['deltas_superseded']} "
          f"unaccounted={ledger['deltas_unaccounted']} versions={ledger['versions_published']}")
    assert stats["fault_ratio"] >= 0.05, stats
    for kind in ("slowdown_503", "reset_request", "lost_response", "stall"):
        assert stats["faults"].get(kind, 0) > 0, stats
