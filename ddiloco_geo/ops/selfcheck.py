"""Store selfcheck: prove a store gives this system what it relies on, before a run.

Under a fresh prefix ``selfcheck/<random>/`` it checks, in order: create-only (the second create
answers False), ranged get, missing key -> NotFoundError, compare-and-swap (create, win with the
current token, lose with a stale one), listing order with ``start_after`` and ``limit``, delete.
Every check runs and is reported, pass or fail: a failing store is a report, not a crash.
:func:`selfcheck` then removes everything it wrote (a failed cleanup is one more failed check) and
returns ``{"url", "checks": [{"name", "ok", "ms", "detail"}], "ok"}``. ``ddiloco-geo selfcheck``
(:mod:`ddiloco_geo.cli.selfcheck`) prints it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from ddiloco_geo.core.errors import NotFoundError, PreconditionFailedError, StorageError
from ddiloco_geo.storage import Store


def _checks(store: Store, base: str) -> list[tuple[str, Callable[[], None]]]:
    obj, head = f"{base}object", f"{base}HEAD"
    payload = bytes(range(256))
    state: dict[str, str] = {}

    def expect(cond: bool, what: str) -> None:
        if not cond:
            raise AssertionError(what)

    def create_only() -> None:
        expect(store.put_if_absent(obj, payload) is True, "first create did not create")
        expect(store.put_if_absent(obj, b"other") is False, "second create did not answer 'exists'")
        expect(store.get(obj) == payload, "object content changed by the second create")

    def ranged_get() -> None:
        expect(store.get(obj, 10, 20) == payload[10:20], "range [10, 20) returned wrong bytes")
        expect(store.get(obj, 250) == payload[250:], "open-ended range returned wrong bytes")

    def not_found() -> None:
        try:
            store.get(f"{base}missing")
        except NotFoundError:
            return
        raise AssertionError("reading a missing key did not raise NotFoundError")

    def cas_win() -> None:
        state["t1"] = store.cas(head, b"v1", None)
        data, token = store.read_token(head)
        expect(data == b"v1" and token == state["t1"], "read_token disagrees with the created pointer")
        state["t2"] = store.cas(head, b"v2", token)
        expect(store.get(head) == b"v2", "winning compare-and-swap did not replace the pointer")

    def cas_lose() -> None:
        try:
            store.cas(head, b"stale", state["t1"])
        except PreconditionFailedError:
            expect(store.get(head) == b"v2", "losing compare-and-swap changed the pointer")
            return
        raise AssertionError("compare-and-swap with a stale token succeeded")

    def listing() -> None:
        names = [f"{base}list/k{i:03d}" for i in (2, 0, 1, 3)]
        for name in names:
            store.put_if_absent(name, b"")
        ordered = sorted(names)
        expect(store.list(f"{base}list/") == ordered, "listing is not in lexicographic order")
        expect(store.list(f"{base}list/", start_after=ordered[1]) == ordered[2:], "start_after not honoured")
        expect(store.list(f"{base}list/", limit=2) == ordered[:2], "limit not honoured")

    def delete() -> None:
        store.delete(obj)
        store.delete(obj)  # missing is fine
        expect(obj not in store.list(base), "deleted object still listed")
        try:
            store.get(obj)
        except NotFoundError:
            return
        raise AssertionError("deleted object is still readable")

    return [
        ("create_only", create_only),
        ("ranged_get", ranged_get),
        ("not_found", not_found),
        ("cas_win", cas_win),
        ("cas_lose_stale_token", cas_lose),
        ("list_start_after_limit", listing),
        ("delete", delete),
    ]


def run_checks(store: Store) -> dict:
    """Run every check under a unique prefix; clean up; return the report."""
    base = f"selfcheck/{uuid.uuid4().hex[:12]}/"
    results = []
    for name, check in _checks(store, base):
        t0 = time.perf_counter()
        try:
            check()
            ok, detail = True, ""
        except Exception as exc:  # a report, not a crash: every check runs and is listed
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        results.append({"name": name, "ok": ok, "ms": round((time.perf_counter() - t0) * 1000, 1), "detail": detail})
    return {"url": store.url, "checks": results, "ok": all(r["ok"] for r in results), "prefix": base}


def cleanup(store: Store, prefix: str) -> None:
    """Delete every object under ``prefix``."""
    for key in store.list(prefix):
        store.delete(key)


def selfcheck(store: Store, *, keep: bool = False) -> dict:
    """Run every check, then (unless ``keep``) remove what they wrote; the report, without its prefix."""
    report = run_checks(store)
    if not keep:
        try:
            cleanup(store, report["prefix"])
        except StorageError as exc:
            report["checks"].append({"name": "cleanup", "ok": False, "ms": 0.0, "detail": str(exc)})
            report["ok"] = False
    report.pop("prefix")
    return report
