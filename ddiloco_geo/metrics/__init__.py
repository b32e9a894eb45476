"""Prometheus metrics and a health endpoint, without a client library.

A :class:`Registry` holds metric families (:class:`Counter`, :class:`Gauge`, :class:`Histogram`)
and renders them in the Prometheus text exposition format 0.0.4: one ``# HELP`` and one ``# TYPE``
line per family, families sorted by name, series sorted by label values, label values escaped
(``\\`` -> ``\\\\``, ``"`` -> ``\\"``, newline -> ``\\n``). Histograms export cumulative
``_bucket{le=...}`` series ending in ``le="+Inf"``, then ``_sum`` and ``_count``.

Every update takes the family's lock, so the learner's training, uploader and poller threads may
update the same metric at once; a render sees each family in one consistent state (a histogram's
``+Inf`` bucket always equals its ``_count``). Registering a name twice returns the existing
family when the definition (type, help, labels, buckets) is identical and raises ``ValueError``
otherwise, so :func:`learner_metrics`, :func:`syncer_metrics` and :func:`export_store_stats` can
share one registry and be called more than once.

:class:`MetricsServer` serves ``GET /metrics`` and ``GET /healthz`` from an aiohttp app on its own
daemon thread and event loop, so a blocked training step never delays a scrape. The endpoint has no
authentication: it binds only loopback hosts unless ``allow_non_loopback=True`` (scrape through an
SSH tunnel or a sidecar instead). ``stop()`` is idempotent and returns within about a second.

Metric names follow ``ddiloco_<component>_<name>``; ``docs/metrics.md`` lists every family.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from aiohttp import web

from ddiloco_geo.core.config import MetricsConfig
from ddiloco_geo.core.errors import ConfigError

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DEFAULT_HOST = "127.0.0.1"

_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


# --- text format -------------------------------------------------------------------------------


def _escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _format_value(value: float) -> str:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _format_labels(pairs: Iterable[tuple[str, str]]) -> str:
    body = ",".join(f'{k}="{_escape_label_value(v)}"' for k, v in pairs)
    return "{" + body + "}" if body else ""


# --- metric families ---------------------------------------------------------------------------


class _Metric:
    """A family: one name, one help text, fixed label names, one series per label-value tuple."""

    type_name = ""
    reserved_labels: tuple[str, ...] = ()

    def __init__(self, name: str, help: str, labels: Iterable[str] = ()) -> None:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"invalid metric name {name!r}: must match [a-zA-Z_:][a-zA-Z0-9_:]*")
        if not isinstance(help, str):
            raise ValueError(f"metric {name}: help must be a string")
        labelnames = tuple(labels)
        for label in labelnames:
            if not isinstance(label, str) or not _LABEL_RE.match(label) or label.startswith("__"):
                raise ValueError(
                    f"metric {name}: invalid label name {label!r}: must match [a-zA-Z_][a-zA-Z0-9_]* "
                    "and not start with '__'"
                )
            if label in self.reserved_labels:
                raise ValueError(f"metric {name}: label name {label!r} is reserved for {self.type_name}s")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"metric {name}: duplicate label names in {labelnames}")
        self.name = name
        self.help = help
        self.labelnames = labelnames
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], Any] = {}
        if not labelnames:
            self._series[()] = self._new_series()

    # subclasses: the zero state of one series and its sample lines
    def _new_series(self) -> Any:
        raise NotImplementedError

    def _samples(self, key: tuple[str, ...], state: Any) -> list[str]:
        raise NotImplementedError

    def _definition(self) -> tuple[Any, ...]:
        return (type(self), self.help, self.labelnames)

    def sample_names(self) -> tuple[str, ...]:
        return (self.name,)

    def _key(self, labels: Mapping[str, Any]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(
                f"metric {self.name}: expected labels {list(self.labelnames)}, got {sorted(labels)}"
            )
        return tuple(str(labels[n]) for n in self.labelnames)

    def _get_series(self, key: tuple[str, ...]) -> Any:
        # caller holds self._lock
        state = self._series.get(key)
        if state is None:
            state = self._series[key] = self._new_series()
        return state

    def init(self, **labels: Any) -> None:
        """Create the series for these label values at zero, so it is exported before its first update."""
        key = self._key(labels)
        with self._lock:
            self._get_series(key)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._series.items())
            lines = [self._samples(key, state) for key, state in items]
        header = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.type_name}"]
        return header + [line for group in lines for line in group]


class _Value:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0


class Counter(_Metric):
    """A monotonically increasing total. ``set_total`` mirrors an external running total."""

    type_name = "counter"

    def _new_series(self) -> _Value:
        return _Value()

    def _samples(self, key: tuple[str, ...], state: _Value) -> list[str]:
        return [f"{self.name}{_format_labels(zip(self.labelnames, key))} {_format_value(state.value)}"]

    def inc(self, value: float = 1, **labels: Any) -> None:
        if value < 0 or (isinstance(value, float) and math.isnan(value)):
            raise ValueError(f"counter {self.name}: cannot increase by {value!r}; counters only go up")
        key = self._key(labels)
        with self._lock:
            self._get_series(key).value += value

    def set_total(self, value: float, **labels: Any) -> None:
        """Set the absolute total (from a running count kept elsewhere); it may never go backwards."""
        key = self._key(labels)
        with self._lock:
            state = self._get_series(key)
            if not value >= state.value:  # also rejects NaN
                raise ValueError(
                    f"counter {self.name}{_format_labels(zip(self.labelnames, key))}: "
                    f"total {value!r} is below the current {state.value!r}; counters never go backwards"
                )
            state.value = value

    def get(self, **labels: Any) -> float:
        key = self._key(labels)
        with self._lock:
            return self._series[key].value if key in self._series else 0


class Gauge(_Metric):
    """A value that goes up and down."""

    type_name = "gauge"

    def _new_series(self) -> _Value:
        return _Value()

    def _samples(self, key: tuple[str, ...], state: _Value) -> list[str]:
        return [f"{self.name}{_format_labels(zip(self.labelnames, key))} {_format_value(state.value)}"]

    def set(self, value: float, **labels: Any) -> None:
        key = self._key(labels)
        with self._lock:
            self._get_series(key).value = value

    def inc(self, value: float = 1, **labels: Any) -> None:
        key = self._key(labels)
        with self._lock:
            self._get_series(key).value += value

    def dec(self, value: float = 1, **labels: Any) -> None:
        self.inc(-value, **labels)

    def get(self, **labels: Any) -> float:
        key = self._key(labels)
        with self._lock:
            return self._series[key].value if key in self._series else 0


class _HistogramState:
    __slots__ = ("counts", "sum", "count")

    def __init__(self, num_buckets: int) -> None:
        self.counts = [0] * num_buckets  # per bucket, not cumulative; made cumulative at render
        self.sum: float = 0
        self.count = 0


class Histogram(_Metric):
    """Observations counted into fixed buckets (upper bounds, ``+Inf`` appended), plus sum and count."""

    type_name = "histogram"
    reserved_labels = ("le",)

    def __init__(self, name: str, help: str, buckets: Iterable[float] = DEFAULT_BUCKETS,
                 labels: Iterable[str] = ()) -> None:
        bounds = [float(b) for b in buckets]
        if bounds and math.isinf(bounds[-1]) and bounds[-1] > 0:
            bounds.pop()
        if not bounds:
            raise ValueError(f"histogram {name}: need at least one finite bucket bound")
        if any(math.isnan(b) or math.isinf(b) for b in bounds) or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"histogram {name}: buckets {bounds} must be finite and strictly increasing")
        self.buckets = tuple(bounds) + (math.inf,)
        super().__init__(name, help, labels)

    def _new_series(self) -> _HistogramState:
        return _HistogramState(len(self.buckets))

    def _definition(self) -> tuple[Any, ...]:
        return super()._definition() + (self.buckets,)

    def sample_names(self) -> tuple[str, ...]:
        return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")

    def _samples(self, key: tuple[str, ...], state: _HistogramState) -> list[str]:
        pairs = list(zip(self.labelnames, key))
        lines = []
        cumulative = 0
        for bound, n in zip(self.buckets, state.counts):
            cumulative += n
            le = "+Inf" if math.isinf(bound) else repr(bound)
            lines.append(f"{self.name}_bucket{_format_labels(pairs + [('le', le)])} {cumulative}")
        lines.append(f"{self.name}_sum{_format_labels(pairs)} {_format_value(state.sum)}")
        lines.append(f"{self.name}_count{_format_labels(pairs)} {state.count}")
        return lines

    def observe(self, value: float, **labels: Any) -> None:
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"histogram {self.name}: cannot observe NaN")
        key = self._key(labels)
        index = next(i for i, bound in enumerate(self.buckets) if value <= bound)
        with self._lock:
            state = self._get_series(key)
            state.counts[index] += 1
            state.sum += value
            state.count += 1

    def get(self, **labels: Any) -> dict[str, Any]:
        """``{"buckets": {le: cumulative}, "sum": s, "count": n}`` for one series."""
        key = self._key(labels)
        with self._lock:
            state = self._series.get(key) or self._new_series()
            cumulative, out = 0, {}
            for bound, n in zip(self.buckets, state.counts):
                cumulative += n
                out[bound] = cumulative
            return {"buckets": out, "sum": state.sum, "count": state.count}


class Registry:
    """Metric families by name; ``render()`` is the whole ``/metrics`` body."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}
        self._sample_owner: dict[str, str] = {}  # every sample name -> the family that emits it

    def _register(self, metric: _Metric) -> Any:
        with self._lock:
            existing = self._metrics.get(metric.name)
            if existing is not None:
                if existing._definition() != metric._definition():
                    raise ValueError(
                        f"metric {metric.name} is already registered as a {existing.type_name} "
                        f"with labels {list(existing.labelnames)} and a different definition"
                    )
                return existing
            for sample in metric.sample_names():
                owner = self._sample_owner.get(sample)
                if owner is not None:
                    raise ValueError(f"metric {metric.name}: sample name {sample} collides with metric {owner}")
            self._metrics[metric.name] = metric
            for sample in metric.sample_names():
                self._sample_owner[sample] = metric.name
            return metric

    def counter(self, name: str, help: str, labels: Iterable[str] = ()) -> Counter:
        return self._register(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labels: Iterable[str] = ()) -> Gauge:
        return self._register(Gauge(name, help, labels))

    def histogram(self, name: str, help: str, buckets: Iterable[float] = DEFAULT_BUCKETS,
                  labels: Iterable[str] = ()) -> Histogram:
        return self._register(Histogram(name, help, buckets, labels))

    def get(self, name: str) -> _Metric | None:
        with self._lock:
            return self._metrics.get(name)

    def render(self) -> str:
        with self._lock:
            metrics = [self._metrics[name] for name in sorted(self._metrics)]
        lines = [line for metric in metrics for line in metric.render()]
        return "\n".join(lines) + "\n" if lines else ""


