"""The codecs: how a float tensor is stored on the wire and restored (pure tensor code, no I/O).

Quantize only on the wire; decode always yields contiguous float32 of the original shape:

- ``fp32``: stored as-is under ``<name>``; exact.
- ``bf16``: stored under ``<name>`` as bfloat16 (round-to-nearest-even); relative error <= 2^-9.
- ``int8``: blockwise symmetric absmax. The tensor is flattened and zero-padded to a multiple of
  ``block_size`` (default 128). Per block: ``scale = absmax / 127`` (float32), ``q =
  round_half_even(x * (127 / absmax))`` in [-127, 127] (an all-zero block has scale +0 and q 0; a
  block so small that ``127 / absmax`` overflows float32, absmax below about 4e-37, has q 0).
  Stored as ``<name>:q`` (int8, ``[num_blocks * block_size]``) and ``<name>:scale`` (float32,
  ``[num_blocks]``). Decoded ``q * scale``; error <= scale / 2 per block.
- ``int4``: as int8 with 7 instead of 127 (q in [-7, 7]) and two values per byte: within each
  block, byte ``j`` holds value ``j`` in its low nibble and value ``j + block_size / 2`` in its high
  nibble, both two's complement. ``<name>:q`` is uint8 ``[num_blocks * block_size / 2]``.
  Scales stay float32: 4 bytes per 128 values, so the wire is 0.125 + 0.0078 = 0.133 of fp32 plus
  a header of a few hundred bytes per tensor (well under the 0.14 budget for a fragment of tens of
  MB), and a scale never rounds below the block's absmax (which would break the error bound).

Rounding is round-to-nearest (no stochastic rounding). On CPU, int8/int4 run in fused C kernels
(``native``: one pass per block, bit-identical, the whole tensor in one call) when a C compiler is
there, else as whole-tensor torch ops over cache-sized chunks with reused scratch buffers (fresh
multi-MB temporaries cost page faults that dwarf the arithmetic). The caller hashes the codes as
they are finished. On an accelerator the same ops run on the device and only the quantized
bytes come back.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Literal, get_args

import torch

from ddiloco_geo.codec import native
from ddiloco_geo.core.errors import CodecError

Codec = Literal["fp32", "bf16", "int8", "int4", "topk"]
CODECS: tuple[Codec, ...] = get_args(Codec)  # the one list of codec names (settings, CLI, bench)
QMAX = {"int8": 127, "int4": 7}  # the quantized codecs and their largest code
DEFAULT_BLOCK_SIZE = 128
MAX_BLOCK_SIZE = 1 << 16

# CPU quantizer chunk: 1 Mi values (4 MiB of fp32) measured best on a 2-core EPYC (1 MiB L2/core).
_CHUNK_VALUES = 1 << 20


def resolve_block_size(codec: str, block_size: int) -> int:
    """The block size written to the header: 0 for fp32/bf16, ``block_size`` or the default else."""
    if codec not in QMAX:
        return 0
    block_size = block_size or DEFAULT_BLOCK_SIZE
    if type(block_size) is not int or not (2 <= block_size <= MAX_BLOCK_SIZE) or block_size % 2:
        raise ValueError(f"block_size {block_size!r}: use an even number in [2, {MAX_BLOCK_SIZE}]")
    return block_size


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``: its max and min are finite (both reductions propagate NaN; an Inf is
    the max or the min). Two reductions that read ``t`` once each, about ten times faster on CPU
    than ``torch.isfinite(t).all()``, which writes a mask of the whole tensor first."""
    return t.numel() == 0 or (math.isfinite(float(t.amax())) and math.isfinite(float(t.amin())))


NONFINITE_SCALE, NEGATIVE_SCALE = 1, 2


def scale_problems(scale: torch.Tensor, qmax: float) -> int:
    """A bitmask of what is wrong with float32 ``scale``: ``NONFINITE_SCALE`` if some ``scale * qmax``
    is NaN or Inf (a NaN/Inf input, or a scale that would overflow), ``NEGATIVE_SCALE`` if some
    scale is negative. One C pass over the scales where the kernels are there (two torch ops per
    check cost more than the check on a fragment of many tensors)."""
    if scale.numel() == 0:
        return 0
    if native.usable(scale):
        return native.check_scales(scale, qmax)
    return (0 if bool(torch.isfinite(scale * qmax).all()) else NONFINITE_SCALE) | (
        NEGATIVE_SCALE if bool((scale < 0).any()) else 0)


