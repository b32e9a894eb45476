"""Storage servers behind the fault proxy (:mod:`ddiloco_geo.tools.faultproxy`).

``make_storage_config("moto+faults")`` (also ``localstack+faults``, ``gcs+faults``) makes a bucket on
the real server, starts a :class:`FaultProxyThread` in front of it and returns a config whose
``endpoint_url`` is the proxy: every request of the test, and of any process it starts with that
config, crosses the proxy. Plain backend names still give the unproxied servers.

The plan is the contract profile (:meth:`HttpFaultPlan.contract`) at :data:`FAULT_RATE`, seeded by
:data:`FAULT_SEED` and the test's node id (each test gets its own reproducible pattern); a test
that wants another plan passes ``plan=...``. Retry settings let an operation survive the rate
(:data:`FAULT_RETRY`); ``timeout_s`` bounds what a stalled connection costs. Each proxy is stopped
at teardown; the session's counters are printed in the terminal summary.
"""

from __future__ import annotations

import collections
import zlib
from urllib.parse import urlsplit

import pytest

from ddiloco_geo.tools.faultproxy import FaultProxyThread, HttpFaultPlan

PROXIED = ("moto+faults", "localstack+faults", "gcs+faults")
FAULT_RATE = 0.10
FAULT_SEED = 1313
FAULT_RETRY = {"retry_attempts": 10, "retry_initial_s": 0.005, "retry_max_s": 0.1, "timeout_s": 5.0}

SESSION_COUNTS: collections.Counter[str] = collections.Counter()


def seed_for(nodeid: str) -> int:
    return FAULT_SEED * 1_000_003 + zlib.crc32(nodeid.encode())


def record(stats: dict) -> None:
    SESSION_COUNTS["requests"] += stats["requests"]
    SESSION_COUNTS.update(stats["faults"])


@pytest.fixture
def start_proxy(request):
    """``start_proxy(endpoint, plan) -> FaultProxyThread`` in front of ``endpoint``; stopped at teardown."""
    proxies: list[FaultProxyThread] = []

    def start(endpoint: str, plan: HttpFaultPlan) -> FaultProxyThread:
        parts = urlsplit(endpoint)
        proxy = FaultProxyThread(parts.hostname, parts.port, plan, stall_max_s=120.0).start()
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        record(proxy.stats())
        proxy.stop()


@pytest.fixture
def make_storage_config(make_storage_config, start_proxy, request):
    """The root factory, plus ``NAME+faults``: the server NAME behind a fault proxy.

    ``plan`` (default: the contract profile at FAULT_RATE) decides the faults; the proxy is
    reachable as ``cfg_proxies[cfg.endpoint_url]`` through the ``fault_proxies`` fixture."""
    parent = make_storage_config

    def make(backend: str, *, plan: HttpFaultPlan | None = None, **overrides):
        if not backend.endswith("+faults"):
            return parent(backend, **overrides)
        server = backend[: -len("+faults")]
        cfg = parent(server, **{**FAULT_RETRY, **overrides})
        plan = plan or HttpFaultPlan.contract(seed_for(request.node.nodeid), FAULT_RATE)
        proxy = start_proxy(cfg.endpoint_url, plan)
        request.node.fault_proxies = [*getattr(request.node, "fault_proxies", []), proxy]
        return cfg.model_copy(update={"endpoint_url": proxy.url})

    return make


@pytest.fixture
def fault_proxies(request):
    """The proxies this test started, in order (read after making a config)."""
    return lambda: list(getattr(request.node, "fault_proxies", []))


@pytest.fixture(params=PROXIED)
def backend(request) -> str:
    return request.param


def pytest_terminal_summary(terminalreporter):
    if SESSION_COUNTS["requests"]:
        requests = SESSION_COUNTS["requests"]
        failing = sum(n for k, n in SESSION_COUNTS.items() if k not in ("requests", "latency"))
        kinds = " ".join(f"{k}={n}" for k, n in sorted(SESSION_COUNTS.items()) if k != "requests")
        terminalreporter.write_line(
            f"fault proxy: {requests} requests, {failing} failed on purpose ({failing / requests:.1%}); {kinds}")
