"""``bench convergence``: the token-efficiency arithmetic, and a tiny study end to end (every kind of
arm trains, the table and the plot are written)."""

from __future__ import annotations

import json
import math

import pytest

from ddiloco_geo.cli.main import main
from ddiloco_geo.tools.bench.convergence import dp_equivalent, token_efficiency

DP = [(1_000, 3.0), (2_000, 2.5), (4_000, 2.0)]  # data-parallel reaches 2.0 at 4,000 tokens


@pytest.mark.unit
def test_efficiency_interpolates_where_the_arm_crosses_data_parallels_final_loss():
    arm = [(1_000, 3.2), (2_000, 2.6), (4_000, 2.2), (8_000, 1.8)]  # 2.0 halfway (in log tokens) 4k..8k
    eff, extrapolated = token_efficiency(DP, arm)
    assert not extrapolated
    assert eff == pytest.approx(4_000 / (4_000 * math.sqrt(2)))


@pytest.mark.unit
def test_efficiency_extrapolates_and_flags_when_the_arm_never_gets_there():
    arm = [(1_000, 3.2), (2_000, 2.8), (4_000, 2.4)]  # falls 0.4 per doubling: 2.0 one doubling later
    eff, extrapolated = token_efficiency(DP, arm)
    assert extrapolated and eff == pytest.approx(0.5)
    assert token_efficiency(DP, [(1_000, 2.5), (4_000, 2.6)]) == (0.0, True)  # not improving
    assert token_efficiency(DP, [(1_000, 1.9), (4_000, 1.5)]) == (4.0, True)  # better from the start
    assert token_efficiency(DP, [(4_000, 2.0)])[0] is None  # one point: no curve


@pytest.mark.unit
def test_dp_equivalent_reads_the_arms_final_loss_on_data_parallels_curve():
    arm = [(2_000, 3.2), (4_000, 2.5)]  # data-parallel reached 2.5 at 2,000 tokens: half the arm's
    assert dp_equivalent(DP, arm) == (pytest.approx(0.5), False)
    eq, extrapolated = dp_equivalent(DP, [(4_000, 2.75)])  # halfway (log tokens) from 1k to 2k
    assert not extrapolated and eq == pytest.approx(math.sqrt(2) * 1_000 / 4_000)
    assert dp_equivalent(DP, [(4_000, 3.5)]) == (pytest.approx(0.25), True)  # worse than dp at its first point: a bound
    assert dp_equivalent(DP[:1], arm) == (None, False)  # one data-parallel point: no curve


@pytest.mark.slow
def test_a_tiny_study_runs_every_kind_of_arm_and_writes_table_and_plot(tmp_path):
    out = tmp_path / "conv"
    assert main(["bench", "convergence", "--learners", "2", "--tokens-per-param", "0.03", "--horizons", "0.5,1",
                 "--arms", "lockstep,streaming,adopt,faults", "--dp-lr-scales", "1,1.5", "--jobs", "1",
                 "--out", str(out), "--set", "data.max_bytes=200000", "--set", "fragments.sync_every=4"]) == 0
    result = json.loads((out / "convergence.json").read_text())
    rows = {(r["arm"], r["h"]): r for r in result["table"]}
    assert set(rows) == {(a, h) for a in ("lockstep", "streaming", "adopt", "faults") for h in (0.5, 1.0)}
    dp = {(r["h"], r["lr_scale"]): r["eval_loss"] for r in result["dp_runs"]}
    for (arm, h), r in rows.items():
        assert r["tokens"] > 0 and math.isfinite(r["eval_loss"])
        assert r["dp_eval_loss"] == min(dp[(h, 1.0)], dp[(h, 1.5)])  # the tuned baseline
        assert r["loss_ratio"] == pytest.approx(r["eval_loss"] / r["dp_eval_loss"])
        if h == 1.0:
            assert "token_efficiency" in r and "dp_equivalent" in r
    # same tokens per arm: exactly for lock-step and each learner's own schedule; under the default
    # learner.schedule=run the learners stop when the run's steps, read from merges a period late,
    # reach the budget, so up to H (4) steps a learner more (at the full budget: +0.08%)
    lock, adopt, steps = rows[("lockstep", 1.0)]["tokens"], rows[("adopt", 1.0)]["tokens"], rows[("lockstep", 1.0)]["steps"]
    assert lock <= adopt <= lock * (1 + 4 / steps), (lock, adopt, steps)
    assert rows[("faults", 1.0)]["discarded_ratio"] >= 0
    assert (out / "convergence.png").stat().st_size > 10_000


def test_speeds_and_jitter_override_the_arms_own(monkeypatch):
    from ddiloco_geo.tools.bench import convergence
    from ddiloco_geo.tools.inprocess import LearnerSpeed

    seen = []

    def fake(settings, speeds, **kw):
        seen.append(speeds)
        return {"discarded_fragment_steps_ratio": 0.0, "eval_loss": 1.0, "tokens": 1}

    monkeypatch.setattr(convergence, "train_harness", fake)
    args = {"model": "nano", "corpus": None, "seed": 0, "overrides": ["data.max_bytes=200000"], "json": True}
    for speeds, jitter in (("arm", None), ("equal", 0.1), ("hetero", 0.0)):
        convergence._task({"arm": "async", "M": 2, "h": 1.0, "steps": 8,
                           "args": {**args, "speeds": speeds, "jitter": jitter}})
    assert seen == [[LearnerSpeed(1.0, 0.1), LearnerSpeed(1.18, 0.1)],  # the async arm's own: mixed, 10% jitter
                    [LearnerSpeed(1.0, 0.1)] * 2, [LearnerSpeed(1.0, 0.0), LearnerSpeed(1.18, 0.0)]]


@pytest.mark.unit
def test_a_set_that_an_arm_fixes_is_refused_by_name_not_silently_overridden():
    """``--arms adopt --set learner.adopt=overwrite`` would run keep_progress (the arm's own setting
    wins): the study refuses it before any training, naming the key, the arm and its value."""
    with pytest.raises(SystemExit) as err:
        main(["bench", "convergence", "--arms", "lockstep,adopt", "--set", "learner.adopt=overwrite",
              "--set", "syncer.outer_lr=0.5"])
    message = str(err.value)
    assert "learner.adopt" in message and "'adopt'" in message and "keep_progress" in message
    assert "outer_lr" not in message  # a key no arm fixes is fine
    with pytest.raises(SystemExit) as err:  # a key the study itself sets, for every arm
        main(["bench", "convergence", "--arms", "lockstep", "--set", "model.name=small"])
    assert "model.name" in str(err.value) and "--model" in str(err.value)
