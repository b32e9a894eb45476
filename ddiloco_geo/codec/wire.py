"""Encode and decode one object: header + codec + checksum + signature, in a fixed order.

``encode`` checks its arguments (ValueError), stores every tensor with its codec (``quantize``),
hashes the stored bytes as they are produced (``checksum``), builds the metadata (``header``),
signs it when given a signer, and frames the lot (``framing``). A tensor holding NaN/Inf raises
``CodecError("nonfinite", name)``: it must not reach the wire.

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

from collections.abc import Mapping
from typing import Any

import torch

from ddiloco_geo.codec.checksum import PARALLEL_HASH_BYTES, Digest
from ddiloco_geo.codec.framing import ST_TO_TORCH, as_bytes, is_int_list, load, numel, parse_framing, serialize
from ddiloco_geo.codec.header import Header, check_header, header_metadata, parse_metadata
from ddiloco_geo.codec.quantize import (
    CODECS, MAX_BLOCK_SIZE, NEGATIVE_SCALE, NONFINITE_SCALE, QMAX, all_finite, dequantize_blocks, quantize_blocks,
    resolve_block_size, scale_problems, store_float,
)  # fmt: skip
from ddiloco_geo.codec.sparse import (
    MAX_CHUNK, index_bits, index_stream_bytes, kept_count, pack_indices, resolve, sparse_decode, sparse_encode,
    sparsify, stored_sizes, unpack_bits, unpack_indices,
)  # fmt: skip
from ddiloco_geo.core.errors import CodecError
from ddiloco_geo.core.signing import SIGNATURE_FIELD, SIGNER_FIELD, Signer, Verifier, signed_message

# The topk codec stores three tensors per object, whatever the number of tensors: the indices of
# all tensors as one Rice-coded stream (``sparse.pack_indices``; formats 1 and 2: each tensor's
# fixed-width indices, concatenated), and each tensor's codes and scales concatenated, in sorted
# name order. A safetensors entry per part and tensor made the header larger than the payload of
# a small fragment's delta.
TOPK_KEYS = ("topk:idx", "topk:q", "topk:scale")

# --- encode --------------------------------------------------------------------------------------


def encode(
    tensors: Mapping[str, torch.Tensor],
    header: Header,
    *,
    codec: str | None = None,
    block_size: int | None = None,
    topk: int | None = None,
    signer: Signer | None = None,
) -> bytes:
    """Serialize ``tensors`` (floating point, any device) with ``header`` as one safetensors object.

    ``codec``/``block_size`` override the header's; the header's ``block_size`` 0 means the
    default (128) for int8/int4. For ``topk``, ``block_size`` is the chunk (default 4096) and
    ``topk`` the values kept per chunk (overrides the header's; default 64). With ``signer`` the metadata also gets ``signer`` (its key id)
    and ``signature`` (HMAC over every other metadata field, checksum included; see
    ``ddiloco_geo.core.signing``). Raises ValueError for unusable arguments and
    ``CodecError("nonfinite", name)`` if a tensor holds NaN/Inf (it must not reach the wire).
    """
    if signer is not None and not isinstance(signer, Signer):
        raise ValueError(f"signer: expected a signing.Signer, got {type(signer).__name__}")
    codec = header.codec if codec is None else codec
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}: expected one of {', '.join(CODECS)}")
    block_size = header.block_size if block_size is None else block_size
    topk = header.topk if topk is None else topk
    if codec == "topk":
        block_size, topk = resolve(block_size, topk)
    else:
        block_size, topk = resolve_block_size(codec, block_size), 0
    check_header(header)
    names = _check_tensors(tensors)
    # Stored keys are laid out, and hashed, in sorted key order: order names by their first key
    # (topk: the packed parts follow the names' own order, see TOPK_KEYS).
    names.sort(key=lambda n: n + ":" if codec in QMAX else n)

    # Only fp32 and bf16 hash on the worker thread: the quantized and sparse codecs store an eighth
    # of the input's bytes or far less, and handing those over measured slower than hashing them here.
    fp32_bytes = sum(t.numel() for t in tensors.values()) * 4
    digest = Digest(parallel=codec in ("fp32", "bf16") and fp32_bytes >= PARALLEL_HASH_BYTES)
    stored: dict[str, torch.Tensor] = {}
    sparse: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    try:
        for name in names:
            x = tensors[name].detach()
            if codec == "topk":
                try:
                    sparse.append(sparse_encode(x, block_size, topk))
                except CodecError as exc:
                    raise CodecError(exc.reason, f"{name}: {exc.detail}") from None
            elif codec in QMAX:
                try:
                    q, scale = quantize_blocks(x.reshape(-1), codec, block_size, digest.update)
                except CodecError as exc:
                    raise CodecError(exc.reason, f"{name}: {exc.detail}") from None
                digest.update(scale)
                stored[f"{name}:q"], stored[f"{name}:scale"] = q, scale
            else:
                stored[name] = store_float(x, codec, name)
                digest.update(stored[name])
        if codec == "topk":  # three stored tensors in all (empty ones for an object without tensors)
            local, codes, scales = list(zip(*sparse)) or [(torch.empty(0, dtype=torch.long),),
                                                          (torch.empty(0, dtype=torch.uint8),), (torch.empty(0),)]
            numels = [tensors[n].numel() for n in names]
            for key, part in zip(TOPK_KEYS, (pack_indices(torch.cat(local), numels, block_size, topk),
                                             torch.cat(codes), torch.cat(scales))):  # fmt: skip
                stored[key] = part
                digest.update(part)
        checksum = digest.hexdigest()
    finally:
        digest.close()

    metadata = header_metadata(
        header, codec=codec, block_size=block_size, topk=topk, checksum=checksum,
        shapes={n: list(tensors[n].shape) for n in names},
        dtypes={n: str(tensors[n].dtype).removeprefix("torch.") for n in names},
    )  # fmt: skip
    if signer is not None:
        metadata[SIGNER_FIELD] = signer.key_id
        metadata[SIGNATURE_FIELD] = signer.sign(signed_message(metadata))
    return serialize(stored, metadata)


def roundtrip(tensors: Mapping[str, torch.Tensor], codec: str, *, block_size: int = 0,
              topk: int = 0) -> dict[str, torch.Tensor]:
    """What ``decode(encode(tensors, codec=..., block_size=..., topk=...))`` yields, bit for bit,
    without serializing or hashing: float32 CPU tensors of the same shapes (for error feedback,
    ``residual = x - roundtrip(x)``). Raises like ``encode`` for unusable arguments and NaN/Inf."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}: expected one of {', '.join(CODECS)}")
    if codec == "topk":
        block_size, topk = resolve(block_size, topk)
    else:
        block_size = resolve_block_size(codec, block_size)
    out = {}
    for name in _check_tensors(tensors):
        x = tensors[name].detach()
        try:
            if codec == "topk":
                out[name] = sparsify(x, block_size=block_size, topk=topk).cpu()
                if not all_finite(out[name]):
                    raise CodecError("nonfinite", "NaN or Inf in input")
            elif codec in QMAX:
                q, scale = quantize_blocks(x.reshape(-1), codec, block_size, lambda _rows: None)
                out[name] = dequantize_blocks(q, scale, codec, block_size, x.numel()).view(x.shape)
            else:
                out[name] = store_float(x, codec, name).float()
        except CodecError as exc:
            raise CodecError(exc.reason, f"{name}: {exc.detail}") from None
    return out


