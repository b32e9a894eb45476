"""`ddiloco-geo simulate`: JSON on stdout only, charts on disk, every mode runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import deadline

from ddiloco_geo.cli.main import main


def test_goodput_json_and_chart(tmp_path, capsys):
    assert main(["simulate", "--json", "--out", str(tmp_path), "--chips", "150000,300000",
                 "--learners", "2,8"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * 4
    assert {r["system"] for r in rows} == {"dp", "elastic_dp", "ddiloco"}
    png = tmp_path / "goodput.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("mode", ["sensitivity", "hetero", "scavenge", "bandwidth"])
def test_other_modes_print_json_rows(mode, tmp_path, capsys):
    extra = ["--slow-learners", "2", "--fast-learners", "2"] if mode == "hetero" else []
    assert main(["simulate", mode, "--json", "--no-chart", "--out", str(tmp_path), *extra]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert isinstance(rows, list) and rows


def test_calibrate_json_prints_constants(capsys):
    assert main(["simulate", "--calibrate", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["constants"]) >= {"downscale_s", "upscale_s", "restart_s"}


def test_json_mode_keeps_stdout_clean(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ddiloco_geo", "simulate", "bandwidth", "--json",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=deadline(120))
    assert proc.returncode == 0
    json.loads(proc.stdout)
    assert "done" in proc.stderr


def test_bad_flag_value_exits_2(capsys):
    assert main(["simulate", "bandwidth", "--precision", "fp7", "--no-chart"]) == 2
