"""Charts of a run: PNG files a person can open.

:func:`plot_local_run` draws what ``ddiloco-geo local`` writes next to ``summary.json``: training
loss against tokens for each learner, the global model's eval loss against tokens, and the bytes
moved next to what a data-parallel all-reduce of the same steps would have moved.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def plot_local_run(summary: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("summary", help="a summary.json written by `ddiloco-geo local`")
    p.add_argument("--out", default=None, help="output directory (default: next to the summary)")


def run(args: argparse.Namespace) -> int:
    src = Path(args.summary)
    summary = json.loads(src.read_text())
    out = Path(args.out) if args.out else src.parent
    path = plot_local_run(summary, out / "training.png")
    print(json.dumps({"plot": str(path)}) if args.json else path)
    return 0
