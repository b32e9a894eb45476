"""What the planner is told: regions, the job, measured token efficiency, retention (a TOML file).

One file (example: ``docs/examples/regions.toml``)::

    [job]                      # the model and how fast one learner-step runs
    params, layers, tokens, tokens_per_step, step_s, step_accelerators, ...
    [[regions]]                # one table per region
    name, instance_type, accelerators_per_instance, instances, ondemand_usd_per_hour,
    spot_usd_per_hour, interruptions_per_hour, egress_usd_per_gb, put_usd_per_1k,
    get_usd_per_1k, storage_usd_per_gb_month, local_gbps, bandwidth_gbps = {other = Gbit/s}
    [[efficiency]]             # optional rows that replace or add to DEFAULT_EFFICIENCY
    system, codec, H, ratio, source
    [gc]                       # optional: the retention policy (defaults: core.config.GcConfig)

Units are in the names. Prices are per instance-hour; an interruption rate is per instance-hour
of spot capacity. A step of ``tokens_per_step`` tokens takes ``step_s`` on ``step_accelerators``
accelerators of speed 1; a learner of n accelerators of speed s takes ``step_s·step_accelerators/(n·s)``
(linear scaling inside a region: an assumption). Every check raises ConfigError naming the field.

Token efficiency: tokens data-parallel needs over the tokens a configuration needs for the same
loss (so tokens to buy = tokens / ratio). The defaults were **measured at small scale** and are
stated with their source; a configuration without a row (e.g. topk, or another H) is not planned.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from ddiloco_geo.core.config import GcConfig, LearnerConfig, SyncerConfig
from ddiloco_geo.core.errors import ConfigError

# wire bytes per parameter, headers/scales/indices included: docs/benchmarks.md "Codec" (wire_ratio × 4)
CODEC_BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "int8": 4 * 0.25793, "int4": 4 * 0.13292, "topk": 4 * 0.00929}
# docs/benchmarks.md "Syncer throughput": MB of fp32 deltas merged per second per core
SYNCER_MB_PER_S_PER_CORE = 158.0


@dataclass(frozen=True)
class Efficiency:
    system: str  # "dp" or "ddiloco"
    codec: str  # the learners' wire codec ("-" for dp)
    H: int  # 0 for dp
    ratio: float
    source: str


DEFAULT_EFFICIENCY = (
    Efficiency("dp", "-", 0, 1.0, "definition: data-parallel is the reference"),
    Efficiency("ddiloco", "int4", 24, 0.64,
               "measured at a compute-optimal budget: bench convergence, arm 'adopt' at the defaults since stop 16 "
               "(int4, K=1+grace, keep_progress, aligned sends, inner lr 6e-3, learners of mixed speed, Nesterov "
               "0.4/0.9), M=4, H=24, 0.5M-parameter GPT, 10.2M tokens (20 per parameter), Shakespeare: dp_equivalent "
               "0.635 on one machine, 0.69 on another (docs/benchmarks.md); the lower is the default. It was 0.51 at "
               "the stop-14 defaults and 0.72 at small scale (254k tokens, M=2)"),
    Efficiency("ddiloco", "int4", 16, 0.70,
               "measured at a compute-optimal budget: bench convergence, arm 'adopt' at the stop-25 defaults "
               "(H=16, P=24, learner.schedule=run), M=4, 0.5M-parameter GPT, 10.2M tokens, Shakespeare seed 0: "
               "dp_equivalent 0.77 where H=24 measured 0.70 on the same machine (docs/benchmarks.md, stop 25); "
               "scaled to the H=24 row's machine (0.64 x 0.77/0.70)"),
    Efficiency("ddiloco", "int4", 12, 0.73,
               "as the H=16 row, at H=12: dp_equivalent 0.80 against 0.70 at H=24 on the same machine, "
               "scaled the same way (0.64 x 0.80/0.70)"),
)


@dataclass(frozen=True)
class Region:
    name: str
    instance_type: str
    accelerators_per_instance: int
    instances: int
    ondemand_usd_per_hour: float
    spot_usd_per_hour: float
    interruptions_per_hour: float
    egress_usd_per_gb: float
    put_usd_per_1k: float
    get_usd_per_1k: float
    storage_usd_per_gb_month: float
    bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    rtt_ms: dict[str, float] = field(default_factory=dict)
    local_gbps: float = 100.0  # learner to a bucket in its own region
    speed: float = 1.0  # accelerator speed relative to the job's reference
    cloud: str = "aws"

    @property
    def accelerators(self) -> int:
        return self.accelerators_per_instance * self.instances

    def gbps_to(self, other: str) -> float:
        return self.local_gbps if other == self.name else float(self.bandwidth_gbps.get(other, 0.0))


@dataclass(frozen=True)
class Job:
    params: float
    layers: int
    tokens: float
    tokens_per_step: float
    step_s: float
    step_accelerators: int
    tau: int = 2
    dp_bytes_per_param: float = 2.0  # bf16 gradients in a DP all-reduce
    update_codec: str = "int4"  # syncer → learners (settings syncer.update_codec)
    h_candidates: tuple[int, ...] = (12, 16, 24)
    learners_per_region: tuple[int, ...] = (1, 2, 4)
    purchase: tuple[str, ...] = ("spot", "ondemand")
    codecs: tuple[str, ...] = ("int4", "topk")
    min_utilization: float = 0.9
    deadline_hours: float | None = None
    budget_usd: float | None = None
    repair_s: float = 600.0  # time until an interrupted instance is replaced
    ondemand_mtbi_days: float = 365.0  # per accelerator (the simulator's default)
    syncer_mb_per_s_per_core: float = SYNCER_MB_PER_S_PER_CORE
    syncer_headroom: float = 0.5  # share of a core's throughput a shard is planned to use
    syncer_usd_per_core_hour: float = 0.045  # a c7i vCPU-hour on demand, 2026 list price
    checkpoint_bytes_per_param: float = 12.0  # fp32 parameters + AdamW moments (one per learner / DP job)


@dataclass(frozen=True)
class PlanInput:
    job: Job
    regions: tuple[Region, ...]
    efficiency: tuple[Efficiency, ...]
    gc: GcConfig
    learner_poll_s: float
    heartbeat_s: float
    syncer_poll_s: float

    def region(self, name: str) -> Region:
        return next(r for r in self.regions if r.name == name)

    def efficiency_of(self, system: str, codec: str, H: int) -> Efficiency | None:
        return next((e for e in reversed(self.efficiency) if (e.system, e.codec, e.H) == (system, codec, H)), None)


def _build(cls, raw: dict, where: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    try:
        obj = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return obj


def _check_job(job: Job) -> None:
    positive = ("params", "tokens", "tokens_per_step", "step_s", "step_accelerators", "layers", "repair_s")
    for name in positive:
        if getattr(job, name) <= 0:
            raise ConfigError(f"[job] {name}={getattr(job, name)} must be > 0")
    if not 0 < job.min_utilization <= 1:
        raise ConfigError(f"[job] min_utilization={job.min_utilization} must be in (0, 1]")
    for c in job.codecs + (job.update_codec,):
        if c not in CODEC_BYTES_PER_PARAM:
            raise ConfigError(f"[job] codec {c!r}: choose from {sorted(CODEC_BYTES_PER_PARAM)}")
    if not set(job.purchase) <= {"spot", "ondemand"} or not job.purchase:
        raise ConfigError(f"[job] purchase={list(job.purchase)}: use 'spot' and/or 'ondemand'")
    if min(job.h_candidates, default=0) < 1 or min(job.learners_per_region, default=0) < 1:
        raise ConfigError("[job] h_candidates and learners_per_region need values >= 1")


def _check_region(r: Region, names: set[str]) -> None:
    for name in ("accelerators_per_instance", "instances", "speed"):
        if getattr(r, name) <= 0:
            raise ConfigError(f"[[regions]] {r.name}: {name} must be > 0")
    for name in ("ondemand_usd_per_hour", "spot_usd_per_hour", "interruptions_per_hour", "egress_usd_per_gb",
                 "put_usd_per_1k", "get_usd_per_1k", "storage_usd_per_gb_month", "local_gbps"):
        if getattr(r, name) < 0:
            raise ConfigError(f"[[regions]] {r.name}: {name} must be >= 0")
    for other, gbps in {**r.bandwidth_gbps, **r.rtt_ms}.items():
        if other not in names or other == r.name:
            raise ConfigError(f"[[regions]] {r.name}: bandwidth/rtt to unknown region {other!r}")
        if gbps < 0:
            raise ConfigError(f"[[regions]] {r.name}: bandwidth/rtt to {other} must be >= 0")


def symmetric(regions: list[Region]) -> tuple[Region, ...]:
    """A link given on one side only holds both ways (the smaller figure wins if both are given)."""
    out = []
    for r in regions:
        bw = dict(r.bandwidth_gbps)
        rtt = dict(r.rtt_ms)
        for o in regions:
            if r.name in o.bandwidth_gbps:
                bw[o.name] = min(bw.get(o.name, float("inf")), o.bandwidth_gbps[r.name])
            if r.name in o.rtt_ms:
                rtt[o.name] = max(rtt.get(o.name, 0.0), o.rtt_ms[r.name])
        out.append(Region(**{**{f.name: getattr(r, f.name) for f in fields(Region)}, "bandwidth_gbps": bw, "rtt_ms": rtt}))
    return tuple(out)


def parse_plan(raw: dict) -> PlanInput:
    if "job" not in raw or not raw.get("regions"):
        raise ConfigError("the plan file needs a [job] table and at least one [[regions]] table")
    job = _build(Job, raw["job"], "[job]")
    _check_job(job)
    regions = [_build(Region, r, f"[[regions]] {r.get('name', '?')}") for r in raw["regions"]]
    names = {r.name for r in regions}
    if len(names) != len(regions):
        raise ConfigError("[[regions]]: region names must be unique")
    for r in regions:
        _check_region(r, names)
    rows = [_build(Efficiency, e, "[[efficiency]]") for e in raw.get("efficiency", [])]
    for e in rows:
        if not 0 < e.ratio <= 1.5:
            raise ConfigError(f"[[efficiency]] {e.system}/{e.codec}/H={e.H}: ratio {e.ratio} must be in (0, 1.5]")
    try:
        gc = GcConfig(**raw.get("gc", {}))
    except Exception as exc:  # pydantic's ValidationError: say which table
        raise ConfigError(f"[gc]: {exc}") from None
    return PlanInput(job=job, regions=symmetric(regions), efficiency=DEFAULT_EFFICIENCY + tuple(rows), gc=gc,
                     learner_poll_s=LearnerConfig().poll_s, heartbeat_s=LearnerConfig().heartbeat_s,
                     syncer_poll_s=SyncerConfig().poll_s)


def load_plan(path: str | Path) -> PlanInput:
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"plan file {path} not found (example: docs/examples/regions.toml)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"plan file {path}: {exc}") from None
    return parse_plan(raw)
