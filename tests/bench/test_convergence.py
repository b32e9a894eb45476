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


def _row(arm: str, seed: int, h: float, loss: float, dp: float) -> dict:
    return {"M": 2, "arm": arm, "seed": seed, "h": h, "eval_loss": loss, "dp_eval_loss": dp, "loss_ratio": loss / dp}


@pytest.mark.unit
def test_spread_gives_each_arms_ratio_and_points_from_lock_step_per_seed_with_mean_sd_and_se():
    from ddiloco_geo.tools.bench.convergence import spread

    table = [_row("lockstep", s, 0.5, 9.0, 9.0) for s in (0, 1, 2)]  # a smaller horizon: not in the spread
    table += [_row("lockstep", 0, 1.0, 1.50, 1.50), _row("lockstep", 1, 1.0, 1.53, 1.50), _row("lockstep", 2, 1.0, 1.47, 1.47),
              _row("adopt", 0, 1.0, 1.53, 1.50), _row("adopt", 1, 1.0, 1.53, 1.50), _row("adopt", 2, 1.0, 1.47, 1.47),
              _row("streaming", 1, 1.0, 1.56, 1.50)]  # one seed only: no sd, paired with that seed's lock-step
    rows = {r["arm"]: r for r in spread(table)}
    assert [r["arm"] for r in spread(table)] == ["lockstep", "streaming", "adopt"]  # the ladder's order
    lock, adopt, streaming = rows["lockstep"], rows["adopt"], rows["streaming"]
    assert lock["n"] == 3 and lock["seeds"] == [0, 1, 2] and "points_vs_lockstep" not in lock
    assert lock["loss_ratio"]["values"] == pytest.approx([1.0, 1.02, 1.0])
    assert lock["loss_ratio"]["mean"] == pytest.approx(3.02 / 3)
    points = adopt["points_vs_lockstep"]
    assert points["values"] == pytest.approx([2.0, 0.0, 0.0])  # 100 x (arm - lock-step) / dp, seed by seed
    assert points["mean"] == pytest.approx(2 / 3)
    assert points["sd"] == pytest.approx(math.sqrt(((4 / 3) ** 2 + 2 * (2 / 3) ** 2) / 2))
    assert points["se"] == pytest.approx(points["sd"] / math.sqrt(3))
    assert streaming["n"] == 1 and streaming["loss_ratio"]["sd"] is None and streaming["loss_ratio"]["se"] is None
    assert streaming["points_vs_lockstep"]["values"] == pytest.approx([2.0])


@pytest.mark.unit
def test_seeds_run_the_study_once_per_seed_each_with_its_model_seed(tmp_path, monkeypatch):
    """``--seeds 3,5``: every job once per seed, with that seed as the harness's and as model.seed; the
    table has each seed's rows against that seed's data-parallel, and the spread covers both."""
    import concurrent.futures

    from ddiloco_geo.tools.bench import convergence

    seen = []

    def fake_task(job):
        args = job["args"]
        seen.append((job["arm"], args["seed"], tuple(args["overrides"])))
        loss = {"dp": 2.0, "lockstep": 2.02, "adopt": 2.04}[job["arm"].split("@")[0]] + args["seed"] / 100
        return {"eval_loss": loss, "tokens": 1000, "arm": job["arm"], "M": job["M"], "h": job["h"],
                "steps": job["steps"], "seed": args["seed"], "wall_s": 0.0, **({"lr_scale": job["lr_scale"]} if "lr_scale" in job else {})}

    class InProcessPool:
        def __init__(self, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, job):
            fut = concurrent.futures.Future()
            fut.set_result(fn(job))
            return fut

    monkeypatch.setattr(convergence, "_task", fake_task)
    monkeypatch.setattr(convergence.concurrent.futures, "ProcessPoolExecutor", InProcessPool)
    out = tmp_path / "conv"
    assert main(["bench", "convergence", "--learners", "2", "--horizons", "1", "--seeds", "3,5",
                 "--set", "syncer.outer_lr=0.5", "--out", str(out)]) == 0
    assert sorted(seen) == sorted((arm, s, ("syncer.outer_lr=0.5", f"model.seed={s}"))
                                  for s in (3, 5) for arm in ("dp@0.75", "dp@1.0", "dp@1.25", "lockstep", "adopt"))
    result = json.loads((out / "convergence.json").read_text())
    assert result["seeds"] == [3, 5]
    by = {(r["arm"], r["seed"]): r for r in result["table"]}
    assert by[("adopt", 5)]["dp_eval_loss"] == pytest.approx(2.05)  # its own seed's data-parallel
    adopt = next(r for r in result["spread"] if r["arm"] == "adopt")
    assert adopt["n"] == 2 and adopt["points_vs_lockstep"]["values"] == pytest.approx([100 * 0.02 / 2.03, 100 * 0.02 / 2.05])
    assert "M=2 adopt seed 5" in result["curves"] and (out / "convergence.png").exists()
    with pytest.raises(SystemExit) as err:  # model.seed is what --seeds sets
        main(["bench", "convergence", "--seeds", "1,2", "--set", "model.seed=4"])
    assert "model.seed" in str(err.value)


@pytest.mark.unit
def test_seeds_that_are_not_distinct_integers_are_refused_before_any_training():
    for bad in ("1,x", "2,2"):
        with pytest.raises(SystemExit) as err:
            main(["bench", "convergence", "--seeds", bad])
        assert "--seeds" in str(err.value)
