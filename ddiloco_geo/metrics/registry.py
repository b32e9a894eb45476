"""A per-component metrics registry on ``prometheus_client``, with the call style our services use.

:class:`Registry` owns one ``prometheus_client.CollectorRegistry``. Its :class:`Counter`,
:class:`Gauge` and :class:`Histogram` wrap the client's metrics so that a call site passes label
values as keywords (``drops.inc(reason="coalesced")``, ``lag.set(2, fragment="3")``) instead of
``.labels(...)``; every value, lock and sample comes from the client.

What this adds on top of the client, and why:

* Names follow the Prometheus text format 0.0.4 (``[a-zA-Z_:][a-zA-Z0-9_:]*``; labels
  ``[a-zA-Z_][a-zA-Z0-9_]*``, not ``__*``, ``le`` reserved for histograms), checked here because
  the client also accepts UTF-8 names. Errors say which rule a name breaks.
* Registering a name again returns the existing metric when the definition (type, help, labels,
  buckets) is identical and raises ``ValueError`` otherwise, so :func:`learner_metrics`,
  :func:`syncer_metrics` and :func:`export_store_stats` can share a registry and run twice. A name
  whose samples collide with another family's (``lat_count`` next to histogram ``lat``) raises.
* :meth:`Counter.set_total` mirrors a running total kept elsewhere (the store's statistics); it
  never goes backwards.
* The registry is itself a collector (``collect()``, ``restricted_registry()``), so the client's
  ``generate_latest`` and aiohttp handler expose it: families sorted by exposed name, series by
  label values, and no ``_created`` series (they would add a gauge per counter and histogram to
  the 0.0.4 text; dropping them here leaves the client's process-wide switch alone).

Values are formatted by the client (``3.0``, ``NaN``, ``+Inf``); a histogram exports its
cumulative ``_bucket{le=...}`` series ending in ``le="+Inf"``, then ``_count`` and ``_sum``, and
its ``+Inf`` bucket always equals its ``_count``. Updates are thread-safe.
"""

from __future__ import annotations

import copy
import math
import re
import threading
from typing import Any, Iterable, Mapping

import prometheus_client
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.registry import Collector

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def _check_definition(name: str, help: str, labels: Iterable[str], reserved: tuple[str, ...]) -> tuple[str, ...]:
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
        if label in reserved:
            raise ValueError(f"metric {name}: label name {label!r} is reserved for histograms")
    if len(set(labelnames)) != len(labelnames):
        raise ValueError(f"metric {name}: duplicate label names in {labelnames}")
    return labelnames


class _Family:
    """One client metric plus its definition; label values are passed as keywords."""

    kind = ""
    reserved_labels: tuple[str, ...] = ()

    def __init__(self, name: str, help: str, labels: Iterable[str] = ()) -> None:
        self.name = name
        self.help = help
        self.labelnames = _check_definition(name, help, labels, self.reserved_labels)
        self._lock = threading.Lock()  # Counter: makes set_total's read-then-increase atomic against inc
        self._metric = self._client_metric()

    def _client_metric(self) -> Any:
        raise NotImplementedError

    def definition(self) -> tuple[Any, ...]:
        return (self.kind, self.help, self.labelnames)

    def _check_labels(self, labels: Mapping[str, Any]) -> None:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"metric {self.name}: expected labels {list(self.labelnames)}, got {sorted(labels)}")

    def _child(self, labels: Mapping[str, Any]) -> Any:
        """The client's series for these label values, created at zero on first use."""
        self._check_labels(labels)
        return self._metric.labels(**labels) if labels else self._metric

    def init(self, **labels: Any) -> None:
        """Create the series for these label values at zero, so it is exported before its first update."""
        self._child(labels)

    def _samples(self, labels: Mapping[str, Any]) -> dict[str, list[tuple[dict[str, str], float]]]:
        """One series' samples by name, read through the client's public ``collect()``; creates nothing."""
        self._check_labels(labels)
        wanted = {k: str(v) for k, v in labels.items()}
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in self._metric.collect():
            for s in family.samples:
                if all(s.labels.get(k) == v for k, v in wanted.items()):
                    out.setdefault(s.name, []).append((s.labels, s.value))
        return out


class Counter(_Family):
    """A monotonically increasing total. ``set_total`` mirrors an external running total."""

    kind = "counter"

    def _client_metric(self) -> prometheus_client.Counter:
        return prometheus_client.Counter(self.name, self.help, self.labelnames, registry=None)

    def inc(self, value: float = 1, **labels: Any) -> None:
        if not value >= 0:  # also rejects NaN
            raise ValueError(f"counter {self.name}: cannot increase by {value!r}; counters only go up")
        child = self._child(labels)
        with self._lock:
            child.inc(value)

    def set_total(self, value: float, **labels: Any) -> None:
        """Set the absolute total (from a running count kept elsewhere); it may never go backwards."""
        child = self._child(labels)
        with self._lock:
            current = self.get(**labels)
            if not value >= current:  # also rejects NaN
                raise ValueError(
                    f"counter {self.name}{labels or ''}: total {value!r} is below the current "
                    f"{current!r}; counters never go backwards"
                )
            child.inc(value - current)

    def get(self, **labels: Any) -> float:
        """The current total of one series; 0 for a series never updated."""
        found = self._samples(labels).get(self.name if self.name.endswith("_total") else self.name + "_total")
        return found[0][1] if found else 0


