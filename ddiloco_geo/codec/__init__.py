"""The wire format: every tensor object in the bucket, as a safetensors file (format version 1).

Deltas, global fragments, update objects, syncer state and learner checkpoints all use this one
format: a plain safetensors file whose ``__metadata__`` carries the header; nothing is ever
pickled. Pure tensor code, no I/O. The modules, bottom up:

- ``framing``: safetensors bytes in and out, ``header_span`` and ``MAX_HEADER_BYTES``;
- ``header``: the ``Header`` dataclass and the metadata fields (``FORMAT_VERSION``, ``KINDS``);
- ``quantize``: the codecs (``CODECS``: fp32, bf16, blockwise int8/int4, topk) and their error bounds;
- ``sparse``: the ``topk`` codec (per-chunk top-k, 12-bit indices, ternary values) and ``sparsify``,
  what it sends as a dense tensor (for error feedback: ``residual = x - sparsify(x)``);
- ``checksum``: BLAKE3 (format 1: SHA-256) over the stored tensor bytes (``checksum_of``);
- ``wire``: ``encode``/``decode``/``read_header``, ``roundtrip`` (what decode would yield, without
  serializing: for error feedback), the order of decode's checks, and signing.

``decode`` raises only ``CodecError(reason, detail)``; ``read_header`` never verifies anything
(routing, never trust). This facade is the public API: call sites use ``from ddiloco_geo import
codec`` and ``codec.encode(...)``.
"""

from __future__ import annotations

from ddiloco_geo.codec.checksum import checksum_of
from ddiloco_geo.codec.framing import MAX_HEADER_BYTES, header_span
from ddiloco_geo.codec.header import FORMAT_KEY, FORMAT_VERSION, KINDS, Header
from ddiloco_geo.codec.quantize import CODECS, DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, QMAX, Codec
from ddiloco_geo.codec.sparse import DEFAULT_CHUNK, DEFAULT_TOPK, MAX_CHUNK, sparsify
from ddiloco_geo.codec.wire import decode, encode, read_header, roundtrip
from ddiloco_geo.core.errors import CodecError

__all__ = [
    "CODECS", "DEFAULT_BLOCK_SIZE", "DEFAULT_CHUNK", "DEFAULT_TOPK", "FORMAT_KEY", "FORMAT_VERSION", "KINDS", "MAX_BLOCK_SIZE", "MAX_CHUNK",
    "MAX_HEADER_BYTES", "QMAX", "Codec", "CodecError", "Header", "checksum_of", "decode", "encode",
    "header_span", "read_header", "roundtrip", "sparsify",
]  # fmt: skip
