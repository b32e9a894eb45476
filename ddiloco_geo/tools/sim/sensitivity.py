"""How much each constant of the goodput model moves each cell of the grid.

For every constant fixed beforehand (not fitted), scale it by 0.5 and 1.5, **re-solve** the two
fitted constants (so the two headline cells stay at 27% and 88%, as they would if we had chosen the
other value) and report the change of every cell in goodput points. For the two fitted constants,
scale them without re-solving: that shows how tightly the targets pin them.

A row: ``{"constant", "factor", "recalibrated", "value", "mean_abs_points", "max_abs_points",
"cells": {"dp@150k": Δ, ...}}``.
"""

from __future__ import annotations

from dataclasses import replace

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.sim.calibrate import solve
from ddiloco_geo.tools.sim.goodput import DEFAULT_CHIPS, DEFAULT_LEARNERS, ClusterModel, simulate_grid

FIXED = ("slice_chips", "detect_s", "repair_s", "ckpt_s", "spare_sigmas", "step_s")
FITTED = ("restart_s", "rescale_s")
FACTORS = (0.5, 1.5)


def cell_name(row: dict) -> str:
    n = row["chips"]
    where = f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}k"
    who = row["system"] if row["system"] != "ddiloco" else f"M{row['learners']}"
    return f"{who}@{where}"


def _grid(model: ClusterModel, chips, learners) -> dict[str, float]:
    return {cell_name(r): r["goodput"] for r in simulate_grid(chips, learners, model)}


def _scaled(model: ClusterModel, name: str, factor: float) -> ClusterModel:
    if name == "rescale_s":
        return model.with_rescale(model.downscale_s * factor)
    value = getattr(model, name) * factor
    return replace(model, **{name: max(1, round(value)) if name == "slice_chips" else value})


def sensitivity_rows(model: ClusterModel | None = None, chips: tuple[int, ...] = DEFAULT_CHIPS,
                     learners: tuple[int, ...] = DEFAULT_LEARNERS) -> list[dict]:
    model = model or ClusterModel()
    base = _grid(model, chips, learners)
    rows = []
    for name in FIXED + FITTED:
        for factor in FACTORS:
            moved = _scaled(model, name, factor)
            recal = name in FIXED
            try:
                moved = solve(moved) if recal else moved
            except ConfigError as e:
                rows.append({"constant": name, "factor": factor, "recalibrated": recal, "error": str(e)})
                continue
            grid = _grid(moved, chips, learners)
            delta = {k: round(100 * (grid[k] - base[k]), 2) for k in base}
            rows.append({"constant": name, "factor": factor, "recalibrated": recal,
                         "value": getattr(moved, "downscale_s" if name == "rescale_s" else name),
                         "mean_abs_points": round(sum(map(abs, delta.values())) / len(delta), 2),
                         "max_abs_points": round(max(map(abs, delta.values())), 2), "cells": delta})
    return rows