def _check_tensors(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or ":" in name or name == "__metadata__":
            raise ValueError(f"tensor name {name!r}: expected a non-empty string without ':'")
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"tensor {name!r}: expected a floating-point torch.Tensor")
    return list(tensors)


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
        mv = as_bytes(data)
        entries, _ = parse_framing(mv, prefix_only=True)
        return parse_metadata(entries)
    except CodecError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CodecError("bad_header", f"{type(exc).__name__}: {exc}"[:300]) from None


def _decode(data, kind, run_id, expect, max_bytes, verify=None, require_signature=False, expected_signer=None):
    mv = as_bytes(data)
    if len(mv) > max_bytes:
        raise CodecError("too_large", f"{len(mv)} bytes exceeds max_bytes={max_bytes}")
    entries, data_start = parse_framing(mv, prefix_only=False)
    header = parse_metadata(entries)
    if kind is not None and header.kind != kind:
        raise CodecError("kind", f"expected {kind!r}, got {header.kind!r}")
    if run_id is not None and header.run_id != run_id:
        raise CodecError("run_id", f"expected {run_id!r}, got {header.run_id!r}")
    layout = _check_layout(header, entries)
    if expect is not None:
        _check_expect(header.shapes, expect)

    keys = sorted(layout)
    digest = Digest(parallel=len(mv) - data_start >= PARALLEL_HASH_BYTES, fmt=header.format)
    try:
        for key in keys:
            start, end = layout[key][2]
            digest.update(mv[data_start + start : data_start + end])
        stored = {k: load(mv, data_start, layout[k]) for k in keys}
        try:  # restored while the bytes hash; a malformed sparse payload is reported after the checksum
            if header.codec == "topk":
                stored.update(_unpack_topk(header, stored))
            tensors, malformed = {name: _restore(header, name, stored) for name in sorted(header.shapes)}, None
        except CodecError as exc:
            tensors, malformed = {}, exc
        checksum = digest.hexdigest()
    finally:
        digest.close()
    if checksum != header.checksum:
        raise CodecError("checksum", f"tensor bytes hash to {checksum[:16]}..., header says "
                                     f"{header.checksum[:16]}...")  # fmt: skip
    if malformed is not None:
        raise malformed
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