# --- the families the services use -------------------------------------------------------------

_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32)
_CONTRIBUTOR_BUCKETS = tuple(range(1, 17))

UPLOAD_DROP_REASONS = ("coalesced", "dropped")


@dataclass(frozen=True)
class LearnerMetrics:
    step_seconds: Histogram
    tokens_total: Counter
    tokens_per_second: Gauge
    steps_total: Counter
    deltas_sent_total: Counter
    delta_bytes_total: Counter
    upload_queue_depth: Gauge
    upload_drops_total: Counter
    adoption_lag_versions: Gauge
    globals_adopted_total: Counter
    loss: Gauge


def learner_metrics(reg: Registry) -> LearnerMetrics:
    p = "ddiloco_learner_"
    m = LearnerMetrics(
        step_seconds=reg.histogram(p + "step_seconds", "Wall time of one inner training step.", _SECONDS_BUCKETS),
        tokens_total=reg.counter(p + "tokens_total", "Tokens trained on by this learner."),
        tokens_per_second=reg.gauge(p + "tokens_per_second", "Recent training throughput in tokens per second."),
        steps_total=reg.counter(p + "steps_total", "Inner steps taken."),
        deltas_sent_total=reg.counter(p + "deltas_sent_total", "Fragment deltas uploaded to the bucket.",
                                      labels=("fragment",)),
        delta_bytes_total=reg.counter(p + "delta_bytes_total", "Encoded delta bytes uploaded."),
        upload_queue_depth=reg.gauge(p + "upload_queue_depth", "Deltas waiting for upload."),
        upload_drops_total=reg.counter(
            p + "upload_drops_total",
            "Deltas never uploaded: coalesced (replaced in the queue by a newer cumulative delta of the "
            "same fragment, no work lost) or dropped (oldest evicted from a full queue).",
            labels=("reason",)),
        adoption_lag_versions=reg.gauge(
            p + "adoption_lag_versions", "Latest published version minus the version this learner last adopted.",
            labels=("fragment",)),
        globals_adopted_total=reg.counter(p + "globals_adopted_total", "Global fragment versions adopted."),
        loss=reg.gauge(p + "loss", "Most recent training loss."),
    )
    for reason in UPLOAD_DROP_REASONS:
        m.upload_drops_total.init(reason=reason)
    return m


