"""Fuzzing decode and read_header: only CodecError may ever escape, and whatever decodes from a
mutated object has passed the checksum."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco_geo import codec
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.codec import CodecError, Header
from ddiloco_geo.codec.framing import serialize

fuzz = settings(max_examples=250, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip

REASONS = {"too_large", "truncated", "bad_header", "foreign", "version", "kind", "run_id", "codec",
           "checksum", "shape", "nonfinite"}  # fmt: skip


def _valid(name: str) -> bytes:
    gen = torch.Generator().manual_seed(7)
    tensors = {"w": torch.randn((10, 13), generator=gen), "b": torch.randn(7, generator=gen),
               "s": torch.randn((), generator=gen)}  # fmt: skip
    header = Header(kind="delta", run_id="run-1", learner="l-1", seq=3, base_version=2,
                    clock=VectorClock({"l-1": 3}), num_steps=4, num_tokens=512, extra={"k": [1, 2]})  # fmt: skip
    return codec.encode(tensors, header, codec=name, block_size=16, topk=4 if name == "topk" else None)


VALID = {name: _valid(name) for name in codec.CODECS}
ORIGINAL = {name: codec.decode(data)[1] for name, data in VALID.items()}


def attempt(data: bytes, **kwargs):
    """decode and read_header; anything but CodecError fails the test."""
    for fn, kw in ((codec.read_header, {}), (codec.decode, kwargs)):
        try:
            result = fn(data, **kw)
        except CodecError as exc:
            assert exc.reason in REASONS, exc
        else:
            if fn is codec.decode:
                return result
    return None


@fuzz
@given(st.binary(max_size=4096))
def test_random_bytes(data):
    attempt(data)


@fuzz
@given(st.binary(max_size=2048), st.integers(0, 2**64 - 1) | st.integers(0, 4096))
def test_random_bytes_behind_a_header_length(body, n):
    attempt(struct.pack("<Q", n) + body)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


@fuzz
@given(st.dictionaries(st.sampled_from(["w", "w:q", "w:scale", "__metadata__", "x"]), json_values),
       st.binary(max_size=256))  # fmt: skip
def test_random_json_headers(entries, payload):
    head = json.dumps(entries).encode()
    attempt(struct.pack("<Q", len(head)) + head + payload)


@fuzz
@given(st.sampled_from(codec.CODECS), st.data())
def test_random_metadata_values(name, data):
    n = struct.unpack_from("<Q", VALID[name])[0]
    entries = json.loads(VALID[name][8 : 8 + n])
    key = data.draw(st.sampled_from(sorted(entries["__metadata__"])))
    entries["__metadata__"][key] = data.draw(st.text(max_size=40) | json_values.map(json.dumps))
    head = json.dumps(entries).encode()
    attempt(struct.pack("<Q", len(head)) + head + VALID[name][8 + n :])


@fuzz
@given(st.sampled_from(codec.CODECS), st.data())
def test_truncations_are_reported_as_truncated(name, data):
    full = VALID[name]
    cut = data.draw(st.integers(0, len(full) - 1))
    for fn in (codec.decode, codec.read_header):
        if fn is codec.read_header and cut >= codec.header_span(full):
            assert fn(full[:cut]) == codec.read_header(full)
            continue
        with pytest.raises(CodecError) as err:
            fn(full[:cut])
        assert err.value.reason == "truncated"


@fuzz
@given(
    st.sampled_from(codec.CODECS),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    st.booleans(),
)
def test_mutations_never_escape_and_never_skip_the_checksum(name, edits, with_checks):
    original = VALID[name]
    mutated = bytearray(original)
    for pos, value in edits:
        mutated[pos % len(mutated)] = value
    mutated = bytes(mutated)
    kwargs = {"kind": "delta", "run_id": "run-1"} if with_checks else {}
    result = attempt(mutated, **kwargs)
    if result is None:
        return
    header, tensors = result
    stored = safetensors.torch.load(mutated)  # what decode accepted is a valid safetensors file
    assert codec.checksum_of(stored) == header.checksum
    span = codec.header_span(original)
    if mutated[span:] == original[span:] and header.shapes == codec.read_header(original).shapes:
        for key, t in tensors.items():
            assert torch.equal(t, ORIGINAL[name][key])


@fuzz
@given(st.sampled_from(["topk:idx", "topk:q", "topk:scale"]),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4))  # fmt: skip
def test_topk_payload_mutations_behind_a_valid_checksum_never_escape(key, edits):
    """The checksum recomputed over mutated sparse payloads: decode's own checks must hold."""
    n = struct.unpack_from("<Q", VALID["topk"])[0]
    entries = json.loads(VALID["topk"][8 : 8 + n])
    stored = {k: v.clone() for k, v in safetensors.torch.load(VALID["topk"]).items()}
    raw = stored[key].view(torch.uint8).view(-1)
    for pos, value in edits:
        raw[pos % raw.numel()] = value
    entries["__metadata__"]["checksum"] = codec.checksum_of(stored)
    data = serialize(stored, entries["__metadata__"])
    result = attempt(data)
    if result is not None:  # whatever decodes is ternary values times a finite, non-negative scale
        for name, t in result[1].items():
            assert t.shape == ORIGINAL["topk"][name].shape and bool(torch.isfinite(t).all())
