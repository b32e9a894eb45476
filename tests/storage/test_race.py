"""Conditional writes under contention: exactly one winner, on every backend."""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor

from conftest import deadline

from ddiloco_geo.core.errors import PreconditionFailedError
from ddiloco_geo.storage import open_store

NUM_WRITERS = 16
NUM_ROUNDS = 20


def _cas_round(store, key: str, round_no: int, pool: ThreadPoolExecutor) -> list[int]:
    _, token = store.read_token(key)
    barrier = threading.Barrier(NUM_WRITERS)

    def writer(i: int) -> int | None:
        barrier.wait()
        mine = f"r{round_no}-w{i}".encode()
        try:
            store.cas(key, mine, token)
            return i
        except PreconditionFailedError:
            # the store's contract (tests/storage/test_faults.py): a cas whose response was lost
            # answers "precondition failed" on its retry, and the caller re-reads to find its own
            # value. Only one writer can find it: the others' attempts all carried the old token.
            return i if store.get(key) == mine else None

    return [i for i in pool.map(writer, range(NUM_WRITERS)) if i is not None]


def test_concurrent_cas_has_exactly_one_winner_per_round(store):
    key = "globals/f000/HEAD"
    store.cas(key, b"r-1", None)
    with ThreadPoolExecutor(NUM_WRITERS) as pool:
        for round_no in range(NUM_ROUNDS):
            winners = _cas_round(store, key, round_no, pool)
            assert len(winners) == 1, f"round {round_no}: winners {winners}"
            assert store.get(key) == f"r{round_no}-w{winners[0]}".encode()


def test_concurrent_put_if_absent_has_exactly_one_creator(store):
    barrier = threading.Barrier(NUM_WRITERS)

    def writer(i: int) -> bool:
        barrier.wait()
        return store.put_if_absent("run.json", f"w{i}".encode())

    with ThreadPoolExecutor(NUM_WRITERS) as pool:
        results = list(pool.map(writer, range(NUM_WRITERS)))
    assert results.count(True) == 1
    assert store.get("run.json") == f"w{results.index(True)}".encode()


def test_concurrent_cas_create_with_none_has_one_winner(store):
    barrier = threading.Barrier(NUM_WRITERS)

    def writer(i: int) -> bool:
        barrier.wait()
        try:
            store.cas("lease", f"w{i}".encode(), None)
            return True
        except PreconditionFailedError:
            return False

    with ThreadPoolExecutor(NUM_WRITERS) as pool:
        assert list(pool.map(writer, range(NUM_WRITERS))).count(True) == 1


# --- local backend across processes --------------------------------------------------------------


def _process_writer(cfg_json: str, key: str, token: str, tag: str, start, results) -> None:
    from ddiloco_geo.core.config import StorageConfig

    store = open_store(StorageConfig.model_validate_json(cfg_json))
    start.wait()
    try:
        store.cas(key, tag.encode(), token)
        results.put(tag)
    except PreconditionFailedError:
        results.put(None)
    created = store.put_if_absent(f"created/{token[:8]}", tag.encode())
    results.put(("created", created))


def test_local_cas_across_processes_has_one_winner(make_storage_config):
    cfg = make_storage_config("local")
    store = open_store(cfg)
    key = "globals/f000/HEAD"
    store.cas(key, b"start", None)
    ctx = multiprocessing.get_context("fork")
    num_procs, rounds = 8, 5
    for round_no in range(rounds):
        _, token = store.read_token(key)
        start, results = ctx.Barrier(num_procs), ctx.Queue()
        procs = [
            ctx.Process(target=_process_writer, args=(cfg.model_dump_json(), key, token, f"r{round_no}p{i}", start, results))
            for i in range(num_procs)
        ]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=deadline(30)) for _ in range(2 * num_procs)]
        for p in procs:
            p.join(timeout=deadline(30))
            assert p.exitcode == 0
        winners = [o for o in outcomes if isinstance(o, str)]
        creators = [o for o in outcomes if isinstance(o, tuple) and o[1]]
        assert len(winners) == 1, outcomes
        assert len(creators) == 1, outcomes
        assert store.get(key) == winners[0].encode()
    # lock and temp files never show up as objects
    assert store.list("globals/") == [key]


# --- moto: the servers this project starts decide a conditional write atomically -------------------


def test_moto_conditional_writes_are_atomic_even_when_the_server_is_slow(make_store, monkeypatch):
    """moto checks If-Match and then stores, with no lock between: a server slowed between the two
    (what CPU load does) lets two writers holding one ETag both win unless ``tools.motoserver``
    serialises its writes. The pause makes the race certain without the lock."""
    import time

    from moto.s3.models import S3Backend

    store = make_store("moto")
    store.cas("HEAD", b"start", None)
    real_put = S3Backend.put_object

    def slow_put(self, *args, **kwargs):
        time.sleep(0.2)
        return real_put(self, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "put_object", slow_put)
    with ThreadPoolExecutor(NUM_WRITERS) as pool:
        winners = _cas_round(store, "HEAD", 0, pool)
    assert len(winners) == 1, winners
    assert store.get("HEAD") == f"r0-w{winners[0]}".encode()
