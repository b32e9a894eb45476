"""One chaos run from start to report: testbed, supervised job, report, baseline, goals.

Order: set up the testbed (S3 endpoint, bucket, fresh prefixes) and write ``OUT/settings.json``
(the settings every child reads, with the chaos prefix and endpoint) and ``OUT/plan.json``; start
the WAN proxies; run the job under the :class:`~ddiloco_geo.tools.chaos.supervisor.Supervisor`;
stop every process and proxy; build the report from the bucket; run the fault-free baseline
(unless disabled or timed out); judge the goals; stop the moto server if it was started here;
write ``OUT/chaos.json``. A hard ``timeout_s`` over the whole run kills everything by PID.

The settings passed in are never changed: the run's own copy is made with ``model_copy(update=...)``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddiloco_geo.core.config import Settings
from ddiloco_geo.storage import open_store
from ddiloco_geo.tools.chaos.baseline import BASELINE_RUNS, run_baseline
from ddiloco_geo.tools.chaos.goals import goals
from ddiloco_geo.tools.chaos.report import build_report
from ddiloco_geo.tools.chaos.supervisor import Supervisor
from ddiloco_geo.tools.chaos.testbed import Testbed, open_testbed
from ddiloco_geo.tools.evaluate import Evaluator

log = logging.getLogger(__name__)


class ChaosRun:
    """``plan`` (from :func:`~ddiloco_geo.tools.chaos.plan.plan_schedule`) played against a real job.

    ``baseline``: fault-free runs to compare with (0: none); ``base_url``: ``s3://BUCKET[/PREFIX]`` to
    run under (default: a fresh bucket); ``env``: the children's base environment (default: this
    process's, without ``DDILOCO_*``)."""

    def __init__(self, settings: Settings, plan: dict[str, Any], *, out: Path, sample_s: float = 0.5,
                 timeout_s: float = 900.0, baseline: int = BASELINE_RUNS, base_url: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.settings = settings
        self.plan = plan
        self.out = out
        self.sample_s = sample_s
        self.timeout_s = timeout_s
        self.baseline = baseline
        self.base_url = base_url
        self.env = env

    def _run_settings(self, testbed: Testbed) -> Settings:
        s = self.settings
        return s.model_copy(update={
            "storage": s.storage.model_copy(update={"url": testbed.url, "endpoint_url": testbed.endpoint,
                                                    "region": testbed.region}),
            "local": s.local.model_copy(update={"learners": self.plan["learners"]}),
            "learner": s.learner.model_copy(update={"max_steps": self.plan["steps"]}),
        })

    def run(self) -> dict[str, Any]:
        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        deadline = time.monotonic() + self.timeout_s
        testbed = open_testbed(self.settings.storage, self.plan, base_url=self.base_url, logs=self.out / "logs",
                               env=self.env)
        try:
            settings = self._run_settings(testbed)
            (self.out / "settings.json").write_text(settings.model_dump_json(indent=1))
            (self.out / "plan.json").write_text(json.dumps(self.plan, indent=1))
            store = open_store(settings.storage)
            try:
                try:
                    testbed.start_proxies(self.plan)
                    log.info("chaos_start seed=%d store=%s learners=%d steps=%d actions=%d", self.plan["seed"],
                             testbed.url, self.plan["learners"], self.plan["steps"], len(self.plan["actions"]))
                    sup = Supervisor(self.plan, store=store, out=self.out, env=testbed.child_env,
                                     proxy_urls={r: px.url for r, px in testbed.proxies.items()},
                                     sample_s=self.sample_s, timeout_s=self.timeout_s, deadline=deadline, t0=t0)
                    sup.run()
                finally:
                    testbed.stop_proxies()
                report = build_report(sup, store, testbed, Evaluator.from_settings(settings))
            finally:
                store.close()
            if self.baseline > 0 and not sup.timed_out:
                run_baseline(settings, report, url=testbed.baseline_url, out=self.out / "baseline",
                             env=testbed.child_env, deadline=deadline, runs=self.baseline)
            report["wall_s"] = round(time.time() - t0, 1)
            report["goals"] = goals(report)
            report["ok"] = all(report["goals"].values())
        finally:
            testbed.close()
        (self.out / "chaos.json").write_text(json.dumps(report, indent=1, default=str))
        log.info("chaos_report_written path=%s", self.out / "chaos.json")
        return report
