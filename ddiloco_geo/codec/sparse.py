"""The ``topk`` codec: per chunk of C values, the k largest magnitudes as ternary values (SparseLoCo).

A tensor of n values is flattened and cut into ``ceil(n / C)`` chunks of C = ``block_size``
values (default 4096, at most 4096); the last chunk may be shorter (r values) and then keeps
``min(k, r)``. Each chunk keeps the k = ``topk`` values (header field, default 84 per 4096, the
same density for other chunks: ``max(1, C * 84 // 4096)``) of
largest magnitude, ties broken toward the lower index, so the choice is a function of the values
alone. Each tensor's parts (K = the number of kept values over all chunks; ``codec.wire`` packs
the parts of all tensors of an object into three stored tensors, ``topk:idx``/``topk:q``/``topk:scale``):

- the kept chunk-relative indices, ascending within each chunk, chunk after chunk, Rice-coded
  (wire format 3): each index as its gap ``g`` (the chunk's first index, then the distance to the
  previous index minus 1) in ``g >> R`` one-bits, a zero bit and the low ``R`` bits of ``g``, least
  significant first, where ``R = floor(log2((C - k) / k))`` (0 if that is below 1; 5 at 84 of 4096),
  in **one** little-endian bit stream over all tensors of the object (bit j of a byte is ``(b >> j)
  & 1``), zero-padded to a whole byte (``topk:idx``). About 7.05 bits per index at 84 of 4096 on
  uniformly spread indices (their entropy: 6.98). Formats 1 and 2 stored each tensor's indices in
  ``w = max(1, bit_length(C - 1))`` bits each (12 for C = 4096), ``ceil(K * w / 8)`` bytes per
  tensor (``<name>:idx``); those objects are still read;
- ``<name>:q`` uint8: one 2-bit code per kept value in the same bit-stream order (4 per byte):
  ``0`` is 0, ``1`` is ``+scale``, ``3`` is ``-scale`` (two's complement -1), ``2`` is reserved;
- ``<name>:scale`` float32 ``[num_chunks]``: the mean magnitude of the chunk's kept non-zero
  values (summed in float64, where a chunk's kept values sum exactly, then divided and rounded
  once to float32), 0 if it kept none. The scaled sign is the least-squares one-level fit, and it
  keeps zeros zero (a chunk with fewer than k non-zeros must not invent values).

At the defaults the wire is about (84 * (7.05 + 2) + 32) / 4096 = 0.19 bits per value, 1/170 of
fp32 (0.295 bits, 1/108, with 12-bit indices). Decode returns dense float32 with zeros where nothing
was sent, and rejects (``CodecError("codec")``) an index out of its chunk, indices not strictly
ascending (duplicates; format 2), an index stream that ends early or has bits or bytes after its
last index, a reserved code and non-zero padding bits, so one set of values has exactly one
encoding.

``sparsify`` returns what would be sent, as the dense tensor decode would yield, without
serializing: error feedback needs ``residual = x - sparsify(x)``. Selection runs where the tensor
lives (on an accelerator only the kept values come back); the rest is small.
"""

from __future__ import annotations

import functools
import threading

import torch

from ddiloco_geo.codec import native
from ddiloco_geo.core.errors import CodecError

DEFAULT_CHUNK = 4096
MAX_CHUNK = 4096  # indices fit in 12 bits
DEFAULT_TOPK = 84  # 64 (SparseLoCo's) until stop 20, which trained about 3 points worse (docs/benchmarks.md)
_LEVELS = torch.tensor([0.0, 1.0, 0.0, -1.0])  # code -> multiple of the chunk's scale (2 reserved)
_CHUNK_ROWS = 256  # rows selected at a time on CPU: the abs() scratch stays in cache


def index_bits(chunk: int) -> int:
    return max(1, (chunk - 1).bit_length())


def kept_count(numel: int, chunk: int, topk: int) -> int:
    """K: how many values a tensor of ``numel`` values keeps."""
    full, rest = divmod(numel, chunk)
    return full * topk + min(topk, rest)


