"""Metrics registry, text exposition format and the /metrics + /healthz endpoint."""

from __future__ import annotations

import json
import logging
import re
import socket
import sys
import threading
import urllib.error
import urllib.request

import pytest
from conftest import deadline

from ddiloco_geo.core.config import MetricsConfig
from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.metrics import (
    MetricsServer,
    Registry,
    export_store_stats,
    learner_metrics,
    parse_address,
    serve_from_config,
    syncer_metrics,
)
from ddiloco_geo.storage import StoreStats

# One sample line of the 0.0.4 text format: name, optional {labels}, value.
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE_RE = re.compile(
    rf'^[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{{{_LABEL}(?:,{_LABEL})*\}})? (?:[+-]Inf|NaN|-?[0-9.]+(?:e[+-]?[0-9]+)?)$'
)


def assert_valid_exposition(text: str) -> None:
    """Every line is HELP, TYPE or a well-formed sample; each family has one HELP and one TYPE."""
    assert text.endswith("\n")
    seen_type: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            kind, name = line.split(" ", 3)[1:3]
            if kind == "TYPE":
                assert name not in seen_type, f"two TYPE lines for {name}"
                seen_type.add(name)
        else:
            assert _SAMPLE_RE.match(line), f"malformed sample line: {line!r}"


def samples(text: str) -> dict[str, str]:
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))


# --- format --------------------------------------------------------------------------------------


@pytest.mark.unit
def test_render_has_help_and_type_per_family_in_name_order():
    reg = Registry()
    reg.gauge("b_gauge", "A gauge.").set(2.5)
    reg.counter("a_total", "A counter\nwith a \\ in help.").inc(3)
    text = reg.render()
    assert text == (
        "# HELP a_total A counter\\nwith a \\\\ in help.\n"
        "# TYPE a_total counter\n"
        "a_total 3.0\n"
        "# HELP b_gauge A gauge.\n"
        "# TYPE b_gauge gauge\n"
        "b_gauge 2.5\n"
    )
    assert_valid_exposition(text)


@pytest.mark.unit
def test_label_values_are_escaped():
    reg = Registry()
    c = reg.counter("escaped_total", "Escapes.", labels=("reason",))
    c.inc(reason='say "hi"\\now\nnext')
    text = reg.render()
    assert 'escaped_total{reason="say \\"hi\\"\\\\now\\nnext"} 1.0\n' in text
    assert_valid_exposition(text)


@pytest.mark.unit
def test_series_are_sorted_by_label_values():
    reg = Registry()
    g = reg.gauge("lag", "Lag.", labels=("fragment",))
    for fragment in ("2", "0", "1"):
        g.set(int(fragment) * 10, fragment=fragment)
    lines = [line for line in reg.render().splitlines() if not line.startswith("#")]
    assert lines == ['lag{fragment="0"} 0.0', 'lag{fragment="1"} 10.0', 'lag{fragment="2"} 20.0']


@pytest.mark.unit
def test_histogram_buckets_are_cumulative_with_inf_sum_and_count():
    reg = Registry()
    h = reg.histogram("wait_seconds", "Wait.", buckets=(0.1, 1, 10), labels=("kind",))
    for v in (0.05, 0.1, 0.5, 5, 50):
        h.observe(v, kind="a")
    text = reg.render()
    assert_valid_exposition(text)
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert body == [
        'wait_seconds_bucket{kind="a",le="0.1"} 2.0',  # le is inclusive
        'wait_seconds_bucket{kind="a",le="1.0"} 3.0',
        'wait_seconds_bucket{kind="a",le="10.0"} 4.0',
        'wait_seconds_bucket{kind="a",le="+Inf"} 5.0',
        'wait_seconds_count{kind="a"} 5.0',  # prometheus_client writes _count before _sum
        'wait_seconds_sum{kind="a"} 55.65',
    ]
    assert "# TYPE wait_seconds histogram" in text
    assert h.get(kind="a")["count"] == 5


@pytest.mark.unit
def test_unlabelled_metrics_export_zero_before_first_update():
    reg = Registry()
    reg.counter("idle_total", "Idle.")
    reg.histogram("idle_seconds", "Idle.", buckets=(1,))
    s = samples(reg.render())
    assert s["idle_total"] == "0.0"
    assert s['idle_seconds_bucket{le="+Inf"}'] == "0.0"
    assert s["idle_seconds_count"] == "0.0"


