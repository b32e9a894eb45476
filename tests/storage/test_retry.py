"""Retry behaviour, driven by deterministic fault injection under the retry layer (habit 9)."""

from __future__ import annotations

import logging

import pytest
from conftest import backend_params

from ddiloco_geo.core.errors import NotFoundError, PreconditionFailedError, TransientStorageError
from ddiloco_geo.storage import FaultPlan, Store

FAST = {"retry_attempts": 4, "retry_initial_s": 0.001, "retry_max_s": 0.002}


def _schedule(op: str, key: str, kinds: list[str]) -> FaultPlan:
    return FaultPlan(schedule={(op, key, attempt): kind for attempt, kind in enumerate(kinds, start=1)})


@pytest.mark.parametrize("backend_name", backend_params(["memory", "local", "moto"]))
@pytest.mark.parametrize("kind", ["slowdown", "timeout"])
def test_transient_faults_are_retried_until_success(make_store, backend_name, kind, caplog):
    plan = FaultPlan(schedule={("get", "k", 1): kind, ("get", "k", 2): kind, ("put_if_absent", "k", 1): kind})
    store = make_store(backend_name, faults=plan, **FAST)
    with caplog.at_level(logging.WARNING, logger="ddiloco_geo.storage"):
        assert store.put_if_absent("k", b"data") is True
        assert store.get("k") == b"data"
    snap = store.stats.snapshot()
    assert snap["requests"] == {"put_if_absent": 2, "get": 3}
    assert snap["retries"] == {kind: 3}
    retry_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("storage_retry ")]
    assert len(retry_lines) == 3
    assert "op=get key=k attempt=1 error=" + kind in retry_lines[1]


@pytest.mark.unit
def test_retries_exhausted_raise_transient(make_store):
    plan = _schedule("get", "k", ["slowdown", "timeout", "slowdown", "timeout"])
    store = make_store("memory", faults=plan, **FAST)
    store.put_if_absent("k", b"x")
    with pytest.raises(TransientStorageError, match="get 'k'"):
        store.get("k")
    snap = store.stats.snapshot()
    assert snap["requests"]["get"] == 4
    assert sum(snap["retries"].values()) == 3
    assert snap["errors"] == {"timeout": 1}


@pytest.mark.unit
def test_not_found_is_attempted_exactly_once(make_store):
    store = make_store("memory", **FAST)
    with pytest.raises(NotFoundError):
        store.get("missing")
    with pytest.raises(NotFoundError):
        store.read_token("missing")
    snap = store.stats.snapshot()
    assert snap["requests"] == {"get": 1, "read_token": 1}
    assert snap["retries"] == {}


@pytest.mark.parametrize("backend_name", backend_params(["memory", "moto", "gcs"]))
def test_precondition_failed_is_attempted_exactly_once(make_store, backend_name):
    store = make_store(backend_name, **FAST)
    token = store.cas("HEAD", b"1", None)
    store.cas("HEAD", b"2", token)
    with pytest.raises(PreconditionFailedError):
        store.cas("HEAD", b"3", token)
    assert store.stats.snapshot()["requests"]["cas"] == 3
    assert store.stats.snapshot()["retries"] == {}


@pytest.mark.unit
def test_backoff_is_capped_full_jitter(make_store):
    sleeps: list[float] = []
    base = make_store("memory", faults=_schedule("get", "k", ["slowdown"] * 7))
    store = Store(base.backend, retry_attempts=8, retry_initial_s=0.1, retry_max_s=0.4, sleep=sleeps.append)
    store.put_if_absent("k", b"x")
    assert store.get("k") == b"x"
    assert len(sleeps) == 7
    caps = [min(0.4, 0.1 * 2**i) for i in range(7)]
    assert all(0 <= s <= cap for s, cap in zip(sleeps, caps))
