"""PNG charts of the simulator's tables (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        label = r["system"] if r["system"] != "ddiloco" else f"ddiloco M={r['learners']}"
        out.setdefault(label, []).append(r)
    return out


def goodput_chart(rows: list[dict], path: Path, title: str = "") -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharex=True)
    for label, pts in _series(rows).items():
        pts = sorted(pts, key=lambda r: r["chips"])
        style = "--" if label in ("dp", "elastic_dp") else "-"
        for ax, key in zip(axes, ("goodput", "uptime")):
            ax.plot([p["chips"] for p in pts], [100 * p[key] for p in pts], style, marker="o", label=label)
    ticks = sorted({r["chips"] for r in rows})
    for ax, key in zip(axes, ("goodput", "system uptime")):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t / 1e6:g}M" if t >= 1e6 else f"{t / 1e3:g}k" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("chips")
        ax.set_ylabel(f"{key} (%)")
        ax.set_ylim(0, 102)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "Goodput and uptime under chip failures")
    return _save(fig, path)


def bandwidth_chart(rows: list[dict], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for system in ("ddiloco", "dp"):
        pts = [r for r in rows if r["system"] == system and r["gbps_per_learner"] is not None]
        if pts:
            ax.plot([100 * p["utilization"] for p in pts], [p["gbps_per_learner"] for p in pts],
                    marker="o", label=f"{system} ({pts[0]['precision']})")
    ax.set_yscale("log")
    ax.set_xlabel("compute utilization target (%)")
    ax.set_ylabel("WAN bandwidth per learner (Gbit/s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("Bandwidth to keep compute busy")
    return _save(fig, path)


def hetero_chart(rows: list[dict], path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["policy"] for r in rows]
    axes[0].bar(names, [100 * r["goodput"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("goodput (%)")
    axes[0].set_ylim(0, 105)
    axes[1].bar(names, [r["mean_learners_per_merge"] for r in rows], color="tab:green")
    axes[1].set_ylabel("mean learners per merge")
    fig.suptitle("Heterogeneous learners: quorum and grace window")
    return _save(fig, path)


def scavenge_chart(rows: list[dict], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ratios = sorted({r["extra_ratio"] for r in rows})
    systems = ("ddiloco", "dp_reconfig", "base_only")
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        hours = [next(r["hours_to_budget"] for r in rows if r["system"] == system and r["extra_ratio"] == x)
                 for x in ratios]
        ax.bar([j + i * width for j in range(len(ratios))], hours, width, label=system)
    ax.set_xticks([j + width for j in range(len(ratios))], [f"+{100 * x:g}%" for x in ratios])
    ax.set_xlabel("extra compute while it is available")
    ax.set_ylabel("wall-clock hours to the token budget")
    ax.legend()
    ax.set_title("Scavenging part-time compute")
    return _save(fig, path)


def sensitivity_chart(rows: list[dict], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    rows = [r for r in rows if "cells" in r]
    names = sorted({r["constant"] for r in rows}, key=[r["constant"] for r in rows].index)
    for i, factor in enumerate((0.5, 1.5)):
        vals = [next((r["max_abs_points"] for r in rows if r["constant"] == n and r["factor"] == factor), 0)
                for n in names]
        ax.bar([j + 0.4 * i for j in range(len(names))], vals, 0.4, label=f"×{factor:g}")
    ax.set_xticks([j + 0.2 for j in range(len(names))], names, rotation=20)
    ax.set_ylabel("largest change of a grid cell (goodput points)")
    ax.legend()
    ax.set_title("Sensitivity of the goodput grid (fixed constants re-calibrated)")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
