"""PNG of the options considered: total cost against wall-clock, one point per option.

Feasible Decoupled DiLoCo options are filled, infeasible ones hollow; the two data-parallel systems
have their own markers; the recommended option is ringed and labelled; the deadline, if any, is a
vertical line. Matplotlib with the Agg backend (no display), imported lazily.
"""

from __future__ import annotations

from pathlib import Path

STYLE = {"ddiloco": ("o", "tab:blue"), "dp_region": ("s", "tab:orange"), "dp_wan": ("^", "tab:red")}


def options_chart(result: dict, path: Path, deadline_h: float | None = None, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    for system, (marker, color) in STYLE.items():
        for feasible in (True, False):
            pts = [r for r in result["options"] if r["system"] == system and r["feasible"] == feasible
                   and r["wall_h"] is not None]
            if not pts:
                continue
            ax.scatter([r["wall_h"] for r in pts], [r["total_usd"] / 1e3 for r in pts], marker=marker, s=28,
                       facecolors=color if feasible else "none", edgecolors=color, alpha=0.8,
                       label=f"{system} ({'feasible' if feasible else 'infeasible'})")
    best = result.get("recommended")
    if best:
        ax.scatter([best["wall_h"]], [best["total_usd"] / 1e3], s=260, facecolors="none", edgecolors="black",
                   linewidths=2, label="recommended")
        ax.annotate(f"{'+'.join(best['regions'])}\n{best['learners']} learners, {best['codec']}, H={best['H']}",
                    (best["wall_h"], best["total_usd"] / 1e3), textcoords="offset points", xytext=(12, 12),
                    fontsize=8)
    if deadline_h:
        ax.axvline(deadline_h, color="grey", linestyle="--", linewidth=1, label=f"deadline {deadline_h:g} h")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("wall-clock (h)")
    ax.set_ylabel("total cost (k$: compute + egress + requests + storage)")
    ax.set_title(title or "ddiloco-geo plan: options considered")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
