"""Merging learners' pseudo-gradients for one fragment: token weights, RDA, weighted mean.

Decoupled DiLoCo (arXiv 2604.21428), sections 4.6 and 4.7 of PAPER-NOTES.md. Pure tensor math.

1. **Weights** (§4.6). Learner m's weight for fragment p is ``w = tokens * (tokens / steps)`` with
   both counters measured since m last received p: "quantity" times "quality" (tokens per inner
   step). A learner with no steps or no tokens has weight 0.
2. **Pseudo-gradients** ``pseudo_grad_m = base - local_m`` are anchored by the caller at the
   syncer's own current global value (§5.1, :func:`anchor`); this module combines them.
3. **Radial-Directional Averaging** (§4.7), per tensor, for every tensor that is not an embedding::

       phi(x) = x / ||x||,  phi(0) = 0
       RDA(v, w) = (sum w ||v|| / sum w) * phi(sum w phi(v) / sum w)

   Why: the learners' pseudo-gradients are nearly orthogonal, so a plain mean of M vectors of norm
   R has norm about R / sqrt(M) and the outer step would shrink as learners join (forcing the
   outer lr to be retuned with M). RDA averages magnitudes and directions separately, so M
   equal-norm vectors merge to norm R whatever M is.
4. **Embeddings** (names matched by ``is_embedding``, e.g. ``wte``/``wpe``/``lm_head``) use the
   weighted mean: their pseudo-gradients are not near-orthogonal (the paper's primary setup).

5. **Sparse deltas** (``sparse="per_index"``, for the ``topk`` codec): each coordinate is the
   token-weighted mean over the contributors that sent it (a non-zero value there), 0 where none
   did; SparseLoCo's aggregation (arXiv 2508.15706). A dense mean of top-k deltas (or RDA, which
   keeps the mean norm) divides a value kept by one learner of M by about M even though the
   others' values for it are still in their residuals; per-index averaging moves each sent
   coordinate by what its senders agree on. It treats a value quantized to exactly 0 as not
   sent, which top-k's ternary values never are (a kept value is +-scale) but int4's can be, so
   it is meant for sparse codecs only.

Degenerate direction: when the mean direction's norm falls below ``DEGENERATE_RATIO`` times the
weighted share of non-zero contributors (e.g. ``v`` and ``-v`` with equal weights), its
direction is numerically meaningless and RDA falls back to the weighted mean.

**How it runs** (the syncer's hot path). A fragment's tensors are laid out once per learner in a
padded buffer of rows of ``ROW`` values (each tensor starts on a row; this thread's buffer is
reused, since fresh multi-MB buffers cost more in page faults than the arithmetic; the results
are copied out of it unless the caller asks for views, as the outer step does). Then every
step is one torch op over all learners and tensors: row norms, per-tensor norms as segment sums
of rows, one coefficient per (learner, tensor) expanded to rows (``w / (W ||v||)`` for RDA,
``w / W`` for embeddings), one scaled sum over learners, the direction's norms, one rescale. The
only Python loops are over learners; a per-tensor loop runs only for a degenerate tensor.

**Numerics.** Element-wise work is float32: every output value is a sum of M float32 products,
a few ulps from the float64 result, far below the int4 wire's error. Float64 is used where it
matters, on scalars: the squared row norms are summed per tensor in float64 (a tensor's norm over
millions of values would lose digits in float32), and weights, radii and coefficients are float64
until each is rounded once to float32. Every reduction has a fixed order whatever the thread
count (rows of ``ROW`` values are reduced one row per thread; segment sums run in row order), and
element-wise ops are exactly rounded, so a merge is bit-for-bit reproducible: ``replay`` depends
on it (tests/ops/test_replay.py). A single contributor (or a single one with positive weight)
returns an fp32 copy of its own pseudo-gradient exactly. Invalid inputs raise ValueError.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

import torch

DEGENERATE_RATIO = 1e-6
ROW = 1024  # values per row of the merge buffer: a row is reduced by one thread, in one fixed order
EPS = 1e-12  # a pseudo-gradient whose norm is at most this has no direction (phi(0) = 0)


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


# --- the vectorised merge ------------------------------------------------------------------------


class _Layout:
    """Where each tensor's values sit in a padded buffer of rows of ``ROW`` values."""

    def __init__(self, shapes: Sequence[torch.Size]) -> None:
        self.shapes = list(shapes)
        self.numels = [math.prod(s) for s in self.shapes]
        rows = [max(1, -(-n // ROW)) for n in self.numels]
        self.starts = [0]
        for r in rows[:-1]:
            self.starts.append(self.starts[-1] + r * ROW)
        self.num_rows = sum(rows)
        self.segment = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows))
        self.has_padding = any(n != r * ROW for n, r in zip(self.numels, rows))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's values in ``flat`` (one buffer of ``num_rows * ROW``), in its shape."""
        return [flat[s:s + n].view(shape) for s, n, shape in zip(self.starts, self.numels, self.shapes)]


    def pads(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The padding after each tensor that does not end on a row boundary."""
        ends = self.starts[1:] + [self.num_rows * ROW]
        return [flat[s + n:e] for s, n, e in zip(self.starts, self.numels, ends) if s + n < e]

    def segment_sums(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-tensor float64 sums of ``rows`` (``[..., num_rows]``), added in row order."""
        out = torch.zeros((*rows.shape[:-1], len(self.shapes)), dtype=torch.float64)
        return out.index_add_(-1, self.segment, rows.to(torch.float64))


_LOCAL = threading.local()


def _buffer(num_values: int) -> torch.Tensor:
    """This thread's merge buffer, at least ``num_values`` float32 long, reused between merges."""
    buf = getattr(_LOCAL, "buffer", None)
    if buf is None or buf.numel() < num_values:
        buf = _LOCAL.buffer = torch.empty(num_values, dtype=torch.float32)
    return buf[:num_values]


def _norms(lay: _Layout, x: torch.Tensor) -> torch.Tensor:
    """Per-tensor L2 norms (float64) of ``x`` (``[..., num_rows, ROW]``, padding zero)."""
    return lay.segment_sums(torch.linalg.vector_norm(x, dim=-1).to(torch.float64).square_()).sqrt_()


def _merge(columns: list[list[torch.Tensor]], ws: list[float], is_emb: list[bool], *,
           reuse: bool, eps: float = EPS) -> list[torch.Tensor]:
    """The merged tensors of ``columns[m][t]`` (learner m, tensor t): RDA, or the weighted mean
    where ``is_emb[t]``. With ``reuse`` the results are views of this thread's buffer."""
    lay = _Layout([v.shape for v in columns[0]])
    total = sum(ws)
    live = [m for m, w in enumerate(ws) if w > 0]
    flat = _buffer(len(live) * lay.num_rows * ROW)
    x = flat.view(len(live), lay.num_rows, ROW)
    rows = [x[i].view(-1) for i in range(len(live))]
    if lay.has_padding:
        torch._foreach_zero_([pad for r in rows for pad in lay.pads(r)])
    torch._foreach_copy_([dst for r in rows for dst in lay.views(r)],
                         [columns[m][t] for m in live for t in range(len(lay.shapes))])
    acc = x[0]
    if len(live) == 1:  # a sole contributor: its own pseudo-gradient, exactly
        return lay.views(acc.reshape(-1) if reuse else acc.reshape(-1).clone())
    w = torch.tensor([ws[m] for m in live], dtype=torch.float64)[:, None]
    norms = _norms(lay, x)                                               # [M, T]
    emb = torch.tensor(is_emb)
    has_dir = norms > eps
    radius = (w * norms).sum(0) / total
    live_share = (w * has_dir).sum(0) / total
    coef = torch.where(emb, w / total, torch.where(has_dir, w / (total * norms), 0.0))
    x.mul_(coef[:, lay.segment].to(torch.float32)[..., None])
    for i in range(1, len(live)):
        acc.add_(x[i])
    dir_norm = _norms(lay, acc)                                          # [T]
    degenerate = ~emb & (live_share > 0) & (dir_norm < DEGENERATE_RATIO * live_share)
    scale = torch.where(emb, 1.0, torch.where(live_share > 0, radius / dir_norm, 0.0))
    scale = torch.where(degenerate, 1.0, scale)
    acc.mul_(scale[lay.segment].to(torch.float32)[:, None])
    out = lay.views(acc.view(-1))
    for t in degenerate.nonzero().flatten().tolist():  # rare: the direction cancelled out
        _weighted_mean_into(out[t], [columns[m][t] for m in live], [ws[m] / total for m in live])
    return out if reuse else lay.views(acc.reshape(-1).clone())


def _weighted_mean_into(out: torch.Tensor, vectors: list[torch.Tensor], coefs: list[float]) -> None:
    torch.mul(vectors[0], coefs[0], out=out)
    for v, c in zip(vectors[1:], coefs[1:]):
        out.add_(torch.mul(v, c))


def _as_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float32)


def weighted_mean(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum w v / sum w`` as a new float32 tensor."""
    ws = _check_weights(weights, len(vectors))
    _check_shapes(vectors)
    return _merge([[_as_fp32(v)] for v in vectors], ws, [True], reuse=False)[0]


def rda(vectors: Sequence[torch.Tensor], weights: Sequence[float], eps: float = EPS) -> torch.Tensor:
    """Radial-Directional Averaging (see the module docstring) as a new float32 tensor.

    A vector whose norm is at most ``eps`` counts as zero: it adds to the radius average but has
    no direction (phi(0) = 0).
    """
    ws = _check_weights(weights, len(vectors))
    _check_shapes(vectors)
    return _merge([[_as_fp32(v)] for v in vectors], ws, [False], reuse=False, eps=eps)[0]


SPARSE_MODES = ("dense", "per_index")


def per_index_mean(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Per coordinate, ``sum w v / sum of w over the contributors whose v is non-zero there`` (0
    where every v is 0), as a new float32 tensor; see the module docstring (5). Contributors are
    added in order, so the result is reproducible bit for bit."""
    ws = _check_weights(weights, len(vectors))
    _check_shapes(vectors)
    total = sum(ws)
    num = torch.zeros(vectors[0].shape, dtype=torch.float32)
    den = torch.zeros_like(num)
    for v, w in zip(vectors, ws):
        if w > 0:
            x = _as_fp32(v)
            num.add_(x, alpha=w / total)
            den.add_((x != 0).to(torch.float32), alpha=w / total)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float32).tiny), 0.0)


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
    *,
    sparse: str = "dense",
    reuse_buffer: bool = False,
) -> dict[str, torch.Tensor]:
    """One merged pseudo-gradient per tensor: RDA, or the weighted mean for embeddings; with
    ``robust`` set, a coordinate-wise robust average for every tensor instead; otherwise with
    ``sparse="per_index"``, :func:`per_index_mean` for every tensor.

    With ``reuse_buffer`` the results are views of this thread's merge buffer, valid until the next
    merge on this thread (the outer step consumes them at once); otherwise they are new tensors."""
    ws = _check_weights(weights, len(pseudo_grads))
    names = list(pseudo_grads[0])
    for i, pg in enumerate(pseudo_grads[1:], start=1):
        if set(pg) != set(names):
            raise ValueError(f"contributor {i} has tensors {sorted(pg)}, contributor 0 has {sorted(names)}")
    columns = [[_as_fp32(pg[name]) for name in names] for pg in pseudo_grads]
    for t, name in enumerate(names):
        try:
            _check_shapes([col[t] for col in columns])
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    if robust != "none":
        return {name: robust_mean([col[t] for col in columns], robust, trim_ratio) for t, name in enumerate(names)}
    if sparse == "per_index":
        return {name: per_index_mean([col[t] for col in columns], ws) for t, name in enumerate(names)}
    if sparse != "dense":
        raise ValueError(f"sparse mode {sparse!r}: expected one of {SPARSE_MODES}")
    merged = _merge(columns, ws, [bool(is_embedding(n)) for n in names], reuse=reuse_buffer)
    return dict(zip(names, merged))


def anchor(current: dict[str, torch.Tensor], base: dict[str, torch.Tensor],
           pseudo_grad: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Δ = Θ_current − θ_learner with θ_learner = Θ_base − pseudo_grad (Appendix D.2 anchoring).

    A delta on the current version (``base`` holds the current tensors themselves, as the syncer's
    history does) is its own anchor, Δ = pseudo_grad: nothing is computed or copied."""
    names = list(current)
    if all(current[n] is base[n] for n in names):
        return {n: pseudo_grad[n] for n in names}
    diff = torch._foreach_sub([current[n] for n in names], [base[n] for n in names])
    torch._foreach_add_(diff, [pseudo_grad[n] for n in names])
    return dict(zip(names, diff))
