"""One learner's history, rebuilt from what it left in the bucket: its heartbeat and exit record,
its delta keys (and their headers, for at most ``max_delta_headers`` deltas), its checkpoints.

Incarnations: a new one starts where the step count in the delta headers goes back (a restart
without a usable checkpoint: the previous one is marked ``lost``) or where a checkpoint of the
learner lies between two deltas (a resume). Each incarnation spans the publish times of the merges
that accounted its deltas, widened by its history and ended by its exit record or last heartbeat.
Events (join, rejoin, checkpoint, exit, preempted, silent, lost) are appended for the timeline.
:func:`throughput_rates` turns a cumulative (time, tokens) series into tokens/s.
"""

from __future__ import annotations

import bisect
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ddiloco_geo import protocol
from ddiloco_geo.core import layout
from ddiloco_geo.core.errors import CodecError, StorageError
from ddiloco_geo.ops.status import SILENT_AFTER_S

log = logging.getLogger(__name__)

FINISHED_REASONS = ("max_steps", "max_time")


def read_headers(store, keys_: list[str], workers: int = 16, verifier=None, signer: str = "") -> dict[str, Any]:
    """Headers of tensor objects (two ranged reads each), in parallel; unreadable ones (and, with
    ``verifier``, ones ``signer`` did not sign) are skipped."""

    def one(key: str):
        try:
            return key, protocol.verified_header(store, key, verifier, signer)
        except (CodecError, StorageError) as exc:
            log.debug("report_header_unreadable key=%s error=%s", key, exc)
            return key, None

    if not keys_:
        return {}
    with ThreadPoolExecutor(max_workers=min(workers, len(keys_))) as pool:
        return {k: h for k, h in pool.map(one, keys_) if h is not None}


def learner_history(store, name: str, t0: float, now: float, accounted_at: dict[str, float], events: list,
                    max_delta_headers: int, verifier=None, skipped=None) -> dict[str, Any]:
    """The learner's row of the report (state, counters, incarnations, throughput); ``accounted_at``
    maps a delta key to the publish time of the merge (or rejection) that accounted it."""
    hb = protocol.heartbeat(store, name, verifier, skipped) or {}
    ex = protocol.exit_record(store, name, verifier, skipped)
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
    signer = f"learner:{name}"
    headers = read_headers(store, delta_keys, verifier=verifier, signer=signer) if len(delta_keys) <= max_delta_headers else {}
    ckpt_keys = store.list(layout.checkpoints_dir(name))
    ckpts = read_headers(store, ckpt_keys, verifier=verifier, signer=signer)
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
        "history": history, "throughput_history": throughput_rates(hist_series, bins=None),
        "heartbeat": {"time": hb_time - t0, "tokens_per_s": hb.get("tokens_per_s"), "step": hb.get("step")}
        if hb_time is not None else None,
    }


def throughput_rates(series: list[tuple[float, float]], bins: int | None) -> list[dict[str, float]]:
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
