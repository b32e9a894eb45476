"""The merge guard (``syncer.clip_ratio``): an outlier contribution is scaled down to the
fragment's reference, the merge record says so, status counts it, and replay reproduces it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ddiloco_geo import protocol
from ddiloco_geo.ops.replay import replay
from tests.service.conftest import tiny_run  # noqa: F401  (fixture)

pytestmark = pytest.mark.unit


def _round(run, syncer, p, version, scale_of=lambda learner: 1.0):
    for learner in ("a", "b", "c"):
        gen = torch.Generator().manual_seed(hash((learner, version)) % 2**31)
        pg = {n: 0.01 * scale_of(learner) * torch.randn(s, generator=gen) for n, s in run.spec.plan.expect(p).items()}
        run.write_delta(learner, p, pg, base_version=version, steps=4)
    asyncio.run(syncer.poll_once())
    syncer.draining = True
    syncer.merge_ready()
    syncer.draining = False


def _latest_record(run, p):
    v = protocol.latest_version(run.store, p)
    return protocol.read_header(run.store, f"globals/f{p:03d}/v{v:010d}.st").extra


def test_an_outlier_contribution_is_clipped_recorded_counted_and_replayed(tiny_run):
    run = tiny_run(**{"syncer.clip_ratio": 4.0})
    syncer = run.syncer()
    p = 0
    for version in range(3):  # 9 honest deltas: the reference exists
        _round(run, syncer, p, version)
    assert "clip" not in str(_latest_record(run, p)["merged"])
    _round(run, syncer, p, 3, scale_of=lambda learner: 10.0 if learner == "c" else 1.0)
    rec = _latest_record(run, p)
    clipped = {e["learner"]: e["clip"] for e in rec["merged"] if "clip" in e}
    assert set(clipped) == {"c"} and 0.2 < clipped["c"] < 0.6 and rec["clipped"] == 1
    assert syncer.status()["counters"]["contributions_clipped"] == 1
    result = replay(run.store, run.spec, outer_kwargs={"lr": 0.7, "momentum": 0.9, "nesterov": True})
    assert result["ok"] and result["bitwise"], result["first_divergence"]


def test_without_the_guard_the_outlier_moves_the_global_more(tiny_run):
    moves = {}
    for ratio in (4.0, 1e9):  # 1e9: no clipping (None in a cli tree means "not given")
        run = tiny_run(**{"syncer.clip_ratio": ratio})
        syncer = run.syncer()
        for version in range(3):
            _round(run, syncer, 0, version)
        before = run.fragment_params(0, 3)
        _round(run, syncer, 0, 3, scale_of=lambda learner: 10.0 if learner == "c" else 1.0)
        after = run.fragment_params(0, 4)
        moves[ratio] = float(torch.sqrt(sum(((after[n] - before[n]) ** 2).sum() for n in after)))
    assert moves[4.0] < 0.7 * moves[1e9]