def store_float(x: torch.Tensor, codec: str, name: str) -> torch.Tensor:
    """``x`` as a contiguous CPU fp32/bf16 tensor; ``CodecError("nonfinite")`` on NaN/Inf."""
    y = x.to(device="cpu", dtype=torch.float32 if codec == "fp32" else torch.bfloat16)
    if not all_finite(y):
        raise CodecError("nonfinite", f"{name}: NaN or Inf (or out of {codec} range) in input")
    return y.contiguous()


def quantize_blocks(
    flat: torch.Tensor, codec: str, block_size: int, on_rows: Callable[[torch.Tensor], None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantization of a flat tensor: (q on CPU, float32 scales on CPU).

    ``on_rows`` receives each finished run of q rows, in order (the checksum hashes them): the whole
    tensor's rows at once when the C kernels take it, chunk by chunk on the torch path."""
    qmax = QMAX[codec]
    width = block_size if codec == "int8" else block_size // 2
    numel = flat.numel()
    num_blocks = -(-numel // block_size)
    num_full = numel // block_size
    on_cpu = flat.device.type == "cpu"
    if flat.dtype != torch.float32:
        flat = flat.float()
    q = torch.empty((num_blocks, width), dtype=torch.int8, device=flat.device)
    scale = torch.empty(num_blocks, dtype=torch.float32, device=flat.device)
    # The C kernels take the tensor in one call, without temporaries; the torch path runs over chunks.
    fused = native.usable(flat)
    rows = max(1, num_full) if fused or not on_cpu else max(1, _CHUNK_VALUES // block_size)
    scratch = None if fused else _scratch(min(rows, max(1, num_full)), block_size, flat.device)
    qmax_t = torch.tensor(float(qmax), device=flat.device)
    for start in range(0, num_full, rows):
        stop = min(num_full, start + rows)
        x2 = flat[start * block_size : stop * block_size].view(-1, block_size)
        _quantize_rows(x2, q[start:stop], scale[start:stop], qmax_t, scratch, codec)
        if on_cpu:
            on_rows(q[start:stop])
    if num_full < num_blocks:
        tail = flat.new_zeros((1, block_size))
        tail[0, : numel - num_full * block_size] = flat[num_full * block_size :]
        _quantize_rows(tail, q[num_full:], scale[num_full:], qmax_t, _scratch(1, block_size, flat.device), codec)
        if on_cpu:
            on_rows(q[num_full:])
    if not on_cpu:
        q, scale = q.cpu(), scale.cpu()
        on_rows(q)
    if scale_problems(scale, qmax) & NONFINITE_SCALE:
        raise CodecError("nonfinite", "NaN or Inf (or a value near the float32 limit) in input")
    return (q.view(-1) if codec == "int8" else q.view(-1).view(torch.uint8)), scale


class _Scratch:
    """Temporaries for one chunk of rows: float values, int8 values, int8 low nibbles."""

    def __init__(self, rows: int, block_size: int, device: torch.device) -> None:
        n = rows * block_size
        self.x = torch.empty(n, dtype=torch.float32, device=device).view(rows, block_size)
        self.q = torch.empty(n, dtype=torch.int8, device=device).view(rows, block_size)
        self.lo = torch.empty(n // 2, dtype=torch.int8, device=device).view(rows, block_size // 2)

    def capacity(self) -> int:
        return self.x.numel()

    def rows(self, rows: int, block_size: int) -> _Scratch:
        """Views of the first ``rows`` x ``block_size`` values (capacity permitting)."""
        view = object.__new__(_Scratch)
        n = rows * block_size
        view.x = self.x.view(-1)[:n].view(rows, block_size)
        view.q = self.q.view(-1)[:n].view(rows, block_size)
        view.lo = self.lo.view(-1)[: n // 2].view(rows, block_size // 2)
        return view


_LOCAL = threading.local()


def _scratch(rows: int, block_size: int, device: torch.device) -> _Scratch:
    """Scratch for ``rows`` rows. On CPU it is per thread and kept between calls: a fresh
    multi-MB buffer per call costs more in page faults than the quantizer's arithmetic."""
    if device.type != "cpu":
        return _Scratch(rows, block_size, device)
    cached = getattr(_LOCAL, "scratch", None)
    if cached is None or cached.capacity() < rows * block_size:
        cached = _LOCAL.scratch = _Scratch(max(rows * block_size, _CHUNK_VALUES) // 2, 2, device)
    return cached.rows(rows, block_size)


def _quantize_rows(
    x2: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, qmax_t: torch.Tensor,
    scratch: _Scratch | None, codec: str,
) -> None:  # fmt: skip
    if native.usable(x2, q_out, s_out):  # one fused pass, bit-identical to the torch ops below
        native.quantize_rows(x2, q_out, s_out, codec)
        return
    k = x2.shape[0]
    scratch = scratch or _scratch(k, x2.shape[1], x2.device)
    # amax and amin separately: on CPU two plain reductions beat aminmax and abs().amax() by 10x.
    absmax = torch.maximum(x2.amax(dim=1), x2.amin(dim=1).neg()).abs_()  # abs_: a block of -0 gives +0
    torch.div(absmax, qmax_t, out=s_out)
    # A block of zeros, or one so small that qmax / absmax overflows (absmax < ~2e-38): codes 0.
    inv = torch.div(qmax_t, absmax).nan_to_num_(nan=0.0, posinf=0.0)
    t = scratch.x[:k]
    torch.mul(x2, inv[:, None], out=t)
    t.round_()  # half to even; |t| <= qmax (+1 ulp) by construction, so no clamp is needed
    if codec == "int8":
        q_out.copy_(t)
        return
    q8, lo, half = scratch.q[:k], scratch.lo[:k], x2.shape[1] // 2
    q8.copy_(t)
    torch.bitwise_left_shift(q8[:, half:], 4, out=q_out)
    torch.bitwise_and(q8[:, :half], 15, out=lo)
    q_out.bitwise_or_(lo)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, codec: str, block_size: int, numel: int) -> torch.Tensor:
    """The flat float32 tensor of ``numel`` values that ``quantize_blocks`` stored as (q, scale)."""
    out = torch.empty(numel, dtype=torch.float32)
    num_full = numel // block_size
    width = block_size if codec == "int8" else block_size // 2
    q2 = q.view(torch.int8).view(-1, width)
    fused = native.usable(q2, scale)  # one kernel call, as in quantize_blocks
    rows = max(1, num_full) if fused else max(1, _CHUNK_VALUES // block_size)
    tmp = None if fused else _scratch(min(rows, max(1, num_full)), block_size, out.device).q
    for start in range(0, num_full, rows):
        stop = min(num_full, start + rows)
        o2 = out[start * block_size : stop * block_size].view(-1, block_size)
        _dequantize_rows(q2[start:stop], scale[start:stop], o2, None if tmp is None else tmp[: stop - start], codec)
    if num_full * block_size < numel:
        tail = torch.empty((1, block_size), dtype=torch.float32)
        _dequantize_rows(q2[num_full:], scale[num_full:], tail, None, codec)
        out[num_full * block_size :] = tail[0, : numel - num_full * block_size]
    return out


def _dequantize_rows(q2: torch.Tensor, scale: torch.Tensor, o2: torch.Tensor, tmp: torch.Tensor | None,
                     codec: str) -> None:  # fmt: skip
    if native.usable(q2, scale, o2):
        native.dequantize_rows(q2, scale, o2, codec)
        return
    if tmp is None:
        tmp = _scratch(q2.shape[0], o2.shape[1], o2.device).q
    if codec == "int8":
        o2.copy_(q2)
    else:
        half = o2.shape[1] // 2
        torch.bitwise_right_shift(q2, 4, out=tmp[:, half:])  # arithmetic shift: sign-extends
        torch.bitwise_left_shift(q2, 4, out=tmp[:, :half])
        tmp[:, :half].bitwise_right_shift_(4)
        o2.copy_(tmp)
    o2.mul_(scale[:, None])
