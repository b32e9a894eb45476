"""Scavenging: part-time extra learners shorten time to a token budget; DP pays to reconfigure."""

from __future__ import annotations

import pytest

from ddiloco_geo.tools.sim.scavenge import ScavengeConfig, scavenge_rows

pytestmark = pytest.mark.unit  # no servers, no subprocesses


def rows_by(rows):
    return {(r["system"], r["extra_ratio"]): r for r in rows}


def test_no_extra_compute_means_no_speedup():
    r = rows_by(scavenge_rows(ScavengeConfig(), (0.0,)))
    assert r[("ddiloco", 0.0)]["hours_to_budget"] == pytest.approx(168.0, abs=0.1)
    assert r[("base_only", 0.0)]["hours_to_budget"] == 168.0


def test_ddiloco_gains_from_extra_compute_and_beats_dp():
    r = rows_by(scavenge_rows())
    speedups = [r[("ddiloco", x)]["speedup_vs_base"] for x in (0.25, 0.5, 1.0, 3.0)]
    assert speedups == sorted(speedups) and speedups[0] > 1.0
    for x in (0.25, 0.5, 1.0, 3.0):
        assert r[("ddiloco", x)]["hours_to_budget"] < r[("dp_reconfig", x)]["hours_to_budget"]


def test_same_region_dp_only_pays_reconfiguration():
    r = rows_by(scavenge_rows(ScavengeConfig(wan_gbps=0), (1.0,)))
    dp, ddl = r[("dp_reconfig", 1.0)]["hours_to_budget"], r[("ddiloco", 1.0)]["hours_to_budget"]
    assert dp == pytest.approx(ddl, rel=0.01)
