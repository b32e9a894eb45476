"""``ddiloco-geo data``: tokenized training data (:mod:`ddiloco_geo.tools.prepare`).

``data tokenizer --input SPEC --vocab-size N --out tokenizer.json``
    train a byte-level BPE tokenizer on a text corpus (or bring any ``tokenizers`` tokenizer.json).
``data prepare --input SPEC --tokenizer tokenizer.json --out URL [--shard-tokens N]``
    tokenize the corpus into token shards in a directory or bucket (``file://``, ``s3://``, ``gs://``,
    ``memory://`` or a path); the bucket is reached with the ``storage`` section's endpoint and
    retry settings overlaid by ``data.storage``. Train on it with ``data.corpus="tokens:URL"``.

``--input`` takes what ``data.corpus`` takes for text (``shakespeare``, ``stdlib``, a glob of files,
a bucket URL glob); default: ``data.corpus``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddiloco_geo.cli.settings import settings_from
from ddiloco_geo.core.config import StorageConfig
from ddiloco_geo.core.data import load_corpus
from ddiloco_geo.storage import open_store
from ddiloco_geo.tools.prepare import prepare, train_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("prepare", "tokenizer"), help="prepare: tokenize into shards; tokenizer: train a BPE")
    p.add_argument("--input", metavar="SPEC", help="text corpus (as data.corpus takes it; default: data.corpus)")
    p.add_argument("--out", required=True, metavar="URL", help="prepare: shard directory or bucket URL; tokenizer: a .json file")
    p.add_argument("--tokenizer", metavar="FILE", help="prepare: the tokenizers tokenizer.json to encode with")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokenizer: vocabulary size (default 4096)")
    p.add_argument("--shard-tokens", type=int, default=1 << 26, help="prepare: tokens per shard file (default 2^26)")
    p.add_argument("--max-bytes", type=int, help="read at most this many corpus bytes (default: data.max_bytes)")


def run(args: argparse.Namespace) -> int:
    settings, _ = settings_from(args)
    corpus = args.input or settings.data.corpus
    max_bytes = args.max_bytes or settings.data.max_bytes
    if args.action == "tokenizer":
        text = load_corpus(corpus, max_bytes=max_bytes).decode("utf-8", errors="replace")
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(train_tokenizer(text, args.vocab_size))
        result = {"out": str(out), "vocab_size": args.vocab_size, "corpus": corpus}
        print(json.dumps(result) if args.json else f"wrote {out}: byte-level BPE, {args.vocab_size} tokens")
        return 0
    if not args.tokenizer:
        raise SystemExit("ddiloco-geo data prepare: --tokenizer FILE is required (a tokenizers tokenizer.json)")
    cfg = StorageConfig(**{**settings.storage.model_dump(exclude={"url"}), **settings.data.storage, "url": args.out})
    store = open_store(cfg)
    try:
        doc = prepare(store, corpus=corpus, tokenizer_json=Path(args.tokenizer).read_text(),
                      shard_tokens=args.shard_tokens, max_bytes=max_bytes)
    finally:
        store.close()
    print(json.dumps(doc) if args.json else
          f"wrote {len(doc['shards'])} shard(s), {doc['num_tokens']:,} {doc['dtype']} tokens (vocab {doc['vocab_size']}) "
          f"to {args.out}; train with --set data.corpus=tokens:{args.out}")
    return 0
