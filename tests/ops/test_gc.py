"""``ddiloco-geo gc``: the retention policy on a live run with a snapshot, a lagging learner, a
delta in flight and a rejected delta; the run, ``replay`` and ``restore`` still work afterwards."""

from __future__ import annotations

import json
import time

from ddiloco_geo import protocol
from ddiloco_geo.cli.main import main
from ddiloco_geo.core import layout, signing
from ddiloco_geo.ops.gc import apply_gc, bytes_held, plan_gc
from ddiloco_geo.ops.replay import replay
from ddiloco_geo.ops.snapshot import load_manifest, restore_to, take_snapshot
from tests.ops.conftest import merge_rounds, poll_and_merge

OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
POLICY = {"keep_versions": 2, "replay_window_s": 0.0, "lag_window_s": 600.0}


def fresh_rounds(run, syncer, rounds: int) -> None:
    """Rounds where every delta is based on the current version (no stale learner)."""
    for _ in range(rounds):
        for p in range(run.spec.plan.num_fragments):
            current = syncer.fragments[p].version
            run.write_delta("a", p, base_version=current, codec_name="int4", steps=4, tokens=256)
            run.write_delta("b", p, base_version=current, codec_name="int4", steps=3, tokens=300)
        assert poll_and_merge(syncer) == run.spec.plan.num_fragments


def live_run(history):
    run, syncer = history(rounds=4)  # learner c merges two versions stale from round 2 on
    take_snapshot(run.store, run.spec, "keep")  # versions 4
    fresh_rounds(run, syncer, 4)  # newest 8
    num = run.spec.plan.num_fragments
    lagging = [8] * num
    lagging[1] = 3
    run.store.cas(layout.heartbeat_key("lag"), json.dumps({"versions": lagging, "time": time.time()}).encode(), None)
    in_flight = run.write_delta("b", 0, base_version=7)
    rejected = run.write_delta("evil", 2, steps=0)
    assert poll_and_merge(syncer) == 0  # evil is rejected, b alone is below quorum
    return run, syncer, in_flight, rejected


def test_dry_run_deletes_nothing_and_counts(history):
    run, _, _, _ = live_run(history)
    before = run.store.list("")
    plan = plan_gc(run.store, **POLICY)
    assert plan.delete and run.store.list("") == before
    assert main(["gc", "--store", run.settings.storage.url, "--dry-run", "--json", "--bytes",
                 "--set", "gc.replay_window_s=0", "--keep-versions", "2"]) == 0
    assert run.store.list("") == before


def test_gc_keeps_what_snapshot_lagging_learner_syncer_and_replay_need(history, tiny_run, capsys):
    run, syncer, in_flight, rejected = live_run(history)
    held = sum(bytes_held(run.store).values())
    plan = plan_gc(run.store, **POLICY)
    assert apply_gc(run.store, plan) == len(plan.delete) > 0
    assert sum(bytes_held(run.store).values()) < held
    keys = set(run.store.list(""))
    manifest = load_manifest(run.store, "keep")
    for entry in manifest["fragments"].values():  # the snapshot's objects
        assert entry["global"] in keys and entry["state_key"] in keys
    for p in range(run.spec.plan.num_fragments):
        floor = plan.floors[p]
        assert floor <= 4  # the snapshot's version
        assert floor == 4 or p == 1  # stale merges below the snapshot pin fragment 1's chain further
        assert protocol.list_versions(run.store, p) == list(range(floor, 9))  # contiguous chain
        assert layout.global_key(p, 8) in keys  # newest
    assert plan.floors[1] <= 3 and layout.global_key(1, 3) in keys  # the lagging learner's base
    assert in_flight in keys and rejected not in keys  # in flight stays; rejected goes (window 0)
    assert any(k.startswith(layout.SYNCER + "rejected/") for k in keys)  # the reason stays
    assert layout.global_key(0, 3) not in keys and layout.global_update_key(0, 3) not in keys
    assert not [k for k in keys if k.startswith(layout.syncer_state_dir(0)) and "/v0000000003-" in k]
    assert plan.summary()["by_kind"]["delta"] > 0  # deltas merged into versions at or below the floor

    merge_rounds(run, syncer, 2, start=8)  # the run goes on (c anchors at v-2)
    result = replay(run.store, run.spec, outer_kwargs=OUTER)
    assert result["ok"], result["first_divergence"]
    assert result["roots"]  # rooted at each floor
    new = tiny_run(**{"syncer.grace_gamma": 0.0, "syncer.quorum": 2})
    new.store.delete(layout.RUN_SPEC)
    assert restore_to(run.store, manifest, new.store) == {p: 4 for p in range(run.spec.plan.num_fragments)}

    # a second gc is idempotent-safe and still keeps the chain
    again = plan_gc(run.store, **POLICY)
    apply_gc(run.store, again)
    assert replay(run.store, run.spec, outer_kwargs=OUTER)["ok"]


SECRET = "gc-signed-run-secret-0123456789abcdef"


def test_forged_objects_cannot_make_gc_delete_honest_objects(history):
    """Anywhere write in a signed run: a forged rejection record and a forged merge record (tape entry;
    the global's signed header is read instead) naming an honest delta in flight, a forged global at a huge version of every fragment, a heartbeat with a
    string time, a malformed manifest. gc keeps the delta and every honest version it would keep
    anyway, does not crash, and counts what it skipped. Without a verifier the same bucket would
    lose its newest honest versions (what the verification prevents)."""
    run, syncer = history(rounds=4, **{"security.run_secret": SECRET})
    num = run.spec.plan.num_fragments
    newest = {p: syncer.fragments[p].version for p in range(num)}
    pending = run.write_delta("a", 0, base_version=newest[0])  # not polled yet: in flight
    run.store.put_if_absent(layout.rejected_key("a", 10**6, 0),
                            json.dumps({"key": pending, "learner": "a", "reason": "norm", "at": 0}).encode())
    tape = layout.tape_key(0, 1)
    forged_entry = {**json.loads(run.store.get(tape)), "merged": [{"key": pending, "learner": "a", "seq": 0,
                                                                   "base_version": 0, "weight": 1.0}]}
    forged_entry.pop("signature", None)
    run.store.cas(tape, json.dumps(forged_entry).encode(), run.store.read_token(tape)[1])
    for p in range(num):
        run.store.put_if_absent(layout.global_key(p, 10**9), b"forged global")
    run.store.cas(layout.heartbeat_key("ghost"), json.dumps({"time": "now", "versions": ["x"]}).encode(), None)
    run.store.put_if_absent(layout.snapshot_manifest_key("junk"), b"{not json")

    plan = plan_gc(run.store, **POLICY, verifier=signing.run_verifier(SECRET))
    assert pending not in plan.delete
    assert plan.newest == newest
    kept_floor = {p: newest[p] - POLICY["keep_versions"] + 1 for p in range(num)}
    assert not [k for k in plan.delete if k.startswith(layout.GLOBALS) and
                layout.parse_global_key(k)[1] >= kept_floor[layout.parse_global_key(k)[0]]]
    skipped = plan.summary()["skipped_unverified"]["by_kind"]
    assert skipped.get("global", 0) >= num and skipped.get("reject_record", 0) >= 1, skipped
    assert skipped.get("manifest") == 1 and skipped.get("heartbeat") == 1, skipped

    unverified = plan_gc(run.store, **POLICY)  # the attack without verification: the newest honest
    assert unverified.newest[1] == 10**9          # version of fragment 1 would go
    assert layout.global_key(1, newest[1]) in unverified.delete
