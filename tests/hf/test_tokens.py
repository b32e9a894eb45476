"""Token shards: the format, the prepare command, and readers that stream slices of them with
ranged reads from every backend and continue at their cursor after a restart."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ddiloco_geo.cli.main import main
from ddiloco_geo.core import tokens as tokmod
from ddiloco_geo.core.config import DataConfig, StorageConfig
from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.learner.data import eval_batches_for, make_reader
from ddiloco_geo.storage import open_store
from ddiloco_geo.tools.prepare import load_tokenizer
from tests.conftest import cli_args_for

BLOCK, BATCH = 32, 4


def _data(url: str, **kw) -> DataConfig:
    return DataConfig(corpus=f"tokens:{url}", chunk_tokens=1024, **kw)


def _reader(data: DataConfig, i: int = 0, n: int = 2):
    return make_reader(data, block_size=BLOCK, batch_size=BATCH, seed=7, slice_index=i, num_slices=n)


def test_header_roundtrip_and_dtype_by_vocabulary():
    ids = np.array([0, 5, 65535], dtype=np.int64)
    raw = tokmod.encode_shard(ids, 65536)
    assert raw[:8] == b"DDTOKENS" and len(raw) == tokmod.HEADER_BYTES + 3 * 2
    dtype, n, vocab = tokmod.decode_header(raw)
    assert (dtype.itemsize, n, vocab) == (2, 3, 65536)
    raw32 = tokmod.encode_shard(np.array([70000]), 100_000)
    assert tokmod.decode_header(raw32)[0].itemsize == 4 and len(raw32) == tokmod.HEADER_BYTES + 4
    with pytest.raises(ValueError):
        tokmod.encode_shard(np.array([300]), 256)
    with pytest.raises(ConfigError, match="not a version-1 token shard"):
        tokmod.decode_header(b"NOTTOKEN" + raw[8:])


def test_prepare_writes_the_corpus_tokens_in_order(shard_dir, tokenizer_file):
    doc = json.loads((shard_dir / "manifest.json").read_text())
    assert doc["format"] == "ddiloco-tokens" and doc["dtype"] == "uint16" and len(doc["shards"]) > 3
    assert all(s["num_tokens"] == 8192 for s in doc["shards"][:-1])
    assert (shard_dir / "tokenizer.json").read_text() == tokenizer_file.read_text()
    source = tokmod.TokenSource(open_store(StorageConfig(url=str(shard_dir))), eval_ratio=0.1)
    all_ids = source.read(0, source.num_tokens)
    tok = load_tokenizer(tokenizer_file.read_text())
    text = tok.decode(all_ids[:2000].tolist())
    assert "ACT" in text or "SCENE" in text or len(text) > 1000  # real text comes back
    # a second prepare of the same corpus is a no-op; into a dataset of another corpus it fails
    assert main(["data", "prepare", "--input", "shakespeare", "--max-bytes", "200000", "--tokenizer",
                 str(tokenizer_file), "--out", str(shard_dir), "--shard-tokens", "8192"]) == 0
    assert main(["data", "prepare", "--input", "stdlib", "--max-bytes", "50000", "--tokenizer",
                 str(tokenizer_file), "--out", str(shard_dir), "--shard-tokens", "8192"]) == 2


def test_slices_are_disjoint_and_deterministic(shard_dir):
    data = _data(str(shard_dir))
    a, b, a2 = _reader(data, 0), _reader(data, 1), _reader(data, 0)
    assert (a.start, a.end) == (0, b.start) and b.end == a.source.num_train
    for _ in range(5):
        xa, ya, n = a.next_batch()
        xa2, _, _ = a2.next_batch()
        assert torch.equal(xa, xa2) and n == BATCH * BLOCK and torch.equal(xa[:, 1:], ya[:, :-1])
    assert xa.max() < a.source.vocab_size


def test_reader_walks_every_window_of_its_slice_once_per_epoch(shard_dir):
    data = _data(str(shard_dir))
    r = _reader(data, 1, 2)
    offset, order, num_windows = r._epoch_plan(0)
    seen = []
    while r.epoch == 0:
        x, _, _ = r.next_batch()
        seen.extend(x[:, 0].tolist())
    full = r.source.read(r.start, r.end)
    expected = [int(full[offset + k * BLOCK]) for k in range(num_windows)]
    assert sorted(seen[:num_windows]) == sorted(expected)


def test_interleaved_slices_deal_chunks_round_robin_and_walk_each_window_once(shard_dir):
    data = _data(str(shard_dir), shard_layout="interleaved")
    readers = [_reader(data, i, 3) for i in range(3)]
    owner = np.full(readers[0].source.num_train, -1)
    for i, r in enumerate(readers):
        assert len(r.spans) > 2 and all(b - a <= 1024 for a, b in r.spans)  # one chunk (ranged read) a stripe
        for a, b in r.spans:
            assert (owner[a:b] == -1).all()
            owner[a:b] = i
    assert (owner[:-1024] >= 0).all()  # only a last stripe too short for a window is left out
    r = readers[1]
    offset, order, num_windows = r._epoch_plan(0)
    seen = []
    while r.epoch == 0:
        x, y, _ = r.next_batch()
        assert torch.equal(x[:, 1:], y[:, :-1])
        seen.extend(x[:, 0].tolist())
    expected = []
    for a, b in r.spans:  # every window of every stripe of this slice, from the epoch's offset
        full = r.source.read(a, b)
        expected += [int(full[offset + k * BLOCK]) for k in range((b - a - 1 - offset) // BLOCK)]
    assert sorted(seen[:len(expected)]) == sorted(expected) and len(expected) == num_windows
    with pytest.raises(ConfigError, match="fewer learners"):  # more slices than chunks: this one has none
        _reader(data, 9_999, 10_000)


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_restarted_reader_continues_at_its_cursor(shard_dir, layout):
    data = _data(str(shard_dir), shard_layout=layout)
    a = _reader(data)
    for _ in range(37):  # past several chunk boundaries (1024 tokens = 32 windows = 8 batches)
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # what the checkpoint header carries
    b = _reader(data)
    b.load_state_dict(state)
    for _ in range(20):
        xa, ya, _ = a.next_batch()
        xb, yb, _ = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        make_reader(data, block_size=BLOCK, batch_size=BATCH + 1, seed=7, slice_index=0,
                    num_slices=2).load_state_dict(state)
    other = "interleaved" if layout == "contiguous" else "contiguous"
    with pytest.raises(ValueError, match=f"layout={layout}"):
        _reader(_data(str(shard_dir), shard_layout=other)).load_state_dict(state)


def test_model_vocabulary_too_small_is_refused(shard_dir):
    with pytest.raises(ConfigError, match="vocab_size >= 3"):
        make_reader(_data(str(shard_dir)), block_size=BLOCK, batch_size=BATCH, seed=0, slice_index=0,
                    num_slices=1, vocab_size=256)


@pytest.mark.parametrize("backend", ["moto", "gcs"])
def test_shards_stream_from_a_bucket_with_ranged_reads(backend, make_storage_config, shard_dir, tokenizer_file):
    """``data prepare`` into S3 (moto) or GCS (fake-gcs-server); readers there give exactly the
    batches of the local copy, read in ranges (far fewer bytes than the dataset), and resume."""
    cfg = make_storage_config(backend)
    url = cfg.url.rsplit("/", 1)[0] + "/tokens"
    flags = cli_args_for(cfg)[2:]  # endpoint and retry settings, not the run's URL
    assert main(["data", "prepare", "--input", "shakespeare", "--max-bytes", "200000", "--tokenizer",
                 str(tokenizer_file), "--out", url, "--shard-tokens", "8192", *flags]) == 0
    storage = {k: v for k, v in cfg.model_dump().items() if k in ("endpoint_url", "region", "anonymous", "retry_attempts",
                                                                   "retry_initial_s", "retry_max_s", "timeout_s")}
    remote, local = _data(url, storage=storage), _data(str(shard_dir))
    r, ref = _reader(remote, 1), _reader(local, 1)
    for _ in range(12):
        assert torch.equal(r.next_batch()[0], ref.next_batch()[0])
    dataset_bytes = sum(p.stat().st_size for p in shard_dir.glob("shard-*.tok"))
    assert r.source.num_reads >= 2 and r.source.bytes_read < dataset_bytes / 4
    resumed = _reader(remote, 1)
    resumed.load_state_dict(r.state_dict())
    assert torch.equal(resumed.next_batch()[0], ref.next_batch()[0])
    for (xa, ya), (xb, yb) in zip(eval_batches_for(remote, block_size=BLOCK, batch_size=BATCH),
                                  eval_batches_for(local, block_size=BLOCK, batch_size=BATCH)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
