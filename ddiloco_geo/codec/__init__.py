"""The wire format: every tensor object in the bucket, as a safetensors file (format version 1).

Deltas, global fragments, syncer state and learner checkpoints all use this one format. An object
is a plain safetensors file (8-byte little-endian header length, JSON header, raw little-endian
tensor bytes); nothing is ever pickled. The header lives in safetensors' ``__metadata__``
(``dict[str, str]``)::

    ddiloco.format  "1"                       (FORMAT_VERSION; a reader refuses any other)
    kind            delta | global | state | checkpoint
    run_id, learner, fragment, seq, base_version, version, num_steps, num_tokens
    clock           VectorClock JSON
    codec           fp32 | bf16 | int8 | int4
    block_size      values per scale block ("0" for fp32/bf16)
    shapes, dtypes  JSON {name: [dims]} and {name: "float32" | ...}: what decode restores
    extra           one JSON object (merge record, data cursor, ...)
    checksum        sha256 hex over the raw bytes of every stored tensor, in sorted key order
    signer          (signed objects only) key id: "learner:<id>" or "syncer"
    signature       (signed objects only) hex HMAC-SHA256 over every other metadata field

Codecs (quantize only on the wire; decode always yields contiguous float32 of the original shape):

- ``fp32``: stored as-is under ``<name>``; exact.
- ``bf16``: stored under ``<name>`` as bfloat16 (round-to-nearest-even); relative error <= 2^-9.
- ``int8``: blockwise symmetric absmax. The tensor is flattened and zero-padded to a multiple of
  ``block_size`` (default 128). Per block: ``scale = absmax / 127`` (float32), ``q =
  round_half_even(x * (127 / absmax))`` in [-127, 127] (an all-zero block has scale 0 and q 0).
  Stored as ``<name>:q`` (int8, ``[num_blocks * block_size]``) and ``<name>:scale`` (float32,
  ``[num_blocks]``). Decoded ``q * scale``; error <= scale / 2 per block.
- ``int4``: as int8 with 7 instead of 127 (q in [-7, 7]) and two values per byte: within each
  block, byte ``j`` holds value ``j`` in its low nibble and value ``j + block_size / 2`` in its high
  nibble, both two's complement. ``<name>:q`` is uint8 ``[num_blocks * block_size / 2]``.
  Scales stay float32: 4 bytes per 128 values, so the wire is 0.125 + 0.0078 = 0.133 of fp32 plus
  a header of a few hundred bytes per tensor (well under the 0.14 budget for a fragment of tens of
  MB), and a scale never rounds below the block's absmax (which would break the error bound).

Rounding is round-to-nearest (no stochastic rounding). The quantizers are whole-tensor torch ops;
on CPU they run over cache-sized chunks with reused scratch buffers (fresh multi-MB temporaries
cost page faults that dwarf the arithmetic), and the sha256 runs on a worker thread while the
quantizer works (hashlib releases the GIL). On an accelerator the same ops run on the device and
only the quantized bytes come back.

Decode is defensive: every malformed, truncated, foreign, corrupted or mismatched input raises
``CodecError(reason, detail)`` and nothing else ever escapes. Checks run in this order: size
(``too_large``), framing (``truncated``, ``bad_header``), ``foreign``, ``version``, header fields
(``bad_header``), ``kind``, ``run_id``, ``codec``, stored tensors vs header (``codec`` for
quantized tensors, ``shape`` otherwise), ``shape`` vs ``expect``, ``checksum``, the signature
when a verifier is given (``unsigned``, ``bad_signature``, ``wrong_signer``), then ``nonfinite``
(NaN/Inf values, or scales that are not finite or would overflow). The checksum detects
corruption, not forgery: header fields outside the tensor bytes are validated, not hashed, so
pass ``expect`` whenever the shapes are known (the fragment plan knows them).

Signing (``ddiloco_geo.core.signing``): ``encode(signer=...)`` adds ``signer`` and ``signature``; the
signature is an HMAC over the sorted JSON of every other metadata field, so it covers the
identity fields, the counters, the shapes and the checksum, and through the checksum the tensor
bytes (the tensor table itself is fully determined by the metadata: names, dtypes and shapes
follow from ``codec``/``shapes``, and the checksum hashes the bytes in key order).
``decode(verify=..., require_signature=..., expected_signer=...)`` checks it. ``read_header``
never verifies anything: use it for routing, never for trust.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.errors import CodecError
from ddiloco_geo.core.layout import ID_PATTERN
from ddiloco_geo.core.signing import SIGNATURE_FIELD, SIGNER_FIELD, Signer, Verifier, signed_message

FORMAT_VERSION = 1
FORMAT_KEY = "ddiloco.format"
CODECS = ("fp32", "bf16", "int8", "int4")
KINDS = ("delta", "global", "update", "state", "checkpoint")
DEFAULT_BLOCK_SIZE = 128
MAX_BLOCK_SIZE = 1 << 16
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
QMAX = {"int8": 127, "int4": 7}

# CPU quantizer chunk: 1 Mi values (4 MiB of fp32) measured best on a 2-core EPYC (1 MiB L2/core).
_CHUNK_VALUES = 1 << 20
# Hash on a worker thread only when there is enough to hash to pay for the hand-off.
_PARALLEL_HASH_BYTES = 1 << 20

_ST_DTYPES: dict[str, int] = {  # every safetensors dtype, with its size, so any valid file parses
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_TORCH_TO_ST = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int8: "I8", torch.uint8: "U8"}
_ST_TO_TORCH = {v: k for k, v in _TORCH_TO_ST.items()}
_INT_RE = re.compile(r"-?[0-9]{1,19}")
_INT64_MAX = 2**63 - 1

if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian; so are all targets
    raise ImportError("ddiloco_geo.codec assumes a little-endian host")


@dataclass
class Header:
    """What an object says about itself. ``shapes``, ``dtypes`` and ``checksum`` are filled in by
    ``decode``/``read_header`` (``encode`` derives them from the tensors) and take no part in
    equality."""

    kind: str
    run_id: str
    fragment: int = -1
    learner: str = ""
    seq: int = -1
    base_version: int = -1
    version: int = -1
    clock: VectorClock = VectorClock()
    num_steps: int = 0
    num_tokens: int = 0
    codec: str = "fp32"
    block_size: int = 0
    extra: dict = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False)
    dtypes: dict[str, str] = field(default_factory=dict, compare=False)
    checksum: str = field(default="", compare=False)
    signer: str = field(default="", compare=False)  # key id; trustworthy only after decode(verify=...)


_INT_FIELDS = ("fragment", "seq", "base_version", "version", "num_steps", "num_tokens", "block_size")


# --- encode --------------------------------------------------------------------------------------


def encode(
    tensors: Mapping[str, torch.Tensor],
    header: Header,
    *,
    codec: str | None = None,
    block_size: int | None = None,
    signer: Signer | None = None,
) -> bytes:
    """Serialize ``tensors`` (floating point, any device) with ``header`` as one safetensors object.

    ``codec``/``block_size`` override the header's; the header's ``block_size`` 0 means the
    default (128) for int8/int4. With ``signer`` the metadata also gets ``signer`` (its key id)
    and ``signature`` (HMAC over every other metadata field, checksum included; see
    ``ddiloco_geo.core.signing``). Raises ValueError for unusable arguments and
    ``CodecError("nonfinite", name)`` if a tensor holds NaN/Inf (it must not reach the wire).
    """
    if signer is not None and not isinstance(signer, Signer):
        raise ValueError(f"signer: expected a signing.Signer, got {type(signer).__name__}")
    codec = header.codec if codec is None else codec
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}: expected one of {', '.join(CODECS)}")
    block_size = _resolve_block_size(codec, header.block_size if block_size is None else block_size)
    _check_header_fields(header)
    names = _check_tensors(tensors)
    # Stored keys are laid out, and hashed, in sorted key order: order names by their first key.
    names.sort(key=lambda n: n + ":" if codec in QMAX else n)

    digest = _Digest(_parallel=sum(t.numel() for t in tensors.values()) * 4 >= _PARALLEL_HASH_BYTES)
    stored: dict[str, torch.Tensor] = {}
    try:
        for name in names:
            x = tensors[name].detach()
            if codec in QMAX:
                try:
                    q, scale = _quantize(x.reshape(-1), codec, block_size, digest.update)
                except CodecError as exc:
                    raise CodecError(exc.reason, f"{name}: {exc.detail}") from None
                digest.update(scale)
                stored[f"{name}:q"], stored[f"{name}:scale"] = q, scale
            else:
                stored[name] = _store_float(x, codec, name)
                digest.update(stored[name])
        checksum = digest.hexdigest()
    finally:
        digest.close()

    metadata = {
        FORMAT_KEY: str(FORMAT_VERSION),
        "kind": header.kind,
        "run_id": header.run_id,
        "learner": header.learner,
        "clock": header.clock.to_json(),
        "codec": codec,
        "extra": _json(header.extra),
        "shapes": _json({n: list(tensors[n].shape) for n in names}),
        "dtypes": _json({n: str(tensors[n].dtype).removeprefix("torch.") for n in names}),
        "checksum": checksum,
        **{f: str(getattr(header, f)) for f in _INT_FIELDS},
        "block_size": str(block_size),
    }
    if signer is not None:
        metadata[SIGNER_FIELD] = signer.key_id
        metadata[SIGNATURE_FIELD] = signer.sign(signed_message(metadata))
    return _serialize(stored, metadata)


def _resolve_block_size(codec: str, block_size: int) -> int:
    if codec not in QMAX:
        return 0
    block_size = block_size or DEFAULT_BLOCK_SIZE
    if type(block_size) is not int or not (2 <= block_size <= MAX_BLOCK_SIZE) or block_size % 2:
        raise ValueError(f"block_size {block_size!r}: use an even number in [2, {MAX_BLOCK_SIZE}]")
    return block_size


def _check_header_fields(h: Header) -> None:
    if h.kind not in KINDS:
        raise ValueError(f"header kind {h.kind!r}: expected one of {', '.join(KINDS)}")
    if not isinstance(h.run_id, str) or not h.run_id:
        raise ValueError(f"header run_id {h.run_id!r}: expected a non-empty string")
    if not isinstance(h.learner, str) or (h.learner and not ID_PATTERN.match(h.learner)):
        raise ValueError(f"header learner {h.learner!r}: expected '' or a learner id")
    if not isinstance(h.clock, VectorClock):
        raise ValueError(f"header clock: expected a VectorClock, got {type(h.clock).__name__}")
    if not isinstance(h.extra, dict):
        raise ValueError(f"header extra: expected a dict, got {type(h.extra).__name__}")
    for f in _INT_FIELDS:
        value = getattr(h, f)
        if type(value) is not int or not -1 <= value <= _INT64_MAX:
            raise ValueError(f"header {f} {value!r}: expected an integer >= -1")


def _check_tensors(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or ":" in name or name == "__metadata__":
            raise ValueError(f"tensor name {name!r}: expected a non-empty string without ':'")
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"tensor {name!r}: expected a floating-point torch.Tensor")
    return list(tensors)


def _store_float(x: torch.Tensor, codec: str, name: str) -> torch.Tensor:
    y = x.to(device="cpu", dtype=torch.float32 if codec == "fp32" else torch.bfloat16)
    if not bool(torch.isfinite(y).all()):
        raise CodecError("nonfinite", f"{name}: NaN or Inf (or out of {codec} range) in input")
    return y.contiguous()


def _quantize(
    flat: torch.Tensor, codec: str, block_size: int, on_rows: Callable[[torch.Tensor], None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantization of a flat tensor: (q on CPU, float32 scales on CPU).

    ``on_rows`` receives each finished run of q rows, in order (the checksum hashes them while the
    next chunk is quantized)."""
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
    rows = max(1, _CHUNK_VALUES // block_size) if on_cpu else max(1, num_full)
    scratch = _scratch(min(rows, max(1, num_full)), block_size, flat.device)
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
    if not bool(torch.isfinite(scale * qmax).all()):
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
    scratch: _Scratch, codec: str,
) -> None:  # fmt: skip
    k = x2.shape[0]
    # amax and amin separately: on CPU two plain reductions beat aminmax and abs().amax() by 10x.
    absmax = torch.maximum(x2.amax(dim=1), x2.amin(dim=1).neg())
    torch.div(absmax, qmax_t, out=s_out)
    inv = torch.where(absmax > 0, torch.div(qmax_t, absmax), 0.0)  # all-zero block: q 0, scale 0
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


