"""The global model at past instants: every version of every fragment stays in the bucket and every
merge record carries ``published_at``, so the global model at instant t is, for each fragment, the
newest version published at or before t. :class:`PastEvaluator` builds the run's model (from
``run.json``) and the eval split (from this command's data settings: a byte corpus or ``tokens:`` shards) and evaluates params on the
CPU; :func:`evaluate_over_time` picks the instants and evaluates each distinct set of versions once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ddiloco_geo import protocol
from ddiloco_geo.core import data, model
from ddiloco_geo.core.config import ModelConfig
from ddiloco_geo.learner.data import eval_batches_for

log = logging.getLogger(__name__)


class PastEvaluator:
    """Rebuilds the global model as it was at an instant and evaluates it (CPU, no gradients)."""

    def __init__(self, settings, spec, eval_batches: int | None = None) -> None:
        model_cfg = ModelConfig.model_validate(spec.model)
        self.batches = eval_batches_for(settings.data, block_size=model_cfg.block_size,
                                        batch_size=settings.learner.batch_size, num_batches=eval_batches)
        self.model = model.build_model(model_cfg)

    def loss(self, params) -> float:
        model.set_tensors(self.model, params)
        return data.evaluate(self.model, self.batches)


def evaluate_over_time(store, summary: dict[str, Any], evaluator: PastEvaluator, points: int, verifier=None,
                       require: bool = False) -> list[dict[str, Any]]:
    """Global eval loss at ``points`` instants spread from the first global to the last merge; with
    ``verifier`` only syncer-signed merge records and globals are read."""
    spec = protocol.load_spec(store)
    P = spec.plan.num_fragments
    published: dict[int, list[tuple[float, int]]] = {p: [] for p in range(P)}
    for r in protocol.merge_records(store, verifier):
        if isinstance(r.get("published_at"), (int, float)):
            published[int(r["fragment"])].append((float(r["published_at"]) - summary["start_time"], int(r["version"])))
    for p in published:
        published[p].sort()
    merges = sorted(summary["merges"], key=lambda m: m["time"])
    t_end = max((m["time"] for m in merges), default=0.0)
    t_first = min((m["time"] for m in merges), default=0.0)
    # the first globals, then the rest spread from the first merge to the last one
    if points <= 1:
        instants = [t_end]
    else:
        instants = [0.0] + [t_first + (t_end - t_first) * i / max(1, points - 2) for i in range(points - 1)]
        instants = sorted(set(instants))
    params: dict[str, Any] = {}
    held: dict[int, int] = {}
    results: list[dict[str, Any]] = []
    cache: dict[tuple[int, ...], float] = {}
    for i, t in enumerate(instants):
        versions = {}
        for p in range(P):
            ok = [v for (at, v) in published[p] if at <= t + 1e-6]
            versions[p] = max(ok) if ok else min((v for _, v in published[p]), default=0)
        for p, v in versions.items():
            if held.get(p) != v:
                _, tensors = protocol.read_global(store, spec, p, v, verify=verifier, require_signature=require)
                params.update(tensors)
                held[p] = v
        sig = tuple(versions[p] for p in range(P))
        t_start = time.monotonic()
        if sig not in cache:
            cache[sig] = evaluator.loss(params)
        tokens = sum(m["tokens"] for m in merges if m["time"] <= t + 1e-6) / P
        results.append({"time": t, "tokens": tokens, "loss": cache[sig], "versions": sum(sig)})
        log.info("report_eval point=%d/%d time_s=%.1f tokens=%.0f versions=%d loss=%.4f eval_s=%.2f",
                 i + 1, len(instants), t, tokens, sum(sig), cache[sig], time.monotonic() - t_start)
    return results

