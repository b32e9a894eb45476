"""The header checksum: BLAKE3 (format 2; SHA-256 in format 1) over the raw bytes of every stored
tensor, in sorted key order.

"Stored" means the tensors as they sit on the wire (``<name>`` for fp32/bf16, ``<name>:q`` then
``<name>:scale`` for int8/int4), so the checksum covers exactly the data section and is checked
before any value is trusted. It detects corruption, not forgery: header fields outside the tensor
bytes are validated, not hashed (a signature covers them; see ``wire``).

BLAKE3 because it is a cryptographic hash (a signature covers the checksum, so it must bind the
tensor bytes) that runs 2.6 times as fast as SHA-256 on one core here (4.7 against 1.8 GB/s, with
SHA-NI): the syncer hashes every global and state object it publishes (docs/benchmarks.md, Syncer
throughput). Format-1 objects (SHA-256) are still read, so buckets written before it stay usable.

Hashing can overlap other work: both hashes release the GIL, so ``Digest`` can feed a single worker
thread (FIFO, so order is kept) when there is enough to hash to pay for the hand-off. ``wire`` uses
it in decode (hashing the stored bytes while the tensors are restored) and for fp32/bf16 encodes;
the quantized and sparse encodes hash on their own thread, which measured faster (stop 37).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import blake3
import torch

from ddiloco_geo.codec.framing import byte_view
from ddiloco_geo.codec.header import FORMAT_VERSION

# The checksum's hash in each format version a reader accepts (``header.READABLE_FORMATS``).
HASHES = {1: hashlib.sha256, 2: blake3.blake3, 3: blake3.blake3}

# Hash on a worker thread only when there is enough to hash to pay for the hand-off.
PARALLEL_HASH_BYTES = 1 << 20

_HASH_POOL: ThreadPoolExecutor | None = None


def _hash_pool() -> ThreadPoolExecutor:
    global _HASH_POOL
    if _HASH_POOL is None:
        _HASH_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddiloco-codec-hash")
    return _HASH_POOL


class Digest:
    """The checksum of format ``fmt`` fed in order; with ``parallel`` the updates run on one worker
    thread (FIFO), so hashing overlaps the quantizer. Callers must not modify a buffer after
    handing it over."""

    def __init__(self, *, parallel: bool, fmt: int = FORMAT_VERSION) -> None:
        self._hash = HASHES[fmt]()
        self._parallel = parallel
        self._futures: list[Future[None]] = []

    def update(self, data: torch.Tensor | memoryview) -> None:
        view = byte_view(data) if isinstance(data, torch.Tensor) else data
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


def checksum_of(stored: Mapping[str, torch.Tensor], fmt: int = FORMAT_VERSION) -> str:
    """The header checksum (of format ``fmt``) of a set of stored (wire) tensors, in sorted key order."""
    h = HASHES[fmt]()
    for key in sorted(stored):
        h.update(byte_view(stored[key].contiguous()))
    return h.hexdigest()
