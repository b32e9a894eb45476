"""Corpora, the held-out split, shard readers and deterministic evaluation."""

import json
from typing import get_args

import numpy as np
import pytest
import torch

from ddiloco_geo.core.config import DataConfig, ModelConfig
from ddiloco_geo.core.data import (SHARD_LAYOUTS, STRIPE_WINDOWS, ShardReader, eval_batches, evaluate, load_corpus, shard_bounds,
                                   shard_stripes, split)
from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.core.model import build_model

pytestmark = pytest.mark.unit  # no servers, no subprocesses


@pytest.fixture(scope="module")
def shakespeare():
    return load_corpus("shakespeare")


def test_shakespeare_is_real_english_without_markdown_breaks(shakespeare):
    assert len(shakespeare) > 1_000_000
    assert b"ROMEO" in shakespeare and b"Hamlet" in shakespeare
    assert b"  \n" not in shakespeare
    shakespeare.decode("utf-8")


def test_max_bytes_caps_the_corpus():
    assert len(load_corpus("shakespeare", max_bytes=5000)) == 5000


def test_stdlib_corpus_loads():
    text = load_corpus("stdlib", max_bytes=300_000)
    assert len(text) == 300_000
    assert b"def " in text and b"import " in text


def _write_docs(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"second document")
    (tmp_path / "a.txt").write_bytes(b"first document\n")
    (tmp_path / "skip.md").write_bytes(b"not matched")


def test_file_url_glob_reads_sorted_documents(tmp_path):
    _write_docs(tmp_path)
    assert load_corpus(f"file://{tmp_path}/*.txt") == b"first document\nsecond document\n"


def test_memory_bucket_glob():
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe({"/ddiloco-test-corpus/x/1.txt": b"one", "/ddiloco-test-corpus/x/2.txt": b"two"})
    try:
        assert load_corpus("memory://ddiloco-test-corpus/x/*.txt") == b"one\ntwo\n"
    finally:
        fs.rm("/ddiloco-test-corpus", recursive=True)


def test_local_glob_and_custom_opener(tmp_path):
    _write_docs(tmp_path)
    assert load_corpus(str(tmp_path / "*.txt")) == b"first document\nsecond document\n"
    calls = []

    def open_url(url, **options):
        import fsspec

        calls.append((url, options))
        return fsspec.open_files(url, mode="rb")

    load_corpus(f"file://{tmp_path}/*.txt", open_url=open_url, anon=True)
    assert calls == [(f"file://{tmp_path}/*.txt", {"anon": True})]


def test_glob_matching_nothing_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="matches no"):
        load_corpus(str(tmp_path / "*.txt"))
    with pytest.raises(ConfigError, match="matches no"):
        load_corpus(f"file://{tmp_path}/*.txt")


def test_split_holds_out_the_tail():
    corpus = bytes(range(256)) * 4
    train, held = split(corpus, 0.25)
    assert train.dtype == np.uint8 and len(train) == 768 and len(held) == 256
    assert bytes(train) + bytes(held) == corpus
    with pytest.raises(ValueError):
        split(corpus, 0.0)


