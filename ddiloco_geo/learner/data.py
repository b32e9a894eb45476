"""What a learner reads, and what an evaluator holds out: one factory for both kinds of corpus.

``data.corpus`` names the corpus:

* ``shakespeare``, ``stdlib`` or a glob of text files: the byte-level corpus of
  :mod:`ddiloco_geo.core.data`, read whole, split, and walked by a :class:`~ddiloco_geo.core.data.ShardReader`
  (unchanged: the byte-level demo);
* ``tokens:URL``: token shards written by ``ddiloco-geo data prepare`` in a directory or a bucket
  (``file://``, ``memory://``, ``s3://``, ``gs://`` or a path), streamed with ranged reads through
  :mod:`ddiloco_geo.storage` by a :class:`~ddiloco_geo.core.tokens.TokenReader`; ``data.storage``
  holds that bucket's storage settings (endpoint, region, credentials mode, retries).

Each learner shard ``i/N`` and torchrun rank ``r`` of ``world`` reads slice ``i * world + r`` of
``N * world``: disjoint and deterministic. Both readers have ``next_batch() -> (x, y, num_tokens)``
and a ``state_dict`` the learner's checkpoint stores.
"""

from __future__ import annotations

import torch

from ddiloco_geo.core import data as datamod
from ddiloco_geo.core.config import DataConfig, StorageConfig
from ddiloco_geo.core.errors import ConfigError, NotFoundError
from ddiloco_geo.core.tokens import TOKENIZER_KEY, TokenReader, TokenSource
from ddiloco_geo.storage import Store, open_store

TOKENS_SCHEME = "tokens:"


def tokens_url(data: DataConfig) -> str | None:
    """The token dataset's URL if ``data.corpus`` is ``tokens:URL``, else None."""
    if not data.corpus.startswith(TOKENS_SCHEME):
        return None
    url = data.corpus[len(TOKENS_SCHEME):]
    if not url:
        raise ConfigError("data.corpus='tokens:' needs a location, e.g. tokens:s3://bucket/tokens or tokens:./tokens")
    return url


def open_tokens_store(data: DataConfig, url: str | None = None) -> Store:
    """A store on the token dataset (``url``, default the corpus's), with ``data.storage``'s settings."""
    url = url or tokens_url(data)
    if url is None:
        raise ConfigError(f"data.corpus={data.corpus!r} is not a tokens: corpus")
    return open_store(StorageConfig(**{**data.storage, "url": url}))


def make_reader(data: DataConfig, *, block_size: int, batch_size: int, seed: int, slice_index: int,
                num_slices: int, vocab_size: int | None = None) -> datamod.ShardReader | TokenReader:
    """The training reader for slice ``slice_index`` of ``num_slices``; with ``vocab_size`` (the
    model's), a token dataset with a larger vocabulary is refused before any step."""
    if tokens_url(data) is None:
        corpus = datamod.load_corpus(data.corpus, max_bytes=data.max_bytes)
        train, _ = datamod.split(corpus, data.eval_ratio)
        return datamod.ShardReader(train, shard=slice_index, num_shards=num_slices, block_size=block_size,
                                   batch_size=batch_size, seed=seed, layout=data.shard_layout)
    source = TokenSource(open_tokens_store(data), eval_ratio=data.eval_ratio, where=data.corpus)  # open for the run
    if vocab_size is not None and source.vocab_size > vocab_size:
        raise ConfigError(f"{data.corpus} has a vocabulary of {source.vocab_size} tokens but the model's embedding has "
                          f"{vocab_size} rows: give the model vocab_size >= {source.vocab_size}")
    return TokenReader(source, slice_index, num_slices, block_size, batch_size, seed, data.chunk_tokens,
                       data.shard_layout)


def eval_batches_for(data: DataConfig, *, block_size: int, batch_size: int,
                     num_batches: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out batches of either kind of corpus (``data.eval_batches`` by default)."""
    n = num_batches or data.eval_batches
    if tokens_url(data) is None:
        corpus = datamod.load_corpus(data.corpus, max_bytes=data.max_bytes)
        _, eval_data = datamod.split(corpus, data.eval_ratio)
        return datamod.eval_batches(eval_data, block_size, batch_size, n)
    store = open_tokens_store(data)
    try:
        return TokenSource(store, eval_ratio=data.eval_ratio, where=data.corpus).eval_batches(block_size, batch_size, n)
    finally:
        store.close()


def tokenizer_json(data: DataConfig) -> str | None:
    """The dataset's ``tokenizer.json`` text for a tokens: corpus; None for byte corpora."""
    if tokens_url(data) is None:
        return None
    store = open_tokens_store(data)
    try:
        return store.get(TOKENIZER_KEY).decode()
    except NotFoundError:
        return None
    finally:
        store.close()