def stored_sizes(numel: int, chunk: int, topk: int) -> tuple[int, int, int]:
    """(idx bytes in formats 1 and 2, q bytes, number of scales) of a tensor of ``numel`` values."""
    kept = kept_count(numel, chunk, topk)
    return -(-kept * index_bits(chunk) // 8), -(-kept // 4), -(-numel // chunk)


def resolve(block_size: int, topk: int) -> tuple[int, int]:
    """(chunk, topk) for the header: 0 means the default (chunk 4096; topk ``max(1, chunk * 84 // 4096)``,
    84 per 4096 = 2.05%); ValueError for unusable values."""
    chunk = block_size or DEFAULT_CHUNK
    if type(chunk) is not int or not 2 <= chunk <= MAX_CHUNK:
        raise ValueError(f"topk block_size {chunk!r}: use a chunk of 2 to {MAX_CHUNK} values")
    topk = topk or max(1, chunk * DEFAULT_TOPK // DEFAULT_CHUNK)
    if type(topk) is not int or not 1 <= topk <= chunk:
        raise ValueError(f"topk {topk!r}: keep 1 to block_size ({chunk}) values per chunk")
    return chunk, topk


# --- encode --------------------------------------------------------------------------------------


def select(flat: torch.Tensor, chunk: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions int64 [K], float32 values [K]) of the kept values, chunk by chunk, on
    ``flat``'s device."""
    flat = flat.float()
    numel = flat.numel()
    full = numel // chunk
    parts = []
    # torch's path goes _CHUNK_ROWS rows at a time (its abs() scratch stays in cache); the C kernel
    # and accelerators take every full chunk at once
    rows = max(1, full) if flat.device.type != "cpu" or native.usable(flat) else _CHUNK_ROWS
    for start in range(0, full, rows):
        stop = min(full, start + rows)
        x2 = flat[start * chunk : stop * chunk].view(-1, chunk)
        idx = _top(x2, topk)
        parts.append(idx + (torch.arange(start, stop, device=flat.device) * chunk)[:, None])
    if full * chunk < numel:
        tail = flat[full * chunk :].view(1, -1)
        parts.append(_top(tail, min(topk, tail.shape[1])) + full * chunk)
    pos = torch.cat([p.reshape(-1) for p in parts]) if parts else flat.new_zeros(0, dtype=torch.long)
    return pos, flat.index_select(0, pos)


def _top(x2: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of the k largest |x| in each row, ties toward the lower index."""
    rows, width = x2.shape
    if k >= width:
        return torch.arange(width, device=x2.device).expand(rows, width)
    if x2.dtype == torch.float32 and width <= MAX_CHUNK and native.usable(x2):  # radix select in C: same indices
        idx = native.topk_rows(x2, k)
        if idx is None:
            raise CodecError("nonfinite", "NaN or Inf in input")
        return idx
    a = torch.abs(x2, out=_abs_scratch(x2))
    vals, idx = torch.topk(a, k + 1, dim=1, sorted=False)  # unsorted: a third cheaper on CPU
    if not bool(torch.isfinite(vals).all()):  # NaN and Inf always rank among the largest
        raise CodecError("nonfinite", "NaN or Inf in input")
    low = vals.min(dim=1, keepdim=True).values
    # The (k+1)-th value is dropped; if it ties with another kept one, topk may have picked either.
    tied = (vals == low).sum(dim=1) > 1
    keep = torch.ones_like(idx, dtype=torch.bool).scatter_(1, vals.argmin(dim=1, keepdim=True), False)
    idx = idx[keep].view(rows, k)
    if bool(tied.any()):
        which = tied.nonzero().view(-1)
        idx[which] = torch.sort(a[which], dim=1, descending=True, stable=True).indices[:, :k]
    return idx.sort(dim=1).values


_LOCAL = threading.local()


def _abs_scratch(x2: torch.Tensor) -> torch.Tensor:
    """A buffer for |x2|: on CPU kept per thread (fresh multi-MB buffers cost page faults)."""
    if x2.device.type != "cpu":
        return torch.empty_like(x2)
    buf = getattr(_LOCAL, "abs", None)
    if buf is None or buf.numel() < x2.numel():
        buf = _LOCAL.abs = torch.empty(max(x2.numel(), _CHUNK_ROWS * MAX_CHUNK), dtype=torch.float32)
    return buf[: x2.numel()].view(x2.shape)


def scales_of(values: torch.Tensor, numel: int, chunk: int, topk: int) -> torch.Tensor:
    """float32 [num_chunks]: the mean |value| of each chunk's kept non-zero values (0 if none)."""
    full, rest = divmod(numel, chunk)
    kept = (values.abs().double(), (values != 0).double())
    total, count = (torch.cat([v[: full * topk].view(full, topk).sum(dim=1), v[full * topk :].sum().view(-1)])
                    if rest else v.view(full, topk).sum(dim=1) for v in kept)  # fmt: skip
    return (total / count.clamp(min=1)).float()


def _owners(numel: int, chunk: int, topk: int, device: torch.device) -> torch.Tensor:
    """The chunk of each kept value: [0]*k, [1]*k, ..., then the short last chunk."""
    full, rest = divmod(numel, chunk)
    owner = torch.arange(full, device=device).repeat_interleave(topk)
    if rest:
        owner = torch.cat([owner, torch.full((min(topk, rest),), full, device=device)])
    return owner


def sparse_encode(x: torch.Tensor, chunk: int, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chunk-relative indices int64 [K], q as stored, scale as stored), on CPU (``pack_indices``
    codes the indices of all of an object's tensors); ``CodecError("nonfinite")`` if a kept value
    is NaN/Inf (NaN and Inf are always among the largest magnitudes, so they are always caught)."""
    local, codes, scale = _parts(x.reshape(-1), chunk, topk)
    if not bool(torch.isfinite(scale).all()):
        raise CodecError("nonfinite", "NaN or Inf in input")
    return local, pack_bits(codes, 2), scale


def _parts(flat: torch.Tensor, chunk: int, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chunk-relative indices int64, codes uint8 0/1/3, scales float32) on CPU, not yet checked."""
    full, rest = divmod(flat.numel(), chunk)
    rows = [(flat[: full * chunk], full, chunk)] if full else []
    rows += [(flat[full * chunk :], 1, rest)] if rest else []
    if rows and all(topk < width for _, _, width in rows) and flat.dtype == torch.float32 and native.usable(flat):
        # the full chunks, then the short last one, in C: selection, codes and scales in one pass each
        parts = [native.topk_rows(x.view(n, width), topk, codes=True) for x, n, width in rows]
        if any(p is None for p in parts):
            raise CodecError("nonfinite", "NaN or Inf in input")
        return tuple(torch.cat([p[i].view(-1) for p in parts]) if len(parts) > 1 else parts[0][i].view(-1)
                     for i in range(3))  # fmt: skip
    pos, values = select(flat, chunk, topk)
    scale = scales_of(values, flat.numel(), chunk, topk).cpu()
    return (pos % chunk).cpu(), torch.sign(values).to(torch.int8).bitwise_and_(3).to(torch.uint8).cpu(), scale


def sparsify(x: torch.Tensor, *, block_size: int = 0, topk: int = 0) -> torch.Tensor:
    """What the ``topk`` codec sends for ``x``, as the dense float32 tensor (same shape and device)
    that decode yields: exactly ``decode(encode({"x": x}, codec="topk", ...))["x"]``. Use it for
    error feedback (``residual = x - sparsify(x)``) without serializing. ``block_size``/``topk`` 0
    mean the defaults (4096, 84)."""
    chunk, topk = resolve(block_size, topk)
    flat = x.detach().reshape(-1)
    if flat.device.type == "cpu":  # the parts encode stores, scattered as decode scatters them
        local, codes, scale = _parts(flat, chunk, topk)
        return scatter(local, codes.long(), scale, chunk, topk, flat.numel()).view(x.shape)
    pos, values = select(flat, chunk, topk)
    out = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
    scale = scales_of(values, flat.numel(), chunk, topk)
    out[pos] = torch.sign(values) * scale[_owners(flat.numel(), chunk, topk, flat.device)]
    return out.view(x.shape)


# --- decode --------------------------------------------------------------------------------------

# What decode refuses, by the bit the C kernel reports it with (checked in this order by both paths).
_MALFORMED = {1: "reserved 2-bit code 2 in the values", 2: "an index lies outside its chunk",
              4: "indices are duplicated or not ascending within a chunk"}


def sparse_decode(local: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, chunk: int, topk: int,
                  numel: int) -> torch.Tensor:  # fmt: skip
    """The flat dense float32 tensor of ``numel`` values from its unpacked chunk-relative indices
    (``unpack_indices``, or ``unpack_bits`` in formats 1 and 2); ``CodecError("codec")`` for an
    index out of its chunk, indices not strictly ascending within a chunk, a reserved code or
    padding bits."""
    return scatter(local, unpack_bits(q, 2, kept_count(numel, chunk, topk)), scale, chunk, topk, numel)


def scatter(local: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, chunk: int, topk: int,
            numel: int) -> torch.Tensor:  # fmt: skip
    """``sparse_decode`` after unpacking (int64 ``local`` and ``codes``, CPU): the dense values, each
    kept one ``level(code) * scale`` of its chunk (``sparsify`` scatters through here too, so it is
    what decode yields by construction)."""
    kept = kept_count(numel, chunk, topk)
    if scale.dtype == torch.float32 and scale.numel() == -(-numel // chunk) and native.usable(local, codes, scale):
        out = native.topk_scatter(local, codes, scale, numel, chunk, topk)
        if isinstance(out, torch.Tensor):
            return out
        raise CodecError("codec", next(why for bit, why in _MALFORMED.items() if out & bit))
    if bool((codes == 2).any()):
        raise CodecError("codec", _MALFORMED[1])
    full, rest = divmod(numel, chunk)
    limit = torch.full((kept,), chunk, dtype=torch.long)
    if rest:
        limit[full * topk :] = rest
    if bool((local >= limit).any()):
        raise CodecError("codec", _MALFORMED[2])
    rows = [local[: full * topk].view(full, topk)] + ([local[full * topk :].view(1, -1)] if rest else [])
    if any(r.shape[1] > 1 and bool((r[:, 1:] <= r[:, :-1]).any()) for r in rows):
        raise CodecError("codec", _MALFORMED[4])
    owner = _owners(numel, chunk, topk, torch.device("cpu"))
    out = torch.zeros(numel, dtype=torch.float32)
    out[owner * chunk + local] = _LEVELS[codes] * scale[owner]
    return out


# --- the index stream (format 3) ------------------------------------------------------------------

_RICE_ERRORS = {1: "bits or bytes after the last index", 2: "an index lies outside its chunk",
                8: "the index stream ends before its last index"}


def rice_param(chunk: int, topk: int) -> int:
    """R: floor(log2) of the mean gap between kept indices, (C - k) / k; 0 when that is below 2."""
    return max(0, ((chunk - topk) // topk).bit_length() - 1)


def chunk_layout(numels: list[int], chunk: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept indices, width) of every chunk of tensors of ``numels`` values, in order: int32 (shared:
    a fragment's layout is the same for every delta of it, so it is kept; do not modify)."""
    return _chunk_layout(tuple(numels), chunk, topk)


@functools.lru_cache(maxsize=64)  # a run's fragments; each entry is 8 bytes a chunk
def _chunk_layout(numels: tuple[int, ...], chunk: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts, limits = [], []
    for n in numels:
        full, rest = divmod(n, chunk)
        counts.append(torch.full((full,), topk, dtype=torch.int32))
        limits.append(torch.full((full,), chunk, dtype=torch.int32))
        if rest:
            counts.append(torch.tensor([min(topk, rest)], dtype=torch.int32))
            limits.append(torch.tensor([rest], dtype=torch.int32))
    empty = torch.zeros(0, dtype=torch.int32)
    return torch.cat(counts) if counts else empty, torch.cat(limits) if limits else empty


def index_stream_bytes(numels: list[int], chunk: int, topk: int) -> tuple[int, int]:
    """(fewest, most) bytes the index stream of tensors of ``numels`` values can take: every gap 0,
    or each chunk's gaps summing to its width minus its count (their unary parts then sum to at
    most that >> R). Arithmetic only: a header's claims are checked before anything is allocated."""
    r, least, spare = rice_param(chunk, topk), 0, 0
    for n in numels:
        full, rest = divmod(n, chunk)
        least += kept_count(n, chunk, topk) * (r + 1)
        spare += full * ((chunk - topk) >> r) + ((rest - min(topk, rest)) >> r)
    return -(-least // 8), -(-(least + spare) // 8)


def pack_indices(local: torch.Tensor, numels: list[int], chunk: int, topk: int) -> torch.Tensor:
    """The Rice-coded stream (uint8) of the ascending chunk-relative indices ``local`` (int64) of
    tensors of ``numels`` values, chunk after chunk."""
    counts, limits = chunk_layout(numels, chunk, topk)
    r = rice_param(chunk, topk)
    local = local.to(torch.int64).cpu()
    if native.kernels() is not None:
        return native.rice_encode(local, counts, r, index_stream_bytes(numels, chunk, topk)[1])
    acc, bits, out, i = 0, 0, bytearray(), 0
    for count in counts.tolist():
        prev = -1
        for v in local[i : i + count].tolist():
            g, prev = v - prev - 1, v
            acc |= (((1 << (g >> r)) - 1) | ((g & ((1 << r) - 1)) << ((g >> r) + 1))) << bits
            bits += (g >> r) + 1 + r
            while bits >= 8:
                out.append(acc & 255)
                acc, bits = acc >> 8, bits - 8
        i += count
    if bits:
        out.append(acc)
    return torch.frombuffer(out, dtype=torch.uint8) if out else torch.zeros(0, dtype=torch.uint8)


def unpack_indices(data: torch.Tensor, numels: list[int], chunk: int, topk: int) -> torch.Tensor:
    """``pack_indices``' inverse: the int64 indices; ``CodecError("codec")`` for an index outside
    its chunk, a stream that ends early, or set bits or whole bytes after the last index."""
    counts, limits = chunk_layout(numels, chunk, topk)
    r = rice_param(chunk, topk)
    data = data.view(torch.uint8)
    if native.usable(data):
        out = native.rice_decode(data, counts, limits, r)
        if isinstance(out, torch.Tensor):
            return out
        raise CodecError("codec", _RICE_ERRORS[out])
    bits = ((data[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1).tolist()
    values, p = [], 0
    for count, limit in zip(counts.tolist(), limits.tolist()):
        prev = -1
        for _ in range(count):
            q = 0
            while p < len(bits) and bits[p]:
                q, p = q + 1, p + 1
                if q << r >= limit:
                    raise CodecError("codec", _RICE_ERRORS[2])
            if p + 1 + r > len(bits):
                raise CodecError("codec", _RICE_ERRORS[8])
            low = sum(b << j for j, b in enumerate(bits[p + 1 : p + 1 + r]))
            p += 1 + r
            prev = prev + 1 + (q << r) + low
            if prev >= limit:
                raise CodecError("codec", _RICE_ERRORS[2])
            values.append(prev)
    if len(bits) - p >= 8 or any(bits[p:]):
        raise CodecError("codec", _RICE_ERRORS[1])
    return torch.tensor(values, dtype=torch.int64)


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative ints < 2^width as one little-endian bit stream, zero-padded: uint8."""
    if values.device.type == "cpu" and 1 <= width <= 32 and native.kernels() is not None:
        return native.pack_bits(values, width)
    shifts = torch.arange(width, dtype=torch.int64)
    bits = ((values.to(torch.int64)[:, None] >> shifts) & 1).to(torch.uint8).view(-1)
    bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(data: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The ``count`` ints of ``width`` bits in ``data`` (int64); ``CodecError("codec")`` unless the
    padding bits are zero."""
    if 1 <= width <= 32 and native.usable(data):
        out = native.unpack_bits(data.view(torch.uint8), width, count)
        if isinstance(out, torch.Tensor):
            return out
        raise CodecError("codec", "non-zero padding bits after the last value" if out == 1 else
                         f"{data.numel()} bytes hold fewer than {count} values of {width} bits")
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = ((data.view(torch.uint8)[:, None] >> shifts) & 1).view(-1)
    if bool(bits[count * width :].any()):
        raise CodecError("codec", "non-zero padding bits after the last value")
    bits = bits[: count * width].view(count, width).to(torch.int64)
    return (bits << torch.arange(width, dtype=torch.int64)).sum(dim=1)
