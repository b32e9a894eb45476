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
"""

from __future__ import annotations

import argparse
import bisect
import html
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SILENT_AFTER_S = 30.0
FINISHED_REASONS = ("max_steps", "max_time")
CHARTS = ("eval_loss", "throughput", "merges", "bytes", "timeline")


# --- the local-run plot (kept for `ddiloco-geo local`) -------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_local_run(summary: dict[str, Any], path: Path) -> Path:
    plt = _plt()

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for name, rec in sorted(summary.get("learners", {}).items()):
        hist = rec.get("history") or []
        if hist:
            ax_loss.plot([h["tokens"] for h in hist], [h["loss"] for h in hist], lw=1, alpha=0.8,
                         label=f"{name} (train, local params)")
    evals = summary.get("global_evals") or []
    if evals:
        ax_loss.plot([e["tokens"] for e in evals], [e["loss"] for e in evals], "k-o", lw=2, ms=4,
                     label="global model (eval)")
    ax_loss.set_xlabel("tokens (all learners)")
    ax_loss.set_ylabel("loss (nats/byte)")
    ax_loss.set_title(f"{summary.get('num_learners', '?')} learners, {summary.get('num_fragments', '?')} fragments")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)

    bars = {
        "ddiloco up": summary.get("bytes_up", 0),
        "ddiloco down": summary.get("bytes_down", 0),
        "DP all-reduce": summary.get("dp_allreduce_bytes", 0),
    }
    ax_bytes.bar(list(bars), [max(1, v) / 2**20 for v in bars.values()], color=["tab:blue", "tab:cyan", "tab:red"])
    ax_bytes.set_yscale("log")
    ax_bytes.set_ylabel("MiB moved")
    ax_bytes.set_title("bytes on the wire")
    ax_bytes.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- reading the run -----------------------------------------------------------------------------


def _json_or_none(store, key: str) -> dict[str, Any] | None:
    from ddiloco_geo.core.errors import NotFoundError

    try:
        value = json.loads(store.get(key))
        return value if isinstance(value, dict) else None
    except (NotFoundError, ValueError):
        return None


def _headers(store, keys_: list[str], workers: int = 16) -> dict[str, Any]:
    """Headers of tensor objects (two ranged reads each), in parallel; unreadable ones are skipped."""
    from ddiloco_geo import protocol
    from ddiloco_geo.core.errors import CodecError, StorageError

    def one(key: str):
        try:
            return key, protocol.read_header(store, key)
        except (CodecError, StorageError) as exc:
            log.debug("report_header_unreadable key=%s error=%s", key, exc)
            return key, None

    if not keys_:
        return {}
    with ThreadPoolExecutor(max_workers=min(workers, len(keys_))) as pool:
        return {k: h for k, h in pool.map(one, keys_) if h is not None}


def _records(store) -> list[dict[str, Any]]:
    from ddiloco_geo import protocol

    return protocol.merge_records(store)


def collect(store, *, max_delta_headers: int = 4000) -> dict[str, Any]:
    """Everything the report shows except the evaluation, as one JSON-able dict (reads only)."""
    from ddiloco_geo.core import layout
    from ddiloco_geo import protocol

    now = time.time()
    spec = protocol.load_spec(store)
    P = spec.plan.num_fragments
    num_params = sum(spec.plan.numel(p) for p in range(P))
    records = _records(store)
    published = [r for r in records if isinstance(r.get("published_at"), (int, float))]
    inits = [float(r["published_at"]) for r in published if r.get("kind") == "init"]
    t0 = max(inits) if len(inits) >= P else min((float(r["published_at"]) for r in published), default=now)
    merges = [r for r in published if r.get("kind") == "merge"]
    merges.sort(key=lambda r: float(r["published_at"]))

    # where each delta ended: merged or superseded by a merge published at t
    accounted_at: dict[str, float] = {}
    merged_keys: set[str] = set()
    superseded_keys: set[str] = set()
    for r in merges:
        for e in r.get("merged", []):
            accounted_at[e["key"]] = float(r["published_at"])
            merged_keys.add(e["key"])
        for k in r.get("superseded", []):
            accounted_at.setdefault(k, float(r["published_at"]))
            superseded_keys.add(k)
    rejected = []
    for key in store.list(layout.SYNCER + "rejected/"):
        rec = _json_or_none(store, key)
        if rec and "key" in rec:
            rejected.append(rec)
            accounted_at.setdefault(rec["key"], float(rec.get("at") or now))

    # merges over time
    merge_rows = []
    for r in merges:
        entries = r.get("merged", [])
        merge_rows.append({
            "fragment": int(r["fragment"]), "version": int(r["version"]), "time": float(r["published_at"]) - t0,
            "contributors": int(r.get("contributors", len({e["learner"] for e in entries}))),
            "staleness": [int(s) for s in r.get("staleness", [])], "grace_s": float(r.get("grace_s", 0.0)),
            "tokens": sum(int(e.get("num_tokens", 0)) for e in entries),
            "learners": sorted({e["learner"] for e in entries}),
        })

    # learners
    learners: dict[str, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    written: set[str] = set()
    for prefix in store.list_prefixes(layout.LEARNERS):
        name = prefix[len(layout.LEARNERS):].strip("/")
        if not layout.ID_PATTERN.match(name):
            continue
        learners[name] = _learner(store, name, t0, now, accounted_at, events, max_delta_headers, written)

    # tokens merged per learner over time (each fragment sees each token once: divide by P)
    for name, rec in learners.items():
        series, total = [], 0
        for r in merges:
            toks = sum(int(e.get("num_tokens", 0)) for e in r.get("merged", []) if e.get("learner") == name)
            if toks:
                total += toks
                series.append((float(r["published_at"]) - t0, total / P))
        rec["merged_tokens"] = [{"time": t, "tokens": v} for t, v in series]
        # merges arrive in bursts: about one bin per fragment period of this learner's deltas
        entries = sum(1 for r in merges for e in r.get("merged", []) if e.get("learner") == name)
        rec["throughput_merged"] = _rates(series, bins=max(3, min(12, entries // max(1, P))))

    for rec in rejected:
        events.append({"time": float(rec.get("at") or now) - t0, "learner": rec.get("learner"), "kind": "rejected",
                       "detail": f"{rec.get('reason')} ({rec['key'].rsplit('/', 1)[-1]})"})
    events.sort(key=lambda e: (e["time"], e["learner"] or "", e["kind"]))

    # syncers and bytes
    syncers = []
    for key in store.list(layout.SYNCER + "status/"):
        st = _json_or_none(store, key)
        if st:
            syncers.append({"shard": st.get("shard"), "age_s": now - float(st.get("time", now)),
                            "counters": st.get("counters"), "storage": st.get("storage") or {},
                            "draining": st.get("draining")})
    lup = sum(int(l["bytes_up"]) for l in learners.values())
    ldown = sum(int(l["bytes_down"]) for l in learners.values())
    sup = sum(int(s["storage"].get("bytes_up", 0)) for s in syncers)
    sdown = sum(int(s["storage"].get("bytes_down", 0)) for s in syncers)
    M = len(learners)
    steps_total = sum(int(l["steps"] or 0) for l in learners.values())
    dp = int(2 * (M - 1) / M * 4 * num_params * steps_total) if M > 1 else 0
    moved = lup + ldown + sup + sdown

    # ledger (as run.ledger, from what was read above)
    merged_or_sup = merged_keys | superseded_keys
    rejected_keys = {r["key"] for r in rejected}
    by_reason: dict[str, int] = {}
    for r in rejected:
        if r["key"] in written and r["key"] not in merged_keys:
            by_reason[r.get("reason", "?")] = by_reason.get(r.get("reason", "?"), 0) + 1
    unaccounted = written - merged_or_sup - rejected_keys
    live = any(l["state"] == "alive" for l in learners.values()) or any(
        s["age_s"] < SILENT_AFTER_S and not s.get("draining") and _syncer_recent(s) for s in syncers)
    last_event = max([float(r["published_at"]) for r in published] + [now - l["last_seen_s"] for l in learners.values()
                                                                      if l["last_seen_s"] is not None], default=t0)
    staleness = [s for m in merge_rows for s in m["staleness"]]
    contributors = [m["contributors"] for m in merge_rows]
    return {
        "url": store.url, "run_id": spec.run_id, "generated_at": now, "start_time": t0,
        "state": "live" if live else "finished", "wall_s": (now if live else last_event) - t0,
        "model": spec.model, "num_params": num_params, "num_fragments": P, "sync_every": spec.sync_every,
        "codec": spec.codec, "num_learners": M,
        "tokens_total": sum(int(l["tokens"] or 0) for l in learners.values()),
        "steps_total": steps_total,
        "tokens_merged": sum(m["tokens"] for m in merge_rows) / P,
        "versions_published": {str(p): max([int(r["version"]) for r in records if int(r["fragment"]) == p], default=0)
                               for p in range(P)},
        "merges": merge_rows,
        "merge_stats": {
            "count": len(merge_rows),
            "contributors_mean": sum(contributors) / len(contributors) if contributors else None,
            "contributors_max": max(contributors, default=None),
            "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
            "staleness_max": max(staleness, default=None),
        },
        "bytes": {"learner_up": lup, "learner_down": ldown, "syncer_up": sup, "syncer_down": sdown, "total": moved,
                  "dp_allreduce": dp, "dp_ratio": dp / moved if moved else None},
        "ledger": {"deltas_written": len(written), "deltas_merged": len(written & merged_or_sup),
                   "deltas_superseded": len(written & (superseded_keys - merged_keys)),
                   "deltas_rejected": sum(by_reason.values()), "rejected_by_reason": by_reason,
                   "deltas_unaccounted": len(unaccounted), "unaccounted_keys": sorted(unaccounted)[:20]},
        "learners": learners, "syncers": syncers, "events": events,
    }


def _syncer_recent(s: dict[str, Any]) -> bool:
    return s["age_s"] < SILENT_AFTER_S


def _learner(store, name: str, t0: float, now: float, accounted_at: dict[str, float], events: list,
             max_delta_headers: int, written: set[str]) -> dict[str, Any]:
    from ddiloco_geo.core import layout

    hb = _json_or_none(store, layout.heartbeat_key(name)) or {}
    ex = _json_or_none(store, layout.exit_key(name))
    hb_time = float(hb["time"]) if isinstance(hb.get("time"), (int, float)) else None
    ex_time = float(ex["time"]) if ex and isinstance(ex.get("time"), (int, float)) else None
    # an exit record older than the heartbeat of a later incarnation does not end the learner
    exited = ex is not None and (hb.get("state") == "exited" or hb_time is None or (ex_time or 0) >= hb_time - 1.0)
    age = now - hb_time if hb_time is not None else None
    state = "exited" if exited else ("alive" if age is not None and age < SILENT_AFTER_S else "silent")
    current = (ex if exited else hb) or hb or ex or {}
    storage = current.get("storage") or {}
    history = (ex or {}).get("history") or []
    if not exited and ex is not None:
        history = []  # the exit record's history is an earlier incarnation's: keep it out of this one's rates
        events.append({"time": ex_time - t0 if ex_time else 0.0, "learner": name,
                       "kind": "exit" if ex.get("reason") in FINISHED_REASONS else "preempted",
                       "detail": f"reason={ex.get('reason')} step={ex.get('step')} (earlier incarnation)"})

    # deltas (headers, bounded) and checkpoints
    delta_keys = store.list(layout.deltas_dir(name))
    written.update(delta_keys)
    headers = _headers(store, delta_keys) if len(delta_keys) <= max_delta_headers else {}
    ckpt_keys = store.list(layout.checkpoints_dir(name))
    ckpts = _headers(store, ckpt_keys)
    # (step, seq) of each checkpoint: seq is the writer's next delta sequence number, so it lies
    # between the writing incarnation's first delta and the resuming incarnation's first delta
    ckpt_marks = sorted((int(h.num_steps), int(h.seq)) for h in ckpts.values())

    incarnations: list[dict[str, Any]] = []
    prev_step = None
    for key in delta_keys:
        h = headers.get(key)
        step = int(h.extra.get("step", 0)) if h is not None else None
        new = not incarnations
        if step is not None and prev_step is not None:
            if step < prev_step:
                new = True  # restarted without a usable checkpoint: the step count went back
            else:  # a checkpoint of this incarnation lies between the two
                seq = layout.parse_delta_key(key).seq
                first_seq = layout.parse_delta_key(incarnations[-1]["first_delta"]).seq
                new = any(prev_step <= c_step < step and first_seq <= c_seq <= seq for c_step, c_seq in ckpt_marks)
        at = accounted_at.get(key)
        if new:
            if incarnations and step is not None and prev_step is not None and step < prev_step:
                incarnations[-1]["lost"] = True  # ended without a checkpoint it could resume from
            incarnations.append({"first_delta": key, "first_step": step, "start": None, "end": None, "deltas": 0})
            if at is not None:
                incarnations[-1]["start"] = at - t0
        inc = incarnations[-1]
        inc["deltas"] += 1
        if at is not None:
            inc["start"] = at - t0 if inc["start"] is None else min(inc["start"], at - t0)
            inc["end"] = at - t0 if inc["end"] is None else max(inc["end"], at - t0)
        if step is not None:
            prev_step = step
    if history:
        hstart = float(history[0]["time"]) - t0
        if incarnations and (incarnations[-1]["start"] is None or hstart < incarnations[-1]["start"]):
            incarnations[-1]["start"] = hstart
    for n, inc in enumerate(incarnations):
        if inc["start"] is not None:
            events.append({"time": inc["start"], "learner": name, "kind": "join" if n == 0 else "rejoin",
                           "detail": f"first delta {inc['first_delta'].rsplit('/', 1)[-1]}"
                                     + (f" at step {inc['first_step']}" if inc["first_step"] is not None else "")})
    for inc in incarnations[:-1]:
        if inc.get("lost") and inc["end"] is not None:
            events.append({"time": inc["end"], "learner": name, "kind": "lost",
                           "detail": f"incarnation of {inc['deltas']} deltas ended without a checkpoint (killed?); "
                                     "the next one restarted at step 0"})
    # the end of the last incarnation: its exit record, else its last heartbeat
    if incarnations:
        last = incarnations[-1]
        end = (ex_time if exited else hb_time)
        if end is not None:
            last["end"] = max(last["end"] or 0.0, end - t0)
        last["open"] = state == "alive"
    for key, h in sorted(ckpts.items()):
        # written at the exit of the incarnation whose last step it holds; timed by that exit or
        # by the last accounted delta of that incarnation
        when = None
        if ex and ex.get("checkpoint") == key and ex_time is not None:
            when = ex_time - t0
        else:
            for inc in incarnations:
                if inc["first_step"] is not None and inc["first_step"] <= int(h.num_steps):
                    when = inc["end"]
        events.append({"time": when if when is not None else 0.0, "learner": name, "kind": "checkpoint",
                       "detail": f"{key.rsplit('/', 1)[-1]} step={h.num_steps} reason={h.extra.get('reason')}"})
        if not (ex and ex.get("checkpoint") == key):  # an earlier incarnation's exit: its record was replaced
            reason = h.extra.get("reason")
            events.append({"time": when if when is not None else 0.0, "learner": name,
                           "kind": "exit" if reason in FINISHED_REASONS else "preempted",
                           "detail": f"reason={reason} step={h.num_steps} (from checkpoint {key.rsplit('/', 1)[-1]})"})
    if exited:
        reason = ex.get("reason")
        events.append({"time": (ex_time or now) - t0, "learner": name,
                       "kind": "exit" if reason in FINISHED_REASONS else "preempted",
                       "detail": f"reason={reason} step={ex.get('step')} flushed={ex.get('flushed')}"
                                 + (f" resumed_from={ex['resumed_from'].rsplit('/', 1)[-1]}" if ex.get("resumed_from") else "")})
    elif state == "silent" and hb_time is not None:
        events.append({"time": hb_time - t0, "learner": name, "kind": "silent",
                       "detail": f"last heartbeat at step {hb.get('step')}; no exit record (killed?)"})

    hist_series = [(float(h["time"]) - t0, float(h["tokens"])) for h in history
                   if isinstance(h.get("time"), (int, float)) and isinstance(h.get("tokens"), (int, float))]
    return {
        "state": state, "last_seen_s": age, "region": current.get("region"), "host": current.get("host"),
        "steps": current.get("step"), "tokens": current.get("tokens"), "loss": current.get("loss"),
        "tokens_per_s": current.get("tokens_per_s"), "reason": (ex or {}).get("reason") if exited else None,
        "resumed_from": current.get("resumed_from") or (ex or {}).get("resumed_from"),
        "bytes_up": int(storage.get("bytes_up", 0)), "bytes_down": int(storage.get("bytes_down", 0)),
        "deltas_written": len(delta_keys), "checkpoints": ckpt_keys, "incarnations": incarnations,
        "history": history, "throughput_history": _rates(hist_series, bins=None),
        "heartbeat": {"time": hb_time - t0, "tokens_per_s": hb.get("tokens_per_s"), "step": hb.get("step")}
        if hb_time is not None else None,
    }


def _rates(series: list[tuple[float, float]], bins: int | None) -> list[dict[str, float]]:
    """Tokens/s between consecutive points of a cumulative (time, tokens) series, optionally
    resampled into ``bins`` equal time bins first (merge records arrive in bursts)."""
    if len(series) < 2:
        return []
    if bins:
        t_lo, t_hi = series[0][0], series[-1][0]
        if t_hi <= t_lo:
            return []
        grid = [t_lo + (t_hi - t_lo) * i / bins for i in range(bins + 1)]
        times = [t for t, _ in series]
        series = [(g, series[max(0, bisect.bisect_right(times, g) - 1)][1]) for g in grid]
    out = []
    for (ta, va), (tb, vb) in zip(series, series[1:]):
        if tb > ta and vb >= va:
            out.append({"time": (ta + tb) / 2, "tokens_per_s": (vb - va) / (tb - ta)})
    return out


# --- evaluating the global model at past instants ------------------------------------------------


class PastEvaluator:
    """Rebuilds the global model as it was at an instant and evaluates it (CPU, no gradients)."""

    def __init__(self, settings, spec, eval_batches: int | None = None) -> None:
        from ddiloco_geo.core import data as datamod
        from ddiloco_geo.core import model as modelmod
        from ddiloco_geo.core.config import ModelConfig

        self.datamod, self.modelmod = datamod, modelmod
        model_cfg = ModelConfig.model_validate(spec.model)
        corpus = datamod.load_corpus(settings.data.corpus, max_bytes=settings.data.max_bytes)
        _, eval_data = datamod.split(corpus, settings.data.eval_ratio)
        n = eval_batches or settings.data.eval_batches
        self.batches = datamod.eval_batches(eval_data, model_cfg.block_size, settings.learner.batch_size, n)
        self.model = modelmod.build_model(model_cfg)

    def loss(self, params) -> float:
        self.modelmod.set_tensors(self.model, params)
        return self.datamod.evaluate(self.model, self.batches)


def evaluate_over_time(store, summary: dict[str, Any], evaluator: PastEvaluator, points: int) -> list[dict[str, Any]]:
    """Global eval loss at ``points`` instants spread from the first global to the last merge."""
    from ddiloco_geo import protocol

    spec = protocol.load_spec(store)
    P = spec.plan.num_fragments
    published: dict[int, list[tuple[float, int]]] = {p: [] for p in range(P)}
    for r in _records(store):
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
                _, tensors = protocol.read_global(store, spec, p, v)
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


# --- charts ----------------------------------------------------------------------------------------


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _colors(names):
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {n: cmap(i % 10) for i, n in enumerate(sorted(names))}


def plot_eval(summary: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    fig, (ax_tok, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    evals = summary.get("global_evals") or []
    colors = _colors(summary["learners"])
    for name, rec in sorted(summary["learners"].items()):
        hist = rec.get("history") or []
        if hist:
            ax_tok.plot([h["tokens"] for h in hist], [h["loss"] for h in hist], lw=1, alpha=0.6, color=colors[name],
                        label=f"{name} train loss (local params)")
            ax_time.plot([float(h["time"]) - summary["start_time"] for h in hist], [h["loss"] for h in hist], lw=1,
                         alpha=0.6, color=colors[name])
    if evals:
        ax_tok.plot([e["tokens"] for e in evals], [e["loss"] for e in evals], "k-o", lw=2, ms=5, label="global model (eval)")
        ax_time.plot([e["time"] for e in evals], [e["loss"] for e in evals], "k-o", lw=2, ms=5, label="global model (eval)")
    else:
        for ax in (ax_tok, ax_time):
            ax.text(0.5, 0.5, "no evaluation (--eval-points 0)", ha="center", va="center", transform=ax.transAxes)
    ax_tok.set_xlabel("tokens (per learner history: that learner's; global: merged into the global model)")
    ax_tok.set_ylabel("loss (nats/byte)")
    ax_time.set_xlabel("wall time since the first global (s)")
    ax_tok.set_title("loss against tokens")
    ax_time.set_title(f"loss against wall time ({summary['state']} run)")
    for ax in (ax_tok, ax_time):
        ax.grid(alpha=0.3)
    ax_tok.legend(fontsize=8)
    return _save(fig, path)


def plot_throughput(summary: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    colors = _colors(summary["learners"])
    drawn = False
    for name, rec in sorted(summary["learners"].items()):
        c = colors[name]
        th = rec.get("throughput_history") or []
        if th:
            ax.plot([r["time"] for r in th], [r["tokens_per_s"] for r in th], "-o", ms=4, color=c, label=f"{name} (history)")
            drawn = True
        tm = rec.get("throughput_merged") or []
        if tm:
            ax.plot([r["time"] for r in tm], [r["tokens_per_s"] for r in tm], "--", lw=1, color=c, alpha=0.7,
                    label=f"{name} (as merged)")
            drawn = True
        hb = rec.get("heartbeat")
        if hb and isinstance(hb.get("tokens_per_s"), (int, float)):
            ax.plot([hb["time"]], [hb["tokens_per_s"]], marker="*", ms=12, color=c, ls="none",
                    label=f"{name} (last heartbeat, mean)")
            drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no throughput data yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("wall time since the first global (s)")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("learner throughput")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def plot_merges(summary: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    fig, (ax_c, ax_s) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    merges = summary["merges"]
    t = [m["time"] for m in merges]
    if merges:
        ax_c.scatter(t, [m["contributors"] for m in merges], s=14, c=[m["fragment"] for m in merges], cmap="viridis",
                     label="one merge (colour: fragment)")
        ax_c.plot(t, _rolling([m["contributors"] for m in merges], 8), "k-", lw=1.5, label="rolling mean (8 merges)")
        for m in merges:
            ax_s.scatter([m["time"]] * len(m["staleness"]), m["staleness"], s=10, color="tab:orange", alpha=0.6)
        ax_s.plot(t, _rolling([max(m["staleness"], default=0) for m in merges], 8), "r-", lw=1.5,
                  label="rolling mean of max staleness (8 merges)")
        ax_s.scatter([], [], s=10, color="tab:orange", label="one merged delta")
        ax_c.legend(fontsize=8)
        ax_s.legend(fontsize=8)
    else:
        ax_c.text(0.5, 0.5, "no merges yet", ha="center", va="center", transform=ax_c.transAxes)
    ax_c.set_ylabel("contributors")
    ax_c.set_title(f"{len(merges)} merges")
    ax_s.set_ylabel("staleness (versions)")
    ax_s.set_xlabel("wall time since the first global (s)")
    for ax in (ax_c, ax_s):
        ax.grid(alpha=0.3)
        ax.yaxis.get_major_locator().set_params(integer=True)
    return _save(fig, path)


def _rolling(values: list[float], n: int) -> list[float]:
    out = []
    for i in range(len(values)):
        window = values[max(0, i - n + 1): i + 1]
        out.append(sum(window) / len(window))
    return out


def plot_bytes(summary: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    b = summary["bytes"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars = {"learners up": b["learner_up"], "learners down": b["learner_down"], "syncer up": b["syncer_up"],
            "syncer down": b["syncer_down"], "ddiloco total": b["total"], "DP all-reduce": b["dp_allreduce"]}
    colors = ["tab:blue", "tab:cyan", "tab:green", "tab:olive", "k", "tab:red"]
    rects = ax.bar(list(bars), [max(1, v) / 2**20 for v in bars.values()], color=colors)
    for rect, v in zip(rects, bars.values()):
        ax.annotate(f"{v / 2**20:.1f}", (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("MiB moved")
    ratio = f"; DP would move {b['dp_ratio']:.1f}x" if b.get("dp_ratio") else ""
    ax.set_title(f"bytes moved ({summary['num_learners']} learners, {summary['steps_total']} steps{ratio})")
    ax.grid(alpha=0.3, axis="y")
    plt.setp(ax.get_xticklabels(), rotation=15)
    return _save(fig, path)


EVENT_STYLE = {
    "join": ("^", "tab:green"), "rejoin": ("^", "tab:olive"), "checkpoint": ("D", "tab:blue"),
    "exit": ("s", "k"), "preempted": ("X", "tab:orange"), "silent": ("o", "tab:gray"), "lost": ("P", "tab:purple"), "rejected": ("x", "tab:red"),
}


def plot_timeline(summary: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    names = sorted(summary["learners"])
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.6 * max(1, len(names))))
    row = {n: i for i, n in enumerate(names)}
    for n in names:
        for inc in summary["learners"][n]["incarnations"]:
            if inc.get("start") is not None and inc.get("end") is not None:
                ax.plot([inc["start"], inc["end"]], [row[n], row[n]], "-", lw=6, alpha=0.35, color="tab:blue",
                        solid_capstyle="butt")
    seen = set()
    for e in summary["events"]:
        if e.get("learner") not in row:
            continue
        marker, color = EVENT_STYLE.get(e["kind"], ("o", "k"))
        ax.plot([e["time"]], [row[e["learner"]]], marker=marker, color=color, ms=9, ls="none",
                label=e["kind"] if e["kind"] not in seen else None)
        seen.add(e["kind"])
    ax.plot([], [], "-", lw=6, alpha=0.35, color="tab:blue", label="incarnation (accounted deltas)")
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.7, max(0, len(names) - 1) + 0.7)
    ax.set_xlabel("wall time since the first global (s)")
    ax.set_title("joins, checkpoints, exits, preemptions, rejected deltas")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


PLOTTERS = {"eval_loss": plot_eval, "throughput": plot_throughput, "merges": plot_merges, "bytes": plot_bytes,
            "timeline": plot_timeline}


# --- the page ------------------------------------------------------------------------------------


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def sections(summary: dict[str, Any]) -> list[tuple[str, list[str] | None, list[list[str]], str | None]]:
    """(heading, table header or None, rows, chart file or None) for the Markdown and HTML pages."""
    b, ms, led = summary["bytes"], summary["merge_stats"], summary["ledger"]
    evals = summary.get("global_evals") or []
    overview = [
        ["run", f"`{summary['run_id']}` at `{summary['url']}`"],
        ["state", f"{summary['state']} (report at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(summary['generated_at']))})"],
        ["model", f"{summary['model'].get('name')} ({summary['num_params']:,} parameters), "
                  f"{summary['num_fragments']} fragments, H={summary['sync_every']}, delta codec {summary['codec']}"],
        ["learners", f"{summary['num_learners']}: " + ", ".join(f"{n} ({l['state']})" for n, l in sorted(summary["learners"].items()))],
        ["wall time", f"{summary['wall_s']:.1f} s"],
        ["tokens", f"{summary['tokens_total']:,} trained, {summary['tokens_merged']:,.0f} merged into the global model"],
        ["global eval loss", f"{_fmt(evals[0]['loss'])} → {_fmt(evals[-1]['loss'])}" if evals else "not evaluated"],
        ["merges", f"{ms['count']}; contributors mean {_fmt(ms['contributors_mean'], 2)}, max {_fmt(ms['contributors_max'])}; "
                   f"staleness mean {_fmt(ms['staleness_mean'], 2)}, max {_fmt(ms['staleness_max'])}"],
        ["deltas", f"{led['deltas_written']} written, {led['deltas_merged']} merged (incl. superseded), "
                   f"{led['deltas_rejected']} rejected {led['rejected_by_reason'] or ''}, {led['deltas_unaccounted']} not yet accounted"],
        ["bytes moved", f"{_mib(b['total'])} (learners ↑{_mib(b['learner_up'])} ↓{_mib(b['learner_down'])}, "
                        f"syncer ↑{_mib(b['syncer_up'])} ↓{_mib(b['syncer_down'])})"],
        ["data-parallel all-reduce", f"{_mib(b['dp_allreduce'])}" + (f" ({b['dp_ratio']:.1f}× more)" if b.get("dp_ratio") else "")],
    ]
    out: list[tuple[str, list[str] | None, list[list[str]], str | None]] = [("Overview", None, overview, None)]
    out.append(("Global eval loss", ["wall time (s)", "tokens merged", "versions", "eval loss"],
                [[f"{e['time']:.1f}", f"{e['tokens']:,.0f}", str(e["versions"]), f"{e['loss']:.4f}"] for e in evals],
                "eval_loss.png"))
    out.append(("Learners", ["learner", "state", "steps", "tokens", "tokens/s", "loss", "deltas", "incarnations",
                             "checkpoints", "exit reason"],
                [[n, l["state"], _fmt(l["steps"]), _fmt(l["tokens"]), _fmt(l["tokens_per_s"], 0), _fmt(l["loss"]),
                  str(l["deltas_written"]), str(len(l["incarnations"])), str(len(l["checkpoints"])), _fmt(l["reason"])]
                 for n, l in sorted(summary["learners"].items())], "throughput.png"))
    out.append(("Merges: contributors and staleness", None, [], "merges.png"))
    out.append(("Bytes against data-parallel", None, [], "bytes.png"))
    out.append(("Timeline: failures, joins, preemptions", ["time (s)", "learner", "event", "detail"],
                [[f"{e['time']:.1f}", _fmt(e["learner"]), e["kind"], e["detail"]] for e in summary["events"]],
                "timeline.png"))
    return out


def write_markdown(summary: dict[str, Any], path: Path) -> Path:
    lines = [f"# ddiloco-geo run `{summary['run_id']}`", ""]
    for heading, header, rows, chart in sections(summary):
        lines += [f"## {heading}", ""]
        if chart:
            lines += [f"![{heading}]({chart})", ""]
        if rows:
            head = header or ["", ""]
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
            lines.append("")
    lines += ["Times are seconds since the first global was published. Tokens merged: the `num_tokens` of the deltas "
              "merged into the global model, averaged over fragments. Event times are those the bucket records "
              "(exit records, heartbeats, rejections) or, for joins and checkpoints without one, the publish time of "
              "the merge that accounted the learner's delta. Bytes: the storage counters of the newest exit record "
              "or heartbeat of each process (earlier incarnations' counters are not kept).", ""]
    path.write_text("\n".join(lines))
    return path


def write_html(summary: dict[str, Any], path: Path) -> Path:
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'>",
             f"<title>ddiloco-geo run {e(summary['run_id'])}</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}img{max-width:100%}</style></head><body>",
             f"<h1>ddiloco-geo run <code>{e(summary['run_id'])}</code></h1>"]
    for heading, header, rows, chart in sections(summary):
        parts.append(f"<h2>{e(heading)}</h2>")
        if chart:
            parts.append(f"<img src='{e(chart)}' alt='{e(heading)}'>")
        if rows:
            parts.append("<table>")
            if header:
                parts.append("<tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
            parts += ["<tr>" + "".join(f"<td>{e(c.replace('`', ''))}</td>" for c in r) + "</tr>" for r in rows]
            parts.append("</table>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts))
    return path


# --- the command ---------------------------------------------------------------------------------


def build_report(store, settings, out: Path, *, eval_points: int = 7, eval_batches: int | None = None,
                 max_delta_headers: int = 4000) -> dict[str, Any]:
    """Read the run, evaluate the global model over time, draw the charts and write the page."""
    from ddiloco_geo import protocol

    t_start = time.monotonic()
    summary = collect(store, max_delta_headers=max_delta_headers)
    log.info("report_collected run=%s state=%s learners=%d merges=%d read_s=%.1f", summary["run_id"], summary["state"],
             summary["num_learners"], summary["merge_stats"]["count"], time.monotonic() - t_start)
    summary["global_evals"] = []
    if eval_points > 0:
        spec = protocol.load_spec(store)
        evaluator = PastEvaluator(settings, spec, eval_batches)
        summary["global_evals"] = evaluate_over_time(store, summary, evaluator, eval_points)
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", nargs="?",
                   help="the run's --store URL (file://, s3://, gs://; or a run directory), "
                        "or a summary.json written by `ddiloco-geo local`")
    p.add_argument("--out", default=None,
                   help="output directory (default: ./report for a run; next to the summary for a summary.json)")
    p.add_argument("--eval-points", type=int, default=7,
                   help="instants at which the global model is rebuilt and evaluated (0: no evaluation)")
    p.add_argument("--eval-batches", type=int, default=None, help="eval batches per point (default: data.eval_batches)")
    p.add_argument("--max-delta-headers", type=int, default=4000,
                   help="read delta headers (incarnation boundaries) only for learners with at most this many deltas")


def _is_summary(source: str | None) -> bool:
    return bool(source) and "://" not in source and source.endswith(".json") and Path(source).is_file()


def run(args: argparse.Namespace) -> int:
    if _is_summary(args.source):
        return _run_summary(args)
    from ddiloco_geo.cli.settings import settings_from
    from ddiloco_geo.core.errors import ConfigError
    from ddiloco_geo.storage import open_store

    url = args.source
    if url and "://" not in url:
        url = f"file://{Path(url).resolve()}"
    settings, _ = settings_from(args, {"storage.url": url})
    url = settings.storage.url
    out = Path(args.out or "report").resolve()
    if url.startswith("file://"):
        root = Path(url[len("file://"):]).resolve()
        # opening a directory store creates its lock folder: refuse anything that is not a run
        if not (root / "run.json").is_file():
            raise ConfigError(f"{root} holds no run.json: pass the --store URL the run was started with")
        if out == root or root in out.parents:
            raise ConfigError(f"--out {out} is inside the run's prefix {root}: the report never writes there")
    if args.eval_points < 0:
        raise ConfigError("--eval-points must be >= 0")
    store = open_store(settings.storage)
    try:
        summary = build_report(store, settings, out, eval_points=args.eval_points, eval_batches=args.eval_batches,
                               max_delta_headers=args.max_delta_headers)
    finally:
        store.close()
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        print(summary["page"]["markdown"])
    return 0


def _run_summary(args: argparse.Namespace) -> int:
    src = Path(args.source)
    summary = json.loads(src.read_text())
    out = Path(args.out) if args.out else src.parent
    path = plot_local_run(summary, out / "training.png")
    print(json.dumps({"plot": str(path)}) if args.json else path, file=sys.stdout)
    return 0
