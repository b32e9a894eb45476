"""Tokenize a text corpus into token shards (``ddiloco-geo data prepare``), and train a small BPE
tokenizer for it (``ddiloco-geo data tokenizer``).

The corpus is any ``data.corpus`` text spec (``shakespeare``, ``stdlib``, a glob of files or a bucket
URL glob, :func:`ddiloco_geo.core.data.load_corpus`), decoded as UTF-8 (invalid bytes replaced).
It is encoded in pieces of about ``piece_bytes`` cut at line ends, with a ``tokenizers`` tokenizer
(a ``tokenizer.json``), into shard files of ``shard_tokens`` tokens in the format of
:mod:`ddiloco_geo.core.tokens`. Everything is written create-only through :mod:`ddiloco_geo.storage`
(a local directory or a bucket): the shards, then ``tokenizer.json``, then ``manifest.json``, so a
dataset whose manifest exists is complete. Preparing into a location that already holds a
different dataset fails; preparing the same corpus again is a no-op.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from ddiloco_geo.core import tokens as tokmod
from ddiloco_geo.core.data import load_corpus
from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.storage import Store

log = logging.getLogger(__name__)

EXTRA_HINT = "install the Hugging Face extra: pip install 'ddiloco-geo[hf]'"


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as exc:
        raise ConfigError(f"tokenizing needs the tokenizers package ({exc}); {EXTRA_HINT}") from None
    return tokenizers


def load_tokenizer(text: str) -> Any:
    """A ``tokenizers.Tokenizer`` from the text of a tokenizer.json."""
    try:
        return _tokenizers().Tokenizer.from_str(text)
    except Exception as exc:  # the Rust side raises plain Exception for malformed JSON
        raise ConfigError(f"not a tokenizers tokenizer.json: {exc}") from None


def pieces(text: str, piece_bytes: int) -> Iterator[str]:
    """``text`` cut after a newline about every ``piece_bytes`` characters (a line never splits)."""
    start = 0
    while start < len(text):
        cut = text.find("\n", start + piece_bytes)
        end = len(text) if cut < 0 else cut + 1
        yield text[start:end]
        start = end


def train_tokenizer(text: str, vocab_size: int, *, min_frequency: int = 2) -> str:
    """A byte-level BPE tokenizer trained on ``text`` (deterministic for a text); its JSON."""
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(pieces(text, 1 << 16), trainer=trainer)
    return tok.to_str()


def prepare(store: Store, *, corpus: str, tokenizer_json: str, shard_tokens: int = 1 << 26,
            max_bytes: int | None = None, piece_bytes: int = 1 << 20) -> dict[str, Any]:
    """Tokenize ``corpus`` into ``store``; returns the manifest."""
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens} must be >= 1")
    tok = load_tokenizer(tokenizer_json)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    text = load_corpus(corpus, max_bytes=max_bytes).decode("utf-8", errors="replace")
    shards: list[dict[str, Any]] = []
    pending: list[np.ndarray] = []
    num_pending = 0
    for piece in pieces(text, piece_bytes):
        ids = np.asarray(tok.encode(piece, add_special_tokens=False).ids, dtype=np.int64)
        pending.append(ids)
        num_pending += len(ids)
        while num_pending >= shard_tokens:
            flat = np.concatenate(pending)
            shards.append(_put_shard(store, len(shards), flat[:shard_tokens], vocab_size))
            pending, num_pending = [flat[shard_tokens:]], len(flat) - shard_tokens
    if num_pending or not shards:
        shards.append(_put_shard(store, len(shards), np.concatenate(pending) if pending else np.zeros(0, np.int64),
                                 vocab_size))
    _put_same(store, tokmod.TOKENIZER_KEY, tokenizer_json.encode())
    doc = tokmod.manifest(shards, vocab_size)
    _put_same(store, tokmod.MANIFEST_KEY, json.dumps(doc, indent=1, sort_keys=True).encode())
    log.info("tokens_prepared store=%s shards=%d tokens=%d vocab=%d dtype=%s", store.url, len(shards),
             doc["num_tokens"], vocab_size, doc["dtype"])
    return doc


def _put_shard(store: Store, i: int, ids: np.ndarray, vocab_size: int) -> dict[str, Any]:
    key = tokmod.shard_key(i)
    _put_same(store, key, tokmod.encode_shard(ids, vocab_size))
    return {"key": key, "num_tokens": int(len(ids))}


def _put_same(store: Store, key: str, data: bytes) -> None:
    """Create ``key``; an existing object must hold the same bytes (a rerun), else refuse."""
    if not store.put_if_absent(key, data) and store.get(key) != data:
        raise ConfigError(f"{store.url}/{key} already exists with other content: prepare into a new location")
