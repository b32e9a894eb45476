"""Snapshots (consistent cuts while training goes on), restore into a new run, rollback in place,
and export to a plain safetensors file."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch
from conftest import wait_until
from safetensors import safe_open
from safetensors.torch import load_file

from ddiloco_geo import codec
from ddiloco_geo.core import config
from ddiloco_geo.core.clocks import VectorClock

from ddiloco_geo.core import layout

from ddiloco_geo.core import model as modelmod

from ddiloco_geo import protocol
from ddiloco_geo.ops.export_hf import export_hf
from ddiloco_geo.ops.replay import read_state, replay
from ddiloco_geo.ops.snapshot import (SnapshotError, active_syncers, export_model, load_manifest, restore_to, rollback,
                                  take_snapshot)
from ddiloco_geo.storage import open_store
from tests.ops.conftest import all_objects, cli, cli_json, merge_rounds, poll_and_merge
from tests.service.conftest import Run

OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def accounted(store) -> set[str]:
    """Delta keys accounted for by a published merge record (merged or superseded) or a rejection."""
    out = set()
    for r in protocol.merge_records(store):
        out.update(e["key"] for e in r.get("merged", []))
        out.update(r.get("superseded", []))
    for key in store.list(layout.SYNCER + "rejected/"):
        out.add(json.loads(store.get(key))["key"])
    return out


def check_consistent(store, spec, manifest) -> None:
    """The Chandy-Lamport conditions the manifest must meet, checked against the bucket."""
    in_flight = {d["key"]: d for d in manifest["in_flight"]}
    for p in range(spec.plan.num_fragments):
        frag = manifest["fragments"][str(p)]
        v = frag["version"]
        # every delta a version inside the cut merged was written inside the cut (exists) and is
        # not also listed as in flight
        for w in range(1, v + 1):
            rec = protocol.read_header(store, layout.global_key(p, w)).extra
            for e in rec.get("merged", []):
                assert store.get(e["key"], 0, 8) and e["key"] not in in_flight
        # no in-flight delta depends on a version after the cut
    for d in in_flight.values():
        assert d["base_version"] <= manifest["fragments"][str(d["fragment"])]["version"]
        assert d["seq"] > manifest["fragments"][str(d["fragment"])]["consumed"].get(d["learner"], -1)


def test_manifest_lists_one_version_per_fragment_and_the_deltas_in_flight(history):
    run, syncer = history(rounds=3)
    merged_earlier = run.write_delta("a", 0, base_version=3)
    run.write_delta("b", 0, base_version=2)
    assert poll_and_merge(syncer) == 1  # fragment 0 at version 4
    rejected = run.write_delta("evil", 1, steps=0)  # seen and rejected: accounted, not in flight
    asyncio.run(syncer.poll_once())
    flying = [run.write_delta("a", 1, base_version=3), run.write_delta("c", 2, base_version=1),
              run.write_delta("b", 3, base_version=3)]
    m = take_snapshot(run.store, run.spec, "snap-1", now=1_700_000_000.0)
    assert m["snapshot"] == "snap-1" and m["run_id"] == run.spec.run_id
    assert m["plan_digest"] == run.spec.plan.digest()
    assert {p: f["version"] for p, f in m["fragments"].items()} == {"0": 4, "1": 3, "2": 3, "3": 3}
    for p, f in m["fragments"].items():
        header = protocol.read_header(run.store, f["global"])
        assert f["global"] == layout.global_key(int(p), f["version"])
        assert f["clock"] == json.loads(header.clock.to_json())
        assert f["state_key"] == header.extra["state_key"]
        assert f["consumed"] == protocol.read_header(run.store, f["state_key"]).extra["consumed"]
    assert [d["key"] for d in m["in_flight"]] == sorted(flying)
    for d in m["in_flight"]:
        header = protocol.read_header(run.store, d["key"])
        assert d["clock"] == json.loads(header.clock.to_json()) and d["clock"]
        assert d["base_version"] == header.base_version
    assert merged_earlier not in {d["key"] for d in m["in_flight"]}
    assert rejected not in {d["key"] for d in m["in_flight"]}
    assert json.loads(run.store.get(layout.snapshot_manifest_key("snap-1"))) == m == load_manifest(run.store, "snap-1")
    check_consistent(run.store, run.spec, m)
    # the cut's frontier dominates every clock in it
    from ddiloco_geo.core.clocks import VectorClock
    frontier = VectorClock(m["clock"])
    assert all(VectorClock(f["clock"]) <= frontier for f in m["fragments"].values())
    assert all(VectorClock(d["clock"]) <= frontier for d in m["in_flight"])


def test_snapshots_are_create_only(history):
    run, _ = history(rounds=1)
    take_snapshot(run.store, run.spec, "same")
    before = run.store.get(layout.snapshot_manifest_key("same"))
    with pytest.raises(SnapshotError, match="already exists"):
        take_snapshot(run.store, run.spec, "same")
    assert run.store.get(layout.snapshot_manifest_key("same")) == before
    with pytest.raises(layout.LayoutError):
        take_snapshot(run.store, run.spec, "Bad/Id")
    auto = take_snapshot(run.store, run.spec, now=1764438300.0)
    assert auto["snapshot"] == "s20251129t174500z" and layout.ID_PATTERN.match(auto["snapshot"])


def test_snapshot_taken_between_the_reads_of_a_merging_syncer_is_consistent(history, monkeypatch):
    """The syncer publishes and a learner adopts and writes between the snapshot's delta listing and
    its globals listing: the cut must still be consistent (nothing depends on a later version)."""
    run, syncer = history(rounds=2)
    import ddiloco_geo.ops.snapshot as snapmod

    real = snapmod.protocol.list_versions
    done = []

    def racing_list_versions(store, fragment):
        if not done:
            done.append(1)
            for p in range(run.spec.plan.num_fragments):
                run.write_delta("a", p, base_version=syncer.fragments[p].version)
                run.write_delta("b", p, base_version=syncer.fragments[p].version)
            poll_and_merge(syncer)  # versions move to 3
            run.write_delta("c", 0, base_version=3)  # a learner already on version 3
        return real(store, fragment)

    run.write_delta("c", 1, base_version=2)  # in flight before the cut
    monkeypatch.setattr(snapmod.protocol, "list_versions", racing_list_versions)
    m = take_snapshot(run.store, run.spec, "racy")
    monkeypatch.undo()
    assert {f["version"] for f in m["fragments"].values()} == {3}
    check_consistent(run.store, run.spec, m)
    # c's delta on fragment 1 was merged by version 3 (not in flight); c's delta on version 3 was
    # written after the deltas were listed: outside the cut
    assert m["in_flight"] == []


def test_snapshots_while_a_syncer_keeps_merging_in_another_thread(tiny_run):
    run = tiny_run(**{"syncer.grace_gamma": 0.0, "syncer.quorum": 1})
    syncer = run.syncer()
    stop = threading.Event()
    errors = []

    def train():
        try:
            while not stop.is_set():
                for p in range(run.spec.plan.num_fragments):
                    run.write_delta("a", p, base_version=syncer.fragments[p].version)
                poll_and_merge(syncer)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    def published() -> list[int]:
        return [syncer.fragments[p].version for p in range(run.spec.plan.num_fragments)]

    t = threading.Thread(target=train)
    t.start()
    manifests = []
    try:
        for i in range(6):  # each snapshot after at least one more merge, however slow the machine
            seen = published()
            wait_until(lambda: errors or published() != seen, 60, interval_s=0.01, what="a merge between snapshots")
            manifests.append(take_snapshot(run.store, run.spec, f"live-{i}"))
    finally:
        stop.set()
        t.join()
    assert not errors
    for m in manifests:
        check_consistent(run.store, run.spec, m)
    versions = [[f["version"] for f in m["fragments"].values()] for m in manifests]
    assert versions[-1] > versions[0] and all(a <= b for x, y in zip(versions, versions[1:]) for a, b in zip(x, y))


# --- restore into a new run ----------------------------------------------------------------------


def test_restore_to_a_new_run_resumes_the_same_params_and_outer_state(history, tiny_run):
    run, syncer = history(rounds=3)
    m = take_snapshot(run.store, run.spec, "base")
    merge_rounds(run, syncer, 1, start=3)  # the old run goes on; the snapshot does not move
    new = tiny_run(**{"syncer.grace_gamma": 0.0, "syncer.quorum": 2})
    new.store.delete(layout.RUN_SPEC)  # an empty store (the fixture created run.json)
    versions = restore_to(run.store, m, new.store)
    assert versions == {p: 3 for p in range(run.spec.plan.num_fragments)}
    assert protocol.read_index(new.store)[0] == versions
    assert new.store.list(layout.LEARNERS) == []  # deltas are not copied
    assert restore_to(run.store, m, new.store) == versions  # a rerun (e.g. after a crash) is idempotent
    resumed = new.syncer()
    for p, state in resumed.fragments.items():
        v = m["fragments"][str(p)]["version"]
        assert state.version == v
        header, params = protocol.read_global(run.store, run.spec, p, v)
        assert all(torch.equal(state.params[n], params[n]) for n in params)
        old = read_state(run.store, run.spec, header.extra["state_key"])
        outer = state.outer.state_dict()
        assert outer["num_steps"] == old.num_steps == 3
        assert all(torch.equal(outer[k], t) for k, t in old.momentum.items())
        assert set(state.residual) == set(old.residual)
        assert all(torch.equal(state.residual[n], t) for n, t in old.residual.items())
        assert state.consumed == {}  # the new run has no deltas yet
    # the new run trains on (learners reusing ids restart their sequence at 0) and replays clean
    new.seq.clear()
    merge_rounds(new, resumed, 2)
    assert protocol.read_index(new.store)[0] == {p: 5 for p in range(run.spec.plan.num_fragments)}
    result = replay(new.store, new.spec, outer_kwargs=OUTER)
    assert result["ok"] and result["roots"] == {str(p): 3 for p in range(4)}
    assert result["versions_checked"] == 4 * 2
    # into a store that holds a run (this one has moved on; the source itself) it is refused
    for target in (new.store, run.store):
        with pytest.raises(SnapshotError, match="already holds a run"):
            restore_to(run.store, m, target)


# --- rollback ------------------------------------------------------------------------------------


def test_rollback_publishes_new_versions_equal_to_the_snapshot_and_deletes_nothing(history):
    run, syncer = history(rounds=2)
    m = take_snapshot(run.store, run.spec, "good")
    merge_rounds(run, syncer, 2, start=2)  # versions 3, 4 ("bad")
    run.write_delta("a", 0, base_version=4)  # in flight across the rollback
    before = all_objects(run.store)
    result = rollback(run.store, m)
    assert result["published"] == {str(p): 5 for p in range(4)} and result["unchanged"] == []
    after = all_objects(run.store)
    assert all(after[k] == data for k, data in before.items() if k != layout.globals_index_key())
    assert protocol.read_index(run.store)[0] == {p: 5 for p in range(4)}
    for p in range(4):
        header, params = protocol.read_global(run.store, run.spec, p, 5)
        assert header.extra["kind"] == "rollback" and header.extra["snapshot"] == "good"
        assert header.extra["from_version"] == 2
        snap_header, snap_params = protocol.read_global(run.store, run.spec, p, 2)
        assert all(torch.equal(params[n], snap_params[n]) for n in params)
        st, snap_st = (read_state(run.store, run.spec, h.extra["state_key"]) for h in (header, snap_header))
        assert st.num_steps == snap_st.num_steps
        assert all(torch.equal(st.momentum[k], t) for k, t in snap_st.momentum.items())
        assert all(torch.equal(st.residual[k], t) for k, t in snap_st.residual.items())
        cur = protocol.read_header(run.store, protocol.read_header(run.store, layout.global_key(p, 4)).extra["state_key"])
        assert st.header.extra["consumed"] == cur.extra["consumed"]  # nothing merged twice or dropped
        assert header.clock > protocol.read_header(run.store, layout.global_key(p, 4)).clock
    # the running syncer loses its next publish race, adopts the rollback and goes on from it
    run.write_delta("b", 0, base_version=4)
    poll_and_merge(syncer)
    assert syncer.counters["publish_races_lost"] == 1 and syncer.fragments[0].version == 5
    assert syncer.merge_ready() == 1  # the kept deltas, anchored at the rolled-back global
    assert protocol.list_versions(run.store, 0) == [0, 1, 2, 3, 4, 5, 6]
    # a restarted syncer resumes from the rollback, replay checks the rollback versions too
    fresh = run.syncer()
    assert fresh.fragments[1].version == 5
    snap_params = protocol.read_global(run.store, run.spec, 1, 2)[1]
    assert all(torch.equal(fresh.fragments[1].params[n], t) for n, t in snap_params.items())
    assert replay(run.store, run.spec, outer_kwargs=OUTER)["ok"]
    assert protocol.ledger(run.store)["deltas_unaccounted"] == 0


def test_rollback_skips_fragments_still_at_the_snapshot(history):
    run, syncer = history(rounds=1)
    m = take_snapshot(run.store, run.spec, "now")
    result = rollback(run.store, m)
    assert result["published"] == {} and result["unchanged"] == [0, 1, 2, 3]


def test_rollback_refuses_while_a_syncer_is_active_unless_forced(history):
    run, syncer = history(rounds=1)
    m = take_snapshot(run.store, run.spec, "snap")
    merge_rounds(run, syncer, 1, start=1)
    syncer.write_status(force=True)
    assert active_syncers(run.store, 30.0)
    with pytest.raises(SnapshotError, match="syncer looks active.*--force"):
        rollback(run.store, m)
    assert protocol.list_versions(run.store, 0) == [0, 1, 2]
    assert active_syncers(run.store, 30.0, now=time.time() + 60) == []
    result = rollback(run.store, m, force=True)
    assert result["forced"] and result["published"] == {str(p): 3 for p in range(4)}


# --- export --------------------------------------------------------------------------------------


def test_export_round_trips_into_the_model(history, tmp_path):
    run, syncer = history(rounds=2)
    m = take_snapshot(run.store, run.spec, "exp")
    merge_rounds(run, syncer, 1, start=2)
    out = tmp_path / "model.safetensors"
    result = export_model(run.store, str(out))
    assert result["versions"] == {str(p): 3 for p in range(4)}
    loaded = load_file(str(out))
    params, versions = protocol.read_global_params(run.store, run.spec)
    assert set(loaded) == set(params) and all(torch.equal(loaded[n], params[n]) for n in params)
    assert all(t.dtype == torch.float32 for t in loaded.values())
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["run_id"] == run.spec.run_id
    assert json.loads(meta["versions"]) == {str(p): v for p, v in versions.items()}
    assert json.loads(meta["model"]) == run.spec.model
    net = modelmod.build_model(config.ModelConfig(**json.loads(meta["model"])))
    net.load_state_dict(loaded, strict=True)
    assert all(torch.equal(t, params[n]) for n, t in net.named_parameters())
    # a snapshot's versions
    snap = export_model(run.store, str(tmp_path / "snap.safetensors"), load_manifest(run.store, "exp"))
    assert snap["versions"] == {str(p): 2 for p in range(4)} and snap["snapshot"] == "exp"
    loaded = load_file(str(tmp_path / "snap.safetensors"))
    for p in range(4):
        for n, t in protocol.read_global(run.store, run.spec, p, 2)[1].items():
            assert torch.equal(loaded[n], t)
    assert m["fragments"]["0"]["version"] == 2


# --- the command line ----------------------------------------------------------------------------


def test_cli_snapshot_restore_rollback_export_replay(tmp_path):
    url = f"file://{tmp_path}/run"
    run = Run(url=url, **{"syncer.grace_gamma": 0.0, "syncer.quorum": 2})
    syncer = run.syncer()
    merge_rounds(run, syncer, 2)
    run.write_delta("a", 2, base_version=2)  # in flight
    snap = cli_json("snapshot", "--store", url, "--id", "cli-1")
    assert snap["snapshot"] == "cli-1" and snap["in_flight"] == 1
    assert snap["versions"] == {str(p): 2 for p in range(4)}
    proc = cli("snapshot", "--store", url, "--id", "cli-1")
    assert proc.returncode == 1 and "already exists" in proc.stderr
    merge_rounds(run, syncer, 1, start=2)

    new_url = f"file://{tmp_path}/new"
    restored = cli_json("restore", "--store", url, "--snapshot", "cli-1", "--to", new_url)
    assert restored["versions"] == {str(p): 2 for p in range(4)}
    new_store = open_store(config.StorageConfig(url=new_url))
    assert protocol.read_index(new_store)[0] == {p: 2 for p in range(4)}
    new_store.close()

    syncer.write_status(force=True)
    proc = cli("restore", "--store", url, "--snapshot", "cli-1", "--rollback")
    assert proc.returncode == 1 and "syncer looks active" in proc.stderr
    rolled = cli_json("restore", "--store", url, "--snapshot", "cli-1", "--rollback", "--force")
    assert rolled["published"] == {str(p): 4 for p in range(4)}

    out = tmp_path / "exported.safetensors"
    exported = cli_json("export", "--store", url, "--out", str(out))
    assert exported["versions"] == {str(p): 4 for p in range(4)}
    loaded = load_file(str(out))
    for p in range(4):
        assert all(torch.equal(loaded[n], t) for n, t in protocol.read_global(run.store, run.spec, p, 2)[1].items())
    cli_json("export", "--store", url, "--snapshot", "cli-1", "--out", str(tmp_path / "s.safetensors"))

    result = cli_json("replay", "--store", url)
    assert result["ok"] and result["versions_checked"] == 4 * 5
    result = cli_json("replay", "--store", new_url)
    assert result["ok"] and result["roots"] == {str(p): 2 for p in range(4)}
    run.store.close()


SECRET = "snapshot-signed-run-secret-0123456789abcdef"


def test_signed_manifests_and_verified_exports_refuse_forgeries(history, tmp_path):
    """Anywhere write in a signed run: a manifest rewritten to point at other versions is refused
    (the run's key signs manifests); a forged global at the next version of a fragment is not what
    either export format writes (both read through the verified path and count what they skip)."""
    from ddiloco_geo.core.signing import run_verifier, signer_for

    run, syncer = history(rounds=2, **{"security.run_secret": SECRET})
    verifier = run_verifier(SECRET)
    m = take_snapshot(run.store, run.spec, "signed", signer=signer_for(SECRET, "syncer"))
    assert load_manifest(run.store, "signed", verifier)["fragments"] == m["fragments"]
    key = layout.snapshot_manifest_key("signed")
    forged = {**m, "fragments": {p: {**f, "version": 0} for p, f in m["fragments"].items()}}
    run.store.cas(key, json.dumps(forged).encode(), run.store.read_token(key)[1])
    with pytest.raises(SnapshotError, match="not signed"):
        load_manifest(run.store, "signed", verifier)

    v = syncer.fragments[1].version + 1
    params = {n: torch.full(s, 7.0) for n, s in run.spec.plan.expect(1).items()}
    header = codec.Header(kind="global", run_id=run.spec.run_id, fragment=1, version=v, clock=VectorClock())
    run.store.put_if_absent(layout.global_key(1, v), codec.encode(params, header, codec="fp32"))  # unsigned
    plain = export_model(run.store, str(tmp_path / "m.safetensors"), verifier=verifier, require_signatures=True)
    hf_out = export_hf(run.store, str(tmp_path / "hf"), verifier=verifier, require_signatures=True)
    for result in (plain, hf_out):
        assert {str(p): int(x) for p, x in result["versions"].items()}["1"] == v - 1
        assert result["skipped_unverified"]["by_kind"].get("global") == 1
