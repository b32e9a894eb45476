"""One report, end to end: read the run (:mod:`~ddiloco_geo.ops.report.collect`), evaluate the global
model at past instants (:mod:`~ddiloco_geo.ops.report.evaluate`), draw the charts
(:mod:`~ddiloco_geo.ops.report.charts`) and write the page (:mod:`~ddiloco_geo.ops.report.render`)
and ``report.json`` into ``out``. Only ``get``/``list`` calls reach the store."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from ddiloco_geo import protocol
from ddiloco_geo.core.signing import tool_keys
from ddiloco_geo.ops.report.charts import CHARTS, PLOTTERS
from ddiloco_geo.ops.report.collect import collect
from ddiloco_geo.ops.report.evaluate import PastEvaluator, evaluate_over_time
from ddiloco_geo.ops.report.render import write_html, write_markdown

log = logging.getLogger(__name__)


def build_report(store, settings, out: Path, *, eval_points: int = 7, eval_batches: int | None = None,
                 max_delta_headers: int = 4000) -> dict[str, Any]:
    """Read the run, evaluate the global model over time, draw the charts and write the page;
    ``settings`` supplies the eval data (``data.*``, ``learner.batch_size``)."""
    t_start = time.monotonic()
    verifier, required = tool_keys(settings.security)
    summary = collect(store, max_delta_headers=max_delta_headers, verifier=verifier)
    log.info("report_collected run=%s state=%s learners=%d merges=%d read_s=%.1f", summary["run_id"], summary["state"],
             summary["num_learners"], summary["merge_stats"]["count"], time.monotonic() - t_start)
    summary["global_evals"] = []
    if eval_points > 0:
        spec = protocol.load_spec(store)
        evaluator = PastEvaluator(settings, spec, eval_batches)
        summary["global_evals"] = evaluate_over_time(store, summary, evaluator, eval_points, verifier, required)
        summary["eval_batches"] = len(evaluator.batches)
    evals = summary["global_evals"]
    summary["initial_eval_loss"] = evals[0]["loss"] if evals else None
    summary["final_eval_loss"] = evals[-1]["loss"] if evals else None
    out.mkdir(parents=True, exist_ok=True)
    summary["charts"] = {name: str(PLOTTERS[name](summary, out / f"{name}.png")) for name in CHARTS}
    summary["page"] = {"markdown": str(write_markdown(summary, out / "report.md")),
                       "html": str(write_html(summary, out / "report.html"))}
    (out / "report.json").write_text(json.dumps(summary, indent=1, default=str))
    summary["page"]["json"] = str(out / "report.json")
    log.info("report_written out=%s seconds=%.1f", out, time.monotonic() - t_start)
    return summary