class Gauge(_Family):
    """A value that goes up and down."""

    kind = "gauge"

    def _client_metric(self) -> prometheus_client.Gauge:
        return prometheus_client.Gauge(self.name, self.help, self.labelnames, registry=None)

    def set(self, value: float, **labels: Any) -> None:
        self._child(labels).set(value)

    def inc(self, value: float = 1, **labels: Any) -> None:
        self._child(labels).inc(value)

    def dec(self, value: float = 1, **labels: Any) -> None:
        self._child(labels).dec(value)

    def get(self, **labels: Any) -> float:
        """The current value of one series; 0 for a series never set."""
        found = self._samples(labels).get(self.name)
        return found[0][1] if found else 0


class Histogram(_Family):
    """Observations counted into fixed buckets (upper bounds, ``+Inf`` appended), plus sum and count."""

    kind = "histogram"
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

    def _client_metric(self) -> prometheus_client.Histogram:
        return prometheus_client.Histogram(self.name, self.help, self.labelnames, registry=None,
                                           buckets=self.buckets)

    def definition(self) -> tuple[Any, ...]:
        return super().definition() + (self.buckets,)

    def observe(self, value: float, **labels: Any) -> None:
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"histogram {self.name}: cannot observe NaN")
        self._child(labels).observe(value)

    def get(self, **labels: Any) -> dict[str, Any]:
        """``{"buckets": {le: cumulative}, "sum": s, "count": n}`` for one series."""
        samples = self._samples(labels)
        buckets = {float(s_labels["le"]): value for s_labels, value in samples.get(self.name + "_bucket", [])}
        total = samples.get(self.name + "_sum", [({}, 0)])[0][1]
        count = samples.get(self.name + "_count", [({}, 0)])[0][1]
        return {"buckets": buckets or {b: 0 for b in self.buckets}, "sum": total, "count": count}


def _exposed_name(family: prometheus_client.Metric) -> str:
    """The name the text format prints for a collected family (the client strips ``_total``)."""
    return family.name + "_total" if family.type == "counter" else family.name


def _tidy(families: Iterable[prometheus_client.Metric]) -> list[prometheus_client.Metric]:
    """Families in name order, series in label-value order, ``_created`` samples dropped."""
    out = []
    for family in sorted(families, key=_exposed_name):
        created = family.name + "_created"
        tidy = copy.copy(family)  # some collectors return the same family object every time
        tidy.samples = sorted(
            (s for s in family.samples if s.name != created),
            key=lambda s: tuple(v for k, v in s.labels.items() if k != "le"),  # stable: buckets keep order
        )
        out.append(tidy)
    return out


class _Restricted:
    """``restricted_registry`` result: the client's name filter, tidied the same way."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def collect(self) -> list[prometheus_client.Metric]:
        return _tidy(self._inner.collect())


class Registry(Collector):
    """Our metric families by name over one ``CollectorRegistry``; ``render()`` is the ``/metrics`` body."""

    def __init__(self) -> None:
        self.collector_registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._metrics: dict[str, _Family] = {}
        self._process_collectors = False

    def _register(self, metric: _Family) -> Any:
        with self._lock:
            existing = self._metrics.get(metric.name)
            if existing is not None:
                if existing.definition() != metric.definition():
                    raise ValueError(
                        f"metric {metric.name} is already registered as a {existing.kind} "
                        f"with labels {list(existing.labelnames)} and a different definition"
                    )
                return existing
            try:
                self.collector_registry.register(metric._metric)
            except ValueError as exc:  # the client's "Duplicated timeseries in CollectorRegistry"
                raise ValueError(f"metric {metric.name}: a sample name collides with a registered metric: {exc}") from exc
            self._metrics[metric.name] = metric
            return metric

    def counter(self, name: str, help: str, labels: Iterable[str] = ()) -> Counter:
        return self._register(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labels: Iterable[str] = ()) -> Gauge:
        return self._register(Gauge(name, help, labels))

    def histogram(self, name: str, help: str, buckets: Iterable[float] = DEFAULT_BUCKETS,
                  labels: Iterable[str] = ()) -> Histogram:
        return self._register(Histogram(name, help, buckets, labels))

    def get(self, name: str) -> _Family | None:
        with self._lock:
            return self._metrics.get(name)

    def register_process_collectors(self) -> None:
        """Add the client's ``process_*`` (Linux) and ``python_*`` families, once per registry."""
        with self._lock:
            if self._process_collectors:
                return
            self._process_collectors = True
        ProcessCollector(registry=self.collector_registry)
        PlatformCollector(registry=self.collector_registry)
        GCCollector(registry=self.collector_registry)

    # -- the collector protocol, so the client's exposition functions and handlers take a Registry

    def collect(self) -> list[prometheus_client.Metric]:
        return _tidy(self.collector_registry.collect())

    def restricted_registry(self, names: Iterable[str]) -> _Restricted:
        return _Restricted(self.collector_registry.restricted_registry(names))

    def render(self) -> str:
        """The whole registry in the Prometheus text format 0.0.4."""
        return prometheus_client.generate_latest(self).decode()
