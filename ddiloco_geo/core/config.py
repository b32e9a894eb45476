"""One settings tree for every component, with one tested precedence.

Precedence, highest first: command line > environment (``DDILOCO_<SECTION>__<FIELD>``) > TOML file
(``--config FILE`` or ``DDILOCO_CONFIG``) > defaults. Unknown keys and invalid values raise
:class:`~ddiloco_geo.core.errors.ConfigError` with a message that names the key and says how to fix it.
Nothing here runs at import time, and nothing outside this module reads the environment for
settings. Each component receives only its own section (habit 3 in STYLE.md).

:func:`load` returns the validated tree and, for ``ddiloco-geo config --show``, where each value
came from (``default``, ``file``, ``env`` or ``cli``).
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ddiloco_geo.core.errors import ConfigError

ENV_PREFIX = "DDILOCO_"
ENV_NESTED = "__"
CONFIG_FILE_ENV = "DDILOCO_CONFIG"
TEST_ENV_PREFIX = "DDILOCO_TEST_"  # reserved for the test harness (e.g. DDILOCO_TEST_LOCALSTACK_URL)
TOPK_OUTER = (1.0, 0.0)  # the outer (lr, momentum) a top-k run gets by default: plain averaging
OUTER_LR_BY_LEARNERS = {2: 0.25}  # local.learners -> its default outer lr, where one measured better than 0.4 (docs/benchmarks.md)
# Process switches outside the settings tree, read before any settings (docs/configuration.md): codec/native.py, cli/main.py
PROCESS_ENV = frozenset({"DDILOCO_NATIVE_CODEC", "DDILOCO_NATIVE_DIR", "DDILOCO_MALLOC_TUNING"})

Codec = Literal["fp32", "bf16", "int8", "int4", "topk"]  # = codec.CODECS (tested); written here to keep config free of torch


def _check_shard(v: str) -> str:
    try:
        i, n = (int(x) for x in v.split("/"))
    except ValueError:
        raise ValueError(f"shard {v!r} must look like 'i/N', e.g. '0/1' or '2/4'") from None
    if not 0 <= i < n:
        raise ValueError(f"shard {v!r}: need 0 <= i < N")
    return v


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StorageConfig(Section):
    """How to reach the bucket and how hard to retry."""

    url: str = Field("file://./ddiloco-run", description="run location: file://DIR, memory://NAME, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (LocalStack, moto, MinIO, R2); GCS emulator for gs://")
    region: str | None = Field(None, description="S3 region name")
    anonymous: bool = Field(False, description="skip credentials (emulators only)")
    retry_attempts: int = Field(8, ge=1, le=100, description="attempts for a transient failure, first one included")
    retry_initial_s: float = Field(0.1, gt=0, description="first backoff delay")
    retry_max_s: float = Field(10.0, gt=0, description="cap on one backoff delay (full jitter below it)")
    timeout_s: float = Field(60.0, gt=0, description="per-request connect/read timeout")
    fault_rate: float = Field(0.0, ge=0, le=1, description="chaos testing only: share of storage attempts that fail (SlowDown, timeout, lost response, torn write), under the retries")
    fault_seed: int = Field(0, description="chaos testing only: seed of the deterministic fault schedule")


class ModelConfig(Section):
    """The model every learner trains: a built-in GPT by name or dimensions, a Hugging Face causal LM
    built from a config (the [hf] extra), or a user factory."""

    name: str = Field("tiny", description="built-in size: nano, tiny, small, base, large, xl, or 'custom' (use n_layer/n_head/n_embd)")
    n_layer: int | None = Field(None, ge=1)
    n_head: int | None = Field(None, ge=1)
    n_embd: int | None = Field(None, ge=8)
    block_size: int = Field(128, ge=8, description="context length in bytes (byte-level vocabulary)")
    factory: str | None = Field(None, description="'module:function' returning a torch.nn.Module; overrides name")
    embedding_patterns: list[str] = Field(
        default_factory=lambda: ["wte", "wpe", "embed", "lm_head"],
        description="parameter-name substrings merged by weighted mean instead of RDA",
    )
    seed: int = Field(0, description="initial weights seed (identical on every learner)")
    hf_config: str | None = Field(None, description="Hugging Face model: a local directory with a transformers config.json (or the file); "
                                  "builds AutoModelForCausalLM.from_config, nothing is downloaded; needs the [hf] extra; overrides name")
    hf_class: str | None = Field(None, description="Hugging Face model from a config class, e.g. 'LlamaConfig' or 'package.module:Class', "
                                 "built with model.hf_kwargs; overrides name")
    hf_kwargs: dict[str, Any] = Field(default_factory=dict, description="arguments of model.hf_class, or values that override "
                                      "model.hf_config's (e.g. {num_hidden_layers = 2})")


class DataConfig(Section):
    corpus: str = Field("shakespeare", description="'shakespeare', 'stdlib', a glob of text files (local path or bucket URL), "
                        "or 'tokens:URL' for token shards written by 'ddiloco-geo data prepare' (directory or bucket URL)")
    eval_ratio: float = Field(0.02, gt=0, lt=0.5, description="held-out share of the corpus for evaluation")
    eval_batches: int = Field(8, ge=1)
    max_bytes: int | None = Field(None, ge=1024, description="cap on corpus bytes read (None: all)")
    shard: str = Field("0/1", description="'i/N': this learner reads the i-th of N disjoint shards")
    shard_layout: Literal["contiguous", "interleaved"] = Field("contiguous", description="'contiguous': shard i is the i-th N-th of the training data in corpus order; 'interleaved': stripes of 64 windows (tokens: corpora: chunks) dealt round-robin")
    chunk_tokens: int = Field(1 << 20, ge=64, description="tokens: corpora: tokens per ranged read; a learner shuffles "
                              "the chunks of its slice, then the windows inside a chunk")
    storage: dict[str, Any] = Field(default_factory=dict, description="tokens: corpora in a bucket: storage-section keys for "
                                    "that bucket (e.g. {endpoint_url = '...', anonymous = true}); empty: the defaults")

    @field_validator("shard")
    @classmethod
    def _shard(cls, v: str) -> str:
        return _check_shard(v)

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: dict[str, Any]) -> dict[str, Any]:
        if "url" in v:
            raise ValueError("data.storage takes no url: the URL is the one in data.corpus ('tokens:URL')")
        StorageConfig.model_validate(v)  # unknown keys and bad values fail here, with the key's name
        return v


class LearnerConfig(Section):
    id: str | None = Field(None, description="learner id (default: derived from hostname and pid)")
    region: str = Field("local", description="region label shown in status views")
    batch_size: int = Field(8, ge=1)
    lr: float = Field(6e-3, gt=0, description="inner AdamW peak learning rate (6e-3 measured best for Decoupled DiLoCo)")
    weight_decay: float = Field(0.1, ge=0)
    warmup_steps: int = Field(20, ge=0)
    max_steps: int = Field(300, ge=1, description="inner steps before exiting (learner.schedule=run: counted on the run's mean step)")
    max_time_s: float | None = Field(None, gt=0)
    alpha: float = Field(0.0, ge=0, lt=1, description="mixing factor on adoption: local = alpha*local + (1-alpha)*global; 0 overwrites")
    follow_run: bool = Field(False, description="a joining or restarted learner starts its learning-rate schedule (and its "
                             "count toward max_steps) at the run's progress (newest merge records), not 0 or its checkpoint's; always with schedule=run")
    schedule: Literal["own", "run"] = Field(
        "run", description="place on the lr schedule and toward max_steps: 'run', the mean of the latest steps of every learner of "
        "the run seen (silent ones too; another's counted up to 2 x max_steps), never going back (a learner never merged stops at its own max_steps): "
        "learners of different speeds anneal together, the run stops after M x max_steps steps; 'own': this learner's count (slower ones train the end alone)")
    send_schedule: Literal["fixed", "aligned"] = Field(
        "aligned", description="when fragment p is sent: 'aligned' timed to the syncer's merges, a lead of steps before the next "
        "merge of p (fragments.overlap, more while sends miss their merge) (2.8 points better at a compute-optimal budget); 'fixed' every H")
    adopt: Literal["overwrite", "keep_progress"] = Field(
        "keep_progress", description="on a new global G of fragment p: 'overwrite' sets local_p = G (work since the last delta was sent is "
        "lost); 'keep_progress' sets local_p = G + (local_p - ref_p), ref_p = local_p at the last send (or the base at the last adoption)")
    error_feedback: Literal["auto", "on", "off"] = Field(
        "auto", description="'on': send the progress since the previous send (an increment) plus what the codec dropped from earlier "
        "ones (a residual per fragment, kept in the exit checkpoint), applied by the syncer as is. 'auto': on for run.codec=topk only")
    residual_decay: float = Field(0.9, gt=0, le=1, description="error feedback: the residual is scaled by this each time it "
                                  "joins an increment (SparseLoCo's beta), so long-unsent values fade; 1 keeps all (top-k: ~10 points worse than 0.95; 0.9 beat 0.95 by 1.4-3.1 on 3 seeds)")
    checkpoint_on_exit: bool = Field(True, description="write a learner checkpoint (inner optimizer, data cursor, counters) on exit")
    upload_queue: int = Field(8, ge=1, description="deltas waiting for upload before the oldest is dropped and counted")
    poll_s: float = Field(0.5, gt=0, description="interval between polls for new global versions")
    heartbeat_s: float = Field(2.0, gt=0)
    slow_step_s: float = Field(0.0, ge=0, description="extra sleep per step (tests and chaos: a straggler)")
    device: str = Field("cpu", description="torch device; 'cuda' under torchrun uses LOCAL_RANK")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="'bf16': forward and loss under bf16 autocast "
                                              "(parameters, AdamW state and deltas stay fp32); for GPUs with bf16")
    compile: bool = Field(False, description="torch.compile the training step's module (a one-off compile at the first step)")
    parallel: Literal["ddp", "fsdp"] = Field("ddp", description="under torchrun, how the learner's ranks share the "
                                             "model: 'ddp' replicates it, 'fsdp' shards parameters, gradients and AdamW "
                                             "state (FSDP2 fully_shard per block) for models larger than one device")
    join_timeout_s: float = Field(300.0, gt=0, description="how long to wait for the run and its first globals")
    flush_deadline_s: float = Field(20.0, gt=0, description="time allowed to flush deltas on exit or preemption notice (fits GCE's 30 s)")
    log_every: int = Field(10, ge=1, description="steps between progress lines")
    sync_enabled: bool = Field(True, description="false: train alone after the first pull (no deltas, no polling); the overhead benchmark's baseline")


class SyncerConfig(Section):
    quorum: int = Field(1, ge=1, description="minimum learners K before a fragment is merged")
    grace_gamma: float = Field(0.5, ge=0, lt=1, description="share of the slack spent waiting for stragglers (0 disables)")
    ema_decay: float = Field(0.8, gt=0, lt=1, description="EMA weight on the old value for timings (step times: one EMA per learner, their median)")
    outer_lr: float = Field(0.4, gt=0, description="outer learning rate (1.0 with momentum 0 is plain averaging); 0.4 with Nesterov 0.9 measured best at a compute-optimal "
                            "budget with 4 learners; 0.25 with local.learners=2 (set it so in a two-learner deployment); 1.0 with momentum 0 in a run.codec=topk run (docs/benchmarks.md)")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="outer (Nesterov) momentum; 0 by default in a run.codec=topk run (see outer_lr)")
    nesterov: bool = True
    outer_warmup: int = Field(32, ge=0, description="outer steps of a fragment that move it linearly from plain averaging to outer_lr / outer_momentum")
    merge_spacing: float = Field(1.0, ge=0, le=4, description="minimum time between two merges of one fragment, as a fraction of a fragment period (H x step time); 0 merges as soon as quorum and grace allow")
    robust: Literal["none", "trimmed_mean", "median"] = Field("none", description="for untrusted learners: a coordinate-wise robust average instead of token-weighted RDA")
    trim_ratio: float = Field(0.25, ge=0, lt=0.5, description="share of values dropped at each end per coordinate by robust='trimmed_mean'")
    sparse_average: Literal["auto", "dense", "per_index"] = Field("auto", description="how deltas are averaged when robust='none': 'dense' (token-weighted RDA, the mean for "
        "embeddings); 'per_index': each coordinate over the learners that sent a non-zero value there, token-weighted "
        "(SparseLoCo's aggregation, for sparse deltas); 'auto': per_index in a run.codec=topk run, dense otherwise. Recorded in each merge record")
    clip_ratio: float | None = Field(4.0, gt=1, description="merge guard: a contributor whose per-step norm exceeds "
                                     "this multiple of the fragment's reference is scaled down to it (recorded as 'clip' "
                                     "in the merge record, counted in status); None turns the guard off")
    anchoring: Literal["current", "base"] = Field("base", description="'base': a delta counts as the learner's own progress "
        "Θ_base − θ_learner, applied to the current global (a resend on a base it already had merged is anchored at 'current', so no "
        "progress is applied twice; recorded per merge entry as 'anchor'); 'current': as the pull Θ_current − θ_learner (the paper's "
        "anchoring: a stale learner alone in a merge pulls the global back toward its model)")
    final_merge: Literal["average", "outer"] = Field("average", description="'average': a merge holding a learner's final delta "
        "(its exit flush when its schedule ends) averages the learners' models (each anchored at the current global, whatever "
        "'anchoring' says): the token-weighted mean, lr 1, momentum kept (recorded as 'final' in the merge record): at the end "
        "of the run the outer momentum would carry the global past where the learners are; 'outer': the usual outer step")
    resends: Literal["share", "pull"] = Field("pull", description="with anchoring='base', a delta sent again on the base of "
        "the learner's merged one: 'pull' anchors it at the current global; 'share' applies its steps beyond the merged delta's (recorded as 'resent' and 'share'; not the default: chaos seeds 6-7 ended worse with it)")
    stale_damping: Literal["inverse", "none"] = Field("inverse", description="'inverse': a contributor whose base is s >= 2 versions behind the fragment is scaled by 1/s (recorded as 'damp' in its merge entry; not in a final merge; chaos runs measured better with it); 'none': at full size")
    max_seq_ahead: int = Field(100_000, ge=1, description="a delta key more than this many sequence numbers past the "
                               "learner's last provable one is rejected unread (seq_ahead): an honest learner skips a "
                               "number only when its key is taken, so one foreign object cannot push its numbering away")
    max_deltas_per_min: int = Field(1200, ge=1, description="per-learner rate limit on delta objects; more are rejected as rate_limit")
    quarantine_after: int = Field(20, ge=1, description="rejections in a row after which a learner is quarantined (ignored until an operator deletes syncer/quarantine/<id>.json)")
    max_staleness: int = Field(8, ge=0, description="reject deltas whose base version is older than current - max_staleness")
    max_norm_ratio: float = Field(50.0, gt=1, description="reject a delta whose per-step norm exceeds this multiple of the fragment's running median")
    update_codec: Literal["none", Codec] = Field("int4", description="codec of the per-version update objects learners download ('none': learners fetch full fp32 globals)")
    poll_s: float = Field(0.2, gt=0)
    fetch_concurrency: int = Field(8, ge=1)
    shard: str = Field("0/1", description="'i/S': this syncer owns fragments p with p % S == i")
    idle_exit_s: float | None = Field(None, gt=0, description="exit after this long with no learner activity (local runs)")
    drain_timeout_s: float = Field(60.0, gt=0, description="on stop: time allowed for the last poll and merge of everything pending")

    @field_validator("shard")
    @classmethod
    def _shard(cls, v: str) -> str:
        return _check_shard(v)


class RunConfig(Section):
    """Run-level settings every process must agree on; recorded in ``run.json`` by the first syncer
    and checked against it when a learner joins (a mismatch is an error, never silently ignored)."""

    codec: Codec = Field("int4", description="wire codec of learners' deltas (topk: measured at fragments.sync_every=24)")
    quant_block: int = Field(128, ge=8, description="quantization block of the int8/int4 codecs (values per scale)")
    topk_chunk: int = Field(4096, ge=2, le=4096, description="topk codec (deltas, and update objects with "
                            "syncer.update_codec=topk): values per chunk; each kept index takes bit_length(chunk - 1) bits")
    topk_keep: int = Field(84, ge=1, description="topk codec: values kept per chunk (84 of 4096 = 2.05%: about 0.30 "
                           "bits per value on the wire, 1/108 of fp32)")

    @model_validator(mode="after")
    def _topk(self) -> "RunConfig":
        if self.topk_keep > self.topk_chunk:
            raise ValueError(f"run.topk_keep={self.topk_keep} exceeds run.topk_chunk={self.topk_chunk}")
        return self


class FragmentConfig(Section):
    num_fragments: int = Field(24, ge=1, description="P; fewer if the model has fewer tensors")
    sync_every: int = Field(16, ge=1, description="H: inner steps between two syncs of one fragment (bytes ~ 1/H)")
    overlap: int = Field(2, ge=0, description="tau: steps a learner keeps training while a fragment is in flight (the aligned send lead's floor; the grace slack)")


class LocalConfig(Section):
    learners: int = Field(3, ge=1, description="M learner processes (2 also sets the outer lr default to 0.25: see syncer.outer_lr)")
    out: str = Field("out", description="directory for summary.json and plots")
    fresh: bool = Field(True, description="start a new run (wipe a local store) instead of joining one")


class AgentConfig(Section):
    """Preemption notices: the learner stops stepping, flushes, checkpoints and exits 0."""

    provider: Literal["none", "auto", "aws", "gce"] = Field("none", description="cloud metadata to watch for spot/preemption notices ('auto' probes both); SIGTERM is always watched")
    metadata_url: str | None = Field(None, description="metadata server URL (default: the cloud's link-local address)")
    poll_s: float = Field(1.0, gt=0, description="interval between metadata polls (GCE long-polls)")
    act_on_rebalance: bool = Field(True, description="treat an AWS rebalance recommendation as a notice")


class SecurityConfig(Section):
    """Signed objects (docs/security.md). Keys come from here or the environment, never the bucket."""

    run_secret: SecretStr | None = Field(None, description="run secret every key is derived from (set DDILOCO_SECURITY__RUN_SECRET; never printed)")
    require_signatures: bool | None = Field(None, description="reject unsigned objects (default: true when a run secret is set)")

    def required(self) -> bool:
        return self.run_secret is not None if self.require_signatures is None else self.require_signatures


class MetricsConfig(Section):
    address: str | None = Field(None, description="host:port for Prometheus metrics and /healthz (127.0.0.1 only by default)")


class GcConfig(Section):
    """Retention policy of ``ddiloco-geo gc`` (the rules are in :mod:`ddiloco_geo.ops.gc`)."""

    keep_versions: int = Field(4, ge=1, description="newest global versions of each fragment always kept")
    replay_window_s: float = Field(86400.0, ge=0, description="versions published (and deltas rejected) this recently stay replayable")
    lag_window_s: float = Field(600.0, ge=0, description="a learner whose heartbeat is this recent keeps its base versions")


class Settings(BaseSettings):
    """The whole tree. Sections are passed to components one at a time."""

    model_config = SettingsConfigDict(extra="forbid", validate_assignment=True)

    run_id: str = Field("run", description="run name recorded in every object header")
    run: RunConfig = Field(default_factory=RunConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    fragments: FragmentConfig = Field(default_factory=FragmentConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    syncer: SyncerConfig = Field(default_factory=SyncerConfig)
    local: LocalConfig = Field(default_factory=LocalConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    gc: GcConfig = Field(default_factory=GcConfig)

    @model_validator(mode="after")
    def _outer_defaults(self) -> "Settings":
        """Unless set explicitly: top-k merges with plain averaging (with error feedback, Nesterov measured 2.27 against 1.75); a run of
        ``local.learners`` in ``OUTER_LR_BY_LEARNERS`` gets that outer lr (0.4 was tuned with 4; 2 measured better at 0.25; docs/benchmarks.md)."""
        if self.run.codec == "topk" and not ({"outer_lr", "outer_momentum"} & self.syncer.model_fields_set):
            self.syncer.outer_lr, self.syncer.outer_momentum = TOPK_OUTER
        elif self.run.codec != "topk" and "outer_lr" not in self.syncer.model_fields_set and self.local.learners in OUTER_LR_BY_LEARNERS:
            self.syncer.outer_lr = OUTER_LR_BY_LEARNERS[self.local.learners]
        return self


SOURCES = ("default", "file", "env", "cli")


def overrides_tree(pairs: list[str] | None = None, flat: dict[str, Any] | None = None) -> dict[str, Any]:
    """A nested override dict from ``KEY=VALUE`` pairs (values parsed as JSON where they are JSON)
    and a flat ``{"section.field": value}`` map (None values dropped), the latter winning."""
    merged: dict[str, Any] = {}
    for item in pairs or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set syncer.quorum=2")
        key, value = item.split("=", 1)
        try:
            merged[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            merged[key.strip()] = value
    merged.update({k: v for k, v in (flat or {}).items() if v is not None})
    tree: dict[str, Any] = {}
    for dotted, value in merged.items():
        node = tree
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def _env_tree(environ: dict[str, str]) -> dict[str, Any]:
    """``DDILOCO_SECTION__FIELD=value`` -> {"section": {"field": value}} (values parsed later)."""
    tree: dict[str, Any] = {}
    for name, value in environ.items():
        if (not name.startswith(ENV_PREFIX) or name == CONFIG_FILE_ENV or name.startswith(TEST_ENV_PREFIX)
                or name in PROCESS_ENV):
            continue
        path = name[len(ENV_PREFIX):].lower().split(ENV_NESTED)
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"environment variable {name} conflicts with another DDILOCO_ variable")
        node[path[-1]] = _parse_env_value(value)
    return tree


def _parse_env_value(value: str) -> Any:
    """Environment values are strings; JSON-looking ones (lists, numbers, booleans) are decoded."""
    text = value.strip()
    if text[:1] in "[{" or text in ("true", "false", "null"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return value
    return value


def _merge(base: dict[str, Any], top: dict[str, Any], source: str, origin: dict[str, str], prefix: str = "") -> None:
    for key, value in top.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value, source, origin, dotted + ".")
        else:
            base[key] = value
            if isinstance(value, dict):
                for leaf in _leaves(value, dotted + "."):
                    origin[leaf] = source
            else:
                origin[dotted] = source


def _leaves(tree: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def _describe(err: ValidationError, origin: dict[str, str]) -> str:
    lines = ["invalid configuration:"]
    for e in err.errors():
        dotted = ".".join(str(p) for p in e["loc"])
        where = origin.get(dotted, "default")
        hint = ("unknown key; check the spelling ('ddiloco-geo config --show' lists every key)"
                if e["type"] == "extra_forbidden" else e["msg"])
        if not e["loc"]:  # a check across sections: no single key to point at
            lines.append(f"  {hint}")
            continue
        env = ENV_PREFIX + ENV_NESTED.join(str(p).upper() for p in e["loc"])
        lines.append(f"  {dotted} (from {where}; env {env}): {hint}")
    return "\n".join(lines)


def load(
    cli: dict[str, Any] | None = None,
    config_file: str | os.PathLike[str] | None = None,
    environ: dict[str, str] | None = None,
) -> tuple[Settings, dict[str, str]]:
    """Resolve the settings tree and the origin of every non-default value.

    ``cli`` is a nested dict of values given on the command line (None entries are ignored).
    ``environ`` defaults to ``os.environ``; tests pass their own.
    """
    environ = dict(os.environ if environ is None else environ)
    config_file = config_file or environ.get(CONFIG_FILE_ENV)
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if config_file:
        path = Path(config_file)
        try:
            text = path.read_text()
            # a .json settings file (what `local` hands its children) is read as JSON, else TOML
            file_tree = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found; pass an existing TOML file or drop --config") from None
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"config file {path} is not valid TOML/JSON: {exc}") from None
        _merge(merged, file_tree, "file", origin)
    _merge(merged, _env_tree(environ), "env", origin)
    _merge(merged, _drop_none(cli or {}), "cli", origin)
    try:
        # init kwargs only: the environment was already folded in above, with provenance.
        settings = Settings.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, origin)) from None
    return settings, origin


def _drop_none(tree: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            sub = _drop_none(value)
            if sub:
                out[key] = sub
        elif value is not None:
            out[key] = value
    return out


def explain(settings: Settings, origin: dict[str, str]) -> list[dict[str, Any]]:
    """Rows of (key, value, source) for every leaf of the tree, for ``config --show``."""
    rows = []
    for dotted in _leaves(settings.model_dump()):
        node: Any = settings.model_dump()
        for part in dotted.split("."):
            node = node[part]
        rows.append({"key": dotted, "value": node, "source": origin.get(dotted, "default")})
    return rows