@pytest.mark.parametrize("num_shards", [1, 3, 7])
def test_shards_are_disjoint_and_cover_the_training_bytes(num_shards):
    n = 10_001
    bounds = [shard_bounds(n, i, num_shards) for i in range(num_shards)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    # every window a reader produces lies inside its own shard
    positions = np.arange(n)  # "bytes" that say where they come from
    for i, (lo, hi) in enumerate(bounds):
        reader = ShardReader(positions, i, num_shards, block_size=16, batch_size=4, seed=0)
        for _ in range(50):
            x, y, _ = reader.next_batch()
            assert x.min() >= lo and y.max() < hi
            assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("num_shards", [1, 3, 7])
def test_interleaved_shards_are_disjoint_cover_the_bytes_and_span_the_corpus(num_shards):
    n, block = 50_003, 8
    stripe = STRIPE_WINDOWS * block
    spans = [shard_stripes(n, i, num_shards, stripe, "interleaved") for i in range(num_shards)]
    owner = np.full(n, -1)
    for i, mine in enumerate(spans):
        for a, b in mine:
            assert (owner[a:b] == -1).all()  # disjoint
            owner[a:b] = i
    assert (owner >= 0).all()  # together they cover every byte
    if num_shards > 1:  # dealt round-robin: consecutive stripes belong to consecutive shards
        assert [owner[j * stripe] for j in range(2 * num_shards)] == list(range(num_shards)) * 2
    positions = np.arange(n)
    for i, mine in enumerate(spans):
        reader = ShardReader(positions, i, num_shards, block_size=block, batch_size=16, seed=0, layout="interleaved")
        seen = []
        while reader.epoch == 0:
            x, y, _ = reader.next_batch()
            assert torch.equal(x[:, 1:], y[:, :-1])
            assert all(owner[int(r[0])] == i and owner[int(r[-1]) + 1] == i for r in x)  # x and its target inside
            seen.extend(x[:, 0].tolist())
        # the epoch's windows, every one once, reach from the first tenth of the corpus to the last
        count = len(reader._starts(0))
        assert len(set(seen[:count])) == count and set(seen) >= set(reader._starts(0).tolist())
        assert min(seen) < n // 10 and max(seen) > n - n // 10 - stripe * num_shards


def test_contiguous_layout_reads_the_windows_it_always_read():
    """The default layout is the reader of every earlier release: same windows, same order, so a
    resumed learner's cursor still points at the batch it would have read next."""
    train = np.arange(10_000, dtype=np.int64)
    reader = ShardReader(train, 1, 3, block_size=16, batch_size=4, seed=9)
    start, end = shard_bounds(len(train), 1, 3)
    rng = np.random.default_rng([9, 1, 0])
    offset = int(rng.integers(0, 16))
    expected = start + offset + 16 * rng.permutation((end - start - 1 - offset) // 16)
    got = np.concatenate([reader.next_batch()[0][:, 0].numpy() for _ in range(len(expected) // 4)])
    assert np.array_equal(got, expected[:len(got)])


def test_shard_layout_is_checked():
    with pytest.raises(ValueError, match="shard layout"):
        shard_stripes(1000, 0, 2, 64, "striped")
    assert get_args(DataConfig.model_fields["shard_layout"].annotation) == SHARD_LAYOUTS
    with pytest.raises(ValueError, match="fewer learners.*shard_layout='contiguous'"):  # 5000 bytes are two stripes: none for shard 3
        ShardReader(np.zeros(5000, dtype=np.uint8), 3, 4, block_size=64, batch_size=2, seed=0, layout="interleaved")


def test_batches_and_token_counts_are_exact(shakespeare):
    train, _ = split(shakespeare[:200_000], 0.02)
    reader = ShardReader(train, 1, 4, block_size=32, batch_size=5, seed=0)
    total = 0
    for _ in range(10):
        x, y, num_tokens = reader.next_batch()
        assert x.shape == y.shape == (5, 32) and x.dtype == y.dtype == torch.int64
        assert num_tokens == 5 * 32
        total += num_tokens
    assert reader.state_dict()["tokens_seen"] == total


def test_epochs_visit_every_window_once_then_reshuffle():
    train = np.arange(1000, dtype=np.int64)
    reader = ShardReader(train, 0, 1, block_size=10, batch_size=1, seed=5)
    first_epoch = []
    while reader.epoch == 0:
        first_epoch.append(int(reader.next_batch()[0][0, 0]))
    assert len(first_epoch) == len(set(first_epoch))
    assert len({s % 10 for s in first_epoch}) == 1  # one window grid per epoch


def test_state_dict_round_trip_continues_the_same_batches():
    train = np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8)
    reader = ShardReader(train, 0, 2, block_size=16, batch_size=7, seed=3)
    for _ in range(13):  # crosses an epoch boundary (~320 windows / 7)
        reader.next_batch()
    cursor = json.loads(json.dumps(reader.state_dict()))
    expected = [reader.next_batch() for _ in range(60)]

    resumed = ShardReader(train, 0, 2, block_size=16, batch_size=7, seed=3)
    resumed.load_state_dict(cursor)
    for x, y, n in expected:
        rx, ry, rn = resumed.next_batch()
        assert torch.equal(x, rx) and torch.equal(y, ry) and n == rn
    assert resumed.state_dict() == reader.state_dict()
    assert reader.epoch >= 1

    other = ShardReader(train, 1, 2, block_size=16, batch_size=7, seed=3)
    with pytest.raises(ValueError, match="shard"):
        other.load_state_dict(cursor)
    interleaved = ShardReader(train, 0, 2, block_size=16, batch_size=7, seed=3, layout="interleaved")
    with pytest.raises(ValueError, match="layout=contiguous"):
        interleaved.load_state_dict(cursor)
    before_layouts = {k: v for k, v in cursor.items() if k != "layout"}  # a cursor of an earlier release
    ShardReader(train, 0, 2, block_size=16, batch_size=7, seed=3).load_state_dict(before_layouts)
    with pytest.raises(ValueError, match="layout=contiguous"):
        interleaved.load_state_dict(before_layouts)


def test_interleaved_cursor_round_trip():
    train = np.arange(20_000, dtype=np.int64)
    reader = ShardReader(train, 2, 3, block_size=16, batch_size=5, seed=1, layout="interleaved")
    for _ in range(11):
        reader.next_batch()
    cursor = json.loads(json.dumps(reader.state_dict()))
    resumed = ShardReader(train, 2, 3, block_size=16, batch_size=5, seed=1, layout="interleaved")
    resumed.load_state_dict(cursor)
    for _ in range(40):
        assert torch.equal(reader.next_batch()[0], resumed.next_batch()[0])


def test_different_seeds_and_shards_give_different_orders():
    train = np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8)
    a = ShardReader(train, 0, 1, 16, 4, seed=0).next_batch()[0]
    b = ShardReader(train, 0, 1, 16, 4, seed=1).next_batch()[0]
    assert not torch.equal(a, b)


def test_tiny_shard_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer learners"):
        ShardReader(np.zeros(100, dtype=np.uint8), 0, 4, block_size=16, batch_size=2, seed=0)


def test_evaluation_is_deterministic_and_restores_mode(shakespeare):
    _, held = split(shakespeare[:100_000], 0.1)
    batches = eval_batches(held, block_size=32, batch_size=4, num_batches=3)
    again = eval_batches(held, block_size=32, batch_size=4, num_batches=3)
    assert len(batches) == 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    model = build_model(ModelConfig(name="custom", n_layer=1, n_head=2, n_embd=32, block_size=32))
    model.train()
    first = evaluate(model, batches)
    assert model.training
    model.eval()
    assert evaluate(model, batches) == first
    assert not model.training
    assert abs(first - np.log(256)) < 0.2
    with pytest.raises(ValueError):
        eval_batches(held[:10], block_size=32, batch_size=1, num_batches=1)