@pytest.mark.unit
def test_gauge_set_inc_dec():
    reg = Registry()
    g = reg.gauge("depth", "Depth.")
    g.set(5)
    g.inc()
    g.dec(3)
    assert g.get() == 3
    g.set(float("nan"))
    g2 = reg.gauge("inf_gauge", "Inf.")
    g2.set(float("inf"))
    s = samples(reg.render())
    assert s["depth"] == "NaN" and s["inf_gauge"] == "+Inf"


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("name", ["", "1abc", "has-dash", "has space", "ünicode", "a.b"])
def test_invalid_metric_names_are_rejected(name):
    with pytest.raises(ValueError, match="invalid metric name"):
        Registry().counter(name, "x")


@pytest.mark.unit
@pytest.mark.parametrize("label", ["1x", "a-b", "__reserved", ""])
def test_invalid_label_names_are_rejected(label):
    with pytest.raises(ValueError, match="invalid label name"):
        Registry().counter("ok_total", "x", labels=(label,))


@pytest.mark.unit
def test_histogram_le_label_is_reserved_and_buckets_must_increase():
    reg = Registry()
    with pytest.raises(ValueError, match="reserved"):
        reg.histogram("h", "x", labels=("le",))
    with pytest.raises(ValueError, match="strictly increasing"):
        reg.histogram("h2", "x", buckets=(1, 1, 2))


@pytest.mark.unit
def test_wrong_labels_on_update_are_rejected():
    c = Registry().counter("by_reason_total", "x", labels=("reason",))
    with pytest.raises(ValueError, match="expected labels"):
        c.inc()
    with pytest.raises(ValueError, match="expected labels"):
        c.inc(reason="a", extra="b")


@pytest.mark.unit
def test_counter_never_goes_down():
    c = Registry().counter("up_total", "x")
    with pytest.raises(ValueError):
        c.inc(-1)
    c.set_total(10)
    c.set_total(10)
    with pytest.raises(ValueError, match="never go backwards"):
        c.set_total(9)
    assert c.get() == 10


@pytest.mark.unit
def test_reregistering_same_definition_returns_it_and_conflicts_raise():
    reg = Registry()
    c = reg.counter("x_total", "X.", labels=("a",))
    assert reg.counter("x_total", "X.", labels=("a",)) is c
    with pytest.raises(ValueError, match="already registered"):
        reg.gauge("x_total", "X.", labels=("a",))
    with pytest.raises(ValueError, match="already registered"):
        reg.counter("x_total", "X.", labels=("b",))
    reg.histogram("lat", "Latency.")
    with pytest.raises(ValueError, match="collides"):
        reg.counter("lat_count", "Clash with the histogram's _count.")


# --- thread safety -------------------------------------------------------------------------------


