"""The bucket layout is a frozen external surface: this snapshot changes only on purpose."""

import pytest

from ddiloco_geo import keys
from ddiloco_geo.errors import LayoutError

SNAPSHOT = {
    "run_spec": "run.json",
    "global": "globals/f007/v0000000012.st",
    "index": "globals/HEAD",
    "delta": "learners/eu-west-1-a/deltas/s000000000042-f007.st",
    "heartbeat": "learners/eu-west-1-a/heartbeat.json",
    "exit": "learners/eu-west-1-a/exit.json",
    "checkpoint": "learners/eu-west-1-a/checkpoints/c0000000003.st",
    "state": "syncer/state/f007/v0000000012-ab12cd.st",
    "lease": "syncer/leases/shard-000-of-001",
    "tape": "syncer/tape/f007/v0000000012.json",
    "rejected": "syncer/rejected/eu-west-1-a/s000000000042-f007.json",
    "status": "syncer/status/shard-001-of-004.json",
    "quarantine": "syncer/quarantine/eu-west-1-a.json",
    "snapshot": "snapshots/snap-1/manifest.json",
}


def test_layout_snapshot():
    assert keys.LAYOUT_VERSION == 1
    got = {
        "run_spec": keys.RUN_SPEC,
        "global": keys.global_key(7, 12),
        "index": keys.globals_index_key(),
        "delta": keys.delta_key("eu-west-1-a", 42, 7),
        "heartbeat": keys.heartbeat_key("eu-west-1-a"),
        "exit": keys.exit_key("eu-west-1-a"),
        "checkpoint": keys.checkpoint_key("eu-west-1-a", 3),
        "state": keys.syncer_state_key(7, 12, "ab12cd"),
        "lease": keys.lease_key(0, 1),
        "tape": keys.tape_key(7, 12),
        "rejected": keys.rejected_key("eu-west-1-a", 42, 7),
        "status": keys.syncer_status_key(1, 4),
        "quarantine": keys.quarantine_key("eu-west-1-a"),
        "snapshot": keys.snapshot_manifest_key("snap-1"),
    }
    assert got == SNAPSHOT


def test_listing_order_is_numeric_order():
    versions = [0, 1, 9, 10, 99, 100, 12345]
    ks = [keys.global_key(3, v) for v in versions]
    assert sorted(ks) == ks
    seqs = [keys.delta_key("a", s, f) for s in (1, 2, 10, 11, 100) for f in (0, 5, 23)]
    assert sorted(seqs) == seqs


def test_parse_round_trips():
    assert keys.parse_global_key(keys.global_key(5, 77)) == (5, 77)
    dk = keys.parse_delta_key(keys.delta_key("learner-1", 9, 23))
    assert (dk.learner, dk.seq, dk.fragment) == ("learner-1", 9, 23)
    assert keys.parse_learner(keys.heartbeat_key("abc")) == "abc"


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "A", "a.b", "-x", "x" * 64, "a b"])
def test_ids_that_could_escape_a_prefix_are_refused(bad):
    with pytest.raises(LayoutError):
        keys.delta_key(bad, 1, 0)


@pytest.mark.parametrize("bad", [
    "learners/../syncer/deltas/s000000000001-f000.st",
    "learners/a/deltas/s1-f0.st",
    "learners/a/deltas/s000000000001-f000.st.bak",
    "globals/f000/v1.st",
])
def test_foreign_keys_do_not_parse(bad):
    with pytest.raises(LayoutError):
        try:
            keys.parse_delta_key(bad)
        except LayoutError:
            keys.parse_global_key(bad)


def test_numbers_out_of_range_are_refused():
    with pytest.raises(LayoutError):
        keys.global_key(1000, 0)
    with pytest.raises(LayoutError):
        keys.global_key(0, -1)


def test_role_prefixes_split_writes():
    learner = keys.role_prefixes("learner", "l1")
    syncer = keys.role_prefixes("syncer")
    assert learner["write"] == ["learners/l1/"]
    assert "globals/" in syncer["write"] and not any(p.startswith("learners/") for p in syncer["write"])
    with pytest.raises(LayoutError):
        keys.role_prefixes("admin")
