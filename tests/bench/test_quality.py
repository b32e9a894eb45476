"""``bench quality``: each side is the best of the rates tried for it, and the ratio is taken between the two bests."""

import json
import math

import pytest

from ddiloco_geo.cli.main import main


@pytest.mark.slow
def test_quality_compares_the_best_rate_of_each_side(capsys):
    assert main(["bench", "quality", "--json", "--model", "nano", "--learners", "2", "--steps", "8",
                 "--max-bytes", "200000", "--variants", "k1_grace,kM", "--dp-lr-scales", "0.25,1", "--lr-scales", "0.5,1",
                 "--set", "fragments.sync_every=4", "--set", "learner.warmup_steps=1",
                 "--set", "data.shard_layout=interleaved"]) == 0
    out = json.loads(capsys.readouterr().out)
    # the JSON says what it measured: the corpus, how it was sharded, every override
    assert (out["corpus"], out["shard_layout"], out["seed"]) == ("shakespeare", "interleaved", 0)
    assert "data.shard_layout=interleaved" in out["overrides"]
    by_lr = out["dp_by_lr"]
    assert set(by_lr) == {"0.0015", "0.006"}  # 0.25 and 1 x the default learner.lr
    assert all(math.isfinite(v) for v in by_lr.values()) and len(set(by_lr.values())) == 2
    assert out["dp_eval_loss"] == min(by_lr.values())
    assert f"{out['dp_lr']:g}" == min(by_lr, key=by_lr.get)
    # Decoupled DiLoCo tuned on its own grid: the first variant's best rate is its figure ...
    tried = out["ddiloco_by_lr"]
    assert set(tried) == {"0.003", "0.006"} and len(set(tried.values())) == 2
    row, lockstep = out["variants"]
    assert row["variant"] == "k1_grace" and row["eval_loss"] == min(tried.values()) == out["ddiloco_eval_loss"]
    assert f"{row['lr']:g}" == min(tried, key=tried.get) and out["lr"] == row["lr"]
    assert out["loss_ratio"] == pytest.approx(row["eval_loss"] / out["dp_eval_loss"])
    # ... and the other variants run at that rate, so they compare mechanisms, not rates
    assert lockstep["variant"] == "kM" and lockstep["lr"] == row["lr"]


@pytest.mark.parametrize("scales", [",", "fast", "0,1", "-1", "inf"])
@pytest.mark.parametrize("bench,flag", [("quality", "--dp-lr-scales"), ("quality", "--lr-scales"),
                                        ("convergence", "--dp-lr-scales")])
def test_benchmarks_refuse_a_list_of_rates_that_is_not_positive_numbers(bench, flag, scales):
    with pytest.raises(SystemExit, match=f"{flag} .*comma list of positive numbers"):
        main(["bench", bench, flag, scales])