@pytest.mark.unit
def test_concurrent_updates_give_exact_totals():
    reg = Registry()
    c = reg.counter("hits_total", "x", labels=("t",))
    h = reg.histogram("obs", "x", buckets=(0.5,))
    g = reg.gauge("level", "x")
    num_threads, per_thread = 16, 5000
    barrier = threading.Barrier(num_threads)

    def work(i: int) -> None:
        barrier.wait()
        for _ in range(per_thread):
            c.inc(t=str(i % 2))
            h.observe(1)
            g.inc()
            g.dec(0.5)
            if _ % 500 == 0:
                reg.render()  # rendering concurrently with updates must not fail

    threads = [threading.Thread(target=work, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = num_threads * per_thread
    assert c.get(t="0") + c.get(t="1") == total
    assert h.get()["count"] == total and h.get()["sum"] == total
    assert g.get() == total * 0.5
    s = samples(reg.render())
    assert s['obs_bucket{le="+Inf"}'] == f"{total}.0"


# --- service families and storage ----------------------------------------------------------------


@pytest.mark.unit
def test_learner_and_syncer_families_share_one_registry():
    reg = Registry()
    lm = learner_metrics(reg)
    sm = syncer_metrics(reg)
    export_store_stats(reg, "learner", {"bytes_up": 1})
    export_store_stats(reg, "syncer", {"retries": {"SlowDown": 2}})
    assert learner_metrics(reg).loss is lm.loss  # idempotent
    lm.step_seconds.observe(0.2)
    lm.deltas_sent_total.inc(fragment=3)
    lm.adoption_lag_versions.set(1, fragment=3)
    sm.contributors_per_merge.observe(3)
    sm.deltas_rejected_total.inc(reason="stale")
    text = reg.render()
    assert_valid_exposition(text)
    for name in ("ddiloco_learner_step_seconds", "ddiloco_learner_tokens_total",
                 "ddiloco_learner_tokens_per_second", "ddiloco_learner_steps_total",
                 "ddiloco_learner_deltas_sent_total", "ddiloco_learner_delta_bytes_total",
                 "ddiloco_learner_upload_queue_depth", "ddiloco_learner_upload_drops_total",
                 "ddiloco_learner_adoption_lag_versions", "ddiloco_learner_globals_adopted_total",
                 "ddiloco_learner_loss", "ddiloco_syncer_quorum_wait_seconds",
                 "ddiloco_syncer_grace_window_seconds", "ddiloco_syncer_contributors_per_merge",
                 "ddiloco_syncer_staleness_versions", "ddiloco_syncer_deltas_rejected_total",
                 "ddiloco_syncer_deltas_merged_total", "ddiloco_syncer_versions_published_total",
                 "ddiloco_syncer_publish_seconds", "ddiloco_syncer_pending_deltas",
                 "ddiloco_syncer_storage_retries_total"):
        assert f"# TYPE {name} " in text, name
    s = samples(text)
    assert s['ddiloco_learner_upload_drops_total{reason="coalesced"}'] == "0.0"
    assert s['ddiloco_learner_upload_drops_total{reason="dropped"}'] == "0.0"
    assert s['ddiloco_syncer_contributors_per_merge_bucket{le="16.0"}'] == "1.0"
    assert s['ddiloco_syncer_storage_retries_total{reason="SlowDown"}'] == "2.0"
    assert sm.storage_retries_total.get(reason="SlowDown") == 2  # one family, fed by export_store_stats


@pytest.mark.unit
def test_component_metric_sets_add_the_process_families_once():
    reg = Registry()
    learner_metrics(reg)
    learner_metrics(reg)
    syncer_metrics(reg)
    text = reg.render()
    assert_valid_exposition(text)  # one TYPE line per family: the collectors were registered once
    assert "# TYPE python_info gauge" in text
    assert "# TYPE python_gc_collections_total counter" in text
    if sys.platform == "linux":
        assert "# TYPE process_resident_memory_bytes gauge" in text
    assert "python_info" not in Registry().render()  # a bare registry has only what is registered


@pytest.mark.unit
def test_export_store_stats_sets_absolute_totals():
    reg = Registry()
    snap = {"bytes_up": 100, "bytes_down": 2000, "requests": {"get": 3, "put_if_absent": 1},
            "retries": {"http_503": 2}, "errors": {"StorageError": 1}}
    export_store_stats(reg, "learner", snap)
    export_store_stats(reg, "learner", snap)  # same totals again: no double counting
    s = samples(reg.render())
    assert s["ddiloco_learner_storage_bytes_up_total"] == "100.0"
    assert s["ddiloco_learner_storage_bytes_down_total"] == "2000.0"
    assert s['ddiloco_learner_storage_requests_total{op="get"}'] == "3.0"
    assert s['ddiloco_learner_storage_requests_total{op="put_if_absent"}'] == "1.0"
    assert s['ddiloco_learner_storage_retries_total{reason="http_503"}'] == "2.0"
    assert s['ddiloco_learner_storage_errors_total{reason="StorageError"}'] == "1.0"
    export_store_stats(reg, "learner", {**snap, "bytes_up": 150})
    assert samples(reg.render())["ddiloco_learner_storage_bytes_up_total"] == "150.0"
    with pytest.raises(ValueError, match="backwards"):
        export_store_stats(reg, "learner", {**snap, "bytes_up": 10})


@pytest.mark.unit
def test_export_store_stats_from_a_real_store():
    stats = StoreStats()
    stats.count_request("get")
    stats.add_down(42)
    reg = Registry()
    export_store_stats(reg, "syncer", stats.snapshot())
    s = samples(reg.render())
    assert s['ddiloco_syncer_storage_requests_total{op="get"}'] == "1.0"
    assert s["ddiloco_syncer_storage_bytes_down_total"] == "42.0"


# --- HTTP endpoint -------------------------------------------------------------------------------


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=deadline(5)) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:  # a 503 still carries the JSON body; close its socket
            return exc.code, exc.headers["Content-Type"], exc.read().decode()


def test_scrape_metrics_and_healthy_healthz_over_http():
    reg = Registry()
    reg.counter("ddiloco_test_hits_total", "Hits.", labels=("path",)).inc(path='a"b')
    with MetricsServer(reg, "127.0.0.1:0") as server:
        host, port = server.start()  # start() again is harmless and returns the same address
        assert host == "127.0.0.1" and port > 0
        status, ctype, body = _get(f"http://{host}:{port}/metrics")
        assert status == 200
        assert ctype.startswith("text/plain; version=0.0.4")
        assert body == reg.render()
        assert 'ddiloco_test_hits_total{path="a\\"b"} 1.0' in body
        status, ctype, body = _get(f"http://{host}:{port}/healthz")
        assert status == 200 and ctype.startswith("application/json")
        assert json.loads(body) == {"ok": True}


def test_scrape_negotiates_openmetrics_and_filters_by_name():
    reg = Registry()
    reg.counter("ddiloco_test_hits_total", "Hits.").inc()
    reg.gauge("ddiloco_test_level", "Level.").set(2)
    with MetricsServer(reg, "127.0.0.1:0") as server:
        host, port = server.address
        accept = {"Accept": "application/openmetrics-text;version=1.0.0"}
        req = urllib.request.Request(f"http://{host}:{port}/metrics", headers=accept)
        with urllib.request.urlopen(req, timeout=deadline(5)) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            body = resp.read().decode()
        assert "ddiloco_test_hits_total 1.0\n" in body and body.endswith("# EOF\n")
        assert "_created" not in body
        _, _, body = _get(f"http://{host}:{port}/metrics?name[]=ddiloco_test_level")
        assert samples(body) == {"ddiloco_test_level": "2.0"}


def test_healthz_returns_503_when_unhealthy_or_the_check_raises():
    state = {"ok": True, "version": 7}

    def health() -> dict:
        if state.get("boom"):
            raise RuntimeError("check broke")
        return dict(state)

    server = MetricsServer(Registry(), ":0", health=health)
    host, port = server.start()
    try:
        assert host == "127.0.0.1"
        status, _, body = _get(f"http://{host}:{port}/healthz")
        assert status == 200 and json.loads(body) == {"ok": True, "version": 7}
        state["ok"] = False
        status, _, body = _get(f"http://{host}:{port}/healthz")
        assert status == 503 and json.loads(body)["ok"] is False
        state["boom"] = True
        status, _, body = _get(f"http://{host}:{port}/healthz")
        assert status == 503 and "check broke" in json.loads(body)["error"]
    finally:
        server.stop()


def test_stop_is_idempotent_prompt_and_releases_the_port(caplog):
    server = MetricsServer(Registry(), "127.0.0.1:0")
    server.stop()  # before start: no-op
    server = MetricsServer(Registry(), "127.0.0.1:0")
    host, port = server.start()
    # an idle keep-alive connection must not hold up the shutdown: stop() gives the serving thread
    # shutdown_timeout_s + 5 s and warns if it is still alive (aiohttp's own default would be 60 s)
    idle = socket.create_connection((host, port))
    with caplog.at_level(logging.WARNING, logger="ddiloco_geo.metrics.server"):
        server.stop()
        server.stop()
    assert "metrics_server_stop_timeout" not in caplog.text
    idle.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=deadline(5))
    with pytest.raises(RuntimeError, match="restarted"):
        server.start()


