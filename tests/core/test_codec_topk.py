"""The topk codec: stored bytes and dense decode against a naive reference, sparsify, wire size,
and every malformed sparse payload."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import safetensors.torch
import torch

from ddiloco_geo import codec
from ddiloco_geo.codec import CodecError, Header
from ddiloco_geo.codec.framing import serialize
from ddiloco_geo.tools.bench.codec import fragment

pytestmark = pytest.mark.unit  # no servers, no subprocesses


def header(**changes) -> Header:
    return Header(kind="delta", run_id="run-1", learner="l-1", seq=1, **changes)


def randn(shape, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# --- the naive reference: one chunk at a time, plain Python ints for the bit streams --------------


def ref_encode(x: np.ndarray, chunk: int, k: int) -> tuple[bytes, bytes, np.ndarray, np.ndarray]:
    """(idx bytes, q bytes, scales, dense decode) of the topk codec, written the slow obvious way."""
    flat = x.astype(np.float32).ravel()
    indices, codes, scales = [], [], []
    dense = np.zeros(flat.size, np.float32)
    for start in range(0, flat.size, chunk):
        part = flat[start : start + chunk]
        order = sorted(range(part.size), key=lambda i: (-abs(float(part[i])), i))  # ties: lower index
        kept = sorted(order[: min(k, part.size)])
        indices.append(kept)
        nonzero = [abs(float(part[i])) for i in kept if part[i] != 0]
        scale = np.float32(sum(nonzero) / len(nonzero)) if nonzero else np.float32(0)
        scales.append(scale)
        for i in kept:
            sign = int(np.sign(part[i]))
            codes.append(sign & 3)
            dense[start + i] = np.float32(sign) * scale
    return _rice(indices, chunk, k), _pack(codes, 2), np.array(scales, np.float32), dense.reshape(x.shape)


def _pack(values: list[int], width: int) -> bytes:
    stream = sum(v << (i * width) for i, v in enumerate(values))
    return stream.to_bytes(-(-len(values) * width // 8), "little")


def _rice(chunks: list[list[int]], chunk: int, k: int) -> bytes:
    """The format-3 index stream, bit by bit: in each chunk, each index's gap g (the first index, then
    the distance to the previous one minus 1) as g >> R ones, a zero and the low R bits of g."""
    r = max(0, math.floor(math.log2((chunk - k) / k))) if chunk > k else 0
    bits: list[int] = []
    for kept in chunks:
        prev = -1
        for i in kept:
            g, prev = i - prev - 1, i
            if g < 0:
                raise ValueError("a format-3 stream cannot hold duplicate or descending indices")
            bits += [1] * (g >> r) + [0] + [(g >> j) & 1 for j in range(r)]
    return _pack(bits, 1)


def _by_chunk(idx: list[int], numel: int, chunk: int, k: int) -> list[list[int]]:
    """A flat index list cut into the chunks a tensor of ``numel`` values has (the last may come short)."""
    counts = [min(k, chunk, numel - start) for start in range(0, numel, chunk)]
    cut = np.cumsum([0] + counts)
    return [idx[a:b] for a, b in zip(cut[:-1], cut[1:])]


CASES = [((), 4096, 64), ((1,), 16, 3), ((5,), 4, 4), ((4096,), 4096, 64), ((4097,), 4096, 64),
         ((300, 7), 128, 2), ((2, 3, 64), 16, 5), ((0,), 4096, 64), ((4, 0), 16, 1), ((100,), 2, 1),
         ((9000,), 1000, 1000), ((77,), 5, 2)]  # fmt: skip


@pytest.mark.parametrize("shape,chunk,k", CASES, ids=str)
def test_topk_matches_naive_reference(shape, chunk, k):
    x = randn(shape, seed=sum(shape) + chunk) * 3
    data = codec.encode({"w": x}, header(), codec="topk", block_size=chunk, topk=k)
    stored = safetensors.torch.load(data)
    idx, q, scales, dense = ref_encode(x.numpy(), chunk, k)
    assert bytes(stored["topk:idx"].numpy()) == idx and bytes(stored["topk:q"].numpy()) == q
    assert np.array_equal(stored["topk:scale"].numpy(), scales)
    back, out = codec.decode(data)
    assert (back.codec, back.block_size, back.topk) == ("topk", chunk, k)
    assert out["w"].dtype == torch.float32 and tuple(out["w"].shape) == shape
    assert np.array_equal(out["w"].numpy(), dense)
    assert torch.equal(codec.sparsify(x, block_size=chunk, topk=k), out["w"])


def test_ties_zeros_and_few_nonzeros_follow_the_reference():
    x = torch.tensor([0, 1, -1, 1, 0, 2, -2, 0, 0, 0, 3, 0] * 40, dtype=torch.float32)
    x[::7] = 0.0
    for chunk, k in ((12, 5), (16, 7), (64, 30), (480, 400)):
        data = codec.encode({"w": x}, header(), codec="topk", block_size=chunk, topk=k)
        stored = safetensors.torch.load(data)
        idx, q, scales, dense = ref_encode(x.numpy(), chunk, k)
        assert bytes(stored["topk:idx"].numpy()) == idx and bytes(stored["topk:q"].numpy()) == q
        assert np.array_equal(codec.decode(data)[1]["w"].numpy(), dense)
        assert np.array_equal(codec.sparsify(x, block_size=chunk, topk=k).numpy(), dense)
    zeros = codec.decode(codec.encode({"w": torch.zeros(5000)}, header(), codec="topk"))[1]["w"]
    assert not zeros.any()


def test_defaults_and_density():
    h, _ = codec.decode(codec.encode({"w": randn(10_000)}, header(), codec="topk"))
    assert (h.block_size, h.topk) == (codec.DEFAULT_CHUNK, codec.DEFAULT_TOPK) == (4096, 84)
    h, _ = codec.decode(codec.encode({"w": randn(10_000)}, header(), codec="topk", block_size=1024))
    assert h.topk == 21  # the default density, 84 per 4096
    h, _ = codec.decode(codec.encode({"w": randn(100)}, header(codec="topk", block_size=16, topk=3)))
    assert (h.block_size, h.topk) == (16, 3)
    for bad in ({"block_size": 4097}, {"block_size": 1}, {"block_size": 16, "topk": 17}, {"topk": -1}):
        with pytest.raises(ValueError):
            codec.encode({"w": randn(10)}, header(), codec="topk", **bad)


def test_sparsify_keeps_shape_dtype_and_device_and_the_residual_is_what_was_not_sent():
    x = randn((96, 64), 3).to(torch.bfloat16)
    sent = codec.sparsify(x, block_size=256, topk=8)
    assert sent.shape == x.shape and sent.dtype == torch.float32 and sent.device == x.device
    assert int((sent != 0).sum()) == 96 * 64 // 256 * 8
    residual = x.float() - sent
    assert float(residual.norm()) < float(x.float().norm())


def test_wire_is_under_a_hundredth_of_fp32_on_a_realistic_fragment():
    tensors = fragment(4.0)
    fp32_bytes = sum(t.numel() * 4 for t in tensors.values())
    data = codec.encode(tensors, header(), codec="topk")
    assert len(data) / fp32_bytes <= 1 / 100
    kept = sum(int((t != 0).sum()) for t in codec.decode(data)[1].values())
    assert kept == sum((t.numel() // 4096) * 84 + min(84, t.numel() % 4096) for t in tensors.values())


def test_nonfinite_input_is_refused():
    for bad in (float("nan"), float("inf")):
        x = randn(10_000)
        x[1234] = bad
        with pytest.raises(CodecError) as err:
            codec.encode({"w": x}, header(), codec="topk")
        assert err.value.reason == "nonfinite"


def test_older_codecs_carry_no_topk_field():
    data = codec.encode({"w": randn(100)}, header(topk=5), codec="int4")
    n = struct.unpack_from("<Q", data)[0]
    assert "topk" not in json.loads(data[8 : 8 + n])["__metadata__"]
    assert codec.decode(data)[0].topk == 0


# --- every malformed sparse payload ---------------------------------------------------------------


def forge(idx: list[int] | bytes, codes: list[int], scales: list[float], numel: int, chunk: int, k: int,
          fmt: int = codec.FORMAT_VERSION) -> bytes:
    """A topk object with a correct checksum around an arbitrary payload: ``idx`` as a list of
    indices (written in the format's index coding) or as the raw index stream."""
    if isinstance(idx, list):
        fixed = _pack(idx, max(1, (chunk - 1).bit_length()))
        try:
            idx = _rice(_by_chunk(idx, numel, chunk, k), chunk, k) if fmt >= 3 else fixed
        except (ValueError, ZeroDivisionError):  # a layout format 3 cannot write: refused on its header
            idx = fixed
    stored = {
        "topk:idx": torch.tensor(list(idx), dtype=torch.uint8),
        "topk:q": torch.tensor(list(_pack(codes, 2)), dtype=torch.uint8),
        "topk:scale": torch.tensor(scales, dtype=torch.float32),
    }
    meta = {"ddiloco.format": str(fmt), "kind": "delta", "run_id": "run-1", "learner": "", "clock": "{}",
            "codec": "topk", "extra": "{}", "shapes": json.dumps({"w": [numel]}),
            "dtypes": json.dumps({"w": "float32"}), "checksum": codec.checksum_of(stored, fmt),
            "fragment": "0", "seq": "0", "base_version": "0", "version": "-1", "num_steps": "1",
            "num_tokens": "1", "block_size": str(chunk), "topk": str(k)}  # fmt: skip
    return serialize(stored, meta)


def reason_of(data: bytes) -> str:
    with pytest.raises(CodecError) as err:
        codec.decode(data)
    return err.value.reason


@pytest.mark.parametrize("fmt", [2, 3])
def test_forge_helper_builds_decodable_objects(fmt):
    """Formats 2 (fixed-width indices) and 3 (Rice-coded) decode to the same values."""
    header, out = codec.decode(forge([1, 3, 0, 2], [1, 3, 0, 1], [2.0, 0.5], 8, 4, 2, fmt))
    assert out["w"].tolist() == [0, 2, 0, -2, 0, 0, 0.5, 0] and header.format == fmt


def test_format_2_objects_still_decode():
    x = randn(9000, 5) * 3
    idx = [i % 4096 for i in codec.sparsify(x, block_size=4096, topk=84).nonzero().view(-1).tolist()]
    _, q, scales, dense = ref_encode(x.numpy(), 4096, 84)
    stored = {"topk:idx": torch.tensor(list(_pack(idx, 12)), dtype=torch.uint8),
              "topk:q": torch.tensor(list(q), dtype=torch.uint8), "topk:scale": torch.from_numpy(scales)}  # fmt: skip
    new = codec.encode({"w": x}, header(), codec="topk")
    meta = json.loads(new[8 : 8 + struct.unpack_from("<Q", new)[0]])["__metadata__"]
    old = serialize(stored, {**meta, "ddiloco.format": "2", "extra": "{}", "dtypes": json.dumps({"w": "float32"}),
                             "checksum": codec.checksum_of(stored, 2)})  # fmt: skip
    assert len(old) > len(new) + len(idx) * (12 - 8) // 8  # 12-bit indices against about 7
    h, out = codec.decode(old)
    assert h.format == 2 and np.array_equal(out["w"].numpy(), dense)


@pytest.mark.parametrize(
    "idx,codes,scales,numel,chunk,k,why",
    [
        ([1, 4, 0, 2], [1, 1, 1, 1], [1.0, 1.0], 8, 4, 2, "index outside its chunk"),
        ([1, 3, 0, 3], [1, 1, 1, 1], [1.0, 1.0], 7, 4, 2, "index outside the short last chunk"),
        ([1, 1, 0, 2], [1, 1, 1, 1], [1.0, 1.0], 8, 4, 2, "duplicate index (format 2)"),
        ([3, 1, 0, 2], [1, 1, 1, 1], [1.0, 1.0], 8, 4, 2, "indices not ascending (format 2)"),
        ([1, 3, 0, 2], [1, 2, 1, 1], [1.0, 1.0], 8, 4, 2, "reserved code"),
        ([1, 3, 0, 2], [1, 1, 1, 1], [1.0, 1.0], 8, 4, 5, "k > C"),
        ([1, 3, 0, 2], [1, 1, 1, 1], [1.0, 1.0], 8, 4, 0, "k = 0"),
        ([1, 3, 0, 2], [1, 1, 1, 1], [1.0, 1.0], 8, 4, 3, "wrong sizes for k"),
        ([1, 3, 0], [1, 1, 1, 1], [1.0, 1.0], 8192, 4096, 2, "too few index bytes"),
        ([1, 3, 0, 2], [1, 1, 1, 1], [1.0], 8, 4, 2, "too few scales"),
        ([1, 3, 0, 2], [1, 1, 1, 1], [1.0, -1.0], 8, 4, 2, "negative scale"),
        ([1, 1, 2], [1, 1], [1.0, 1.0], 6, 4, 1, "padding bits hold an index"),
        ([1, 1], [1, 1, 1], [1.0, 1.0], 6, 4, 1, "padding bits hold a code"),
        ([1, 3, 0, 2], [1, 1, 1, 1], [1.0, 1.0], 8, 5000, 2, "chunk over 4096"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_malformed_payloads_are_codec_errors(idx, codes, scales, numel, chunk, k, why):
    fmt = 2 if "format 2" in why or "padding bits hold an index" in why else codec.FORMAT_VERSION
    assert reason_of(forge(idx, codes, scales, numel, chunk, k, fmt)) == "codec", why


def _good_stream(seed: int = 0) -> tuple[list[int], bytes]:
    """84 ascending indices of one chunk of 4096 (R = 5) and their stream."""
    idx = sorted(np.random.default_rng(seed).choice(4096, 84, replace=False).tolist())
    return idx, _rice([idx], 4096, 84)


def _stream_object(stream: bytes) -> bytes:
    return forge(stream, [1] * 84, [1.0], 4096, 4096, 84)


def test_a_well_formed_stream_decodes_to_its_indices():
    idx, stream = _good_stream()
    out = codec.decode(_stream_object(stream))[1]["w"]
    assert out.nonzero().view(-1).tolist() == idx
    assert 63 <= len(stream) <= 79  # 84 * 6 bits at the least, 84 * 6 + (4096 - 84) >> 5 at the most


@pytest.mark.parametrize("fault", ["cut", "extra byte", "padding bit", "all ones", "too short", "too long"])
def test_malformed_index_streams_are_codec_errors(fault):
    """Every way a format-3 index stream can be wrong is a codec error with its own reason, on the
    C path and the torch path alike (tests/core/test_codec_native.py compares them bit by bit)."""
    idx, stream = _good_stream(1)
    used = sum((g >> 5) + 6 for g in np.diff([-1] + idx) - 1)
    bad = {"cut": stream[:-3], "extra byte": stream + b"\0", "all ones": b"\xff" * len(stream),
           "too short": stream[:62], "too long": stream + b"\0" * (80 - len(stream)),
           "padding bit": stream[:-1] + bytes([stream[-1] | 0x80])}[fault]  # fmt: skip
    assert used % 8, "seed 1's stream must leave padding bits in its last byte for the 'padding bit' case"
    with pytest.raises(CodecError) as err:
        codec.decode(_stream_object(bad))
    assert err.value.reason == "codec"
    detail = {"cut": "ends before its last index", "extra byte": "after the last index",
              "padding bit": "after the last index", "all ones": "outside its chunk", "too short": "63 to 79 bytes",
              "too long": "63 to 79 bytes"}[fault]  # fmt: skip
    assert detail in err.value.detail


def test_nonfinite_scale_is_nonfinite_and_a_flipped_byte_is_checksum():
    assert reason_of(forge([1, 3, 0, 2], [1, 1, 1, 1], [1.0, float("nan")], 8, 4, 2)) == "nonfinite"
    data = bytearray(codec.encode({"w": randn(10_000)}, header(), codec="topk"))
    data[-200] ^= 1  # an index byte: the checksum is reported before the malformed payload
    assert reason_of(bytes(data)) == "checksum"


def test_what_was_sent_encodes_to_itself():
    """The learner may encode ``sent = sparsify(e)`` instead of ``e``: the same object decodes."""
    x = randn((70, 300), 9)
    x[:, 100:] = 0  # chunks with fewer non-zeros than k too
    sent = codec.sparsify(x, block_size=512, topk=40)
    assert torch.equal(codec.sparsify(sent, block_size=512, topk=40), sent)
    _, out = codec.decode(codec.encode({"w": sent}, header(), codec="topk", block_size=512, topk=40))
    assert torch.equal(out["w"], sent)


def test_an_object_stores_three_packed_tensors_whatever_its_tensor_count():
    """Each tensor's parts, concatenated in sorted name order ("a.b" sorts before "a:" but after
    "a"): every tensor decodes to its own sparsify(), and the header holds three entries."""
    tensors = {"b": randn((40, 33), 1), "a.b": randn(5000, 2), "a": randn(7, 3), "e": torch.zeros(0),
               "z": randn((3, 2, 100), 4)}  # fmt: skip
    data = codec.encode(tensors, header(), codec="topk", block_size=64, topk=5)
    assert sorted(safetensors.torch.load(data)) == ["topk:idx", "topk:q", "topk:scale"]
    _, out = codec.decode(data)
    for name, x in tensors.items():
        assert torch.equal(out[name], codec.sparsify(x, block_size=64, topk=5)), name
    empty = codec.encode({}, header(), codec="topk")
    assert codec.decode(empty)[1] == {}


def test_packed_parts_of_the_wrong_size_and_the_old_per_tensor_layout_are_refused():
    good = {"topk:idx": torch.tensor(list(_rice([[1, 3], [0, 2]], 4, 2)), dtype=torch.uint8),
            "topk:q": torch.tensor(list(_pack([1, 3, 0, 1], 2)), dtype=torch.uint8),
            "topk:scale": torch.tensor([2.0, 0.5])}  # fmt: skip

    def object_with(stored):
        data = forge([1, 3, 0, 2], [1, 3, 0, 1], [2.0, 0.5], 8, 4, 2)
        meta = json.loads(data[8 : 8 + struct.unpack_from("<Q", data)[0]])["__metadata__"]
        return serialize(stored, {**meta, "checksum": codec.checksum_of(stored)})

    assert codec.decode(object_with(good))[1]["w"].tolist() == [0, 2, 0, -2, 0, 0, 0.5, 0]
    longer = {**good, "topk:scale": torch.tensor([2.0, 0.5, 1.0])}
    old = {"w:idx": good["topk:idx"], "w:q": good["topk:q"], "w:scale": good["topk:scale"]}
    for bad in (longer, old, {k: v for k, v in good.items() if k != "topk:q"}):
        assert reason_of(object_with(bad)) == "codec"
