"""safetensors framing: an object's bytes in and out, and the limits checked before parsing.

An object is a plain safetensors file: an 8-byte little-endian header length, a JSON header
(``{key: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}}``, space-padded so the
data section starts on a multiple of 8), then the raw little-endian tensor bytes, back to back
in sorted key order. Nothing is ever pickled. Every safetensors dtype is known here, so any valid
safetensors file frames; what the tensors must be is ``wire``'s business.

Reading is defensive and raises only ``CodecError``: a header length over ``MAX_HEADER_BYTES`` is
``too_large`` before a byte of the header is parsed; an object shorter than its framing says is
``truncated``; JSON that is not an object of well-formed entries, or tensor data with gaps,
overlaps or trailing bytes, is ``bad_header``.
"""

from __future__ import annotations

import json
import struct
import sys
from typing import Any

import torch

from ddiloco_geo.core.errors import CodecError

# The largest header a reader parses. A header holds, per stored tensor, its table entry and its
# name/shape/dtype in the metadata (~300 bytes with a 60-character name), plus the clock (one entry
# per learner) and ``extra``. The largest real headers are learner checkpoints (weights + both
# Adam moments of the whole model): ~1,000 tensors and ~210 KB for the 350M "xl" GPT, ~600 for a
# 1B model (a fragment delta has at most a few hundred tensors, well under 100 KB); an 80-layer
# model's checkpoint (~2,900 tensors) still fits in ~700 KB. 1 MiB leaves that headroom while
# bounding the JSON a hostile object can make a reader parse (the safetensors library allows 100 MB).
MAX_HEADER_BYTES = 1 << 20
INT64_MAX = 2**63 - 1

ST_DTYPES: dict[str, int] = {  # every safetensors dtype, with its size, so any valid file parses
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
TORCH_TO_ST = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int8: "I8", torch.uint8: "U8"}
ST_TO_TORCH = {v: k for k, v in TORCH_TO_ST.items()}

if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian; so are all targets
    raise ImportError("ddiloco_geo.codec assumes a little-endian host")


def serialize(stored: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """One safetensors object: ``stored`` (contiguous CPU tensors of the dtypes in ``TORCH_TO_ST``)
    laid out in sorted key order, ``metadata`` as ``__metadata__``."""
    entries: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    keys = sorted(stored)
    for key in keys:
        t = stored[key]
        end = offset + t.numel() * t.element_size()
        entries[key] = {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors aligns the data section to 8 bytes
    return b"".join([struct.pack("<Q", len(head)), head, *(byte_view(stored[k]) for k in keys)])


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def as_bytes(data: Any) -> memoryview:
    """``data`` (bytes, bytearray or memoryview) as a flat byte view; anything else is ``bad_header``."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError("bad_header", f"expected bytes, got {type(data).__name__}")
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def header_span(data: bytes) -> int:
    """How many leading bytes of an object hold its header (needs the first 8 bytes); a storage
    layer can fetch that range and hand it to ``read_header``."""
    mv = as_bytes(data)
    if len(mv) < 8:
        raise CodecError("truncated", f"{len(mv)} bytes: the 8-byte header length is incomplete")
    n = struct.unpack_from("<Q", mv)[0]
    if n > MAX_HEADER_BYTES:
        raise CodecError("too_large", f"header of {n} bytes exceeds {MAX_HEADER_BYTES}")
    return 8 + n


def parse_framing(mv: memoryview, *, prefix_only: bool) -> tuple[dict[str, Any], int]:
    """Check the safetensors framing; return (header JSON, offset of the data section).

    With ``prefix_only`` the data section is not required (``mv`` may be just the header)."""
    span = header_span(mv)
    if span > len(mv):
        raise CodecError("truncated", f"header needs {span} bytes, object has {len(mv)}")
    try:
        entries = json.loads(bytes(mv[8:span]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CodecError("bad_header", f"header is not JSON: {exc}"[:300]) from None
    if not isinstance(entries, dict):
        raise CodecError("bad_header", "header is not a JSON object")
    ranges = []
    for key, entry in entries.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CodecError("bad_header", f"tensor {key[:80]!r}: malformed entry")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in ST_DTYPES or not is_int_list(shape, 0) or not is_int_list(offsets, 2):
            raise CodecError("bad_header", f"tensor {key[:80]!r}: bad dtype, shape or offsets")
        start, end = offsets
        if not 0 <= start <= end or end - start != numel(shape) * ST_DTYPES[dtype]:
            raise CodecError("bad_header", f"tensor {key[:80]!r}: offsets do not match its size")
        ranges.append((start, end))
    ranges.sort()
    cursor = 0
    for start, end in ranges:
        if start != cursor:
            raise CodecError("bad_header", "tensor data has gaps or overlaps")
        cursor = end
    if not prefix_only:
        available = len(mv) - span
        if cursor > available:
            raise CodecError("truncated", f"tensor data needs {cursor} bytes, object has {available}")
        if cursor < available:
            raise CodecError("bad_header", f"{available - cursor} trailing bytes after tensor data")
    return entries, span


def is_int_list(value: Any, length: int) -> bool:
    """A JSON list of ``length`` (0: any number of) integers in [0, 2^63)."""
    return (
        isinstance(value, list)
        and (length == 0 or len(value) == length)
        and all(type(v) is int and 0 <= v <= INT64_MAX for v in value)
    )


def numel(shape: list[int] | tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def load(mv: memoryview, data_start: int, spec: tuple[torch.dtype, tuple, list]) -> torch.Tensor:
    """The stored tensor ``spec`` = (dtype, shape, data_offsets) describes, in memory it owns."""
    dtype, shape, (start, end) = spec
    if start == end:
        return torch.empty(shape, dtype=dtype)
    # One copy into memory the tensor owns (torch.frombuffer on read-only bytes would alias them).
    buf = bytearray(mv[data_start + start : data_start + end])
    return torch.frombuffer(buf, dtype=dtype).view(shape)
