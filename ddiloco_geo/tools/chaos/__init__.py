"""``ddiloco-geo chaos``: a seeded chaos run on real processes and a real S3 server.

A real job (one syncer and M learners as OS processes, as ``ddiloco-geo local`` runs them) against a
real S3 server (moto on 127.0.0.1, started here unless ``--set storage.endpoint_url=...`` points at
one, e.g. LocalStack), while a schedule that is a pure function of ``--seed`` (``random.Random``)

* SIGKILLs and SIGTERMs learners and restarts them with the same ``--id`` (a SIGTERMed learner
  flushes, checkpoints and resumes; a SIGKILLed one loses its unflushed work), restarting one of
  them as a straggler (``learner.slow_step_s``);
* SIGKILLs the syncer and restarts it, and runs a second syncer for a while (the create-only
  global write decides every race);
* injects storage faults into some processes (``storage.fault_rate``/``fault_seed``: SlowDown,
  timeouts, lost responses, torn uploads, under each process's retry layer);
* puts the WAN emulator (one :class:`~ddiloco_geo.tools.wanproxy.WanProxyThread` per "region": one-way
  delay plus a shared bandwidth cap) between some learners and the bucket.

Triggers are learner steps (``{"learner": id, "step": s}``: the target's current incarnation has
reached step s) or offsets after an earlier action (``{"after": action_id, "delay_s": d}``,
counted from that action, or from the exit of the process it signalled), so the plan is the same
for a seed on any machine; only the times it executes at differ. The harness samples every
learner's heartbeat (``step``, ``time``, ``deltas_sent``) every ``--sample-s``; when every learner
has finished its ``learner.max_steps`` it SIGTERMs the syncer(s) so they drain, then reads the
bucket and reports (definitions in ``docs/chaos.md``):

``downtime_s``   time during which at least one learner had joined and not yet stopped, yet no
                 learner was stepping (a learner steps between two of its heartbeats whose step
                 advanced); plus ``stalls``: stretches longer than three fragment periods
                 (H x median step time) with no version published while a syncer was serving and
                 a delivered delta was waiting.
``goodput``      share of learner steps whose work reached a merged delta: per learner incarnation
                 and fragment, the steps up to the highest step covered by a merged delta, over
                 P x steps taken.
``deltas_*``     the ledger: written = merged (incl. superseded) + rejected; unaccounted must be 0.
``loss_ratio``   final eval loss of the global model / that of a fault-free run with the same
                 settings (M, model and data seed) run by the same command, at equal tokens merged
                 (``--baseline-runs``, default 3, a line through their losses, with its standard
                 error: :mod:`~.baseline`; ``--no-baseline`` skips them).
``recovery_s``   ``notice_to_exit`` (SIGTERM -> exit, learners), ``restart_to_first_merge``
                 (restart -> ``published_at`` of the first merge record holding a delta of the new
                 incarnation), and more.

A hard overall ``--timeout`` kills everything by PID. Every process started is stopped by its PID
(learners, syncers, and the moto server if the harness started it). Progress goes to stderr; the
report is written to ``--out``/chaos.json and, with ``--json``, printed on stdout.

Modules: :mod:`~.plan` (the run's shape and the seeded schedule), :mod:`~.testbed` (S3 server,
bucket, prefixes, WAN proxies, the children's environment), :mod:`~.supervisor` (processes and the
plan's actions), :mod:`~.report` (what the bucket and the supervisor say), :mod:`~.goals` (the
measurements and the pass/fail goals), :mod:`~.baseline` (the fault-free run), :mod:`~.runner`
(:class:`ChaosRun`, one run in order). The command line is :mod:`ddiloco_geo.cli.chaos`.
"""

from ddiloco_geo.tools.chaos.goals import (
    LOSS_GOAL, STALL_PERIODS, compute_downtime, compute_goodput, find_stalls, first_merge_after, goals, measure,
    subtract, union,
)
from ddiloco_geo.tools.chaos.plan import CHAOS_DEFAULTS, LONG, SHORT, plan_schedule
from ddiloco_geo.tools.chaos.runner import ChaosRun
from ddiloco_geo.tools.chaos.testbed import emulator_credentials

__all__ = [
    "CHAOS_DEFAULTS", "LONG", "LOSS_GOAL", "SHORT", "STALL_PERIODS", "ChaosRun", "compute_downtime", "compute_goodput",
    "emulator_credentials", "find_stalls", "first_merge_after", "goals", "measure", "plan_schedule", "subtract", "union",
]
