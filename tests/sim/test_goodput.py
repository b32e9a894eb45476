"""The goodput model's invariants (the issue's list) and its calibration."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.sim.calibrate import TARGET_DDILOCO, TARGET_DP, calibrate
from ddiloco_geo.tools.sim.failures import covered_before, union
from ddiloco_geo.tools.sim.goodput import (DAY_S, ClusterModel, simulate_ddiloco, simulate_dp,
                                     simulate_elastic_dp, simulate_grid, trace_for)

MODEL = ClusterModel()
SHORT = replace(MODEL, horizon_s=2 * DAY_S)


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    return simulate_grid(model=MODEL, seed=0)


def cell(rows, system, chips, learners=1):
    return next(r for r in rows if (r["system"], r["chips"], r["learners"]) == (system, chips, learners))


def test_union_and_coverage_are_exact():
    s, e = union(np.array([0.0, 1.0, 5.0, 5.5]), np.array([2.0, 1.5, 6.0, 7.0]), 10.0)
    assert s.tolist() == [0.0, 5.0] and e.tolist() == [2.0, 7.0]
    assert covered_before(s, e, np.array([1.0, 3.0, 6.0, 9.0])).tolist() == [1.0, 2.0, 3.0, 4.0]


def test_calibrated_defaults_hit_the_paper_headline(grid):
    assert abs(cell(grid, "dp", 1_200_000)["goodput"] - TARGET_DP) <= 0.01
    assert abs(cell(grid, "ddiloco", 1_200_000, 8)["goodput"] - TARGET_DDILOCO) <= 0.01


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_calibration_holds_on_other_seeds(seed):
    trace = trace_for(1_200_000, MODEL, seed)
    assert abs(simulate_dp(trace, MODEL).goodput - TARGET_DP) <= 0.015
    assert abs(simulate_ddiloco(trace, MODEL, learners=8).goodput - TARGET_DDILOCO) <= 0.01


def test_calibrate_recovers_the_defaults():
    result = calibrate(SHORT, seed=0)
    assert abs(result["achieved"]["dp"] - TARGET_DP) <= 0.005
    assert abs(result["achieved"]["ddiloco"] - TARGET_DDILOCO) <= 0.005
    assert result["constants"]["repair_mean_s"] == pytest.approx(MODEL.repair_mean_s, rel=0.15)
    assert result["constants"]["downscale_s"] == pytest.approx(MODEL.downscale_s, rel=0.1)


def test_rows_have_the_documented_schema(grid):
    assert len(grid) == 5 * 6
    for r in grid:
        assert set(r) == {"system", "chips", "learners", "goodput", "uptime"}
        assert r["system"] in ("dp", "elastic_dp", "ddiloco")
        assert 0.0 <= r["goodput"] <= r["uptime"] <= 1.0


def test_goodput_falls_as_chips_grow(grid):
    chips = sorted({r["chips"] for r in grid})
    for system, m in [("dp", 1), ("elastic_dp", 1)] + [("ddiloco", m) for m in (2, 4, 8, 16)]:
        values = [cell(grid, system, n, m)["goodput"] for n in chips]
        assert values == sorted(values, reverse=True), (system, m, values)


def test_goodput_rises_with_m_and_beats_dp(grid):
    for n in sorted({r["chips"] for r in grid}):
        values = [cell(grid, "ddiloco", n, m)["goodput"] for m in (2, 4, 8, 16)]
        assert values == sorted(values), (n, values)
        assert cell(grid, "dp", n)["goodput"] < cell(grid, "elastic_dp", n)["goodput"] < values[0]


def test_one_learner_is_elastic_dp():
    trace = trace_for(600_000, SHORT, 0)
    one = simulate_ddiloco(trace, SHORT, learners=1, quorum=1)
    elastic = simulate_elastic_dp(trace, SHORT)
    assert one.goodput == elastic.goodput and one.uptime == elastic.uptime


@pytest.mark.parametrize("chips,m", [(1_200_000, 8), (2_400_000, 4), (600_000, 2)])
def test_m_learners_on_n_chips_behave_like_one_learner_on_n_over_m(chips, m):
    many = simulate_ddiloco(trace_for(chips, MODEL, 0), MODEL, learners=m).goodput
    one = simulate_elastic_dp(trace_for(chips // m, MODEL, 7), MODEL).goodput
    assert many == pytest.approx(one, abs=0.015)


def test_quorum_k_equal_m_stalls_on_any_learner_pause():
    trace = trace_for(1_200_000, SHORT, 0)
    k1 = simulate_ddiloco(trace, SHORT, learners=8, quorum=1)
    k8 = simulate_ddiloco(trace, SHORT, learners=8, quorum=8)
    assert k1.uptime > 0.999
    assert k8.uptime < 0.5 and k8.goodput < k1.goodput


def test_seeded_runs_are_reproducible_and_seeds_differ():
    a = simulate_grid((300_000,), (4,), SHORT, seed=5)
    b = simulate_grid((300_000,), (4,), SHORT, seed=5)
    c = simulate_grid((300_000,), (4,), SHORT, seed=6)
    assert a == b and a != c


def test_stragglers_cost_more_in_bigger_synchronous_groups():
    slow = replace(SHORT, step_cv=0.05)
    trace = trace_for(1_200_000, slow, 0)
    base = simulate_ddiloco(trace_for(1_200_000, SHORT, 0), SHORT, learners=8).goodput
    assert simulate_ddiloco(trace, slow, learners=8).goodput < base
    assert simulate_dp(trace, slow).goodput < simulate_dp(trace, SHORT).goodput


def test_invalid_settings_say_how_to_fix():
    with pytest.raises(ConfigError, match="quorum"):
        simulate_ddiloco(trace_for(150_000, SHORT, 0), SHORT, learners=4, quorum=5)
    with pytest.raises(ConfigError):
        ClusterModel(downscale_s=-1)


def test_default_grid_runs_in_well_under_a_minute():
    started = time.monotonic()
    simulate_grid(model=MODEL, seed=11)
    assert time.monotonic() - started < 20
