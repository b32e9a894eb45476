"""The catalogue of our metrics: every ``ddiloco_*`` family, its help text, labels and buckets.

:func:`learner_metrics` and :func:`syncer_metrics` register one role's families in a component's
:class:`~ddiloco_geo.metrics.registry.Registry` (plus the client's ``process_*`` and ``python_*``
families for the process that role runs in) and return them as a frozen dataclass, so call sites
write ``m.upload_drops_total.inc(reason="coalesced")``. Both are idempotent: called again on the
same registry they return the same metrics. :func:`export_store_stats` mirrors a ``Store``'s
running totals into the ``ddiloco_<component>_storage_*_total`` counters.

Names follow ``ddiloco_<component>_<name>``; ``docs/metrics.md`` lists every family and must
change with this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ddiloco_geo.metrics.registry import Counter, Gauge, Histogram, Registry

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32)
CONTRIBUTOR_BUCKETS = tuple(range(1, 17))

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
        step_seconds=reg.histogram(p + "step_seconds", "Wall time of one inner training step.", SECONDS_BUCKETS),
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
    reg.register_process_collectors()
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
    m = SyncerMetrics(
        quorum_wait_seconds=reg.histogram(
            p + "quorum_wait_seconds", "Time from a fragment's first pending delta until the quorum was met.",
            WAIT_BUCKETS),
        grace_window_seconds=reg.histogram(
            p + "grace_window_seconds", "Extra time spent waiting for stragglers after the quorum was met.",
            WAIT_BUCKETS),
        contributors_per_merge=reg.histogram(
            p + "contributors_per_merge", "Learner deltas merged into one published version.", CONTRIBUTOR_BUCKETS),
        staleness_versions=reg.histogram(
            p + "staleness_versions", "Current version minus the base version of each merged delta.",
            STALENESS_BUCKETS),
        deltas_rejected_total=reg.counter(p + "deltas_rejected_total", "Deltas rejected, by reason.",
                                          labels=("reason",)),
        deltas_merged_total=reg.counter(p + "deltas_merged_total", "Deltas merged into a published version."),
        versions_published_total=reg.counter(p + "versions_published_total", "Global fragment versions published."),
        publish_seconds=reg.histogram(p + "publish_seconds", "Time to merge, encode and publish one version.",
                                      SECONDS_BUCKETS),
        pending_deltas=reg.gauge(p + "pending_deltas", "Deltas seen but not yet merged or rejected."),
        storage_retries_total=storage_counters(reg, "syncer")["retries"],
    )
    reg.register_process_collectors()
    return m


def storage_counters(reg: Registry, component: str) -> dict[str, Counter]:
    """The five ``ddiloco_<component>_storage_*_total`` counters, by ``Store.stats`` field."""
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
    counters = storage_counters(reg, component)
    counters["bytes_up"].set_total(stats_snapshot.get("bytes_up", 0))
    counters["bytes_down"].set_total(stats_snapshot.get("bytes_down", 0))
    for op, n in (stats_snapshot.get("requests") or {}).items():
        counters["requests"].set_total(n, op=op)
    for field in ("retries", "errors"):
        for reason, n in (stats_snapshot.get(field) or {}).items():
            counters[field].set_total(n, reason=reason)
