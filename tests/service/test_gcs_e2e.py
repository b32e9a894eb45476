"""End to end on the GCS server: ``ddiloco-geo local`` (a syncer and learners as OS processes) on
fake-gcs-server, checked like the moto run in ``test_local_e2e.py`` (loss, versions, the ledger),
plus the ledger read back from the server by this process."""

from __future__ import annotations

import json

import pytest

from ddiloco_geo import protocol
from ddiloco_geo.core import layout
from ddiloco_geo.storage import open_store
from tests.conftest import cli_args_for
from tests.service.test_local_e2e import SMALL, check_summary, ddiloco

pytestmark = pytest.mark.slow


def test_two_learners_and_a_syncer_on_the_gcs_server(make_storage_config, tmp_path):
    cfg = make_storage_config("gcs")
    out = tmp_path / "out"
    proc = ddiloco("local", "--learners", "2", "--steps", "40", "--out", str(out), "--json", *SMALL,
                   *cli_args_for(cfg), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    check_summary(summary, learners=2)
    assert summary["store"].startswith("gs://")
    assert summary["deltas_rejected"] == 0
    with open_store(cfg) as store:
        ledger = protocol.ledger(store)
        assert ledger["deltas_unaccounted"] == 0
        assert ledger["deltas_written"] == summary["deltas_written"] == ledger["deltas_merged"]
        for name, learner in summary["learners"].items():
            assert learner["deltas_sent"] == len(store.list(layout.deltas_dir(name))), name
        assert store.get(layout.RUN_SPEC)  # run.json on the server
