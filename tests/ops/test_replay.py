"""Replay: every published version recomputed from the bucket and compared bit for bit."""

from __future__ import annotations

import uuid

import pytest
import torch

from ddiloco_geo import codec

from ddiloco_geo.core import config

from ddiloco_geo.core import layout

from ddiloco_geo.core import merge, signing
from ddiloco_geo.core.clocks import VectorClock

from ddiloco_geo import protocol
from ddiloco_geo.ops.replay import read_state, replay
from ddiloco_geo.storage import open_store
from tests.ops.conftest import cli_json, copy_store, merge_rounds, poll_and_merge, total_versions

OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def fresh_store():
    return open_store(config.StorageConfig(url=f"memory://replay-{uuid.uuid4().hex[:10]}"))


def with_record(store, spec, changes):
    """A copy of ``store`` whose merge records are changed: ``changes[(p, v)](record) -> record``."""
    replace = {}
    for (p, v), change in changes.items():
        g_header, g_tensors = protocol.read_global(store, spec, p, v)
        g_header.extra = change(dict(g_header.extra))
        replace[layout.global_key(p, v)] = codec.encode(g_tensors, g_header, codec="fp32")
    copy = fresh_store()
    copy_store(store, copy, replace=replace)
    return copy


def reencode_global(store, spec, p, v, change):
    """The bytes of global p/v with ``change(tensors)`` applied (header kept, checksum valid)."""
    header, tensors = protocol.read_global(store, spec, p, v)
    return codec.encode(change(tensors), header, codec="fp32")


def test_replay_reproduces_every_version_bit_for_bit(history):
    run, _ = history(rounds=5)
    # a rejected delta and a delta still in flight must not disturb replay
    run.write_delta("evil", 1, steps=0)
    run.write_delta("a", 2, base_version=5)
    result = replay(run.store, run.spec, outer_kwargs=OUTER)
    assert result["ok"] and result["bitwise"], result["first_divergence"]
    assert result["first_divergence"] is None
    assert result["fragments"] == run.spec.plan.num_fragments
    assert result["versions_checked"] == total_versions(run.store, run.spec.plan.num_fragments) == 4 * 6
    assert result["roots"] == {}
    # the history really has what the test claims: int4 updates, stale and superseded deltas
    rec = protocol.read_header(run.store, layout.global_key(0, 4)).extra
    assert sorted(rec["staleness"]) == [0, 0, 2]
    assert protocol.read_header(run.store, layout.global_key(0, 2)).extra["superseded"]
    upd = protocol.read_header(run.store, layout.global_update_key(3, 5))
    assert upd.codec == "int4"


@pytest.mark.parametrize("update_codec", ["none", "fp32", "bf16", "int8"])
def test_replay_with_every_update_codec(history, update_codec):
    run, _ = history(rounds=3, **{"syncer.update_codec": update_codec})
    result = replay(run.store, run.spec, outer_kwargs=OUTER)
    assert result["ok"], (forged_v, {k: v for k, v in result["first_divergence"].items() if k != "detail"})
    assert result["versions_checked"] == 4 * 4


