"""Token shards: the on-bucket format of a tokenized corpus, and the reader a learner streams it with.

A dataset is a directory or bucket prefix written by ``ddiloco-geo data prepare``
(:mod:`ddiloco_geo.tools.prepare`)::

    shard-00000.tok, shard-00001.tok, ...   token ids, in corpus order
    tokenizer.json                          the ``tokenizers`` tokenizer that produced them
    manifest.json                           written last: the dataset exists once it does

Shard file (format version 1, little-endian)::

    offset  size  field
    0       8     magic b"DDTOKENS"
    8       4     version (uint32) = 1
    12      4     bytes per token (uint32): 2 (uint16) when vocab_size <= 65536, else 4 (uint32)
    16      8     num_tokens (uint64)
    24      8     vocab_size (uint64)
    32      ...   num_tokens token ids

``manifest.json``: ``{"format": "ddiloco-tokens", "version": 1, "dtype": "uint16", "vocab_size",
"num_tokens", "tokenizer": "tokenizer.json", "shards": [{"key", "num_tokens"}, ...]}``.

The shards form one token stream. The last ``ceil(eval_ratio * num_tokens)`` tokens are held out
(:meth:`TokenSource.eval_batches`, the same windows every time); the rest is split into
``num_slices`` contiguous, disjoint slices, one per learner and torchrun rank. A
:class:`TokenReader` walks its slice in windows of ``block_size + 1`` tokens, grouped into chunks
of about ``chunk_tokens``: epoch ``e`` shifts every window by a seeded offset in
``[0, block_size)``, visits the chunks in a permutation seeded by ``(seed, slice, e)`` and the
windows inside a chunk in another; each chunk is one ranged read per shard file it touches
(a background thread fetches the next one while the current one trains). Its cursor
(``state_dict``) is four integers, so a restarted learner continues with exactly the batch it
would have read next.

The reader talks to any object with ``get(key, start, end) -> bytes`` (a
:class:`~ddiloco_geo.storage.Store`); headers are checked on the first read of each file.
"""

from __future__ import annotations

import bisect
import json
import math
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from ddiloco_geo.core.data import eval_batches as window_batches
from ddiloco_geo.core.data import shard_stripes
from ddiloco_geo.core.errors import ConfigError

MAGIC = b"DDTOKENS"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")  # magic, version, bytes per token, num_tokens, vocab_size
HEADER_BYTES = HEADER.size  # 32
MANIFEST_KEY = "manifest.json"
TOKENIZER_KEY = "tokenizer.json"
FORMAT = "ddiloco-tokens"
DTYPES = {2: "uint16", 4: "uint32"}


class ByteSource(Protocol):
    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes: ...


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65536), else uint32; little-endian."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_key(i: int) -> str:
    return f"shard-{i:05d}.tok"


def encode_shard(tokens: np.ndarray, vocab_size: int) -> bytes:
    """One shard file: header + token ids in the dtype the vocabulary needs."""
    dtype = dtype_for(vocab_size)
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    return HEADER.pack(MAGIC, VERSION, dtype.itemsize, len(tokens), vocab_size) + tokens.astype(dtype).tobytes()


def decode_header(raw: bytes, key: str = "shard") -> tuple[np.dtype, int, int]:
    """(dtype, num_tokens, vocab_size) of a shard header, or ConfigError naming what is wrong."""
    if len(raw) < HEADER_BYTES:
        raise ConfigError(f"{key}: {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte token shard header")
    magic, version, itemsize, num_tokens, vocab_size = HEADER.unpack(raw[:HEADER_BYTES])
    if magic != MAGIC or version != VERSION or itemsize not in DTYPES:
        raise ConfigError(f"{key} is not a version-{VERSION} token shard (magic {magic!r}, version {version}, "
                          f"{itemsize} bytes/token); write it with 'ddiloco-geo data prepare'")
    return np.dtype(DTYPES[itemsize]).newbyteorder("<"), num_tokens, vocab_size


def manifest(shards: list[dict[str, Any]], vocab_size: int) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "dtype": dtype_for(vocab_size).name, "vocab_size": vocab_size,
            "num_tokens": sum(int(s["num_tokens"]) for s in shards), "tokenizer": TOKENIZER_KEY, "shards": shards}


