"""A learner's preemption checkpoint: the one object that lets a restarted learner continue.

Written by rank 0 on exit (create-only, ``learners/<id>/checkpoints/cNNNNNNNNNN.st``, fp32,
signed with the learner's key in a signed run): local parameters (``param.*``), AdamW moments
(``adam.exp_avg.*``, ``adam.exp_avg_sq.*``), error-feedback residuals (``residual.<p>.*``, with
``learner.error_feedback``), and in the header the step and token counts, the
vector clock, and ``extra``: base versions, per-fragment counters, last-sent steps, every rank's
data cursor, AdamW step counts, world size, plan digest and stop reason.

Reading takes the newest checkpoint that decodes and verifies; a corrupt, truncated, foreign or
forged one is skipped with a ``checkpoint_unusable`` warning (the learner then starts from the
latest globals). Whether its parameters are used is the learner's decision (staleness bound).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ddiloco_geo import codec
from ddiloco_geo.core import layout
from ddiloco_geo.core.model import full_tensor, like_param
from ddiloco_geo.core.errors import CodecError, NotFoundError
from ddiloco_geo.learner import ranks
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)

CKPT_PARAM = "param."
CKPT_EXP_AVG = "adam.exp_avg."
CKPT_EXP_AVG_SQ = "adam.exp_avg_sq."
CKPT_RESIDUAL = "residual."  # error feedback: what the codec has not sent yet, per fragment


def checkpoint_tensors(params: dict[str, torch.Tensor], model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(tensors to store, AdamW step count per parameter name). With a sharded (FSDP) model every
    rank calls this: the moments are gathered whole."""
    tensors = {CKPT_PARAM + n: t for n, t in params.items()}
    adam_steps = {}
    for name, param in model.named_parameters():
        st = optimizer.state.get(param)
        if st:
            tensors[CKPT_EXP_AVG + name] = full_tensor(st["exp_avg"].detach()).float().cpu()
            tensors[CKPT_EXP_AVG_SQ + name] = full_tensor(st["exp_avg_sq"].detach()).float().cpu()
            adam_steps[name] = float(st["step"])
    return tensors, adam_steps


def write_checkpoint(store: Store, learner_id: str, tensors: dict[str, torch.Tensor], header: codec.Header,
                     signer: Any = None) -> str:
    """Create-only, at the first free number; returns the key."""
    data = codec.encode(tensors, header, codec="fp32", signer=signer)
    number = len(store.list(layout.checkpoints_dir(learner_id)))
    while not store.put_if_absent(layout.checkpoint_key(learner_id, number), data):
        number += 1
    key = layout.checkpoint_key(learner_id, number)
    log.info("checkpoint_written learner=%s key=%s bytes=%d", learner_id, key, len(data))
    return key


def latest_checkpoint(store: Store, learner_id: str, run_id: str, *, verifier: Any = None,
                      require_signature: bool = False) -> tuple[str, codec.Header, dict[str, torch.Tensor]] | None:
    """The newest checkpoint of this learner that decodes and verifies, or None."""
    for key in reversed(store.list(layout.checkpoints_dir(learner_id))):
        try:
            header, tensors = codec.decode(
                store.get(key), kind="checkpoint", run_id=run_id, verify=verifier,
                require_signature=require_signature,
                expected_signer=f"learner:{learner_id}" if verifier is not None else None)
            return key, header, tensors
        except (CodecError, NotFoundError) as exc:
            log.warning("checkpoint_unusable key=%s reason=%s", key, exc)
    return None


def residual_tensors(residual: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The uploader's error-feedback residuals as checkpoint tensors (``residual.<p>.<name>``)."""
    return {f"{CKPT_RESIDUAL}{p}.{n}": t for p, r in residual.items() for n, t in r.items()}


def residuals_of(tensors: dict[str, torch.Tensor], plan) -> dict[int, dict[str, torch.Tensor]]:
    """The residuals a checkpoint holds, for fragments whose every tensor is there with the plan's
    shape; anything else (another plan, a malformed name) is dropped with a warning, never raised:
    a residual is progress not yet sent, and losing it costs less than a learner that cannot start."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.startswith(CKPT_RESIDUAL):
            p, _, name = key[len(CKPT_RESIDUAL):].partition(".")
            if p.isdigit() and int(p) < plan.num_fragments and name in plan.fragments[int(p)]:
                out.setdefault(int(p), {})[name] = t
    usable = {p: r for p, r in out.items() if set(r) == set(plan.fragments[p])
              and all(tuple(r[n].shape) == tuple(plan.shapes[n]) for n in r)}
    dropped = sum(k.startswith(CKPT_RESIDUAL) for k in tensors) - sum(len(r) for r in usable.values())
    if dropped:
        log.warning("checkpoint_residuals_dropped tensors=%d reason=not_in_this_plan action=none "
                    "(the learner starts those fragments with an empty residual; only their unsent "
                    "top-k remainder is lost)", dropped)
    return usable


def params_of(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n[len(CKPT_PARAM):]: t for n, t in tensors.items() if n.startswith(CKPT_PARAM)}


def moments_of(tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return tensors[CKPT_EXP_AVG + name], tensors[CKPT_EXP_AVG_SQ + name]


def restore_adam(optimizer: torch.optim.Optimizer, model: torch.nn.Module, tensors: dict[str, torch.Tensor],
                 adam_steps: dict[str, float], *, rank: int, world: int, device: torch.device) -> None:
    """AdamW moments and step counts from rank 0's checkpoint tensors, on every rank (each rank's
    shard of them with a sharded model)."""
    for name, param in model.named_parameters():
        if name not in adam_steps:
            continue
        if rank == 0:
            moments = [t.to(device) for t in moments_of(tensors, name)]
        else:
            moments = [torch.empty(param.shape, dtype=torch.float32, device=device) for _ in range(2)]
        moments = [like_param(ranks.broadcast_tensor(t, world), param) for t in moments]
        optimizer.state[param] = {"step": torch.tensor(float(adam_steps[name])),
                                  "exp_avg": moments[0], "exp_avg_sq": moments[1]}
