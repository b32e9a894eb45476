"""Helpers for syncer/learner tests: a tiny run on a real store, deltas written by hand."""

from __future__ import annotations

import uuid

import pytest
import torch

from ddiloco_geo import codec

from ddiloco_geo.core import config

from ddiloco_geo.core import layout

from ddiloco_geo import protocol
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.model import is_embedding
from ddiloco_geo.core.signing import signer_for, syncer_keys
from ddiloco_geo.storage import open_store
from ddiloco_geo.protocol import build_spec
from ddiloco_geo.syncer import Syncer

TINY = {"model": {"name": "custom", "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16},
        "fragments": {"num_fragments": 4, "sync_every": 4}, "run": {"codec": "fp32"},
        # the numerics tests pin Nesterov from the first merge, whatever the defaults
        "syncer": {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_warmup": 0},
        "data": {"max_bytes": 200_000}}


def tiny_settings(**overrides):
    tree = {k: dict(v) for k, v in TINY.items()}
    for dotted, value in overrides.items():
        section, field = dotted.split(".")
        tree.setdefault(section, {})[field] = value
    settings, _ = config.load(cli=tree, environ={})
    return settings


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Run:
    """A syncer over a memory:// store plus a way to write deltas as any learner would."""

    def __init__(self, url: str | None = None, **overrides) -> None:
        self.settings = tiny_settings(**{"storage.url": url or f"memory://t-{uuid.uuid4().hex[:10]}", **overrides})
        self.store = open_store(self.settings.storage)
        spec, self.params = build_spec(self.settings)
        self.spec = protocol.create_or_load_spec(self.store, spec)
        self.clock = Clock()
        self.seq: dict[str, int] = {}

    def syncer(self) -> Syncer:
        s = Syncer(self.store, self.spec, **self.settings.syncer.model_dump(),
                   is_embedding=lambda n: is_embedding(n, self.settings.model.embedding_patterns), now=self.clock,
                   **syncer_keys(self.settings.security))
        s.bootstrap(self.params)
        return s

    def fragment_params(self, p: int, version: int = 0) -> dict[str, torch.Tensor]:
        return protocol.read_global(self.store, self.spec, p, version)[1]

    def write_delta(self, learner: str, p: int, pseudo_grad: dict[str, torch.Tensor] | None = None, *,
                    base_version: int = 0, steps: int = 4, tokens: int = 256, seq: int | None = None,
                    header_overrides: dict | None = None, raw: bytes | None = None, codec_name: str = "fp32") -> str:
        if seq is None:
            seq = self.seq.get(learner, -1) + 1
        self.seq[learner] = max(seq, self.seq.get(learner, -1))
        key = layout.delta_key(learner, seq, p)
        if raw is None:
            if pseudo_grad is None:
                gen = torch.Generator().manual_seed(hash((learner, seq, p)) % 2**31)
                pseudo_grad = {n: 0.01 * torch.randn(s, generator=gen) for n, s in self.spec.plan.expect(p).items()}
            fields = dict(kind="delta", run_id=self.spec.run_id, fragment=p, learner=learner, seq=seq,
                          base_version=base_version, clock=VectorClock({learner: seq + 1}), num_steps=steps,
                          num_tokens=tokens)
            fields.update(header_overrides or {})
            secret = self.settings.security.run_secret  # a signed run: the learner signs with its key
            signer = signer_for(secret.get_secret_value(), "learner", learner) if secret is not None else None
            raw = codec.encode(pseudo_grad, codec.Header(**fields), codec=codec_name, signer=signer)
        assert self.store.put_if_absent(key, raw)
        return key


@pytest.fixture
def tiny_run():
    runs = []

    def make(**overrides) -> Run:
        r = Run(**overrides)
        runs.append(r)
        return r

    yield make
    for r in runs:
        r.store.close()