@dataclass(frozen=True)
class SyncerMetrics:
    quorum_wait_seconds: Histogram
    grace_window_seconds: Histogram
    contributors_per_merge: Histogram
    staleness_versions: Histogram
    deltas_rejected_total: Counter
    deltas_merged_total: Counter
    versions_published_total: Counter
    publish_seconds: Histogram
    pending_deltas: Gauge
    storage_retries_total: Counter


def syncer_metrics(reg: Registry) -> SyncerMetrics:
    p = "ddiloco_syncer_"
    return SyncerMetrics(
        quorum_wait_seconds=reg.histogram(
            p + "quorum_wait_seconds", "Time from a fragment's first pending delta until the quorum was met.",
            _WAIT_BUCKETS),
        grace_window_seconds=reg.histogram(
            p + "grace_window_seconds", "Extra time spent waiting for stragglers after the quorum was met.",
            _WAIT_BUCKETS),
        contributors_per_merge=reg.histogram(
            p + "contributors_per_merge", "Learner deltas merged into one published version.", _CONTRIBUTOR_BUCKETS),
        staleness_versions=reg.histogram(
            p + "staleness_versions", "Current version minus the base version of each merged delta.",
            _STALENESS_BUCKETS),
        deltas_rejected_total=reg.counter(p + "deltas_rejected_total", "Deltas rejected, by reason.",
                                          labels=("reason",)),
        deltas_merged_total=reg.counter(p + "deltas_merged_total", "Deltas merged into a published version."),
        versions_published_total=reg.counter(p + "versions_published_total", "Global fragment versions published."),
        publish_seconds=reg.histogram(p + "publish_seconds", "Time to merge, encode and publish one version.",
                                      _SECONDS_BUCKETS),
        pending_deltas=reg.gauge(p + "pending_deltas", "Deltas seen but not yet merged or rejected."),
        storage_retries_total=_storage_counters(reg, "syncer")["retries"],
    )


