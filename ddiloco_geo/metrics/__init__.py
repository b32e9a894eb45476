"""Prometheus metrics and the health endpoint of learners and syncers, on ``prometheus_client``.

* :mod:`~ddiloco_geo.metrics.registry`: a per-component registry over a ``CollectorRegistry``,
  with keyword label values (``m.upload_drops_total.inc(reason="coalesced")``) and a sorted 0.0.4
  exposition.
* :mod:`~ddiloco_geo.metrics.catalogue`: our ``ddiloco_*`` families (:func:`learner_metrics`,
  :func:`syncer_metrics`, :func:`export_store_stats`); ``docs/metrics.md`` lists them.
* :mod:`~ddiloco_geo.metrics.server`: ``GET /metrics`` and ``GET /healthz`` on loopback
  (:class:`MetricsServer`, :func:`serve_from_config`).

This facade re-exports the public API so call sites stay ``from ddiloco_geo.metrics import ...``.
"""

from ddiloco_geo.metrics.catalogue import (
    UPLOAD_DROP_REASONS,
    LearnerMetrics,
    SyncerMetrics,
    export_store_stats,
    learner_metrics,
    storage_counters,
    syncer_metrics,
)
from ddiloco_geo.metrics.registry import DEFAULT_BUCKETS, Counter, Gauge, Histogram, Registry
from ddiloco_geo.metrics.server import (
    CONTENT_TYPE,
    DEFAULT_HOST,
    MetricsServer,
    is_loopback,
    parse_address,
    serve_from_config,
)

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_BUCKETS",
    "DEFAULT_HOST",
    "UPLOAD_DROP_REASONS",
    "Counter",
    "Gauge",
    "Histogram",
    "LearnerMetrics",
    "MetricsServer",
    "Registry",
    "SyncerMetrics",
    "export_store_stats",
    "is_loopback",
    "learner_metrics",
    "parse_address",
    "serve_from_config",
    "storage_counters",
    "syncer_metrics",
]