class TokenSource:
    """A token dataset in a store: its manifest, ranged reads of the token stream, the eval split."""

    def __init__(self, store: ByteSource, *, eval_ratio: float, where: str = "tokens") -> None:
        self.store, self.where = store, where
        try:
            doc = json.loads(store.get(MANIFEST_KEY))
        except Exception as exc:
            raise ConfigError(f"{where}: cannot read {MANIFEST_KEY} ({exc}); run 'ddiloco-geo data prepare' first") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ConfigError(f"{where}/{MANIFEST_KEY} is not a version-{VERSION} {FORMAT} manifest")
        self.manifest = doc
        self.vocab_size = int(doc["vocab_size"])
        self.dtype = dtype_for(self.vocab_size)
        self.keys = [s["key"] for s in doc["shards"]]
        self.offsets = np.cumsum([0] + [int(s["num_tokens"]) for s in doc["shards"]]).tolist()
        self.num_tokens = self.offsets[-1]
        if not 0.0 < eval_ratio < 1.0:
            raise ValueError(f"eval_ratio={eval_ratio} must be in (0, 1)")
        self.num_eval = int(math.ceil(self.num_tokens * eval_ratio))
        self.num_train = self.num_tokens - self.num_eval
        if self.num_train <= 0:
            raise ConfigError(f"{where} holds {self.num_tokens} tokens, too few to hold out eval_ratio={eval_ratio}")
        self.checked: set[str] = set()
        self.num_reads = 0
        self.bytes_read = 0

    def read(self, start: int, end: int) -> np.ndarray:
        """Tokens ``[start, end)`` of the stream as int64: one ranged read per shard file touched."""
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"token range [{start}, {end}) outside [0, {self.num_tokens})")
        parts = []
        i = bisect.bisect_right(self.offsets, start) - 1
        while start < end:
            lo, hi = start - self.offsets[i], min(end, self.offsets[i + 1]) - self.offsets[i]
            if hi > lo:
                parts.append(self._read_file(i, lo, hi))
            start = self.offsets[i] + hi
            i += 1
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    def _read_file(self, i: int, lo: int, hi: int) -> np.ndarray:
        key, size = self.keys[i], self.dtype.itemsize
        if key not in self.checked:
            dtype, count, vocab = decode_header(self.store.get(key, 0, HEADER_BYTES), f"{self.where}/{key}")
            expected = self.offsets[i + 1] - self.offsets[i]
            if dtype != self.dtype or count != expected or vocab != self.vocab_size:
                raise ConfigError(f"{self.where}/{key}: header ({dtype}, {count} tokens, vocab {vocab}) disagrees "
                                  f"with the manifest ({self.dtype}, {expected} tokens, vocab {self.vocab_size})")
            self.checked.add(key)
        raw = self.store.get(key, HEADER_BYTES + lo * size, HEADER_BYTES + hi * size)
        if len(raw) != (hi - lo) * size:
            raise ConfigError(f"{self.where}/{key}: short read ({len(raw)} of {(hi - lo) * size} bytes): truncated shard")
        self.num_reads += 1
        self.bytes_read += len(raw)
        return np.frombuffer(raw, dtype=self.dtype)

    def eval_batches(self, block_size: int, batch_size: int, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fixed batches of windows spread evenly over the held-out tokens (as for byte corpora)."""
        return window_batches(self.read(self.num_train, self.num_tokens), block_size, batch_size, num_batches)


class TokenReader:
    """Batches ``(x, y, num_tokens)`` from slice ``shard`` of ``num_shards`` of the training tokens:
    one contiguous region cut in chunks, or (``layout="interleaved"``) every ``num_shards``-th chunk."""

    def __init__(self, source: TokenSource, shard: int, num_shards: int, block_size: int, batch_size: int,
                 seed: int, chunk_tokens: int, layout: str = "contiguous") -> None:
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"block_size={block_size} and batch_size={batch_size} must be >= 1")
        self.source = source
        self.chunk_windows = max(1, chunk_tokens // block_size)
        self.chunk_tokens = chunk_tokens
        # interleaved: the stripes are the chunks (one ranged read each), dealt round-robin over the shards
        spans = shard_stripes(source.num_train, shard, num_shards, self.chunk_windows * block_size, layout)
        self.spans = [(a, b) for a, b in spans if b - a >= 2 * block_size + 1]
        if not self.spans:
            raise ConfigError(f"token slice {shard}/{num_shards} holds {sum(b - a for a, b in spans)} tokens, fewer than "
                              f"2 * block_size + 1 = {2 * block_size + 1} in one piece; use more data or fewer learners"
                              + (" (or data.shard_layout='contiguous')" if layout == "interleaved" else ""))
        self.start, self.end = self.spans[0][0], self.spans[-1][1]
        self.shard, self.num_shards, self.layout = shard, num_shards, layout
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        self.epoch = self.chunk = self.index = self.tokens_seen = 0
        self._plans: dict[int, tuple[int, np.ndarray, int]] = {}  # epoch -> (offset, chunk order, windows)
        self._loaded: tuple[tuple[int, int], np.ndarray, np.ndarray] | None = None  # (epoch, chunk), tokens, order
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-prefetch")
        self._next: tuple[tuple[int, int], Future] | None = None

    # -- the walk --

    def _epoch_plan(self, epoch: int) -> tuple[int, np.ndarray, int]:
        """(offset, chunk order, number of windows) of an epoch; the two newest are kept."""
        if epoch not in self._plans:
            rng = np.random.default_rng([self.seed, self.shard, epoch])
            offset = int(rng.integers(0, self.block_size))
            if self.layout == "contiguous":
                num_windows = (self.end - self.start - 1 - offset) // self.block_size
                num_chunks = -(-num_windows // self.chunk_windows)
            else:  # one chunk a stripe
                num_windows = sum((b - a - 1 - offset) // self.block_size for a, b in self.spans)
                num_chunks = len(self.spans)
            self._plans = {e: v for e, v in self._plans.items() if e >= epoch - 1}
            self._plans[epoch] = (offset, rng.permutation(num_chunks), num_windows)
        return self._plans[epoch]

    def _chunk_span(self, epoch: int, chunk: int) -> tuple[int, int, int]:
        """(first token, end token, windows) of the chunk at position ``chunk`` of epoch ``epoch``."""
        offset, order, num_windows = self._epoch_plan(epoch)
        if self.layout != "contiguous":  # one stripe: its windows from the epoch's offset on
            a, b = self.spans[int(order[chunk])]
            count = (b - a - 1 - offset) // self.block_size  # >= 1: every kept stripe holds 2 * block_size + 1
            return a + offset, a + offset + count * self.block_size + 1, count
        first = int(order[chunk]) * self.chunk_windows
        count = min(self.chunk_windows, num_windows - first)
        begin = self.start + offset + first * self.block_size
        return begin, begin + count * self.block_size + 1, count

    def _fetch(self, at: tuple[int, int], span: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
        """Runs in the prefetch thread: one ranged read and the chunk's window order (no shared state)."""
        begin, end, count = span
        order = np.random.default_rng([self.seed, self.shard, at[0], at[1]]).permutation(count)
        return self.source.read(begin, end), order

    def _following(self, epoch: int, chunk: int) -> tuple[int, int]:
        return (epoch, chunk + 1) if chunk + 1 < len(self._epoch_plan(epoch)[1]) else (epoch + 1, 0)

    def _current(self) -> tuple[np.ndarray, np.ndarray]:
        at = (self.epoch, self.chunk)
        if self._loaded is None or self._loaded[0] != at:
            if self._next is not None and self._next[0] == at:
                tokens, order = self._next[1].result()
            else:
                tokens, order = self._fetch(at, self._chunk_span(*at))
            self._loaded = (at, tokens, order)
            nxt = self._following(*at)
            self._next = (nxt, self._pool.submit(self._fetch, nxt, self._chunk_span(*nxt)))
        return self._loaded[1], self._loaded[2]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        rows = []
        while len(rows) < self.batch_size:
            tokens, order = self._current()
            take = order[self.index: self.index + self.batch_size - len(rows)]
            rows.extend(tokens[int(k) * self.block_size: int(k) * self.block_size + self.block_size + 1] for k in take)
            self.index += len(take)
            if self.index >= len(order):
                self.epoch, self.chunk = self._following(self.epoch, self.chunk)
                self.index = 0
        chunk = torch.from_numpy(np.stack(rows))
        x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
        self.tokens_seen += x.numel()
        return x, y, x.numel()

    # -- the cursor --

    def state_dict(self) -> dict[str, int]:
        return {"format": "tokens", "layout": self.layout, "epoch": self.epoch, "chunk": self.chunk, "index": self.index,
                "tokens_seen": self.tokens_seen, "shard": self.shard, "num_shards": self.num_shards,
                "block_size": self.block_size, "batch_size": self.batch_size, "seed": self.seed,
                "chunk_tokens": self.chunk_tokens, "num_train": self.source.num_train}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != "tokens":
            raise ValueError("data cursor was saved by a byte-corpus reader; this run reads token shards")
        state = {"layout": "contiguous", **state}  # a cursor from before data.shard_layout: one region
        for key in ("layout", "shard", "num_shards", "block_size", "batch_size", "seed", "chunk_tokens", "num_train"):
            have = self.source.num_train if key == "num_train" else getattr(self, key)
            if key in state and state[key] != have:
                raise ValueError(f"data cursor was saved with {key}={state[key]}, this reader has {have}")
        epoch, chunk, index = int(state["epoch"]), int(state["chunk"]), int(state["index"])
        if epoch < 0 or not 0 <= chunk < len(self._epoch_plan(epoch)[1]) or not 0 <= index < self._chunk_span(epoch, chunk)[2]:
            raise ValueError(f"data cursor out of range: {state}")
        self.epoch, self.chunk, self.index = epoch, chunk, index
        self.tokens_seen = int(state["tokens_seen"])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