# --- storage statistics ------------------------------------------------------------------------


def _storage_counters(reg: Registry, component: str) -> dict[str, Counter]:
    p = f"ddiloco_{component}_storage_"
    return {
        "bytes_up": reg.counter(p + "bytes_up_total", "Bytes written to the bucket."),
        "bytes_down": reg.counter(p + "bytes_down_total", "Bytes read from the bucket."),
        "requests": reg.counter(p + "requests_total", "Storage request attempts, by operation.", labels=("op",)),
        "retries": reg.counter(p + "retries_total", "Transient storage failures retried, by reason.",
                               labels=("reason",)),
        "errors": reg.counter(p + "errors_total",
                              "Storage failures given up on (retries exhausted or not retryable; not-found and "
                              "lost compare-and-swap excluded), by reason.", labels=("reason",)),
    }


def export_store_stats(reg: Registry, component: str, stats_snapshot: Mapping[str, Any]) -> None:
    """Mirror ``Store.stats.snapshot()`` into ``ddiloco_<component>_storage_*_total`` counters.

    Call it periodically (before each scrape is fine). Values are absolute running totals; a total
    that went backwards (a new Store under the same registry) raises ``ValueError``.
    """
    counters = _storage_counters(reg, component)
    counters["bytes_up"].set_total(stats_snapshot.get("bytes_up", 0))
    counters["bytes_down"].set_total(stats_snapshot.get("bytes_down", 0))
    for op, n in (stats_snapshot.get("requests") or {}).items():
        counters["requests"].set_total(n, op=op)
    for field in ("retries", "errors"):
        for reason, n in (stats_snapshot.get(field) or {}).items():
            counters[field].set_total(n, reason=reason)


# --- the HTTP endpoint -------------------------------------------------------------------------


