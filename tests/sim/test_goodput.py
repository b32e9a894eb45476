"""The goodput model: closed forms vs event simulation, the calibration, and the grid's invariants."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.sim.calibrate import TARGET_DDILOCO, TARGET_DP, calibrate, solve
from ddiloco_geo.tools.sim.failures import draw_trace, simulate_dp_events, simulate_elastic_events
from ddiloco_geo.tools.sim.goodput import (ClusterModel, ddiloco_outcome, dp_outcome, elastic_group,
                                           elastic_outcome, simulate_grid)
from ddiloco_geo.tools.sim.sensitivity import FITTED, FIXED, sensitivity_rows

pytestmark = pytest.mark.unit  # no servers, no subprocesses

MODEL = ClusterModel()


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    return simulate_grid(model=MODEL)


def cell(rows, system, chips, learners=1):
    return next(r for r in rows if (r["system"], r["chips"], r["learners"]) == (system, chips, learners))


def test_calibrated_defaults_hit_the_paper_headline(grid):
    assert cell(grid, "dp", 1_200_000)["goodput"] == pytest.approx(TARGET_DP, abs=0.001)
    assert cell(grid, "ddiloco", 1_200_000, 8)["goodput"] == pytest.approx(TARGET_DDILOCO, abs=0.001)


def test_calibrate_recovers_the_defaults():
    result = calibrate(MODEL)
    assert result["achieved"] == {"dp": TARGET_DP, "ddiloco": TARGET_DDILOCO}
    assert result["constants"]["restart_s"] == pytest.approx(MODEL.restart_s, abs=0.05)
    assert result["constants"]["downscale_s"] == pytest.approx(MODEL.downscale_s, abs=0.05)


@pytest.mark.parametrize("chips", [150_000, 1_200_000, 2_400_000])
def test_closed_form_dp_matches_the_event_simulation(chips):
    trace = draw_trace(chips, MODEL, seed=1)
    assert simulate_dp_events(trace, MODEL) == pytest.approx(dp_outcome(chips, MODEL).goodput, abs=0.015)


@pytest.mark.parametrize("chips", [150_000, 600_000, 2_400_000])
def test_closed_form_elastic_group_matches_the_event_simulation(chips):
    good, stepping = simulate_elastic_events(draw_trace(chips, MODEL, seed=2), MODEL)
    want_good, want_stepping = elastic_group(chips, MODEL)
    assert good == pytest.approx(want_good, abs=0.015)
    assert stepping == pytest.approx(want_stepping, abs=0.015)


def test_rows_have_the_documented_schema(grid):
    assert len(grid) == 5 * 6
    for r in grid:
        assert set(r) == {"system", "chips", "learners", "goodput", "uptime"}
        assert 0.0 <= r["goodput"] <= r["uptime"] <= 1.0


def test_goodput_falls_gently_as_chips_grow(grid):
    chips = sorted({r["chips"] for r in grid})
    for system, m in [("dp", 1), ("elastic_dp", 1)] + [("ddiloco", m) for m in (2, 4, 8, 16)]:
        values = [cell(grid, system, n, m)["goodput"] for n in chips]
        assert values == sorted(values, reverse=True), (system, m, values)
    # hyperbolic, not exponential: doubling chips from 1.2M to 2.4M keeps more than half of dp's goodput
    assert cell(grid, "dp", 2_400_000)["goodput"] > 0.5 * TARGET_DP


def test_goodput_rises_with_m_and_beats_dp(grid):
    for n in sorted({r["chips"] for r in grid}):
        values = [cell(grid, "ddiloco", n, m)["goodput"] for m in (2, 4, 8, 16)]
        assert values == sorted(values), (n, values)
        assert cell(grid, "dp", n)["goodput"] < cell(grid, "elastic_dp", n)["goodput"] < values[0]


def test_one_learner_is_elastic_dp_and_m_learners_are_one_on_n_over_m():
    assert ddiloco_outcome(600_000, MODEL, 1, 1).goodput == elastic_outcome(600_000, MODEL).goodput
    assert ddiloco_outcome(1_200_000, MODEL, 8).goodput == pytest.approx(
        elastic_outcome(150_000, MODEL).goodput, abs=1e-6)


def test_quorum_k_equal_m_stalls_on_any_learner_pause():
    k1 = ddiloco_outcome(1_200_000, MODEL, 8, 1)
    k8 = ddiloco_outcome(1_200_000, MODEL, 8, 8)
    assert k1.uptime > 0.999
    assert k8.uptime < 0.5 and k8.goodput < k1.goodput


def test_stragglers_cost_more_in_bigger_synchronous_groups():
    slow = replace(MODEL, step_cv=0.05)
    assert ddiloco_outcome(1_200_000, slow, 8).goodput < ddiloco_outcome(1_200_000, MODEL, 8).goodput
    assert dp_outcome(1_200_000, slow).goodput < dp_outcome(1_200_000, MODEL).goodput


def test_unreachable_targets_and_invalid_settings_say_how_to_fix():
    with pytest.raises(ConfigError, match="quorum"):
        ddiloco_outcome(150_000, MODEL, 4, 5)
    with pytest.raises(ConfigError):
        ClusterModel(downscale_s=-1)
    with pytest.raises(ConfigError, match="unreachable"):
        solve(replace(MODEL, repair_s=1e7))


def test_sensitivity_keeps_the_targets_and_covers_every_constant():
    rows = sensitivity_rows(MODEL)
    assert {r["constant"] for r in rows} == set(FIXED + FITTED)
    for r in rows:
        if r["recalibrated"] and "cells" in r:
            assert abs(r["cells"]["dp@1.2M"]) < 0.05 and abs(r["cells"]["M8@1.2M"]) < 0.05
    moved = next(r for r in rows if r["constant"] == "restart_s" and r["factor"] == 1.5)
    assert moved["cells"]["dp@1.2M"] < -3
