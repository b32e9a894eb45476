"""The outer optimizer: SGD with (Nesterov) momentum on one fragment's global parameters.

Decoupled DiLoCo keeps one outer-optimizer state per fragment, in fp32, on the syncer
(PAPER-NOTES.md §4.3 step 7 and §5 items 1-2). With ``pseudo_grad = global - local`` (merged
across learners by :mod:`ddiloco_geo.core.merge`)::

    buf    <- momentum * buf + pseudo_grad
    global <- global - lr * (pseudo_grad + momentum * buf)     # nesterov=True
    global <- global - lr * buf                                # nesterov=False

This is exactly ``torch.optim.SGD(lr, momentum, nesterov, dampening=0)`` fed ``pseudo_grad`` as the
gradient (pinned by a test), once past the warm-up.

``warmup`` (``syncer.outer_warmup``, in outer steps of the fragment): the step with ``num_steps = k``
uses ``r = min(1, k / warmup)`` of the way from plain averaging to the configured optimizer,
``lr_k = 1 + (lr - 1) r`` and ``momentum_k = momentum r``: the first merge takes the learners' mean,
and the momentum builds up only as the run leaves its first phase, where the pseudo-gradients turn
fast and momentum carries stale directions (plain averaging wins short runs, Nesterov the full
budget: docs/benchmarks.md). ``num_steps`` is in the state, so a restarted syncer and ``replay``
continue the same ramp. The sign matters: ``pseudo_grad`` points from the learners to the
global, so the descent step moves the global toward the learners. Defaults are DiLoCo's
(lr 0.7, momentum 0.9); the Decoupled DiLoCo paper publishes none.

``step`` never mutates its inputs (unless told it may consume the pseudo-gradient); the momentum
buffers start at zero and are created on the first step (or from ``shapes``). A step is four
``torch._foreach_*`` ops over the fragment's tensors, the ones ``SGD(foreach=True)`` runs, in fp32:
element-wise and exactly rounded, so no float64 is needed and the bits do not depend on the thread
count. ``state_dict`` holds ``momentum.<name>`` fp32 tensors and a ``num_steps`` int64 scalar.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ddiloco_geo.core import merge

MOMENTUM_PREFIX = "momentum."
NUM_STEPS_KEY = "num_steps"


def settings_kwargs(cfg: Any) -> dict[str, Any]:
    """The optimizer's keyword arguments from a ``SyncerConfig`` (``syncer.outer_lr``,
    ``outer_momentum``, ``nesterov``, ``outer_warmup``): what a merge record names under ``outer``."""
    return {"lr": cfg.outer_lr, "momentum": cfg.outer_momentum, "nesterov": cfg.nesterov, "warmup": cfg.outer_warmup}


class OuterOptimizer:
    def __init__(
        self,
        lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
        shapes: dict[str, tuple[int, ...]] | None = None,
        warmup: int = 0,
    ) -> None:
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"outer lr={lr} must be a positive number")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"outer momentum={momentum} must be in [0, 1)")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"outer warmup={warmup!r} must be an int >= 0")
        self.lr, self.momentum, self.nesterov, self.warmup = float(lr), float(momentum), bool(nesterov), warmup
        self.num_steps = 0
        self._bufs: dict[str, torch.Tensor] | None = None
        if shapes is not None:
            self._bufs = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}

    def effective(self) -> tuple[float, float]:
        """(lr, momentum) of the next step: the configured ones past the warm-up."""
        if not self.warmup or self.num_steps >= self.warmup:
            return self.lr, self.momentum
        r = self.num_steps / self.warmup
        return 1.0 + (self.lr - 1.0) * r, self.momentum * r

    def ramp_record(self) -> dict[str, dict[str, float]]:
        """For the merge record of the next step: ``{"outer_step": {"lr", "momentum"}}`` while it is
        inside the warm-up, else nothing (the record's ``outer`` says the rest)."""
        if self.num_steps >= self.warmup:
            return {}
        return {"outer_step": dict(zip(("lr", "momentum"), self.effective()))}

    def _check_names(self, tensors: dict[str, torch.Tensor], what: str) -> None:
        assert self._bufs is not None
        if set(tensors) != set(self._bufs):
            raise ValueError(f"{what} has tensors {sorted(tensors)}, the optimizer state has {sorted(self._bufs)}")
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(self._bufs[name].shape):
                raise ValueError(f"{what}: {name} has shape {tuple(t.shape)}, expected {tuple(self._bufs[name].shape)}")

    def step(self, params: dict[str, torch.Tensor], pseudo_grad: dict[str, torch.Tensor], *,
             consume: bool = False) -> dict[str, torch.Tensor]:
        """New fp32 global parameters after one outer step; inputs are left unchanged, except that
        with ``consume`` the fp32 CPU ``pseudo_grad`` tensors are overwritten (Nesterov's look-ahead
        is computed in them instead of in fresh memory)."""
        if set(params) != set(pseudo_grad):
            raise ValueError(f"params {sorted(params)} and pseudo_grad {sorted(pseudo_grad)} name different tensors")
        for name in params:
            if params[name].shape != pseudo_grad[name].shape:
                raise ValueError(f"{name}: params shape {tuple(params[name].shape)} != pseudo_grad shape {tuple(pseudo_grad[name].shape)}")
        if not self._bufs:  # no momentum yet (a fresh optimizer, or only final merges so far)
            self._bufs = {name: torch.zeros(p.shape, dtype=torch.float32) for name, p in params.items()}
        self._check_names(params, "params")
        names = list(params)
        deltas = [pseudo_grad[n].detach().to("cpu", torch.float32) for n in names]
        bufs = [self._bufs[n] for n in names]
        lr, momentum = self.effective()
        # the ops and their order are torch.optim.SGD's (foreach=True), so the bits are its bits
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, deltas)
        if self.nesterov:
            if consume:
                torch._foreach_add_(deltas, bufs, alpha=momentum)
                update = deltas
            else:
                update = torch._foreach_add(deltas, bufs, alpha=momentum)
        else:
            update = bufs
        stepped = torch._foreach_add([params[n].detach().to("cpu", torch.float32) for n in names], update,
                                     alpha=-lr)
        self.num_steps += 1
        return dict(zip(names, stepped))

    def copy(self, **hyperparameters: Any) -> OuterOptimizer:
        """An independent optimizer in the same state (one copy of the momentum buffers), with
        ``hyperparameters`` (lr, momentum, nesterov, warmup) replacing this one's where given."""
        twin = OuterOptimizer(**{"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov,
                                 "warmup": self.warmup, **hyperparameters})
        if self._bufs is not None:
            twin._bufs = dict(zip(self._bufs, [b.clone() for b in self._bufs.values()]))
        twin.num_steps = self.num_steps
        return twin

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {MOMENTUM_PREFIX + name: buf.clone() for name, buf in (self._bufs or {}).items()}
        state[NUM_STEPS_KEY] = torch.tensor(self.num_steps, dtype=torch.int64)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore buffers and the step count; names and shapes must match any existing state."""
        if NUM_STEPS_KEY not in state:
            raise ValueError(f"outer optimizer state lacks {NUM_STEPS_KEY!r}")
        unknown = [k for k in state if k != NUM_STEPS_KEY and not k.startswith(MOMENTUM_PREFIX)]
        if unknown:
            raise ValueError(f"outer optimizer state has unknown keys {unknown}")
        bufs = {k[len(MOMENTUM_PREFIX):]: v.detach().to("cpu", torch.float32, copy=True) for k, v in state.items() if k != NUM_STEPS_KEY}
        num_steps = int(state[NUM_STEPS_KEY])
        if num_steps < 0:
            raise ValueError(f"num_steps={num_steps} must be >= 0")
        if any(not torch.isfinite(b).all() for b in bufs.values()):
            raise ValueError("outer optimizer state has non-finite momentum")
        if not bufs:  # no momentum yet (a fresh optimizer, or only final merges so far): zero momentum
            for buf in (self._bufs or {}).values():
                buf.zero_()
        else:
            if self._bufs is not None:
                self._check_names(bufs, "loaded state")
            self._bufs = bufs
        self.num_steps = num_steps


def merge_and_step(params: dict[str, torch.Tensor], outer: OuterOptimizer, anchored: list[dict[str, torch.Tensor]],
                   weights: list[float], is_embedding: Callable[[str], bool],
                   outer_kwargs: dict[str, Any], robust: str = "none",
                   trim_ratio: float = 0.25, sparse: str = "dense",
                   final: float = 0.0) -> tuple[dict[str, torch.Tensor], OuterOptimizer]:
    """Token-weighted RDA (mean for embeddings), a robust average, or the per-index mean of sparse
    deltas (:func:`ddiloco_geo.core.merge.merge_fragment`); then one outer Nesterov step
    on a copy of ``outer`` (with ``outer_kwargs``' hyperparameters, ``outer``'s momentum and step
    count). The merged pseudo-gradient lives in the merge's reused buffer and is consumed there.

    ``final`` > 0 (a merge of learners' final deltas, ``syncer.final_merge = average``): the models are
    averaged instead, the weighted mean for every tensor (not RDA, whose norm-preserving step goes past
    the mean of the models) applied at lr ``final`` (1: in full; below 1, a later learner joining the
    average of the models merged before, :func:`ddiloco_geo.syncer.rounds.final_share`), and the
    momentum is left as it was (nothing more to accelerate; a run extended later goes on with it)."""
    delta = merge.merge_fragment(anchored, weights, (lambda _name: True) if final else is_embedding, robust=robust,
                                 trim_ratio=trim_ratio, sparse=sparse, reuse_buffer=True)
    stepped = outer.copy(**outer_kwargs)
    if not final:
        return stepped.step(params, delta, consume=True), stepped
    names = list(params)
    stepped.num_steps += 1
    return dict(zip(names, torch._foreach_sub([params[n].detach().to("cpu", torch.float32) for n in names],
                                              [delta[n] for n in names], alpha=float(final)))), stepped
