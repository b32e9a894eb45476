"""``bench syncer``: each round merges every fragment and leaves nothing behind in the process."""

import argparse
import json

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from ddiloco_geo.cli.main import main
from ddiloco_geo.core import config
from ddiloco_geo.tools.bench import syncer as bench_syncer


@pytest.mark.unit
def test_a_round_frees_its_memory_bucket():
    # memory:// buckets are process-wide: a round that kept its objects grew the process by the
    # round's deltas, globals and state every round (~250 MB a round of the small model)
    p = argparse.ArgumentParser()
    bench_syncer.add_arguments(p)
    args = p.parse_args(["--model", "nano", "--learners", "2"])
    settings, _ = config.load(cli={"model": {"name": "nano"}, "syncer": {"grace_gamma": 0.0}})
    before = set(MemoryFileSystem.store)
    rnd = bench_syncer.Round(settings, args, seed=0)
    assert set(MemoryFileSystem.store) - before  # the deltas are there to be merged
    timings = rnd.run()
    assert timings["total_s"] > 0 and timings["cpu_s"] >= 0
    assert set(MemoryFileSystem.store) - before == set()


@pytest.mark.slow
def test_bench_syncer_reports_throughput_and_capacity(capsys):
    assert main(["bench", "syncer", "--json", "--model", "nano", "--learners", "2", "--budget-s", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rounds"] == out["window"] == 3
    assert out["syncer_mb_per_cpu_s"] > 0 and out["ratio_vs_add_cpu"] > 0
    assert out["capacity"]["learners_per_core"] == pytest.approx(
        out["syncer_mb_per_cpu_s"] / out["capacity"]["learner_fp32_mb_per_s"], rel=0.01)
