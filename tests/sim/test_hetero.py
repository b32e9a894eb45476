"""Heterogeneous learners: K=M waits, K=1 merges alone, K=1 + grace gets both (paper §4.10.4)."""

from __future__ import annotations

import pytest

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.sim.hetero import HeteroConfig, simulate_hetero, simulate_policy

pytestmark = pytest.mark.unit  # no servers, no subprocesses

CFG = HeteroConfig(horizon_steps=1500)


@pytest.fixture(scope="module")
def rows():
    return {r["policy"]: r for r in simulate_hetero(CFG, seed=0)}


def test_wait_for_all_loses_goodput_to_slow_learners(rows):
    assert rows["K=8"]["mean_learners_per_merge"] == 8
    assert rows["K=8"]["goodput"] < 0.95
    assert rows["K=1"]["goodput"] > 0.99


def test_k1_merges_with_too_few_learners(rows):
    assert rows["K=1"]["mean_learners_per_merge"] < 1.5
    assert rows["K=1"]["merged_work_ratio"] < 0.3


def test_grace_restores_merge_size_without_costing_goodput(rows):
    grace = rows["K=1+grace"]
    assert grace["goodput"] > 0.99
    assert grace["mean_learners_per_merge"] > 6.5
    assert grace["merged_work_ratio"] > 0.8


def test_homogeneous_learners_do_not_wait_even_at_k_equal_m():
    same = HeteroConfig(slow_factor=1.0, slow_cv=0.02, horizon_steps=600)
    assert simulate_policy(same, quorum=8, grace=False)["goodput"] > 0.97


def test_seeded_hetero_is_reproducible():
    assert simulate_hetero(CFG, seed=3) == simulate_hetero(CFG, seed=3)


def test_bad_quorum_is_rejected():
    with pytest.raises(ConfigError):
        simulate_policy(CFG, quorum=9, grace=False)
