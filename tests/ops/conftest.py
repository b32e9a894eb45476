"""Helpers for the ops tests (replay, snapshots, restore, export): a tiny run with history.

Builds on ``tests.service.conftest`` (a syncer over a real store with a fake clock, deltas written
by hand as a learner would)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import deadline

from ddiloco_geo.core import layout

from ddiloco_geo import protocol
from ddiloco_geo.storage import Store
from tests.service.conftest import Run, tiny_run  # noqa: F401  (fixture re-export)

REPO = Path(__file__).resolve().parents[2]
LEARNERS = ("a", "b", "c")


def poll_and_merge(syncer) -> int:
    asyncio.run(syncer.poll_once())
    return syncer.merge_ready()


def merge_rounds(run: Run, syncer, rounds: int, *, start: int = 0, codec_name: str = "int4") -> None:
    """Rounds of deltas from three learners on every fragment: a and b on the current version,
    c two versions stale from round 2 on, and in round 1 a second (superseding) delta from a."""
    for rnd in range(start, start + rounds):
        for p in range(run.spec.plan.num_fragments):
            current = syncer.fragments[p].version
            run.write_delta("a", p, base_version=current, codec_name=codec_name, steps=4, tokens=256)
            if rnd == 1:
                run.write_delta("a", p, base_version=current, codec_name=codec_name, steps=8, tokens=512)
            run.write_delta("b", p, base_version=current, codec_name=codec_name, steps=3, tokens=300)
            stale = max(0, current - 2) if rnd >= 2 else current
            run.write_delta("c", p, base_version=stale, codec_name=codec_name, steps=5, tokens=200)
        assert poll_and_merge(syncer) == run.spec.plan.num_fragments


@pytest.fixture
def history(tiny_run):
    """A run whose syncer merged 4 rounds (3 learners, stale and superseded deltas, int4 updates)."""

    def make(rounds: int = 4, **overrides):
        run = tiny_run(**{"syncer.grace_gamma": 0.0, "syncer.quorum": 2, **overrides})
        syncer = run.syncer()
        merge_rounds(run, syncer, rounds)
        return run, syncer

    return make


def all_objects(store: Store) -> dict[str, bytes]:
    return {k: store.get(k) for k in store.list("")}


def copy_store(src: Store, dst: Store, replace: dict[str, bytes] | None = None) -> None:
    """Copy every object (create-only puts), substituting ``replace[key]`` where given."""
    replace = replace or {}
    for key in src.list(""):
        data = replace.get(key)
        if data is None:
            data = src.get(key)
        if key == layout.globals_index_key():
            dst.cas(key, data, None)
        else:
            assert dst.put_if_absent(key, data)


def total_versions(store: Store, num_fragments: int) -> int:
    return sum(len(protocol.list_versions(store, p)) for p in range(num_fragments))


def cli(*argv: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m ddiloco_geo ARGV`` in a subprocess (the run's tiny model needs no settings)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "ddiloco_geo", *argv], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=deadline(timeout))


def cli_json(*argv: str, expect_rc: int = 0, **kw) -> dict:
    proc = cli(*argv, "--json", **kw)
    assert proc.returncode == expect_rc, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])
