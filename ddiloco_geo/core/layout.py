"""The bucket layout: every key this system reads or writes, as pure format/parse functions.

Layout format version 1 (``LAYOUT_VERSION``). Keys are relative to the run prefix (the ``--store``
URL names the bucket and the run prefix). Numbers are zero-padded so that a lexicographic listing
is numeric order::

    run.json                                         run spec (create-only, once)
    globals/f007/v0000000012.st                      global fragment 7, version 12 (create-only)
    globals/f007/u0000000012.st                      compressed update from version 11 to 12 (create-only)
    globals/HEAD                                     index: newest version of every fragment (compare-and-swap)
    learners/<learner>/deltas/s000000000042-f007.st  learner's 42nd delta, for fragment 7 (create-only)
    learners/<learner>/heartbeat.json                liveness and throughput (compare-and-swap)
    learners/<learner>/checkpoints/c0000000003.st     preemption checkpoint (create-only)
    learners/<learner>/exit.json                     deregistration on a clean exit (compare-and-swap)
    syncer/state/f007/v0000000012-<token>.st         outer-optimizer state that goes with version 12
    syncer/leases/shard-000-of-001                   syncer lease with fencing token (compare-and-swap)
    syncer/tape/f007/v0000000012.json                event-tape entry for one merge (create-only)
    syncer/rejected/<learner>/s000000000042-f007.json  why a delta was rejected (create-only)
    syncer/status/shard-000-of-001.json              syncer counters, lag and timings (compare-and-swap)
    syncer/quarantine/<learner>.json                 a quarantined learner (create-only; deleted to lift)
    snapshots/<snapshot>/manifest.json               consistent cut (create-only)

Why deltas live under the learner and not under the fragment: a learner's sequence number is
monotonic across all fragments, so the syncer keeps one cursor per learner and lists each learner's
prefix with ``start_after=cursor`` (one list call per learner per poll, not one per learner and
fragment); and a learner's write permission is exactly one prefix, ``learners/<learner>/``, which
the Terraform IAM policies derive from :func:`role_prefixes`.

Identifiers (learner ids, snapshot ids, tokens) match ``ID_PATTERN``: no slashes, no dots, so a key
can never climb out of its prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ddiloco_geo.core.errors import LayoutError

LAYOUT_VERSION = 1

ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
FRAGMENT_DIGITS = 3
VERSION_DIGITS = 10
SEQ_DIGITS = 12
CHECKPOINT_DIGITS = 10
SHARD_DIGITS = 3
TENSOR_SUFFIX = ".st"

RUN_SPEC = "run.json"
GLOBALS = "globals/"
LEARNERS = "learners/"
SYNCER = "syncer/"
SNAPSHOTS = "snapshots/"


def check_id(value: str, what: str = "id") -> str:
    if not isinstance(value, str) or not ID_PATTERN.match(value):
        raise LayoutError(
            f"invalid {what} {value!r}: use 1-63 characters from a-z, 0-9, '_' and '-', "
            "starting with a letter or digit"
        )
    return value


def _num(value: int, digits: int, what: str) -> str:
    if not isinstance(value, int) or value < 0 or value >= 10**digits:
        raise LayoutError(f"{what} {value!r} out of range [0, 1e{digits})")
    return f"{value:0{digits}d}"


# --- globals -------------------------------------------------------------------------------------


def fragment_dir(fragment: int) -> str:
    return f"{GLOBALS}f{_num(fragment, FRAGMENT_DIGITS, 'fragment')}/"


def global_key(fragment: int, version: int) -> str:
    return f"{fragment_dir(fragment)}v{_num(version, VERSION_DIGITS, 'version')}{TENSOR_SUFFIX}"


def global_update_key(fragment: int, version: int) -> str:
    """The compressed change from version - 1 to ``version`` (what learners usually download)."""
    return f"{fragment_dir(fragment)}u{_num(version, VERSION_DIGITS, 'version')}{TENSOR_SUFFIX}"


def globals_index_key() -> str:
    """One small object that learners poll: the newest published version of every fragment."""
    return f"{GLOBALS}HEAD"


_GLOBAL_RE = re.compile(rf"^{GLOBALS}f(\d{{{FRAGMENT_DIGITS}}})/v(\d{{{VERSION_DIGITS}}})\.st$")


def parse_global_key(key: str) -> tuple[int, int]:
    """Return (fragment, version) of a global key; raise LayoutError if it is not one."""
    m = _GLOBAL_RE.match(key)
    if not m:
        raise LayoutError(f"not a global key: {key!r}")
    return int(m.group(1)), int(m.group(2))


# --- learners ------------------------------------------------------------------------------------


def learner_dir(learner: str) -> str:
    return f"{LEARNERS}{check_id(learner, 'learner id')}/"


def deltas_dir(learner: str) -> str:
    return f"{learner_dir(learner)}deltas/"


def delta_key(learner: str, seq: int, fragment: int) -> str:
    return (
        f"{deltas_dir(learner)}s{_num(seq, SEQ_DIGITS, 'seq')}"
        f"-f{_num(fragment, FRAGMENT_DIGITS, 'fragment')}{TENSOR_SUFFIX}"
    )


@dataclass(frozen=True)
class DeltaKey:
    learner: str
    seq: int
    fragment: int


_DELTA_RE = re.compile(
    rf"^{LEARNERS}([^/]+)/deltas/s(\d{{{SEQ_DIGITS}}})-f(\d{{{FRAGMENT_DIGITS}}})\.st$"
)


def parse_delta_key(key: str) -> DeltaKey:
    m = _DELTA_RE.match(key)
    if not m or not ID_PATTERN.match(m.group(1)):
        raise LayoutError(f"not a delta key: {key!r}")
    return DeltaKey(m.group(1), int(m.group(2)), int(m.group(3)))


def heartbeat_key(learner: str) -> str:
    return f"{learner_dir(learner)}heartbeat.json"


def exit_key(learner: str) -> str:
    return f"{learner_dir(learner)}exit.json"


def checkpoints_dir(learner: str) -> str:
    return f"{learner_dir(learner)}checkpoints/"


def checkpoint_key(learner: str, number: int) -> str:
    return f"{checkpoints_dir(learner)}c{_num(number, CHECKPOINT_DIGITS, 'checkpoint')}{TENSOR_SUFFIX}"


_LEARNER_RE = re.compile(rf"^{LEARNERS}([^/]+)/")


def parse_learner(key: str) -> str:
    """The learner id that owns a key under ``learners/``."""
    m = _LEARNER_RE.match(key)
    if not m or not ID_PATTERN.match(m.group(1)):
        raise LayoutError(f"not a learner key: {key!r}")
    return m.group(1)


# --- syncer --------------------------------------------------------------------------------------


def syncer_state_dir(fragment: int) -> str:
    return f"{SYNCER}state/f{_num(fragment, FRAGMENT_DIGITS, 'fragment')}/"


def syncer_state_key(fragment: int, version: int, token: str) -> str:
    return (
        f"{syncer_state_dir(fragment)}v{_num(version, VERSION_DIGITS, 'version')}"
        f"-{check_id(token, 'state token')}{TENSOR_SUFFIX}"
    )


def _shard_name(shard: int, num_shards: int) -> str:
    return f"shard-{_num(shard, SHARD_DIGITS, 'shard')}-of-{_num(num_shards, SHARD_DIGITS, 'shard count')}"


def tape_key(fragment: int, version: int) -> str:
    return (
        f"{SYNCER}tape/f{_num(fragment, FRAGMENT_DIGITS, 'fragment')}/"
        f"v{_num(version, VERSION_DIGITS, 'version')}.json"
    )


def rejected_key(learner: str, seq: int, fragment: int) -> str:
    return (
        f"{SYNCER}rejected/{check_id(learner, 'learner id')}/s{_num(seq, SEQ_DIGITS, 'seq')}"
        f"-f{_num(fragment, FRAGMENT_DIGITS, 'fragment')}.json"
    )


QUARANTINE = f"{SYNCER}quarantine/"


def quarantine_key(learner: str) -> str:
    """Present while a learner is quarantined; an operator lifts it by deleting the object."""
    return f"{QUARANTINE}{check_id(learner, 'learner id')}.json"


def parse_quarantine_key(key: str) -> str:
    """The learner id a quarantine record names; LayoutError for anything else."""
    if key.startswith(QUARANTINE) and key.endswith(".json"):
        learner = key[len(QUARANTINE):-len(".json")]
        if ID_PATTERN.match(learner):
            return learner
    raise LayoutError(f"not a quarantine record key: {key!r}")


def parse_learner_prefix(prefix: str) -> str:
    """The learner id of a ``learners/<id>/`` listing prefix; LayoutError if it is not a valid id."""
    if prefix.startswith(LEARNERS):
        learner = prefix[len(LEARNERS):].strip("/")
        if ID_PATTERN.match(learner):
            return learner
    raise LayoutError(f"not a learner prefix: {prefix!r}")


def forged_key(fragment: int, version: int) -> str:
    """A global that failed verification, set aside by the syncer (never adopted; an operator
    deletes the global and this record)."""
    return f"{SYNCER}forged/f{_num(fragment, FRAGMENT_DIGITS, 'fragment')}/v{_num(version, VERSION_DIGITS, 'version')}.json"


def syncer_status_key(shard: int, num_shards: int) -> str:
    return f"{SYNCER}status/{_shard_name(shard, num_shards)}.json"


# --- snapshots -----------------------------------------------------------------------------------


def snapshot_manifest_key(snapshot: str) -> str:
    return f"{SNAPSHOTS}{check_id(snapshot, 'snapshot id')}/manifest.json"


# --- permissions derived from the layout ---------------------------------------------------------


def role_prefixes(role: str, learner: str = "*") -> dict[str, list[str]]:
    """What a role may read and write, as key prefixes (``*`` is a wildcard for IAM policies).

    learner: reads the run spec and globals (and its own prefix), writes only ``learners/<id>/``.
    syncer: reads everything, writes ``globals/``, ``syncer/`` and ``snapshots/`` (and creates the
    run spec). Nobody else writes. Terraform's IAM policies and their tests derive from this.
    """
    if role == "learner":
        own = f"{LEARNERS}{learner}/"
        return {"read": [RUN_SPEC, GLOBALS, own], "write": [own]}
    if role == "syncer":
        return {
            "read": [RUN_SPEC, GLOBALS, LEARNERS, SYNCER, SNAPSHOTS],
            "write": [RUN_SPEC, GLOBALS, SYNCER, SNAPSHOTS],
        }
    raise LayoutError(f"unknown role {role!r}: expected 'learner' or 'syncer'")
