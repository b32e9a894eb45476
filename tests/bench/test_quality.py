"""``bench quality``: the data-parallel baseline is the best of the rates tried, and the ratio is taken against it."""

import json
import math

import pytest

from ddiloco_geo.cli.main import main


@pytest.mark.slow
def test_quality_compares_with_the_best_data_parallel_rate(capsys):
    assert main(["bench", "quality", "--json", "--model", "nano", "--learners", "2", "--steps", "8",
                 "--max-bytes", "200000", "--variants", "k1_grace", "--dp-lr-scales", "0.25,1",
                 "--set", "fragments.sync_every=4", "--set", "learner.warmup_steps=1"]) == 0
    out = json.loads(capsys.readouterr().out)
    by_lr = out["dp_by_lr"]
    assert set(by_lr) == {"0.0015", "0.006"}  # 0.25 and 1 x the default learner.lr
    assert all(math.isfinite(v) for v in by_lr.values()) and len(set(by_lr.values())) == 2
    assert out["dp_eval_loss"] == min(by_lr.values())
    assert f"{out['dp_lr']:g}" == min(by_lr, key=by_lr.get)
    (row,) = out["variants"]
    assert out["loss_ratio"] == pytest.approx(row["eval_loss"] / out["dp_eval_loss"])


@pytest.mark.parametrize("scales", [",", "fast", "0,1", "-1", "inf"])
@pytest.mark.parametrize("bench", ["quality", "convergence"])
def test_benchmarks_refuse_a_list_of_rates_that_is_not_positive_numbers(bench, scales):
    with pytest.raises(SystemExit, match="dp-lr-scales .*comma list of positive numbers"):
        main(["bench", bench, "--dp-lr-scales", scales])
