"""One contract, every backend (habit 11): local, memory, moto, LocalStack and fake-gcs-server."""

from __future__ import annotations

import pytest
from conftest import backend_params

from ddiloco_geo.core.errors import LayoutError, NotFoundError, PreconditionFailedError, StorageError
from ddiloco_geo.storage import check_key


@pytest.fixture(params=backend_params())
def backend(request) -> str:
    """Every backend; the local and memory cases are in the unit tier (no server)."""
    return request.param


def test_put_if_absent_creates_once_and_answers_false_after(store):
    assert store.put_if_absent("run.json", b"first") is True
    assert store.put_if_absent("run.json", b"second") is False
    assert store.get("run.json") == b"first"


def test_get_whole_and_ranged(store):
    data = bytes(range(256)) * 4
    assert store.put_if_absent("globals/f000/v0000000001.st", data)
    key = "globals/f000/v0000000001.st"
    assert store.get(key) == data
    assert store.get(key, 10, 20) == data[10:20]
    assert store.get(key, 1000) == data[1000:]
    assert store.get(key, None, 5) == data[:5]
    assert store.get(key, 1020, 5000) == data[1020:]
    assert store.get(key, 7, 7) == b""
    assert store.get(key, 5000) == b""


def test_empty_object(store):
    assert store.put_if_absent("empty", b"")
    assert store.get("empty") == b""
    assert store.list("") == ["empty"]


def test_missing_object_is_not_found(store):
    with pytest.raises(NotFoundError, match="missing/key"):
        store.get("missing/key")
    with pytest.raises(NotFoundError):
        store.get("missing/key", 0, 4)
    with pytest.raises(NotFoundError):
        store.read_token("missing/key")


def test_list_is_lexicographic_with_prefix_start_after_and_limit(store):
    for i in (3, 10, 1, 2, 11):
        assert store.put_if_absent(f"learners/a/deltas/s{i:08d}-f000.st", b"d")
    store.put_if_absent("learners/ab/heartbeat.json", b"h")
    store.put_if_absent("globals/f000/HEAD", b"p")
    deltas = [f"learners/a/deltas/s{i:08d}-f000.st" for i in (1, 2, 3, 10, 11)]
    assert store.list("learners/a/deltas/") == deltas
    assert store.list("learners/a/") == deltas
    assert store.list("learners/a") == deltas + ["learners/ab/heartbeat.json"]
    assert store.list("learners/a/deltas/", start_after=deltas[1]) == deltas[2:]
    assert store.list("learners/a/deltas/", start_after="learners/a/deltas/s00000002") == deltas[1:]
    assert store.list("learners/a/deltas/", limit=2) == deltas[:2]
    assert store.list("learners/a/deltas/", start_after=deltas[0], limit=3) == deltas[1:4]
    assert store.list("learners/a/deltas/", start_after=deltas[-1]) == []
    assert store.list("learners/a/deltas/", limit=0) == []
    assert store.list("nothing/") == []
    assert store.list("") == sorted(deltas + ["learners/ab/heartbeat.json", "globals/f000/HEAD"])


def test_delete_removes_and_missing_is_fine(store):
    store.put_if_absent("x/y", b"1")
    store.delete("x/y")
    with pytest.raises(NotFoundError):
        store.get("x/y")
    assert store.list("x/") == []
    store.delete("x/y")
    store.delete("never/existed")
    assert store.put_if_absent("x/y", b"2")  # a deleted key can be created again
    assert store.get("x/y") == b"2"


def test_cas_create_win_and_lose(store):
    head = "globals/f000/HEAD"
    t1 = store.cas(head, b"v1", None)
    with pytest.raises(PreconditionFailedError):
        store.cas(head, b"v1-again", None)  # None means "must not exist yet"
    data, token = store.read_token(head)
    assert data == b"v1" and token == t1
    t2 = store.cas(head, b"v2", token)
    assert t2 != t1
    with pytest.raises(PreconditionFailedError):
        store.cas(head, b"stale", t1)
    assert store.read_token(head) == (b"v2", t2)
    t3 = store.cas(head, b"v3", t2)
    assert store.get(head) == b"v3"
    assert store.read_token(head)[1] == t3


