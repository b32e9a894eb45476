"""Merging learners' pseudo-gradients for one fragment: token weights, RDA, weighted mean.

Decoupled DiLoCo (arXiv 2604.21428), sections 4.6 and 4.7 of PAPER-NOTES.md. Pure tensor math.

1. **Weights** (§4.6). Learner m's weight for fragment p is ``w = tokens * (tokens / steps)`` with
   both counters measured since m last received p: "quantity" times "quality" (tokens per inner
   step). A learner with no steps or no tokens has weight 0.
2. **Pseudo-gradients** ``pseudo_grad_m = base - local_m`` are anchored by the caller at the
   syncer's own current global value (§5.1); this module only combines them.
3. **Radial-Directional Averaging** (§4.7), per tensor, for every tensor that is not an embedding::

       phi(x) = x / ||x||,  phi(0) = 0
       RDA(v, w) = (sum w ||v|| / sum w) * phi(sum w phi(v) / sum w)

   Why: the learners' pseudo-gradients are nearly orthogonal, so a plain mean of M vectors of norm
   R has norm about R / sqrt(M) and the outer step would shrink as learners join (forcing the
   outer lr to be retuned with M). RDA averages magnitudes and directions separately, so M
   equal-norm vectors merge to norm R whatever M is.
4. **Embeddings** (names matched by ``is_embedding``, e.g. ``wte``/``wpe``/``lm_head``) use the
   weighted mean: their pseudo-gradients are not near-orthogonal (the paper's primary setup).

Degenerate direction: when the mean direction's norm falls below ``DEGENERATE_RATIO`` times the
weighted share of non-zero contributors (e.g. ``v`` and ``-v`` with equal weights), its
direction is numerically meaningless and RDA falls back to the weighted mean.

Numerics: inputs are cast to float64 for the accumulation and the result is float32 on CPU.
A single contributor (or a single one with positive weight) returns an fp32 copy of its own
pseudo-gradient exactly. Invalid inputs raise ValueError.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

DEGENERATE_RATIO = 1e-6


def token_weight(num_tokens: int, num_steps: int) -> float:
    """``tokens * (tokens / steps)``; 0 when either counter is 0."""
    if num_tokens < 0 or num_steps < 0:
        raise ValueError(f"counters must be non-negative, got tokens={num_tokens}, steps={num_steps}")
    if num_tokens == 0 or num_steps == 0:
        return 0.0
    return float(num_tokens) * (float(num_tokens) / float(num_steps))


def _check_weights(weights: Sequence[float], num_vectors: int) -> list[float]:
    if num_vectors == 0:
        raise ValueError("nothing to merge: no contributors")
    if len(weights) != num_vectors:
        raise ValueError(f"{len(weights)} weights for {num_vectors} contributors")
    ws = [float(w) for w in weights]
    if any(not math.isfinite(w) or w < 0 for w in ws):
        raise ValueError(f"weights must be finite and non-negative, got {ws}")
    if sum(ws) <= 0:
        raise ValueError(f"weights must have a positive sum, got {ws}")
    return ws


def _check_shapes(vectors: Sequence[torch.Tensor]) -> None:
    shape = vectors[0].shape
    for v in vectors[1:]:
        if v.shape != shape:
            raise ValueError(f"shape mismatch: {tuple(v.shape)} != {tuple(shape)}")


def _sole_contributor(vectors: Sequence[torch.Tensor], ws: list[float]) -> torch.Tensor | None:
    positive = [i for i, w in enumerate(ws) if w > 0]
    if len(positive) == 1:
        return vectors[positive[0]].detach().to(device="cpu", dtype=torch.float32, copy=True)
    return None


def weighted_mean(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum w v / sum w``, accumulated in float64, returned as float32."""
    ws = _check_weights(weights, len(vectors))
    _check_shapes(vectors)
    sole = _sole_contributor(vectors, ws)
    if sole is not None:
        return sole
    return _weighted_mean64(vectors, ws).to(torch.float32)