def _check_layout(header: Header, entries: dict[str, Any]) -> dict[str, tuple[torch.dtype, tuple, list]]:
    """Check that the stored tensors are exactly what the header's codec and shapes imply."""
    codec, bs = header.codec, header.block_size
    if codec not in CODECS:
        raise CodecError("codec", f"unknown codec {codec[:30]!r}")
    if codec in QMAX and not (2 <= bs <= MAX_BLOCK_SIZE and bs % 2 == 0):
        raise CodecError("codec", f"block_size {bs} is not an even number in [2, {MAX_BLOCK_SIZE}]")
    if codec == "topk" and not (2 <= bs <= MAX_CHUNK and 1 <= header.topk <= bs):
        raise CodecError("codec", f"topk {header.topk} of a chunk of {bs}: need 1 <= topk <= chunk <= {MAX_CHUNK}")
    wanted: dict[str, tuple[str, tuple[int, ...]]] = {}
    packed = [0, 0, 0]  # topk: idx bytes (formats 1 and 2), q bytes, scales over all tensors
    for name, shape in header.shapes.items():
        if ":" in name or not name:
            raise CodecError("bad_header", f"tensor name {name[:80]!r} is not allowed")
        if codec == "topk":
            packed = [a + b for a, b in zip(packed, stored_sizes(numel(shape), bs, header.topk))]
        elif codec in QMAX:
            num_blocks = -(-numel(shape) // bs)
            q_len = num_blocks * (bs if codec == "int8" else bs // 2)
            wanted[f"{name}:q"] = ("I8" if codec == "int8" else "U8", (q_len,))
            wanted[f"{name}:scale"] = ("F32", (num_blocks,))
        else:
            wanted[name] = ("F32" if codec == "fp32" else "BF16", shape)
    if codec == "topk":
        wanted.update({key: (dtype, (size,)) for key, dtype, size in zip(TOPK_KEYS, ("U8", "U8", "F32"), packed)})
    stored = {k: v for k, v in entries.items() if k != "__metadata__"}
    reason = "codec" if codec in QMAX or codec == "topk" else "shape"
    if codec == "topk" and header.format >= 3 and isinstance(stored.get(TOPK_KEYS[0]), dict):
        # a Rice-coded stream's length depends on the indices: any length its layout allows
        least, most = index_stream_bytes([numel(s) for s in header.shapes.values()], bs, header.topk)
        size = stored[TOPK_KEYS[0]].get("shape")
        if is_int_list(size, 0) and len(size) == 1 and least <= size[0] <= most:
            wanted[TOPK_KEYS[0]] = ("U8", tuple(size))
        else:
            raise CodecError(reason, f"{TOPK_KEYS[0]!r} is {size!r}: an index stream of this layout takes "
                                     f"{least} to {most} bytes")  # fmt: skip
    if set(stored) != set(wanted):
        raise CodecError(reason, f"stored tensors {_names(stored)} do not match the header's {_names(wanted)}")
    layout = {}
    for key, (dtype, shape) in wanted.items():
        entry = stored[key]
        if entry["dtype"] != dtype or tuple(entry["shape"]) != shape:
            raise CodecError(reason, f"{key[:80]!r} is {entry['dtype']}{entry['shape']}, expected {dtype}{list(shape)}")
        layout[key] = (ST_TO_TORCH[dtype], shape, entry["data_offsets"])
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


def _unpack_topk(header: Header, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor's ``<name>:local`` (its unpacked chunk-relative indices) and views ``:q``/``:scale``
    of its slices of the packed parts; ``CodecError("codec")`` for a malformed index stream."""
    names, chunk, topk = sorted(header.shapes), header.block_size, header.topk
    numels = [numel(header.shapes[name]) for name in names]
    if header.format >= 3:
        local = unpack_indices(stored[TOPK_KEYS[0]], numels, chunk, topk)
    views, offsets = {}, [0, 0, 0]
    for name, n in zip(names, numels):
        sizes, kept = stored_sizes(n, chunk, topk), kept_count(n, chunk, topk)
        if header.format >= 3:
            views[f"{name}:local"] = local[offsets[0] : offsets[0] + kept]
            offsets[0] += kept
        else:  # formats 1 and 2: each tensor's fixed-width indices, padded to a byte
            part = stored[TOPK_KEYS[0]][offsets[0] : offsets[0] + sizes[0]]
            views[f"{name}:local"] = unpack_bits(part, index_bits(chunk), kept)
            offsets[0] += sizes[0]
        for i, (key, part_name) in enumerate(zip(TOPK_KEYS[1:], ("q", "scale")), start=1):
            views[f"{name}:{part_name}"] = stored[key][offsets[i] : offsets[i] + sizes[i]]
            offsets[i] += sizes[i]
    return views


def _restore(header: Header, name: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    shape = header.shapes[name]
    if header.codec == "fp32":
        return stored[name]
    if header.codec == "bf16":
        return stored[name].float()
    if header.codec == "topk":
        return sparse_decode(stored[f"{name}:local"], stored[f"{name}:q"], stored[f"{name}:scale"],
                             header.block_size, header.topk, numel(shape)).view(shape)  # fmt: skip
    return dequantize_blocks(stored[f"{name}:q"], stored[f"{name}:scale"], header.codec,
                             header.block_size, numel(shape)).view(shape)  # fmt: skip


def _check_finite(header: Header, stored: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    if header.codec in QMAX or header.codec == "topk":
        qmax = QMAX.get(header.codec, 1)
        for name in tensors:
            problems = scale_problems(stored[f"{name}:scale"], qmax)
            if problems & NONFINITE_SCALE:
                raise CodecError("nonfinite", f"{name!r}: a scale is NaN, Inf or would overflow")
            if problems & NEGATIVE_SCALE:
                raise CodecError("codec", f"{name!r}: negative scale")
        return
    for name, t in tensors.items():
        if not all_finite(t):
            raise CodecError("nonfinite", f"{name!r}: NaN or Inf")
