"""The report's PNG charts, one function per chart, each ``plot_*(summary, path) -> path`` reading
only the summary dict that :func:`ddiloco_geo.ops.report.collect.collect` (plus the evaluation)
builds: ``eval_loss`` (global eval loss against tokens and wall time), ``throughput`` (tokens/s per
learner), ``merges`` (contributors and staleness), ``bytes`` (against a data-parallel all-reduce),
``timeline`` (incarnations and events). :func:`plot_local_run` draws ``training.png`` from the
``summary.json`` of ``ddiloco-geo local``. matplotlib is imported on first use (Agg backend).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHARTS = ("eval_loss", "throughput", "merges", "bytes", "timeline")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tokens_all_learners(histories: dict[str, list[dict[str, Any]]], at: float) -> float:
    """Tokens every learner together had trained at wall time ``at``: each learner's own
    (time, tokens) history, interpolated, held at its last point after it, and extrapolated back
    to zero at its first segment's rate before it."""
    total = 0.0
    for hist in histories.values():
        pts = sorted((float(h["time"]), float(h["tokens"])) for h in hist if "time" in h)
        if not pts:
            continue
        (t0, n0), (t1, n1) = pts[0], pts[1] if len(pts) > 1 else pts[0]
        if at <= t0:
            rate = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
            total += max(0.0, n0 - rate * (t0 - at)) if rate > 0 else (n0 if at == t0 else 0.0)
            continue
        for (ta, na), (tb, nb) in zip(pts, pts[1:]):
            if ta <= at <= tb:
                total += na + (nb - na) * (at - ta) / (tb - ta) if tb > ta else nb
                break
        else:
            total += pts[-1][1]
    return total


def plot_local_run(summary: dict[str, Any], path: Path) -> Path:
    plt = _plt()

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    # one x axis for every curve: tokens trained by all learners together at that moment (learner
    # histories carry their own tokens and a wall time; the global evals carry the sum already)
    histories = {name: rec.get("history") or [] for name, rec in summary.get("learners", {}).items()}
    for name, hist in sorted(histories.items()):
        if hist:
            xs = [tokens_all_learners(histories, float(h["time"])) if "time" in h else h["tokens"] for h in hist]
            ax_loss.plot(xs, [h["loss"] for h in hist], lw=1, alpha=0.8, label=f"{name} (train, local params)")
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