def _weighted_mean64(vectors: Sequence[torch.Tensor], ws: list[float]) -> torch.Tensor:
    total = sum(ws)
    acc = torch.zeros(vectors[0].shape, dtype=torch.float64)
    for v, w in zip(vectors, ws):
        if w > 0:
            acc.add_(v.detach().to("cpu", torch.float64), alpha=w / total)
    return acc


def rda(vectors: Sequence[torch.Tensor], weights: Sequence[float], eps: float = 1e-12) -> torch.Tensor:
    """Radial-Directional Averaging (see the module docstring); float32 result.

    A vector whose norm is at most ``eps`` counts as zero: it adds to the radius average but has
    no direction (phi(0) = 0).
    """
    ws = _check_weights(weights, len(vectors))
    _check_shapes(vectors)
    sole = _sole_contributor(vectors, ws)
    if sole is not None:
        return sole
    total = sum(ws)
    radius = 0.0
    direction = torch.zeros(vectors[0].shape, dtype=torch.float64)
    live_share = 0.0  # weighted share of non-zero vectors: the norm the mean direction would have if they agreed
    for v, w in zip(vectors, ws):
        if w == 0:
            continue
        v64 = v.detach().to("cpu", torch.float64)
        norm = float(torch.linalg.vector_norm(v64))
        radius += w * norm / total
        if norm > eps:
            direction.add_(v64, alpha=w / (total * norm))
            live_share += w / total
    dir_norm = float(torch.linalg.vector_norm(direction))
    if live_share == 0.0:
        return torch.zeros(vectors[0].shape, dtype=torch.float32)
    if dir_norm < DEGENERATE_RATIO * live_share:
        return _weighted_mean64(vectors, ws).to(torch.float32)
    return direction.mul_(radius / dir_norm).to(torch.float32)


ROBUST_MODES = ("none", "trimmed_mean", "median")


def robust_mean(vectors: Sequence[torch.Tensor], mode: str, trim_ratio: float = 0.25) -> torch.Tensor:
    """Coordinate-wise robust average for untrusted learners, unweighted (weights are claims a
    malicious learner controls): ``median``, or ``trimmed_mean`` dropping ``floor(trim_ratio·M)``
    values at each end of every coordinate (the median when that leaves nothing)."""
    stacked = torch.stack([v.to(torch.float32) for v in vectors])
    if mode == "median":
        return stacked.median(dim=0).values if len(vectors) % 2 else stacked.quantile(0.5, dim=0)
    if mode != "trimmed_mean":
        raise ValueError(f"robust mode {mode!r}: expected one of {ROBUST_MODES}")
    k = int(trim_ratio * len(vectors))
    if len(vectors) - 2 * k < 1:
        return robust_mean(vectors, "median")
    ordered = stacked.sort(dim=0).values
    return ordered[k:len(vectors) - k].mean(dim=0)


def merge_fragment(
    pseudo_grads: Sequence[dict[str, torch.Tensor]],
    weights: Sequence[float],
    is_embedding: Callable[[str], bool],
    robust: str = "none",
    trim_ratio: float = 0.25,
) -> dict[str, torch.Tensor]:
    """One merged pseudo-gradient per tensor: RDA, or the weighted mean for embeddings; with
    ``robust`` set, a coordinate-wise robust average for every tensor instead."""
    ws = _check_weights(weights, len(pseudo_grads))
    names = list(pseudo_grads[0])
    for i, pg in enumerate(pseudo_grads[1:], start=1):
        if set(pg) != set(names):
            raise ValueError(f"contributor {i} has tensors {sorted(pg)}, contributor 0 has {sorted(names)}")
    out = {}
    for name in names:
        vectors = [pg[name] for pg in pseudo_grads]
        try:
            _check_shapes(vectors)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if robust != "none":
            out[name] = robust_mean(vectors, robust, trim_ratio)
        else:
            out[name] = weighted_mean(vectors, ws) if is_embedding(name) else rda(vectors, ws)
    return out


def anchor(current: dict[str, torch.Tensor], base: dict[str, torch.Tensor],
           pseudo_grad: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Δ = Θ_current − θ_learner with θ_learner = Θ_base − pseudo_grad (Appendix D.2 anchoring)."""
    return {n: (current[n] - base[n]) + pseudo_grad[n] for n in current}