@pytest.mark.unit
def test_non_loopback_host_is_refused_unless_allowed():
    for address in ("0.0.0.0:9400", "10.1.2.3:9400", "[::]:9400", "metrics.example.com:9400"):
        with pytest.raises(ConfigError, match="allow_non_loopback"):
            MetricsServer(Registry(), address)
    # allowed explicitly: constructing is fine (not started here, to avoid binding all interfaces)
    MetricsServer(Registry(), "0.0.0.0:9400", allow_non_loopback=True)


def test_busy_port_is_a_config_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ConfigError, match="cannot bind"):
            MetricsServer(Registry(), f"127.0.0.1:{port}").start()


@pytest.mark.unit
@pytest.mark.parametrize("address,expected", [
    ("127.0.0.1:9400", ("127.0.0.1", 9400)),
    (":9400", ("127.0.0.1", 9400)),
    ("9400", ("127.0.0.1", 9400)),
    ("[::1]:9400", ("::1", 9400)),
    ("localhost:0", ("localhost", 0)),
])
def test_parse_address(address, expected):
    assert parse_address(address) == expected


@pytest.mark.unit
@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000", "[::1]9400"])
def test_parse_address_rejects_bad_values(address):
    with pytest.raises(ConfigError, match="metrics.address"):
        parse_address(address)


def test_serve_from_config():
    reg = Registry()
    assert serve_from_config(MetricsConfig(), reg) is None
    server = serve_from_config(MetricsConfig(address="127.0.0.1:0"), reg, health=lambda: {"ok": True})
    assert server is not None
    try:
        host, port = server.address
        assert _get(f"http://{host}:{port}/healthz")[0] == 200
    finally:
        server.stop()
