"""A view of a run built from the bucket alone (never writes to it): ``ddiloco-geo status``.

:func:`collect` reads every learner's heartbeat and exit record, the quarantine records, the
globals index and the syncer status objects, and returns one JSON-able dict. :func:`render` draws
it as a rich table; :class:`LiveView` refreshes it with rich (on a terminal) or as periodic plain
log lines; ``ddiloco-geo local`` uses it for its live view. A learner whose last heartbeat is older
than :data:`SILENT_AFTER_S` and that has no exit record is ``silent``. Unreadable or non-object
JSON records read as absent (:func:`read_record`). With a verifier (a signed run) every record goes
through :mod:`ddiloco_geo.protocol.verified`: heartbeats and exit records count only if the learner
signed them, syncer status and quarantine records only if the syncer did, and every field is
validated; what was refused is counted in ``skipped_unverified`` and shown. The command line is
:mod:`ddiloco_geo.cli.status`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from ddiloco_geo import protocol
from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import DdilocoError, NotFoundError, StorageError
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)

SILENT_AFTER_S = 30.0


def read_record(store: Store, key: str) -> dict[str, Any] | None:
    """The JSON object at ``key``; None if it is missing, not JSON, or not an object."""
    try:
        value = json.loads(store.get(key))
    except (NotFoundError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def collect(store: Store, egress_usd_per_gb: float = 0.02, verifier=None) -> dict[str, Any]:
    """Everything the bucket says about the run; with ``verifier`` (the run secret is configured)
    only what the learner or the syncer signed (``signed``: true, or null without a verifier)."""
    now = time.time()
    skipped = protocol.Skipped()
    learners = []
    quarantined = protocol.quarantined_learners(store, verifier)
    for name in protocol.learner_ids(store)[0]:
        hb = protocol.heartbeat(store, name, verifier, skipped) or {}
        ex = protocol.exit_record(store, name, verifier, skipped)
        hb_time, ex_time = hb.get("time"), (ex or {}).get("time")
        age = now - hb_time if hb_time is not None else None
        # an exit record older than a later incarnation's heartbeat does not end the learner
        exited = ex is not None and (hb_time is None or hb.get("state") == "exited" or (ex_time or 0) >= hb_time - 1.0)
        state = "exited" if exited else ("alive" if age is not None and age < SILENT_AFTER_S else "silent")
        storage = (ex or hb).get("storage") or {}
        learners.append({
            "learner": name, "region": hb.get("region"), "state": state, "last_seen_s": age,
            "step": hb.get("step"), "tokens": hb.get("tokens"), "tokens_per_s": hb.get("tokens_per_s"),
            "loss": hb.get("loss"), "deltas_sent": (hb.get("uploads") or {}).get("deltas_sent"),
            "upload_queue": hb.get("upload_queue"), "quarantined": name in quarantined,
            "send_timing": hb.get("send_timing"),  # the aligned send lead; sends on time and late
            "signed": None if verifier is None or not hb else True,
            "bytes_up": int(storage.get("bytes_up", 0)), "bytes_down": int(storage.get("bytes_down", 0)),
            "rejected": len(store.list(f"{layout.SYNCER}rejected/{name}/")),
        })
    syncers = []
    for key in store.list(layout.SYNCER + "status/"):
        if not key.endswith(".json"):
            continue
        st = protocol.syncer_status(store, key, verifier, skipped)
        if st:
            st["age_s"] = now - (st["time"] if st["time"] is not None else now)
            syncers.append({k: st.get(k) for k in ("shard", "age_s", "versions", "pending", "counters",
                                                   "ema_step_s", "ema_sync_s", "last_merge", "draining",
                                                   "quarantined")})
    versions = _versions(store, syncers, verifier)
    moved = sum(l["bytes_up"] + l["bytes_down"] for l in learners)
    totals = {"tokens": sum(l["tokens"] or 0 for l in learners), "learner_bytes": moved,
              "egress_usd_per_gb": egress_usd_per_gb,
              # learners sit in other regions than the bucket: their traffic is what crosses regions
              "estimated_egress_usd": moved / 1e9 * egress_usd_per_gb}
    return {"time": now, "url": store.url, "learners": learners, "versions": {str(p): v for p, v in sorted(versions.items())},
            "syncers": syncers, "totals": totals, "skipped_unverified": skipped.as_dict()}


def _versions(store: Store, syncers: list[dict[str, Any]], verifier) -> dict[int, int]:
    """Newest version per fragment: the index (in a signed run only if the syncer signed it; a forged
    one reads as empty) raised by what the syncer-signed status objects say."""
    index, _ = protocol.read_index(store, verifier)
    if verifier is None:
        return index
    out: dict[int, int] = dict(index)
    for s in syncers:
        for p, v in (s.get("versions") or {}).items():
            if str(p).isdigit() and isinstance(v, int) and not isinstance(v, bool):
                out[int(p)] = max(v, out.get(int(p), -1))
    return out


def render(snapshot: dict[str, Any], global_evals: list[dict[str, float]] | None = None):
    from rich.table import Table

    table = Table(title=f"ddiloco-geo {snapshot['url']}", expand=False)
    for col in ("learner", "region", "state", "step", "loss", "tok/s", "deltas", "queue", "rejected"):
        table.add_column(col)
    for l in snapshot["learners"]:
        table.add_row(
            l["learner"], str(l["region"] or "-"), l["state"], str(l["step"] or 0),
            f"{l['loss']:.3f}" if isinstance(l["loss"], (int, float)) else "-",
            f"{l['tokens_per_s']:.0f}" if isinstance(l["tokens_per_s"], (int, float)) else "-",
            str(l["deltas_sent"] or 0), str(l["upload_queue"] or 0),
            f"{l['rejected']}" + (" QUARANTINED" if l["quarantined"] else ""),
        )
    versions = snapshot["versions"]
    caption = f"fragments={len(versions)} versions published={sum(versions.values())}"
    for s in snapshot["syncers"]:
        c = s.get("counters") or {}
        caption += (f" | syncer {s['shard']}: merged={c.get('deltas_merged', 0)} rejected={c.get('deltas_rejected', 0)}"
                    f" merges={c.get('merges', 0)}")
    if global_evals:
        caption += f" | global eval loss={global_evals[-1]['loss']:.3f}"
    refused = (snapshot.get("skipped_unverified") or {}).get("total", 0)
    if refused:
        caption += f" | {refused} unverified objects ignored"
    t = snapshot.get("totals") or {}
    if t:
        caption += (f"\ntokens={t['tokens']:,} learner traffic={t['learner_bytes'] / 2**20:.1f} MiB "
                    f"est. egress=${t['estimated_egress_usd']:.4f} at ${t['egress_usd_per_gb']}/GB")
    table.caption = caption
    return table


class LiveView:
    """Context manager: a rich Live table on a terminal, else a plain line every few seconds."""

    def __init__(self, store: Store, *, live: bool = True, plain_every_s: float = 5.0, verifier=None) -> None:
        self.store, self.verifier = store, verifier
        self.live = live and sys.stderr.isatty()
        self.plain_every_s = plain_every_s
        self._last_plain = 0.0
        self._live = None

    def __enter__(self) -> "LiveView":
        if self.live:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(stderr=True), refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def refresh(self, global_evals: list[dict[str, float]] | None = None) -> None:
        try:
            snap = collect(self.store, verifier=self.verifier)
        except (StorageError, DdilocoError) as exc:
            log.debug("status_unavailable error=%s", exc)
            return
        if self._live is not None:
            self._live.update(render(snap, global_evals))
        elif time.monotonic() - self._last_plain > self.plain_every_s:
            self._last_plain = time.monotonic()
            parts = [f"{l['learner']}:step={l['step'] or 0},loss={l['loss'] if l['loss'] is None else round(l['loss'], 3)}"
                     for l in snap["learners"]]
            log.info("progress versions=%d %s", sum(snap["versions"].values()), " ".join(parts))

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
