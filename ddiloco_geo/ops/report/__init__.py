"""``ddiloco-geo report``: PNG charts and a one-page summary of a run, from the bucket alone.

``ddiloco-geo report <run-url> --out DIR`` reads a run (finished or live, on any backend) and writes
to ``DIR`` (never to the run's prefix: only ``get``/``list`` calls reach the store):

* ``eval_loss.png``: the global model's eval loss against tokens and against wall time. The global
  model at instant t is rebuilt from the bucket (every version is kept): for each fragment the newest
  version published at or before t. It is evaluated with the run spec's model settings on the eval
  split of the data settings given to this command (``--config``/``--set``, as for the run).
  Tokens at t are the tokens the global model has absorbed: the ``num_tokens`` of the deltas merged
  into versions published at or before t, averaged over fragments (each fragment sees every token
  of a learner once).
* ``throughput.png``: tokens/s of every learner over time (from ``exit.json`` histories; from the
  merge records, i.e. tokens as the syncer merged them, for every learner, including live ones).
* ``merges.png``: contributors and staleness of every merge over time.
* ``bytes.png``: bytes moved by learners and syncer against a data-parallel ring all-reduce of fp32
  gradients every step (2(M-1)/M * 4 * params per learner step).
* ``timeline.png``: learner incarnations, joins, checkpoints, exits (with their reasons), silent
  learners and rejected deltas.
* ``report.md`` and ``report.html``: the numbers, the event table and the charts on one page;
  ``report.json``: the same data ``--json`` prints.

With a ``summary.json`` written by ``ddiloco-geo local`` instead of a URL, it re-draws that run's
``training.png`` (:func:`plot_local_run`, which ``local`` calls itself).

Modules: :mod:`~.collect` (the summary from the bucket, with the protocol's delta ledger),
:mod:`~.learners` (one learner's incarnations, events and throughput), :mod:`~.evaluate` (the
global model at past instants), :mod:`~.charts` (the PNGs), :mod:`~.render` (the Markdown and HTML
page), :mod:`~.build` (all of it into ``--out``). The command line is :mod:`ddiloco_geo.cli.report`.
"""

from ddiloco_geo.ops.report.build import build_report
from ddiloco_geo.ops.report.charts import (
    CHARTS, PLOTTERS, plot_bytes, plot_eval, plot_local_run, plot_merges, plot_throughput, plot_timeline,
)
from ddiloco_geo.ops.report.collect import collect
from ddiloco_geo.ops.report.evaluate import PastEvaluator, evaluate_over_time
from ddiloco_geo.ops.report.learners import FINISHED_REASONS, learner_history, throughput_rates
from ddiloco_geo.ops.report.render import sections, write_html, write_markdown

__all__ = [
    "CHARTS", "FINISHED_REASONS", "PLOTTERS", "PastEvaluator", "build_report", "collect", "evaluate_over_time",
    "learner_history", "plot_bytes", "plot_eval", "plot_local_run", "plot_merges", "plot_throughput",
    "plot_timeline", "sections", "throughput_rates", "write_html", "write_markdown",
]
