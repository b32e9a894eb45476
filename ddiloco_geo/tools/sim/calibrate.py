"""Solve the goodput model's two unknown constants from the paper's two headline cells.

Targets (Decoupled DiLoCo, arXiv 2604.21428): at 1.2M chips with a one-year MTBI per chip,
data-parallel without elasticity has **27%** goodput and Decoupled DiLoCo with M=8 has **88%**.
These are the only calibration targets; every other cell is a prediction.

Unknowns: the DP restart time ``restart_s`` and the elastic rescale time ``downscale_s =
upscale_s`` (one number: both rebuild the group's mesh at a new size). Every other constant is
fixed beforehand with its source or reason (docs/simulator.md). Both targets are closed-form in
their unknown (:mod:`.goodput`), so the solve is two divisions, not a search:

- ``dp = A / (1 + λ·(detect + restart))`` with ``A`` the spare, checkpoint and straggler factors:
  ``restart = (A/0.27 − 1)/λ − detect``;
- ``ddiloco`` M=8 (K=1, the stall term is negligible there) ``= B / (1 + λ/8·(detect + 2·rescale))``:
  ``rescale = ((B/0.88 − 1)/(λ/8) − detect) / 2``.

A target the constants cannot reach (``A`` or ``B`` already below it) raises ConfigError.
"""

from __future__ import annotations

from dataclasses import replace

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.sim.goodput import ClusterModel, ddiloco_outcome, dp_outcome

TARGET_CHIPS = 1_200_000
TARGET_LEARNERS = 8
TARGET_DP = 0.27
TARGET_DDILOCO = 0.88


def solve(base: ClusterModel, *, chips: int = TARGET_CHIPS, learners: int = TARGET_LEARNERS,
          target_dp: float = TARGET_DP, target_ddiloco: float = TARGET_DDILOCO) -> ClusterModel:
    """``base`` with ``restart_s`` and the rescale time chosen to hit both targets exactly."""
    lam = base.rate(chips)
    free = replace(base, restart_s=0.0, downscale_s=0.0, upscale_s=0.0, detect_s=0.0)
    a = dp_outcome(chips, free).goodput
    b = ddiloco_outcome(chips, free, learners, 1).goodput
    if a <= target_dp or b <= target_ddiloco:
        raise ConfigError(f"targets unreachable with these constants (ceilings dp {a:.3f}, ddiloco {b:.3f}); "
                          "lower repair_s, ckpt_s or spare_sigmas")
    restart_s = (a / target_dp - 1) / lam - base.detect_s
    rescale_s = ((b / target_ddiloco - 1) / (lam / learners) - base.detect_s) / 2
    if restart_s < 0 or rescale_s < 0:
        raise ConfigError(f"detect_s={base.detect_s} alone exceeds a target's budget; lower it")
    return replace(base, restart_s=restart_s).with_rescale(rescale_s)


def calibrate(model: ClusterModel | None = None, *, chips: int = TARGET_CHIPS,
              learners: int = TARGET_LEARNERS, target_dp: float = TARGET_DP,
              target_ddiloco: float = TARGET_DDILOCO) -> dict:
    """Solve the two unknowns; return them, the goodputs they give and the whole model."""
    base = model or ClusterModel()
    fitted = solve(base, chips=chips, learners=learners, target_dp=target_dp, target_ddiloco=target_ddiloco)
    return {
        "targets": {"chips": chips, "mtbi_days": base.mtbi_days, "dp": target_dp,
                    "ddiloco_learners": learners, "ddiloco": target_ddiloco},
        "constants": {"restart_s": round(fitted.restart_s, 1), "downscale_s": round(fitted.downscale_s, 1),
                      "upscale_s": round(fitted.upscale_s, 1)},
        "tie": "downscale_s = upscale_s",
        "achieved": {"dp": round(dp_outcome(chips, fitted).goodput, 4),
                     "ddiloco": round(ddiloco_outcome(chips, fitted, learners, 1).goodput, 4)},
        "model": fitted.as_dict(),
    }