def _json(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"header value is not plain JSON: {exc}") from None


def _byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _serialize(stored: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    keys = sorted(stored)
    for key in keys:
        t = stored[key]
        end = offset + t.numel() * t.element_size()
        entries[key] = {"dtype": _TORCH_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors aligns the data section to 8 bytes
    return b"".join([struct.pack("<Q", len(head)), head, *(_byte_view(stored[k]) for k in keys)])


# --- decode --------------------------------------------------------------------------------------


def decode(
    data: bytes,
    *,
    kind: str | None = None,
    run_id: str | None = None,
    expect: Mapping[str, tuple[int, ...]] | None = None,
    max_bytes: int = 2**31,
    verify: Verifier | None = None,
    require_signature: bool = False,
    expected_signer: str | None = None,
) -> tuple[Header, dict[str, torch.Tensor]]:
    """Validate and decode one object: (header, {name: float32 tensor of the original shape}).

    ``kind``/``run_id``, when given, must match; ``expect`` ({name: shape}) must match the object's
    tensors exactly. Raises only CodecError (see the module docstring for the reasons).

    Signatures (checked after the checksum, before ``nonfinite``), only when ``verify`` is given:
    an object without a ``signature`` is ``unsigned`` if ``require_signature`` (else accepted,
    with ``header.signer`` cleared); a signature that does not verify, or names a key id the
    verifier does not know, is ``bad_signature`` (even when signatures are not required); a valid
    signature by another key id than ``expected_signer`` is ``wrong_signer``. Without ``verify``
    nothing is verified and ``header.signer`` is only a claim; ``require_signature`` without
    ``verify`` is a programming error (ValueError, before reading ``data``)."""
    if require_signature and verify is None:
        raise ValueError("decode(require_signature=True) needs a verifier")
    if verify is not None and not isinstance(verify, Verifier):
        raise ValueError(f"verify: expected a signing.Verifier, got {type(verify).__name__}")
    try:
        return _decode(data, kind, run_id, expect, max_bytes, verify, require_signature, expected_signer)
    except CodecError:
        raise
    except Exception as exc:  # noqa: BLE001 - the contract: nothing but CodecError escapes
        raise CodecError("bad_header", f"{type(exc).__name__}: {exc}"[:300]) from None


def read_header(data: bytes) -> Header:
    """Parse and validate only the header. ``data`` may be just a prefix of the object (at least
    ``header_span(data)`` bytes); tensors are neither read nor checksummed.

    Nothing is verified here: no checksum, no signature (``header.signer`` is a claim). Use it for
    routing and listing views only, never to trust an object; ``decode(verify=...)`` is the only
    authenticated path."""
    try:
        mv = _as_bytes(data)
        entries, _ = _parse_framing(mv, prefix_only=True)
        return _parse_metadata(entries)
    except CodecError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CodecError("bad_header", f"{type(exc).__name__}: {exc}"[:300]) from None


def header_span(data: bytes) -> int:
    """How many leading bytes of an object hold its header (needs the first 8 bytes); a storage
    layer can fetch that range and hand it to ``read_header``."""
    mv = _as_bytes(data)
    if len(mv) < 8:
        raise CodecError("truncated", f"{len(mv)} bytes: the 8-byte header length is incomplete")
    n = struct.unpack_from("<Q", mv)[0]
    if n > MAX_HEADER_BYTES:
        raise CodecError("too_large", f"header of {n} bytes exceeds {MAX_HEADER_BYTES}")
    return 8 + n


def _as_bytes(data: Any) -> memoryview:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError("bad_header", f"expected bytes, got {type(data).__name__}")
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _decode(data, kind, run_id, expect, max_bytes, verify=None, require_signature=False, expected_signer=None):
    mv = _as_bytes(data)
    if len(mv) > max_bytes:
        raise CodecError("too_large", f"{len(mv)} bytes exceeds max_bytes={max_bytes}")
    entries, data_start = _parse_framing(mv, prefix_only=False)
    header = _parse_metadata(entries)
    if kind is not None and header.kind != kind:
        raise CodecError("kind", f"expected {kind!r}, got {header.kind!r}")
    if run_id is not None and header.run_id != run_id:
        raise CodecError("run_id", f"expected {run_id!r}, got {header.run_id!r}")
    layout = _check_layout(header, entries)
    if expect is not None:
        _check_expect(header.shapes, expect)

    keys = sorted(layout)
    digest = _Digest(_parallel=len(mv) - data_start >= _PARALLEL_HASH_BYTES)
    try:
        for key in keys:
            start, end = layout[key][2]
            digest.update(mv[data_start + start : data_start + end])
        stored = {k: _load(mv, data_start, layout[k]) for k in keys}
        tensors = {name: _restore(header, name, stored) for name in sorted(header.shapes)}
        checksum = digest.hexdigest()
    finally:
        digest.close()
    if checksum != header.checksum:
        raise CodecError("checksum", f"tensor bytes hash to {checksum[:16]}..., header says "
                                     f"{header.checksum[:16]}...")  # fmt: skip
    if verify is not None:
        header.signer = _check_signature(entries["__metadata__"], verify, require_signature, expected_signer)
    _check_finite(header, stored, tensors)
    return header, tensors


def _check_signature(meta: dict[str, str], verify: Verifier, required: bool, expected: str | None) -> str:
    """Verify the metadata's signature; return the verified signer ('' for an accepted unsigned
    object). Details name key ids, never keys or signature values."""
    signature, signer = meta.get(SIGNATURE_FIELD), meta.get(SIGNER_FIELD)
    if signature is None:
        if required:
            raise CodecError("unsigned", "object has no signature and signatures are required")
        return ""
    if signer is None:
        raise CodecError("bad_signature", "signature without a signer key id")
    if not verify.verify(signer, signed_message(meta), signature):
        why = "does not verify" if verify.knows(signer) else "names an unknown key id"
        raise CodecError("bad_signature", f"signature by {signer[:80]!r} {why}")
    if expected is not None and signer != expected:
        raise CodecError("wrong_signer", f"signed by {signer[:80]!r}, expected {expected[:80]!r}")
    return signer


def _parse_framing(mv: memoryview, *, prefix_only: bool) -> tuple[dict[str, Any], int]:
    """Check the safetensors framing; return (header JSON, offset of the data section)."""
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
        if dtype not in _ST_DTYPES or not _is_int_list(shape, 0) or not _is_int_list(offsets, 2):
            raise CodecError("bad_header", f"tensor {key[:80]!r}: bad dtype, shape or offsets")
        start, end = offsets
        if not 0 <= start <= end or end - start != _numel(shape) * _ST_DTYPES[dtype]:
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


def _is_int_list(value: Any, length: int) -> bool:
    return (
        isinstance(value, list)
        and (length == 0 or len(value) == length)
        and all(type(v) is int and 0 <= v <= _INT64_MAX for v in value)
    )


def _numel(shape: list[int] | tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _parse_metadata(entries: dict[str, Any]) -> Header:
    meta = entries.get("__metadata__")
    if meta is None:
        raise CodecError("foreign", "safetensors file without metadata")
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CodecError("bad_header", "__metadata__ is not a map of strings")
    if FORMAT_KEY not in meta:
        raise CodecError("foreign", f"no {FORMAT_KEY!r} in the metadata: not a ddiloco-geo object")
    if meta[FORMAT_KEY] != str(FORMAT_VERSION):
        raise CodecError("version", f"format {meta[FORMAT_KEY][:20]!r}, this reader knows {FORMAT_VERSION}")

    def text(key: str) -> str:
        if key not in meta:
            raise CodecError("bad_header", f"missing header field {key!r}")
        return meta[key]

    def integer(key: str) -> int:
        value = text(key)
        if not _INT_RE.fullmatch(value) or not -1 <= int(value) <= _INT64_MAX:
            raise CodecError("bad_header", f"header field {key!r}={value[:30]!r} is not an integer >= -1")
        return int(value)

    def obj(key: str) -> Any:
        try:
            return json.loads(text(key))
        except (ValueError, RecursionError) as exc:
            raise CodecError("bad_header", f"header field {key!r} is not JSON: {exc}"[:300]) from None

    kind, learner, run = text("kind"), text("learner"), text("run_id")
    if kind not in KINDS:
        raise CodecError("bad_header", f"unknown kind {kind[:30]!r}")
    if not run or (learner and not ID_PATTERN.match(learner)):
        raise CodecError("bad_header", "empty run_id or invalid learner id")
    try:
        clock = VectorClock.from_json(text("clock"))
    except CodecError as exc:
        raise CodecError("bad_header", f"header field 'clock': {exc.detail}") from None
    extra, shapes, dtypes = obj("extra"), obj("shapes"), obj("dtypes")
    if not isinstance(extra, dict):
        raise CodecError("bad_header", "header field 'extra' is not a JSON object")
    if not isinstance(shapes, dict) or not all(_is_int_list(s, 0) for s in shapes.values()):
        raise CodecError("bad_header", "header field 'shapes' is not {name: [dims]}")
    if not isinstance(dtypes, dict) or set(dtypes) != set(shapes) or not all(
        isinstance(d, str) for d in dtypes.values()
    ):
        raise CodecError("bad_header", "header field 'dtypes' does not match 'shapes'")
    checksum = text("checksum")
    if not re.fullmatch(r"[0-9a-f]{64}", checksum):
        raise CodecError("bad_header", "header field 'checksum' is not a sha256 hex digest")
    ints = {f: integer(f) for f in _INT_FIELDS}
    return Header(
        kind=kind, run_id=run, learner=learner, clock=clock, codec=text("codec"), extra=extra,
        shapes={n: tuple(s) for n, s in shapes.items()}, dtypes=dtypes, checksum=checksum,
        signer=meta.get(SIGNER_FIELD, ""), **ints,
    )  # fmt: skip


def _check_layout(header: Header, entries: dict[str, Any]) -> dict[str, tuple[torch.dtype, tuple, list]]:
    """Check that the stored tensors are exactly what the header's codec and shapes imply."""
    codec, bs = header.codec, header.block_size
    if codec not in CODECS:
        raise CodecError("codec", f"unknown codec {codec[:30]!r}")
    if codec in QMAX and not (2 <= bs <= MAX_BLOCK_SIZE and bs % 2 == 0):
        raise CodecError("codec", f"block_size {bs} is not an even number in [2, {MAX_BLOCK_SIZE}]")
    wanted: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in header.shapes.items():
        if ":" in name or not name:
            raise CodecError("bad_header", f"tensor name {name[:80]!r} is not allowed")
        if codec in QMAX:
            num_blocks = -(-_numel(shape) // bs)
            q_len = num_blocks * (bs if codec == "int8" else bs // 2)
            wanted[f"{name}:q"] = ("I8" if codec == "int8" else "U8", (q_len,))
            wanted[f"{name}:scale"] = ("F32", (num_blocks,))
        else:
            wanted[name] = ("F32" if codec == "fp32" else "BF16", shape)
    stored = {k: v for k, v in entries.items() if k != "__metadata__"}
    reason = "codec" if codec in QMAX else "shape"
    if set(stored) != set(wanted):
        raise CodecError(reason, f"stored tensors {_names(stored)} do not match the header's {_names(wanted)}")
    layout = {}
    for key, (dtype, shape) in wanted.items():
        entry = stored[key]
        if entry["dtype"] != dtype or tuple(entry["shape"]) != shape:
            raise CodecError(reason, f"{key[:80]!r} is {entry['dtype']}{entry['shape']}, expected {dtype}{list(shape)}")
        layout[key] = (_ST_TO_TORCH[dtype], shape, entry["data_offsets"])
    return layout


def _names(d: Mapping[str, Any]) -> str:
    names = sorted(d)
    return repr(names[:4])[:-1] + (f", ... {len(names)} in all]" if len(names) > 4 else "]")


def _check_expect(shapes: dict[str, tuple[int, ...]], expect: Mapping[str, tuple[int, ...]]) -> None:
    if set(shapes) != set(expect):
        missing, unexpected = sorted(set(expect) - set(shapes)), sorted(set(shapes) - set(expect))
        raise CodecError("shape", f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    for name, shape in expect.items():
        if tuple(shapes[name]) != tuple(shape):
            raise CodecError("shape", f"{name!r} is {list(shapes[name])}, expected {list(shape)}")


def _load(mv: memoryview, data_start: int, spec: tuple[torch.dtype, tuple, list]) -> torch.Tensor:
    dtype, shape, (start, end) = spec
    if start == end:
        return torch.empty(shape, dtype=dtype)
    # One copy into memory the tensor owns (torch.frombuffer on read-only bytes would alias them).
    buf = bytearray(mv[data_start + start : data_start + end])
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def _restore(header: Header, name: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    shape = header.shapes[name]
    if header.codec == "fp32":
        return stored[name]
    if header.codec == "bf16":
        return stored[name].float()
    return _dequantize(stored[f"{name}:q"], stored[f"{name}:scale"], header.codec,
                       header.block_size, _numel(shape)).view(shape)  # fmt: skip


def _dequantize(q: torch.Tensor, scale: torch.Tensor, codec: str, block_size: int, numel: int) -> torch.Tensor:
    out = torch.empty(numel, dtype=torch.float32)
    num_full = numel // block_size
    rows = max(1, _CHUNK_VALUES // block_size)
    width = block_size if codec == "int8" else block_size // 2
    q2 = q.view(torch.int8).view(-1, width)
    tmp = _scratch(min(rows, max(1, num_full)), block_size, out.device).q
    for start in range(0, num_full, rows):
        stop = min(num_full, start + rows)
        o2 = out[start * block_size : stop * block_size].view(-1, block_size)
        _dequantize_rows(q2[start:stop], scale[start:stop], o2, tmp[: stop - start], codec)
    if num_full * block_size < numel:
        tail = torch.empty((1, block_size), dtype=torch.float32)
        _dequantize_rows(q2[num_full:], scale[num_full:], tail, tmp[:1], codec)
        out[num_full * block_size :] = tail[0, : numel - num_full * block_size]
    return out


def _dequantize_rows(q2: torch.Tensor, scale: torch.Tensor, o2: torch.Tensor, tmp: torch.Tensor, codec: str) -> None:
    if codec == "int8":
        o2.copy_(q2)
    else:
        half = o2.shape[1] // 2
        torch.bitwise_right_shift(q2, 4, out=tmp[:, half:])  # arithmetic shift: sign-extends
        torch.bitwise_left_shift(q2, 4, out=tmp[:, :half])
        tmp[:, :half].bitwise_right_shift_(4)
        o2.copy_(tmp)
    o2.mul_(scale[:, None])


def _check_finite(header: Header, stored: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    if header.codec in QMAX:
        qmax = QMAX[header.codec]
        for name in tensors:
            scale = stored[f"{name}:scale"]
            if not bool(torch.isfinite(scale * qmax).all()):
                raise CodecError("nonfinite", f"{name!r}: a scale is NaN, Inf or would overflow")
            if bool((scale < 0).any()):
                raise CodecError("codec", f"{name!r}: negative scale")
        return
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise CodecError("nonfinite", f"{name!r}: NaN or Inf")


# --- checksum ------------------------------------------------------------------------------------


_HASH_POOL: ThreadPoolExecutor | None = None


def _hash_pool() -> ThreadPoolExecutor:
    global _HASH_POOL
    if _HASH_POOL is None:
        _HASH_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddiloco-codec-sha256")
    return _HASH_POOL


class _Digest:
    """sha256 fed in order; with ``_parallel`` the updates run on one worker thread (FIFO), so
    hashing overlaps the quantizer. Callers must not modify a buffer after handing it over."""

    def __init__(self, *, _parallel: bool) -> None:
        self._hash = hashlib.sha256()
        self._parallel = _parallel
        self._futures: list[Future[None]] = []

    def update(self, data: torch.Tensor | memoryview) -> None:
        view = _byte_view(data) if isinstance(data, torch.Tensor) else data
        if not len(view):
            return
        if self._parallel:
            self._futures.append(_hash_pool().submit(self._hash.update, view))
        else:
            self._hash.update(view)

    def hexdigest(self) -> str:
        for fut in self._futures:
            fut.result()
        self._futures.clear()
        return self._hash.hexdigest()

    def close(self) -> None:
        """Wait for in-flight updates (they reference caller buffers), ignoring their outcome."""
        for fut in self._futures:
            if not fut.cancel():
                fut.exception()
        self._futures.clear()


def checksum_of(stored: Mapping[str, torch.Tensor]) -> str:
    """The header checksum of a set of stored (wire) tensors: sha256 in sorted key order."""
    h = hashlib.sha256()
    for key in sorted(stored):
        h.update(_byte_view(stored[key].contiguous()))
    return h.hexdigest()