def test_replay_reports_the_first_divergence_of_a_tampered_global(history):
    run, _ = history(rounds=4)
    p, v, name = 2, 3, sorted(run.spec.plan.fragments[2])[0]

    def nudge(tensors):
        t = tensors[name].clone()
        t.view(-1)[0] += 1e-3
        return {**tensors, name: t}

    tampered = fresh_store()
    copy_store(run.store, tampered, replace={layout.global_key(p, v): reencode_global(run.store, run.spec, p, v, nudge)})
    result = replay(tampered, run.spec, outer_kwargs=OUTER)
    assert not result["ok"]
    d = result["first_divergence"]
    assert (d["fragment"], d["version"], d["what"], d["tensor"]) == (p, v, "params", name)
    assert d["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert [x["fragment"] for x in result["divergences"]] == [p]  # the other fragments still match
    # every other fragment fully checked, this one up to the version before the tampered one
    assert result["versions_checked"] == 3 * 5 + v


def test_replay_checks_the_outer_state_and_the_hyperparameters(history):
    run, _ = history(rounds=3)
    p, v = 1, 2
    header, _ = protocol.read_global(run.store, run.spec, p, v)
    state = read_state(run.store, run.spec, header.extra["state_key"])
    st_header, st_tensors = codec.decode(run.store.get(state.key), kind="state")
    mom = sorted(k for k in st_tensors if k.startswith("momentum."))[-1]
    st_tensors[mom] = st_tensors[mom] * 1.0001
    tampered = fresh_store()
    copy_store(run.store, tampered, replace={state.key: codec.encode(st_tensors, st_header, codec="fp32")})
    d = replay(tampered, run.spec, outer_kwargs=OUTER)["first_divergence"]
    assert (d["fragment"], d["version"], d["what"], d["tensor"]) == (p, v, "momentum", mom)

    # the merge record names the outer hyperparameters the syncer used; replay trusts the record
    # over its own settings, and a record that lies about them diverges
    assert replay(run.store, run.spec, outer_kwargs={**OUTER, "lr": 0.69})["ok"]
    lying = with_record(run.store, run.spec, {(0, 1): lambda r: {**r, "outer": {**r["outer"], "lr": 0.69}}})
    d = replay(lying, run.spec, outer_kwargs=OUTER)["first_divergence"]
    assert (d["fragment"], d["version"], d["what"]) == (0, 1, "params")


def test_replay_checks_recorded_weights_and_version_zero(history):
    run, _ = history(rounds=2)
    p = 0
    header, tensors = protocol.read_global(run.store, run.spec, p, 1)
    header.extra["merged"][0]["weight"] += 1.0
    tampered = fresh_store()
    copy_store(run.store, tampered, replace={layout.global_key(p, 1): codec.encode(tensors, header, codec="fp32")})
    d = replay(tampered, run.spec, outer_kwargs=OUTER)["first_divergence"]
    assert (d["fragment"], d["version"], d["what"]) == (p, 1, "weight")

    other_init = {n: t + 1 for n, t in run.params.items()}
    d = replay(run.store, run.spec, outer_kwargs=OUTER, initial_params=other_init)["first_divergence"]
    assert (d["fragment"], d["version"], d["what"]) == (0, 0, "params")


def test_replay_reports_an_unreadable_object(history):
    run, _ = history(rounds=2)
    key = layout.global_key(3, 1)
    data = bytearray(run.store.get(key))
    data[-5] ^= 0x10
    tampered = fresh_store()
    copy_store(run.store, tampered, replace={key: bytes(data)})
    d = replay(tampered, run.spec, outer_kwargs=OUTER)["first_divergence"]
    assert (d["fragment"], d["version"], d["what"]) == (3, 1, "unreadable")
    assert "checksum" in d["detail"]


def test_replay_does_not_depend_on_the_thread_count(history):
    run, _ = history(rounds=3)
    before = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert replay(run.store, run.spec, outer_kwargs=OUTER)["ok"]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("numel", [1_000, 70_001, 2_000_003])
def test_merge_and_quantize_are_thread_count_invariant(numel):
    """The premise of bit-exact replay on tensors large enough for torch to parallelise reductions."""
    gen = torch.Generator().manual_seed(numel)
    vectors = [torch.randn(numel, generator=gen) * (i + 1) for i in range(3)]
    weights = [1.0, 2.5, 0.3]
    header = codec.Header(kind="update", run_id="r")
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            direction = merge.rda(vectors, weights)
            _, sent = codec.decode(codec.encode({"x": direction}, header, codec="int4"))
            results.append((direction, sent["x"]))
    finally:
        torch.set_num_threads(before)
    for direction, sent in results[1:]:
        assert torch.equal(direction, results[0][0]) and torch.equal(sent, results[0][1])


def test_replay_cli_on_a_local_directory(history, tmp_path):
    run, syncer = history(rounds=3, **{"storage.url": f"file://{tmp_path}/run"})
    url = f"file://{tmp_path}/run"
    result = cli_json("replay", "--store", url)
    assert result["ok"] and result["versions_checked"] == 4 * 4 and result["bitwise"] is True
    result = cli_json("replay", "--store", url, "--fragment", "2", "--threads", "1")
    assert result["fragments"] == 1 and result["versions_checked"] == 4
    # the condition for bit-exactness: the syncer's ISA level (here: this process's)
    level = torch.backends.cpu.get_cpu_capability()
    result = cli_json("replay", "--store", url, env={"ATEN_CPU_CAPABILITY": level.lower()})
    assert result["ok"] and result["cpu_capability"] == level
    if level != "DEFAULT":  # other kernels, other bits: reported, never hidden behind a tolerance
        result = cli_json("replay", "--store", url, env={"ATEN_CPU_CAPABILITY": "default"}, expect_rc=1)
        assert result["cpu_capability"] == "DEFAULT" and result["bitwise"] is True
        assert result["first_divergence"]["max_abs_diff"] > 0
    # tamper in place (the local backend allows delete + create): fragment 1, version 2
    p, v = 1, 2
    key = layout.global_key(p, v)
    data = reencode_global(run.store, run.spec, p, v, lambda t: {n: x * 0.5 for n, x in t.items()})
    run.store.delete(key)
    assert run.store.put_if_absent(key, data)
    result = cli_json("replay", "--store", url, expect_rc=1)
    assert not result["ok"]
    d = result["first_divergence"]
    assert (d["fragment"], d["version"], d["what"]) == (p, v, "params")
    assert d["max_abs_diff"] > 0


def test_replay_follows_on_after_more_merges(history):
    run, syncer = history(rounds=2)
    merge_rounds(run, syncer, 2, start=2)
    run.write_delta("a", 0, base_version=syncer.fragments[0].version)
    run.write_delta("b", 0, base_version=syncer.fragments[0].version - 1)
    assert poll_and_merge(syncer) == 1
    assert replay(run.store, run.spec, outer_kwargs=OUTER)["ok"]


def test_replay_reproduces_a_final_merge_and_the_steps_after_it(history):
    # a merge holding final deltas averages the models (syncer.final_merge=average): its record says
    # so, and replay recomputes it and the outer steps that follow it bit for bit
    run, syncer = history(rounds=3)
    final = {"extra": {"final": True}}
    v = syncer.fragments[0].version
    run.write_delta("a", 0, base_version=v, header_overrides=final)
    run.write_delta("b", 0, base_version=v, header_overrides=final)
    assert poll_and_merge(syncer) == 1
    rec = protocol.read_header(run.store, layout.global_key(0, v + 1)).extra
    assert rec["final"] is True
    merge_rounds(run, syncer, 1, start=3)
    result = replay(run.store, run.spec, outer_kwargs=OUTER)
    assert result["ok"] and result["bitwise"], result["first_divergence"]


def test_a_later_final_merge_joins_the_average_with_its_share_and_replays(history):
    # a and b's final deltas averaged the models; c finishes later, alone: its model joins that
    # average with a third (the record's final_share), and replay recomputes it bit for bit
    run, syncer = history(rounds=3, **{"syncer.quorum": 1})
    final = {"extra": {"final": True}}
    v = syncer.fragments[0].version
    for learner in ("a", "b"):
        run.write_delta(learner, 0, base_version=v, header_overrides=final)
    assert poll_and_merge(syncer) == 1
    assert "final_share" not in protocol.read_header(run.store, layout.global_key(0, v + 1)).extra  # in full
    run.write_delta("c", 0, base_version=v + 1, header_overrides=final)
    assert poll_and_merge(syncer) == 1
    rec = protocol.read_header(run.store, layout.global_key(0, v + 2)).extra
    assert rec["final"] is True and rec["final_share"] == pytest.approx(1 / 3)
    result = replay(run.store, run.spec, outer_kwargs=OUTER)
    assert result["ok"] and result["bitwise"], result["first_divergence"]
    # a record that lies about the share diverges there; one that is not a share is a bad record
    lying = with_record(run.store, run.spec, {(0, v + 2): lambda r: {**r, "final_share": 0.5}})
    d = replay(lying, run.spec, outer_kwargs=OUTER)["first_divergence"]
    assert (d["fragment"], d["version"], d["what"]) == (0, v + 2, "params")
    for bad in ("half", 1.5, 0, -0.1, None, True):
        broken = with_record(run.store, run.spec, {(0, v + 2): lambda r: {**r, "final_share": bad}})
        d = replay(broken, run.spec, outer_kwargs=OUTER)["first_divergence"]
        assert (d["fragment"], d["version"], d["what"]) == (0, v + 2, "record") and "final_share" in d["detail"]


def test_replay_reproduces_a_resend_merged_by_its_share_and_checks_the_record(history):
    # syncer.resends=share: a's second delta on the base of its merged one is applied by its new
    # steps' share; replay takes the merged delta's counters from the version before's state object
    run, syncer = history(rounds=3, **{"syncer.resends": "share"})
    v = syncer.fragments[0].version
    base = syncer.fragments[0].merged_base["a"]
    run.write_delta("a", 0, base_version=base, steps=10, tokens=640)  # its merged delta had 4 steps, 256 tokens
    run.write_delta("b", 0, base_version=v, steps=3, tokens=300)
    assert poll_and_merge(syncer) == 1
    entry = next(e for e in protocol.read_header(run.store, layout.global_key(0, v + 1)).extra["merged"] if e["learner"] == "a")
    assert entry["resent"] == [4, 256] and entry["share"] == pytest.approx(0.6)
    merge_rounds(run, syncer, 1, start=3)
    result = replay(run.store, run.spec, outer_kwargs=OUTER)
    assert result["ok"] and result["bitwise"], result["first_divergence"]

    def lie(field, value):
        def change(r):
            merged = [dict(e, **{field: value}) if e["learner"] == "a" else e for e in r["merged"]]
            return {**r, "merged": merged}
        return with_record(run.store, run.spec, {(0, v + 1): change})

    for field, value in (("share", 0.5), ("resent", [3, 256]), ("resent", "4,256")):
        d = replay(lie(field, value), run.spec, outer_kwargs=OUTER)["first_divergence"]
        assert (d["fragment"], d["version"], d["what"]) == (0, v + 1, "record") and "resent" in d["detail"]


def test_replay_reproduces_a_resend_the_merge_guard_also_scaled(history):
    # clipped and merged by its share: replay scales in the syncer's order, bit for bit
    run, syncer = history(rounds=4, **{"syncer.resends": "share"})
    v = syncer.fragments[0].version
    base = syncer.fragments[0].merged_base["a"]
    big = {n: 0.4 * torch.randn(s) for n, s in run.spec.plan.expect(0).items()}  # 16x the per-step norm: clipped, not rejected
    run.write_delta("a", 0, big, base_version=base, steps=10, tokens=640)
    run.write_delta("b", 0, base_version=v, steps=3, tokens=300)
    assert poll_and_merge(syncer) == 1
    entry = next(e for e in protocol.read_header(run.store, layout.global_key(0, v + 1)).extra["merged"] if e["learner"] == "a")
    assert entry["clip"] < 1.0 and entry["share"] == pytest.approx(0.6)
    result = replay(run.store, run.spec, outer_kwargs=OUTER)
    assert result["ok"] and result["bitwise"], result["first_divergence"]


def test_replay_reproduces_stale_damping_and_checks_the_recorded_factor(history):
    # syncer.stale_damping=inverse: a delta three versions behind merged at 1/3 of its size, beside
    # a current one; replay recomputes the factor from the base and the record's mode
    run, syncer = history(rounds=4, **{"syncer.stale_damping": "inverse", "syncer.anchoring": "base"})
    v = syncer.fragments[0].version
    run.write_delta("a", 0, base_version=v - 3, steps=4, tokens=256)
    run.write_delta("b", 0, base_version=v, steps=4, tokens=256)
    assert poll_and_merge(syncer) == 1
    rec = protocol.read_header(run.store, layout.global_key(0, v + 1)).extra
    damp = {e["learner"]: e.get("damp") for e in rec["merged"]}
    assert damp == {"a": pytest.approx(1 / 3), "b": None}
    result = replay(run.store, run.spec, outer_kwargs=OUTER)
    assert result["ok"] and result["bitwise"], result["first_divergence"]

    def lie(change_entry=None, mode=None):
        def change(r):
            r = {**r, "merged": [change_entry(e) if change_entry and e["learner"] == "a" else e for e in r["merged"]]}
            return {**r, "stale_damping": mode} if mode is not None else r
        return with_record(run.store, run.spec, {(0, v + 1): change})

    for store in (lie(lambda e: {k: x for k, x in e.items() if k != "damp"}),  # the factor dropped
                  lie(lambda e: {**e, "damp": 0.5}), lie(mode="none"), lie(mode="halve")):
        d = replay(store, run.spec, outer_kwargs=OUTER)["first_divergence"]
        assert (d["fragment"], d["version"], d["what"]) == (0, v + 1, "record") and "damp" in d["detail"]


def test_replay_without_an_update_object_tries_the_configured_codec(history):
    """A syncer that crashed between the global and its update object leaves no codec on record."""
    run, _ = history(rounds=3)
    missing = layout.global_update_key(1, 2)
    copy = fresh_store()
    copy_store(run.store, copy)
    copy.delete(missing)
    assert replay(copy, run.spec, outer_kwargs=OUTER, update_codec="int4")["ok"]
    assert replay(copy, run.spec, outer_kwargs=OUTER, update_codec="none")["ok"]  # the record wins


SECRET = "replay-signed-run-secret-0123456789abcdef"


def test_a_forged_global_the_syncer_set_aside_is_not_a_gap(history):
    """Anywhere write in a signed run: a forged global at fragment 0's next version. The syncer sets
    it aside and publishes that merge at the number after; replay (with the run's verifier) skips
    the forged object, counts it, and checks the chain across it. Without the syncer's record of
    the set-aside (an attacker deleted it) the gap is reported."""
    run, syncer = history(rounds=2, **{"security.run_secret": SECRET})
    forged_v = syncer.fragments[0].version + 1
    tensors = {n: torch.full(s, 7.0) for n, s in run.spec.plan.expect(0).items()}
    header = codec.Header(kind="global", run_id=run.spec.run_id, fragment=0, version=forged_v, clock=VectorClock())
    wrong = signing.signer_for("not-the-run-secret-0123456789abcdef", "syncer")
    assert run.store.put_if_absent(layout.global_key(0, forged_v), codec.encode(tensors, header, codec="fp32", signer=wrong))
    merge_rounds(run, syncer, 2, start=2)
    assert syncer.fragments[0].version > forged_v + 1
    assert run.store.list(layout.forged_key(0, forged_v))
    result = replay(run.store, run.spec, outer_kwargs=OUTER, verifier=signing.run_verifier(SECRET), require_signatures=True)
    assert result["ok"], (forged_v, {k: v for k, v in result["first_divergence"].items() if k != "detail"})
    assert result["skipped_unverified"]["by_kind"] == {"global": 1}
    run.store.delete(layout.forged_key(0, forged_v))
    d = replay(run.store, run.spec, outer_kwargs=OUTER, verifier=signing.run_verifier(SECRET),
               require_signatures=True)["first_divergence"]
    assert d["fragment"] == 0 and d["version"] == forged_v and d["what"] == "missing", d


def test_replay_reproduces_per_index_merges_of_topk_deltas(tiny_run):
    run = tiny_run(**{"syncer.grace_gamma": 0.0, "syncer.quorum": 2, "syncer.sparse_average": "per_index"})
    syncer = run.syncer()
    merge_rounds(run, syncer, 3, codec_name="topk")
    rec = protocol.read_header(run.store, layout.global_key(0, 2)).extra
    assert rec["sparse_average"] == "per_index" and len(rec["merged"]) >= 2
    # replay must merge the way the record says: the dense average of these deltas differs
    result = replay(run.store, run.spec, outer_kwargs=OUTER)
    assert result["ok"] and result["bitwise"], result["first_divergence"]


@pytest.mark.parametrize("field, value", [("sparse_average", "bogus"), ("robust", ["median"]),
                                          ("outer", {"lr": 0.7, "momentum": 0.9, "warmup": -3}),
                                          ("outer", {"lr": "fast", "momentum": 0.9}), ("outer", {"beta": 2})])
def test_a_merge_record_naming_an_unknown_merge_is_a_divergence_not_a_crash(history, field, value):
    run, _ = history(rounds=2)
    lying = with_record(run.store, run.spec, {(0, 1): lambda r: {**r, field: value}})
    result = replay(lying, run.spec, outer_kwargs=OUTER)
    d = result["first_divergence"]
    assert not result["ok"] and (d["fragment"], d["version"], d["what"]) == (0, 1, "record")
    assert field in d["detail"] and "release that wrote it" in d["detail"]


def test_an_outer_warm_up_is_recorded_per_merge_and_replayed(history):
    # syncer.outer_warmup: each merge inside the ramp records the lr and momentum it stepped with;
    # the record names the warm-up, so replay reproduces the run whatever its own settings say
    run, syncer = history(rounds=5, **{"syncer.outer_warmup": 3})
    steps = []
    for v in range(1, syncer.fragments[0].version + 1):
        rec = protocol.read_header(run.store, layout.global_key(0, v)).extra
        assert rec["outer"]["warmup"] == 3
        steps.append(rec.get("outer_step"))
    assert steps[0] == {"lr": 1.0, "momentum": 0.0}  # the first merge is the learners' mean
    assert steps[2] == pytest.approx({"lr": 1.0 - 0.3 * 2 / 3, "momentum": 0.9 * 2 / 3})
    assert steps[3:] == [None] * (len(steps) - 3)  # past the ramp: the configured optimizer, not repeated
    result = replay(run.store, run.spec, outer_kwargs=OUTER)
    assert result["ok"] and result["bitwise"], result["first_divergence"]
    # a different warm-up in the records is another run: replay finds the first version it changes
    lying = with_record(run.store, run.spec, {(0, 2): lambda r: {**r, "outer": {**r["outer"], "warmup": 2}}})
    d = replay(lying, run.spec, outer_kwargs=OUTER)["first_divergence"]
    assert (d["fragment"], d["version"], d["what"]) == (0, 2, "params")


def test_a_record_from_before_the_outer_warm_up_replays_without_one(history):
    run, _ = history(rounds=3)
    def without_warmup(r):
        return {**r, "outer": {k: x for k, x in r["outer"].items() if k != "warmup"}}

    old = with_record(run.store, run.spec, {(0, v): without_warmup for v in (1, 2, 3)})
    result = replay(old, run.spec, outer_kwargs={**OUTER, "warmup": 3})
    assert result["ok"] and result["bitwise"], result["first_divergence"]