def test_cas_on_deleted_object_fails(store):
    token = store.cas("p", b"one", None)
    store.delete("p")
    with pytest.raises(PreconditionFailedError):
        store.cas("p", b"two", token)


def test_cas_token_none_loses_to_put_if_absent(store):
    assert store.put_if_absent("p", b"created")
    with pytest.raises(PreconditionFailedError):
        store.cas("p", b"x", None)


def test_overwrite_through_cas_is_visible_to_get_and_list(store):
    token = store.cas("a/HEAD", b"1", None)
    store.cas("a/HEAD", b"22", token)
    assert store.get("a/HEAD") == b"22"
    assert store.list("a/") == ["a/HEAD"]


@pytest.mark.parametrize(
    "key", ["../escape", "a/../b", "/abs", "a//b", "a/", "a\\b", "", "a/./b", ".ddiloco-tmp-x", "a/\nb"],
)
def test_invalid_keys_are_rejected(store, key):
    with pytest.raises((LayoutError, ValueError)):
        store.put_if_absent(key, b"x")
    with pytest.raises((LayoutError, ValueError)):
        store.get(key)


@pytest.mark.unit
def test_invalid_key_message_says_what_is_wrong():
    with pytest.raises(LayoutError, match=r"'\.\.'"):
        check_key("a/../b")
    with pytest.raises(LayoutError, match="leading '/'"):
        check_key("/etc/passwd")


def test_stats_count_bytes_and_requests(store):
    store.put_if_absent("s/1", b"12345")
    store.get("s/1")
    store.get("s/1", 0, 2)
    snap = store.stats.snapshot()
    assert snap["bytes_up"] == 5
    assert snap["bytes_down"] == 7
    assert snap["requests"]["put_if_absent"] == 1
    assert snap["requests"]["get"] == 2


def test_url_is_the_root_and_close_is_idempotent(store):
    assert "://" in store.url
    store.close()
    store.close()
    with pytest.raises(StorageError, match="closed"):
        store.get("anything")


def test_two_stores_on_one_root_see_each_other(make_storage_config, backend):
    from ddiloco_geo.storage import open_store

    cfg = make_storage_config(backend)
    with open_store(cfg) as a, open_store(cfg) as b:
        assert a.put_if_absent("shared", b"x")
        assert b.get("shared") == b"x"
        assert b.put_if_absent("shared", b"y") is False


@pytest.mark.parametrize("backend_name", ["localstack", "gcs"])  # moto in-process is 3x slower here
def test_listing_paginates_past_1000_keys(make_store, backend_name):
    import concurrent.futures

    store = make_store(backend_name)
    keys = [f"many/k{i:05d}" for i in range(1003)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        assert all(pool.map(lambda k: store.put_if_absent(k, b""), keys))
    assert store.list("many/") == keys
    assert store.list("many/", start_after=keys[998]) == keys[999:]
    assert store.list("many/", start_after=keys[1], limit=1001) == keys[2:1003]
    assert store.list("many/", limit=1002) == keys[:1002]


def test_list_prefixes_gives_one_level_of_directories(store):
    for key in ("learners/b/heartbeat.json", "learners/a/deltas/s00000001-f000.st", "learners/a/exit.json",
                "learners/c/x", "globals/f000/HEAD", "run.json"):
        store.put_if_absent(key, b"x")
    store.delete("learners/c/x")  # an emptied "directory" is not a prefix any more
    assert store.list_prefixes("learners/") == ["learners/a/", "learners/b/"]
    assert store.list_prefixes("") == ["globals/", "learners/"]
    assert store.list_prefixes("learners/a/") == ["learners/a/deltas/"]
    assert store.list_prefixes("learners/b/") == []
    assert store.list_prefixes("nothing/") == []
