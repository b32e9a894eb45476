"""The bucket layout is a frozen external surface: this snapshot changes only on purpose."""

import pytest

from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import LayoutError

pytestmark = pytest.mark.unit  # no servers, no subprocesses

SNAPSHOT = {
    "run_spec": "run.json",
    "global": "globals/f007/v0000000012.st",
    "index": "globals/HEAD",
    "delta": "learners/eu-west-1-a/deltas/s000000000042-f007.st",
    "heartbeat": "learners/eu-west-1-a/heartbeat.json",
    "exit": "learners/eu-west-1-a/exit.json",
    "checkpoint": "learners/eu-west-1-a/checkpoints/c0000000003.st",
    "state": "syncer/state/f007/v0000000012-ab12cd.st",
    "tape": "syncer/tape/f007/v0000000012.json",
    "rejected": "syncer/rejected/eu-west-1-a/s000000000042-f007.json",
    "status": "syncer/status/shard-001-of-004.json",
    "quarantine": "syncer/quarantine/eu-west-1-a.json",
    "snapshot": "snapshots/snap-1/manifest.json",
}


def test_layout_snapshot():
    assert layout.LAYOUT_VERSION == 1
    got = {
        "run_spec": layout.RUN_SPEC,
        "global": layout.global_key(7, 12),
        "index": layout.globals_index_key(),
        "delta": layout.delta_key("eu-west-1-a", 42, 7),
        "heartbeat": layout.heartbeat_key("eu-west-1-a"),
        "exit": layout.exit_key("eu-west-1-a"),
        "checkpoint": layout.checkpoint_key("eu-west-1-a", 3),
        "state": layout.syncer_state_key(7, 12, "ab12cd"),
        "tape": layout.tape_key(7, 12),
        "rejected": layout.rejected_key("eu-west-1-a", 42, 7),
        "status": layout.syncer_status_key(1, 4),
        "quarantine": layout.quarantine_key("eu-west-1-a"),
        "snapshot": layout.snapshot_manifest_key("snap-1"),
    }
    assert got == SNAPSHOT


def test_listing_order_is_numeric_order():
    versions = [0, 1, 9, 10, 99, 100, 12345]
    ks = [layout.global_key(3, v) for v in versions]
    assert sorted(ks) == ks
    seqs = [layout.delta_key("a", s, f) for s in (1, 2, 10, 11, 100) for f in (0, 5, 23)]
    assert sorted(seqs) == seqs


def test_parse_round_trips():
    assert layout.parse_global_key(layout.global_key(5, 77)) == (5, 77)
    dk = layout.parse_delta_key(layout.delta_key("learner-1", 9, 23))
    assert (dk.learner, dk.seq, dk.fragment) == ("learner-1", 9, 23)
    assert layout.parse_learner(layout.heartbeat_key("abc")) == "abc"


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "A", "a.b", "-x", "x" * 64, "a b"])
def test_ids_that_could_escape_a_prefix_are_refused(bad):
    with pytest.raises(LayoutError):
        layout.delta_key(bad, 1, 0)


@pytest.mark.parametrize("bad", [
    "learners/../syncer/deltas/s000000000001-f000.st",
    "learners/a/deltas/s1-f0.st",
    "learners/a/deltas/s000000000001-f000.st.bak",
    "globals/f000/v1.st",
])
def test_foreign_keys_do_not_parse(bad):
    with pytest.raises(LayoutError):
        try:
            layout.parse_delta_key(bad)
        except LayoutError:
            layout.parse_global_key(bad)


def test_numbers_out_of_range_are_refused():
    with pytest.raises(LayoutError):
        layout.global_key(1000, 0)
    with pytest.raises(LayoutError):
        layout.global_key(0, -1)


def test_role_prefixes_split_writes():
    learner = layout.role_prefixes("learner", "l1")
    syncer = layout.role_prefixes("syncer")
    assert learner["write"] == ["learners/l1/"]
    assert "globals/" in syncer["write"] and not any(p.startswith("learners/") for p in syncer["write"])
    with pytest.raises(LayoutError):
        layout.role_prefixes("admin")
