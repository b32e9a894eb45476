"""WAN bandwidth each learner needs for a compute-utilization target, and what it costs.

Method of Streaming DiLoCo (arXiv 2501.18512): the step time comes from the FLOPs,
``step_s = 6 · params · tokens_per_step / (chips · peak_flops · mfu)`` (unless given), and
communication overlaps compute. Utilization u = step_s / (step_s + stall_s) per step, so the
stall a target allows is ``s = step_s · (1/u − 1)``.

Decoupled DiLoCo (P fragments, one exchanged per step, τ steps of overlap). The largest fragment
holds ``ceil(L/P)`` of the L layers (whole layers per fragment; with P > L one layer each), so it
has ``F = params · ceil(L/P)/L`` parameters and ``C = F · bits`` on the wire per direction per step.
Upload and download run on a full-duplex link, so two constraints hold:

- throughput, one fragment each way per step: ``C / BW <= step_s + s``;
- latency, a fragment's round trip (up, merge, down) completes within τ steps:
  ``2·C / BW + rtt <= τ · (step_s + s)``.

``BW(u)`` is the larger of the two bounds; with τ = 2 and rtt = 0 they coincide.

Data-parallel across the same sites: a ring all-reduce of the gradient every step, each site
sends ``2·(n−1)/n · params · bits`` (n sites) and waits ``(n−1) · rtt`` of ring latency. By default
it is **not** overlapped with compute (``dp_overlap_steps = 0``: the all-reduce sits between
backward and the optimizer step); ``dp_overlap_steps = 1`` hides it behind one step of compute.
``None`` (JSON ``null``) means no bandwidth reaches the target (latency alone exceeds the slack).

Cost side: bytes per hour per learner (both directions, at the utilization target's step rate)
and the cross-region egress bill at ``egress_usd_per_gb``. For DDiLoCo both directions leave a
region (learner → bucket region, bucket region → learner); for DP each site pays for what it sends.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ddiloco_geo.core.errors import ConfigError

BITS = {"fp32": 32, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4, "int2": 2}
DEFAULT_UTILIZATION = (0.5, 0.8, 0.9, 0.95, 0.99)


@dataclass(frozen=True)
class BandwidthModel:
    params: float = 10e9
    layers: int = 48
    tokens_per_step: float = 4 * 1024 * 1024
    chips_per_learner: int = 1024
    peak_tflops: float = 459.0  # bf16 dense, TPU v5p-class
    mfu: float = 0.4
    step_s: float | None = None  # overrides the FLOPs-derived step time
    H: int = 24
    P: int = 24
    tau: int = 2
    precision: str = "int4"
    dp_precision: str = "bf16"
    sites: int = 8
    dp_overlap_steps: int = 0
    rtt_ms: float = 0.0
    egress_usd_per_gb: float = 0.02

    def __post_init__(self) -> None:
        for name in ("precision", "dp_precision"):
            if getattr(self, name) not in BITS:
                raise ConfigError(f"{name}={getattr(self, name)!r}: choose one of {sorted(BITS)}")
        if self.params <= 0 or self.layers < 1 or self.P < 1 or self.H < 1 or self.tau < 1:
            raise ConfigError("params > 0, layers >= 1, P >= 1, H >= 1 and tau >= 1 are required")
        if self.sites < 2:
            raise ConfigError("sites must be >= 2 (a ring all-reduce needs two ends)")
        if not 0 < self.mfu <= 1:
            raise ConfigError(f"mfu={self.mfu} must be in (0, 1]")

    @property
    def step_time_s(self) -> float:
        if self.step_s is not None:
            return self.step_s
        return 6 * self.params * self.tokens_per_step / (self.chips_per_learner * self.peak_tflops * 1e12 * self.mfu)

    @property
    def fragment_params(self) -> float:
        return self.params * math.ceil(self.layers / self.P) / self.layers if self.P <= self.layers \
            else self.params / self.layers


def _gbps(bits: float, seconds: float) -> float | None:
    return None if seconds <= 0 else bits / seconds / 1e9


def ddiloco_gbps(m: BandwidthModel, utilization: float) -> float | None:
    step = m.step_time_s
    window = step / utilization  # step + allowed stall
    bits = m.fragment_params * BITS[m.precision]
    throughput = _gbps(bits, window)
    latency = _gbps(2 * bits, m.tau * window - m.rtt_ms / 1e3)
    return None if latency is None else max(throughput, latency)


def dp_gbps(m: BandwidthModel, utilization: float) -> float | None:
    step = m.step_time_s
    slack = step * (1 / utilization - 1) + m.dp_overlap_steps * step
    n = m.sites
    bits = 2 * (n - 1) / n * m.params * BITS[m.dp_precision]
    return _gbps(bits, slack - (n - 1) * m.rtt_ms / 1e3)


def bandwidth_rows(m: BandwidthModel | None = None,
                   utilization: tuple[float, ...] = DEFAULT_UTILIZATION) -> list[dict]:
    """One row per (system, utilization target)."""
    m = m or BandwidthModel()
    for u in utilization:
        if not 0 < u < 1:
            raise ConfigError(f"utilization target {u} must be in (0, 1), e.g. 0.9")
    step = m.step_time_s
    rows = []
    for u in utilization:
        steps_per_hour = 3600 * u / step
        ddl_bytes = 2 * m.fragment_params * BITS[m.precision] / 8 * steps_per_hour
        dp_sent = 2 * (m.sites - 1) / m.sites * m.params * BITS[m.dp_precision] / 8 * steps_per_hour
        for system, gbps, per_hour, egress in (
            ("ddiloco", ddiloco_gbps(m, u), ddl_bytes, ddl_bytes),
            ("dp", dp_gbps(m, u), 2 * dp_sent, dp_sent),
        ):
            rows.append({
                "system": system,
                "utilization": u,
                "gbps_per_learner": None if gbps is None else round(gbps, 4),
                "precision": m.precision if system == "ddiloco" else m.dp_precision,
                "step_s": round(step, 4),
                "bytes_per_hour_per_learner": round(per_hour),
                "egress_usd_per_hour_per_learner": round(egress / 1e9 * m.egress_usd_per_gb, 2),
            })
    return rows


def describe(m: BandwidthModel) -> dict:
    return {**asdict(m), "step_time_s": m.step_time_s, "fragment_params": m.fragment_params}