def parse_address(address: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port``, ``:port`` or ``port`` -> (host, port); the host defaults to 127.0.0.1."""
    text = address.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ConfigError(f"metrics.address={address!r}: expected '[IPv6]:PORT', e.g. '[::1]:9400'")
    elif ":" in text:
        host, _, port = text.rpartition(":")
    else:
        host, port = "", text
    try:
        port_num = int(port)
    except ValueError:
        port_num = -1
    if not 0 <= port_num <= 65535:
        raise ConfigError(f"metrics.address={address!r}: expected HOST:PORT with PORT 0-65535, e.g. '127.0.0.1:9400'")
    return host or DEFAULT_HOST, port_num


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class MetricsServer:
    """``GET /metrics`` and ``GET /healthz`` on a daemon thread with its own event loop."""

    def __init__(self, registry: Registry, address: str, health: Callable[[], dict] | None = None,
                 *, allow_non_loopback: bool = False, shutdown_timeout_s: float = 1.0) -> None:
        self.host, self.port = parse_address(address)
        if self.host.lower() == "localhost":
            self.host = DEFAULT_HOST  # one socket: "localhost" with port 0 could bind ::1 and 127.0.0.1 apart
        if not allow_non_loopback and not is_loopback(self.host):
            raise ConfigError(
                f"metrics.address={address!r} binds non-loopback host {self.host!r}, but the metrics and "
                "health endpoints have no authentication; use 127.0.0.1:PORT and scrape through a tunnel "
                "or sidecar, or pass allow_non_loopback=True if the network is private"
            )
        self.registry = registry
        self.health = health
        self.shutdown_timeout_s = shutdown_timeout_s
        self._lock = threading.Lock()
        self._state = "new"  # new -> running -> stopped
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._bound: tuple[str, int] | None = None
        self._stop_event: asyncio.Event | None = None  # created on the server's loop

    # -- handlers (run on the server's loop)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = self.registry.render()
        return web.Response(body=body.encode(), headers={"Content-Type": CONTENT_TYPE})

    async def _healthz(self, request: web.Request) -> web.Response:
        try:
            report = dict(self.health()) if self.health is not None else {"ok": True}
        except Exception as exc:  # a broken health check is itself unhealthy, never a 500
            log.warning("health_check_failed error=%r", exc)
            report = {"ok": False, "error": repr(exc)}
        status = 200 if report.get("ok") else 503
        return web.Response(text=json.dumps(report, default=str), status=status, content_type="application/json")

    # -- lifecycle

    def start(self) -> tuple[str, int]:
        """Bind and serve; returns the bound (host, port). Port 0 picks a free port."""
        with self._lock:
            if self._state == "running":
                assert self._bound is not None
                return self._bound
            if self._state == "stopped":
                raise RuntimeError("MetricsServer cannot be restarted after stop(); create a new one")
            ready = threading.Event()
            failure: list[BaseException] = []
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._serve, args=(ready, failure),
                                            name="ddiloco-metrics", daemon=True)
            self._thread.start()
            ready.wait()
            if failure:
                self._thread.join()
                self._state = "stopped"
                raise ConfigError(
                    f"metrics server cannot bind {self.host}:{self.port}: {failure[0]}; "
                    "choose a free port (or port 0) for metrics.address"
                ) from failure[0]
            self._state = "running"
            assert self._bound is not None
            log.info("metrics_server_started host=%s port=%d", *self._bound)
            return self._bound

    def _serve(self, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._run(ready))
        except BaseException as exc:  # a bind failure; start() reports it
            failure.append(exc)
        finally:
            ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _run(self, ready: threading.Event) -> None:
        """Serve until stop(); then close the site, the open connections and every leftover task."""
        self._stop_event = asyncio.Event()
        try:
            await self._setup()
            ready.set()
            await self._stop_event.wait()
        finally:
            if self._runner is not None:
                # Let connections the kernel has already accepted reach their protocol before the
                # listener closes: on Python 3.11 a connection accepted in the same loop turn as
                # Server.close() fails transport creation and leaks its socket.
                await asyncio.sleep(0.01)
                for _ in range(3):
                    await asyncio.sleep(0)
                await self._runner.cleanup()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for _ in range(3):  # let closed transports run their connection_lost callbacks
                await asyncio.sleep(0)

    async def _setup(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=self.shutdown_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockname = self._runner.addresses[0]
        self._bound = (sockname[0], sockname[1])

    def stop(self) -> None:
        """Stop serving and join the thread. Idempotent; safe before start()."""
        with self._lock:
            if self._state != "running":
                self._state = "stopped"
                return
            self._state = "stopped"
            loop, thread = self._loop, self._thread
        assert loop is not None and thread is not None and self._stop_event is not None
        try:
            loop.call_soon_threadsafe(self._stop_event.set)
        except RuntimeError:  # the loop already closed: nothing left to stop
            pass
        thread.join(timeout=self.shutdown_timeout_s + 5.0)
        if thread.is_alive():
            log.warning("metrics_server_stop_timeout timeout_s=%.1f", self.shutdown_timeout_s + 5.0)
        log.info("metrics_server_stopped host=%s port=%d", self.host, self._bound[1] if self._bound else self.port)

    @property
    def address(self) -> tuple[str, int] | None:
        return self._bound

    def __enter__(self) -> "MetricsServer":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def serve_from_config(cfg: MetricsConfig, registry: Registry, health: Callable[[], dict] | None = None,
                      *, allow_non_loopback: bool = False) -> MetricsServer | None:
    """Start a server for ``metrics.address``; None (and nothing started) when it is unset."""
    if cfg.address is None:
        return None
    server = MetricsServer(registry, cfg.address, health, allow_non_loopback=allow_non_loopback)
    server.start()
    return server
