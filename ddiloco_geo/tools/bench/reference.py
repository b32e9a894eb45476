"""The trainers the quality benchmarks run, on exactly the learners' tokens.

- :func:`train_dp`: plain data-parallel: one AdamW step per global batch (the concatenation of the
  M learners' batches, read by the same shard readers the learners use), the learners' schedule;
- :func:`train_lockstep`: synchronous DiLoCo as the papers define it: M replicas, each H AdamW
  steps on its own shard from the same global model, then the pseudo-gradients (global − local)
  are merged with the product's merge (token-weighted RDA, weighted mean for embeddings), one
  outer step (the syncer's outer optimizer settings; at the end the replicas' models averaged under
  ``syncer.final_merge = average``, as the syncer merges final deltas), every replica restarts from
  the new global and keeps its AdamW state. Whole model, fp32, no bucket: the upper bound of what fragments,
  quantization and asynchrony can keep.

- :func:`train_harness`: Decoupled DiLoCo itself, the real learner and syncer code on the in-process
  harness (:class:`~ddiloco_geo.tools.inprocess.InProcessRun`, simulated time), with learner speeds
  and faults.

All evaluate the final model on the held-out slice every learner and the global model use (the
reference trainers can also record the eval loss at intermediate token counts).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco_geo.core import data as datamod
from ddiloco_geo.core import model as modelmod
from ddiloco_geo.core.outer import OuterOptimizer, merge_and_step, settings_kwargs
from ddiloco_geo.learner.data import eval_batches_for, make_reader
from ddiloco_geo.learner.schedule import lr_schedule
from ddiloco_geo.tools.inprocess import Fault, InProcessRun, LearnerSpeed


@dataclass
class Result:
    eval_loss: float
    tokens: int
    curve: list[tuple[int, float]] = field(default_factory=list)  # (tokens, eval loss)
    extra: dict[str, Any] = field(default_factory=dict)


class Data:
    """Per-learner readers (exactly the learners' slices) and the held-out eval batches, from
    settings; either kind of corpus (text, or ``tokens:`` shards)."""

    def __init__(self, settings, num_learners: int) -> None:
        d, b, n = settings.data, settings.model.block_size, settings.learner.batch_size
        self.readers = [make_reader(d, block_size=b, batch_size=n, seed=settings.model.seed + i, slice_index=i,
                                    num_slices=num_learners) for i in range(num_learners)]
        self.eval = eval_batches_for(d, block_size=b, batch_size=n)


def lr_scales(text: str, flag: str = "--dp-lr-scales") -> list[float]:
    """``--dp-lr-scales`` (or ``flag``): a comma list of positive multipliers of ``learner.lr``; SystemExit, saying
    what to give, for anything else."""
    try:
        scales = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        scales = []
    if not scales or not all(0 < s < float("inf") for s in scales):
        raise SystemExit(f"{flag} {text!r}: give a comma list of positive numbers (multipliers of "
                         "learner.lr), e.g. 0.5,0.75,1")
    return scales


def _optimizer(model: torch.nn.Module, cfg, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)


def _inner_step(model, opt, x, y, lr: float) -> float:
    for group in opt.param_groups:
        group["lr"] = lr
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def train_dp(settings, num_learners: int, *, lr_scale: float = 1.0, eval_every_tokens: int = 0,
             label: str = "dp") -> Result:
    """Data-parallel baseline; ``lr_scale`` multiplies the learners' peak learning rate."""
    cfg = settings.learner
    model = modelmod.build_model(settings.model)
    data = Data(settings, num_learners)
    opt = _optimizer(model, cfg, cfg.lr * lr_scale)
    tokens, curve, next_eval = 0, [], eval_every_tokens
    for step in range(cfg.max_steps):
        batches = [r.next_batch() for r in data.readers]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        loss = _inner_step(model, opt, x, y, lr_schedule(step, cfg.lr * lr_scale, cfg.warmup_steps, cfg.max_steps))
        tokens += sum(b[2] for b in batches)
        if eval_every_tokens and tokens >= next_eval:
            curve.append((tokens, datamod.evaluate(model, data.eval)))
            next_eval += eval_every_tokens
        if step % 200 == 0:
            print(f"bench: {label} step {step}/{cfg.max_steps} loss {loss:.3f}", file=sys.stderr, flush=True)
    final = datamod.evaluate(model, data.eval)
    return Result(final, tokens, curve + [(tokens, final)])


def train_lockstep(settings, num_learners: int, *, eval_every_tokens: int = 0, label: str = "lockstep") -> Result:
    """Synchronous DiLoCo over the whole model (see the module docstring)."""
    cfg, scfg = settings.learner, settings.syncer
    H = settings.fragments.sync_every
    global_model = modelmod.build_model(settings.model)
    names = [n for n, _ in global_model.named_parameters()]
    global_params = modelmod.get_tensors(global_model, names)
    replicas = [modelmod.build_model(settings.model) for _ in range(num_learners)]
    for r in replicas:
        modelmod.set_tensors(r, global_params)
    opts = [_optimizer(r, cfg, cfg.lr) for r in replicas]
    okw = settings_kwargs(scfg)
    outer = OuterOptimizer(**okw)
    is_emb = modelmod.embedding_rule(settings.model)
    data = Data(settings, num_learners)
    tokens, curve, next_eval, counts = 0, [], eval_every_tokens, [0] * num_learners
    for step in range(cfg.max_steps):
        lr = lr_schedule(step, cfg.lr, cfg.warmup_steps, cfg.max_steps)
        for m, (r, o, reader) in enumerate(zip(replicas, opts, data.readers)):
            x, y, n = reader.next_batch()
            loss = _inner_step(r, o, x, y, lr)
            tokens += n
            counts[m] += n
        if (step + 1) % H == 0 or step + 1 == cfg.max_steps:
            pgs = [{n: global_params[n] - t for n, t in modelmod.get_tensors(r, names).items()} for r in replicas]
            weights = [c * c / (H if (step + 1) % H == 0 else (step + 1) % H) for c in counts]
            final = step + 1 == cfg.max_steps and scfg.final_merge == "average"  # as the syncer merges final deltas
            global_params, outer = merge_and_step(global_params, outer, pgs, weights, is_emb, okw, final=final)
            for r in replicas:
                modelmod.set_tensors(r, global_params)
            counts = [0] * num_learners
        if eval_every_tokens and tokens >= next_eval:
            modelmod.set_tensors(global_model, global_params)
            curve.append((tokens, datamod.evaluate(global_model, data.eval)))
            next_eval += eval_every_tokens
        if step % 200 == 0:
            print(f"bench: {label} step {step}/{cfg.max_steps} loss {loss:.3f}", file=sys.stderr, flush=True)
    modelmod.set_tensors(global_model, global_params)
    final = datamod.evaluate(global_model, data.eval)
    return Result(final, tokens, curve + [(tokens, final)])


def hetero_speeds(num_learners: int) -> list[LearnerSpeed]:
    """The paper's heterogeneous-hardware setting: half at full speed, half 18% slower, 10% jitter."""
    return [LearnerSpeed(1.0 if i % 2 == 0 else 1.18, 0.10) for i in range(num_learners)]


def train_harness(settings, speeds: list[LearnerSpeed], *, seed: int, faults: list[Fault] | None = None,
                  label: str = "ddiloco") -> dict[str, Any]:
    """Decoupled DiLoCo on the in-process harness; the global model's eval loss and the run's counters."""
    run = InProcessRun(settings, speeds, seed=seed, faults=faults)
    try:
        print(f"bench: {label} ({settings.learner.max_steps} steps x {len(speeds)} learners)", file=sys.stderr,
              flush=True)
        steps = settings.learner.max_steps
        status = run.run(progress=lambda step: print(f"bench: {label} step {step}/{steps} (learner 0)",
                                                     file=sys.stderr, flush=True))
        model = modelmod.build_model(settings.model)
        modelmod.set_tensors(model, run.global_params())
        c = status["counters"]
        return {
            "eval_loss": datamod.evaluate(model, eval_batches_for(settings.data, block_size=settings.model.block_size,
                                                                  batch_size=settings.learner.batch_size)),
            "tokens": run.tokens_total(),
            "merges": c["merges"], "mean_contributors": c["contributors_total"] / max(1, c["merges"]),
            "deltas_merged": c["deltas_merged"], "deltas_rejected": c["deltas_rejected"],
            "contributions_clipped": c.get("contributions_clipped", 0), "simulated_s": run.now,
            "stale_share": c["stale_contributions"] / max(1, c["deltas_merged"]),
            "discarded_fragment_steps_ratio": run.discarded_ratio(), "out_of_step_ratio": run.out_of_step_ratio(),
        }
    finally:
        run.close()
