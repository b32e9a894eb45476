"""`ddiloco-geo selfcheck` against real stores: passes, reports JSON, cleans up, fails loudly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, cli_args_for, deadline
from ddiloco_geo.cli.main import main
from ddiloco_geo.storage import open_store


@pytest.mark.parametrize("backend_name", ["local", "memory", "moto", "gcs"])
def test_selfcheck_passes_and_cleans_up(make_storage_config, backend_name, capsys):
    cfg = make_storage_config(backend_name)
    assert main(["selfcheck", *cli_args_for(cfg), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert report["url"] == open_store(cfg).url
    assert [c["name"] for c in report["checks"]] == [
        "create_only", "ranged_get", "not_found", "cas_win", "cas_lose_stale_token", "list_start_after_limit", "delete",
    ]
    assert all(c["ok"] and c["ms"] >= 0 for c in report["checks"])
    with open_store(cfg) as store:
        assert store.list("") == []


def test_selfcheck_table_output(make_storage_config, capsys):
    cfg = make_storage_config("local")
    assert main(["selfcheck", *cli_args_for(cfg)]) == 0
    out = capsys.readouterr().out
    assert "cas_lose_stale_token" in out and "all checks passed" in out


def test_selfcheck_fails_with_exit_1_on_a_missing_bucket(moto_endpoint, capsys):
    from conftest import storage_config_for

    cfg = storage_config_for("moto", "bucket-that-does-not-exist/run", moto_endpoint, retry_attempts=1)
    assert main(["selfcheck", *cli_args_for(cfg), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert "NoSuchBucket" in report["checks"][0]["detail"]


def test_selfcheck_as_a_subprocess(make_storage_config):
    cfg = make_storage_config("moto")
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco_geo", "selfcheck", *cli_args_for(cfg), "--json"],
        cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=deadline(120),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"] is True
