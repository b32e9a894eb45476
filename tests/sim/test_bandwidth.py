"""Bandwidth model sanity: precision scales the wire, DDiLoCo needs orders of magnitude less."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.sim.bandwidth import BandwidthModel, bandwidth_rows, ddiloco_gbps, dp_gbps

pytestmark = pytest.mark.unit  # no servers, no subprocesses

M = BandwidthModel()


def test_step_time_follows_6_params_tokens():
    assert M.step_time_s == pytest.approx(6 * 10e9 * 4 * 1024**2 / (1024 * 459e12 * 0.4))
    assert replace(M, step_s=2.0).step_time_s == 2.0


def test_int4_needs_eight_times_less_than_fp32():
    for u in (0.5, 0.9, 0.99):
        fp32 = ddiloco_gbps(replace(M, precision="fp32"), u)
        int4 = ddiloco_gbps(replace(M, precision="int4"), u)
        assert fp32 / int4 == pytest.approx(8.0)


def test_ddiloco_needs_at_least_100x_less_than_dp_at_defaults():
    rows = bandwidth_rows()
    for u in (0.5, 0.8, 0.9, 0.95, 0.99):
        ddl = next(r for r in rows if r["system"] == "ddiloco" and r["utilization"] == u)
        dp = next(r for r in rows if r["system"] == "dp" and r["utilization"] == u)
        assert dp["gbps_per_learner"] >= 100 * ddl["gbps_per_learner"]
        assert dp["egress_usd_per_hour_per_learner"] > 10 * ddl["egress_usd_per_hour_per_learner"]


def test_bandwidth_grows_with_the_utilization_target():
    values = [dp_gbps(M, u) for u in (0.5, 0.8, 0.9, 0.99)]
    assert values == sorted(values)
    assert [ddiloco_gbps(M, u) for u in (0.5, 0.99)] == sorted(ddiloco_gbps(M, u) for u in (0.5, 0.99))


def test_latency_can_make_dp_unattainable():
    assert dp_gbps(replace(M, rtt_ms=50.0), 0.99) is None
    assert ddiloco_gbps(replace(M, rtt_ms=50.0), 0.99) is not None


def test_rows_schema_and_cost():
    rows = bandwidth_rows(M, (0.9,))
    assert {r["system"] for r in rows} == {"ddiloco", "dp"}
    ddl = rows[0]
    assert set(ddl) == {"system", "utilization", "gbps_per_learner", "precision", "step_s",
                        "bytes_per_hour_per_learner", "egress_usd_per_hour_per_learner"}
    assert ddl["egress_usd_per_hour_per_learner"] == pytest.approx(
        ddl["bytes_per_hour_per_learner"] / 1e9 * 0.02, abs=0.01)


def test_bad_precision_is_rejected():
    with pytest.raises(ConfigError, match="precision"):
        BandwidthModel(precision="fp7")
