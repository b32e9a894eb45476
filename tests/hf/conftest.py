"""Shared data for the Hugging Face tests: a tiny byte-level BPE trained on the shipped
Shakespeare and token shards prepared by the ``data`` command (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddiloco_geo.cli.main import main

CORPUS_BYTES = 200_000
VOCAB = 384


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    assert main(["data", "tokenizer", "--input", "shakespeare", "--max-bytes", str(CORPUS_BYTES),
                 "--vocab-size", str(VOCAB), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory, tokenizer_file) -> Path:
    """Shakespeare as token shards of 8192 tokens in a local directory, written by ``data prepare``."""
    out = tmp_path_factory.mktemp("shards") / "tokens"
    assert main(["data", "prepare", "--input", "shakespeare", "--max-bytes", str(CORPUS_BYTES), "--tokenizer",
                 str(tokenizer_file), "--out", str(out), "--shard-tokens", "8192"]) == 0
    return out
