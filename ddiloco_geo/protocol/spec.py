"""The run spec (``run.json``): created once, create-only; the first writer wins and every later
process must agree.

Run spec (JSON, layout version 1): run id, model settings, fragment plan and its digest, schedule
(P, H, tau), wire codec and quantization block. A learner whose own model produces a different plan
refuses to join with a message naming both digests.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch


from ddiloco_geo.codec import DEFAULT_CHUNK, DEFAULT_TOPK, MAX_CHUNK
from ddiloco_geo.core import layout
from ddiloco_geo.core import model as modelmod
from ddiloco_geo.core.errors import CodecError, ConfigError, NotFoundError
from ddiloco_geo.core.fragments import FragmentPlan, plan_fragments
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSpec:
    run_id: str
    model: dict[str, Any]
    plan: FragmentPlan
    sync_every: int
    overlap: int
    codec: str
    quant_block: int
    topk_chunk: int = DEFAULT_CHUNK
    topk_keep: int = DEFAULT_TOPK
    layout_version: int = layout.LAYOUT_VERSION

    def __post_init__(self) -> None:
        if not (2 <= self.topk_chunk <= MAX_CHUNK and 1 <= self.topk_keep <= self.topk_chunk):
            raise ValueError(f"topk_chunk={self.topk_chunk}, topk_keep={self.topk_keep}: expected a chunk of 2 to "
                             f"{MAX_CHUNK} values keeping 1 to all of them")

    def codec_args(self, codec_name: str) -> dict[str, int]:
        """``block_size`` (and ``topk``) for encoding with ``codec_name`` in this run: the top-k chunk
        and count for ``topk``, the quantization block for the others."""
        if codec_name == "topk":
            return {"block_size": self.topk_chunk, "topk": self.topk_keep}
        return {"block_size": self.quant_block}

    def check_settings(self, run_cfg) -> None:
        """A process's ``run`` settings must match the run it joins (never silently ignored); the
        top-k settings only in a top-k run."""
        keys = ("codec", "quant_block") + (("topk_chunk", "topk_keep") if self.codec == "topk" else ())
        wrong = [k for k in keys if getattr(run_cfg, k) != getattr(self, k)]
        if wrong:
            mismatched = "; ".join(f"run.{k}={getattr(run_cfg, k)!r} but the run uses {getattr(self, k)!r}" for k in wrong)
            fix = " ".join(f"--set run.{k}={getattr(self, k)}" for k in wrong)
            raise ConfigError(f"this process's settings disagree with run {self.run_id} ({mismatched}): start it with "
                              f"the run's settings (its run.json), e.g. {fix}")

    def to_json(self) -> str:
        return json.dumps(
            {
                "layout_version": self.layout_version,
                "run_id": self.run_id,
                "model": self.model,
                "plan": json.loads(self.plan.to_json()),
                "plan_digest": self.plan.digest(),
                "sync_every": self.sync_every,
                "overlap": self.overlap,
                "codec": self.codec,
                "quant_block": self.quant_block,
                "topk_chunk": self.topk_chunk,
                "topk_keep": self.topk_keep,
            },
            sort_keys=True,
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> "RunSpec":
        try:
            d = json.loads(text)
            if d.get("layout_version") != layout.LAYOUT_VERSION:
                raise ConfigError(
                    f"run.json has layout version {d.get('layout_version')!r}; this build reads "
                    f"{layout.LAYOUT_VERSION}: use a matching ddiloco-geo release"
                )
            plan = FragmentPlan.from_json(json.dumps(d["plan"]))
            quant_block = int(d["quant_block"] if "quant_block" in d else d["block_size"])  # layout-1 runs before 2026-12
            if plan.digest() != d["plan_digest"]:
                raise ConfigError("run.json is inconsistent: its plan does not match its plan_digest")
            return cls(
                run_id=d["run_id"], model=d["model"], plan=plan, sync_every=int(d["sync_every"]),
                overlap=int(d["overlap"]), codec=d["codec"],
                quant_block=quant_block,
                # runs before 2026-12-02 cut top-k chunks at the quantization block and kept 1/64
                topk_chunk=int(d.get("topk_chunk", quant_block)),
                topk_keep=int(d.get("topk_keep", max(1, quant_block // 64))),
            )
        except (KeyError, TypeError, ValueError, CodecError) as exc:
            raise ConfigError(f"run.json is malformed ({exc}); was it written by ddiloco-geo?") from None


def create_or_load_spec(store: Store, spec: RunSpec) -> RunSpec:
    """Create ``run.json`` if absent; otherwise load it and check it describes the same training."""
    store.put_if_absent(layout.RUN_SPEC, spec.to_json().encode())
    existing = load_spec(store)
    if existing.plan.digest() != spec.plan.digest():
        raise ConfigError(
            f"the run at {store.url} was created with fragment plan {existing.plan.digest()[:12]} but this "
            f"process's model gives {spec.plan.digest()[:12]}: use the run's model settings "
            f"({existing.model}) or a new --store"
        )
    return existing


def load_spec(store: Store) -> RunSpec:
    return RunSpec.from_json(store.get(layout.RUN_SPEC))


def wait_for_spec(store: Store, timeout_s: float, poll_s: float = 0.5) -> RunSpec:
    """The one wait a learner may do: for the run to exist at all (first pull of the model)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return load_spec(store)
        except NotFoundError:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"no run.json at {store.url} after {timeout_s:.0f}s: start a syncer on this store first"
                ) from None
            time.sleep(poll_s)


def build_spec(settings, net: torch.nn.Module | None = None) -> tuple[RunSpec, dict[str, torch.Tensor]]:
    """The run spec and initial weights from a settings tree (its run-level sections); ``net``: the
    model ``build_model(settings.model)`` already built, if the caller has it."""
    return spec_from(run_id=settings.run_id, model=settings.model, fragments=settings.fragments, run=settings.run,
                     net=net)


def spec_from(*, run_id: str, model, fragments, run, net: torch.nn.Module | None = None) -> tuple[RunSpec, dict[str, torch.Tensor]]:
    """The run spec and initial weights from the model, fragment and run settings (identical in
    every process that has the same settings)."""
    net = modelmod.build_model(model) if net is None else net
    params = {n: t.detach().to(torch.float32) for n, t in net.named_parameters()}
    plan = plan_fragments(modelmod.param_shapes(net), fragments.num_fragments)
    spec = RunSpec(run_id=run_id, model=model.model_dump(), plan=plan, sync_every=fragments.sync_every,
                   overlap=fragments.overlap, codec=run.codec, quant_block=run.quant_block,
                   topk_chunk=run.topk_chunk, topk_keep=run.topk_keep)
    return spec, params
