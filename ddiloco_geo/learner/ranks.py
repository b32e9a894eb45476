"""A learner under ``torchrun``: its ranks are one ordinary data-parallel job (gloo on CPU, nccl on
GPU), replicated (DDP) or sharded (FSDP2, ``learner.parallel = "fsdp"``). Only rank 0 talks to storage; what it reads (the model, adoptions, the stop flag, the
resume plan) reaches the other ranks through these collectives, among the learner's own ranks
only, never from a bucket. With one process (``world == 1``) every function is a no-op.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from ddiloco_geo.core import model as modelmod
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.fragments import FragmentPlan


def init_from_env(device: str) -> tuple[int, int, str]:
    """(rank, world, device) from torchrun's environment; joins the process group when world > 1."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, device
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return dist.get_rank(), dist.get_world_size(), device


def shutdown(world: int, *, clean: bool = True) -> None:
    """Leave the process group; the last thing a multi-rank learner process does.

    On a clean exit every rank waits at a barrier for the others (rank 0 may still be flushing and
    checkpointing), then **ends the process** with ``os._exit(0)`` (stdio and logging flushed)
    without tearing the gloo group down: that teardown can abort a rank (``terminate called
    without an active exception``) while a peer still holds the connection. After an error there
    is no barrier (the peers may be stuck in another collective; ``torchrun`` stops them) and the
    group is destroyed."""
    if world > 1:
        if clean:
            dist.barrier()
            # Everything is flushed and every rank is here: leave without tearing the gloo group down.
            # Its teardown still aborted rank 1 after the barrier at times (the same message, two CI runs
            # in stop 22, never alone); without destructors there is nothing to race.
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(0)
        dist.destroy_process_group()


def broadcast_model(model: torch.nn.Module, world: int) -> None:
    if world > 1:
        for t in model.parameters():
            dist.broadcast(t.data, src=0)


def shard_model(model: torch.nn.Module, parallel: str, world: int) -> bool:
    """With ``parallel == "fsdp"`` and more than one rank: FSDP2 ``fully_shard`` on every block (each
    child of a ``ModuleList``: the built-in GPT's ``blocks``, a transformers model's ``layers``) and
    on the whole model, so parameters, gradients and AdamW state are sharded across the learner's
    ranks. Parameters become ``DTensor``s; :func:`ddiloco_geo.core.model.get_tensors` gathers them
    whole (every rank calls it at the same points: sends, keep_progress adoptions, the checkpoint).
    True if the model was sharded."""
    if parallel != "fsdp" or world == 1:
        return False
    from torch.distributed.fsdp import fully_shard  # only here: it imports torch.distributed.tensor (core/model.py)

    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                fully_shard(block)
    fully_shard(model)
    return True


def training_module(model: torch.nn.Module, *, replicate: bool, compile: bool) -> torch.nn.Module:
    """What a step calls: the model, wrapped in DDP when its ranks replicate it, and compiled with
    ``torch.compile`` when asked (the parameters stay the model's own: sends and adoptions read and
    write them directly)."""
    net = torch.nn.parallel.DistributedDataParallel(model) if replicate else model
    return torch.compile(net) if compile else net


def load_params(model: torch.nn.Module, tensors: dict[str, torch.Tensor] | None, world: int) -> None:
    """Rank 0's whole parameters (``tensors``, None on the other ranks) into every rank's model,
    replicated or sharded, one parameter at a time."""
    if world == 1:
        modelmod.set_tensors(model, tensors or {})
        return
    for name, param in model.named_parameters():
        t = tensors[name] if tensors is not None else torch.empty(param.shape, dtype=torch.float32)
        t = t.to(device=param.device, dtype=torch.float32)
        dist.broadcast(t, src=0)
        modelmod.set_tensors(model, {name: t})


def broadcast_tensor(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.broadcast(t, src=0)
    return t


def broadcast_object(obj: Any, world: int) -> Any:
    """Rank 0's object on every rank (a JSON-like plan; never bucket data on the wire)."""
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any, world: int) -> list:
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


def sync_control(adoptions: dict, stop: bool, position: int, rank: int, world: int,
                 plan: FragmentPlan, hold: set[int] | None = None) -> tuple[dict, bool, int, set[int]]:
    """Rank 0 tells every rank which fragment versions to adopt this step (and what the poller saw of
    this learner's step in their merges), whether to stop, where the step is on the learning-rate
    schedule and which fragments' sends wait (``hold``), so every rank does the same."""
    hold = set(hold or ())
    if world == 1:
        return adoptions, stop, position, hold
    P = plan.num_fragments
    ctrl = torch.full((3 * P + 2,), -1, dtype=torch.int64)
    if rank == 0:
        for p, (v, _, _, mine) in adoptions.items():
            ctrl[p], ctrl[P + 2 + p] = v, -2 if mine is None else mine
        ctrl[P], ctrl[P + 1] = int(stop), position
        for p in hold:
            ctrl[2 * P + 2 + p] = 1
    dist.broadcast(ctrl, src=0)
    out = {}
    for p in range(P):
        if ctrl[p] < 0:
            continue
        names = plan.fragments[p]
        if rank == 0:
            tensors = adoptions[p][1]
        else:
            tensors = {n: torch.empty(plan.shapes[n], dtype=torch.float32) for n in names}
        for n in names:
            dist.broadcast(tensors[n], src=0)
        mine = int(ctrl[P + 2 + p])
        out[p] = (int(ctrl[p]), tensors, adoptions[p][2] if rank == 0 else VectorClock(), None if mine == -2 else mine)
    return out, bool(ctrl[P].item()), int(ctrl[P + 1].item()), {p for p in range(P) if ctrl[2 * P + 2 + p] == 1}
