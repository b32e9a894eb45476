"""The wire format: codecs against a naive reference, error bounds, header, and every rejection."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
import safetensors.torch
import torch

from ddiloco_geo import codec
from ddiloco_geo.tools.bench.codec import fragment
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.codec import CodecError, Header
from ddiloco_geo.codec.framing import serialize

pytestmark = pytest.mark.unit  # no servers, no subprocesses

SHAPES = [(), (1,), (5,), (127,), (128,), (129,), (300, 7), (2, 3, 64), (0,), (4, 0)]


def make_header(**changes) -> Header:
    fields = dict(kind="delta", run_id="run-1", fragment=3, learner="l-7", seq=42, base_version=11,
                  clock=VectorClock({"l-7": 42, "syncer": 11}), num_steps=24, num_tokens=98304,
                  extra={"note": "x", "weights": [1.5, 2]})  # fmt: skip
    fields.update(changes)
    return Header(**fields)


def randn(shape, seed=0, scale=1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


# --- the naive reference: one block at a time, in numpy ------------------------------------------


def ref_quantize(x: np.ndarray, qmax: int, bs: int) -> tuple[np.ndarray, np.ndarray]:
    flat = x.astype(np.float32).ravel()
    num_blocks = -(-flat.size // bs)
    padded = np.zeros(num_blocks * bs, np.float32)
    padded[: flat.size] = flat
    q = np.zeros(num_blocks * bs, np.int8)
    scales = np.zeros(num_blocks, np.float32)
    for b in range(num_blocks):
        block = padded[b * bs : (b + 1) * bs]
        absmax = np.float32(np.max(np.abs(block)))
        scales[b] = absmax / np.float32(qmax)
        inv = np.float32(qmax) / absmax if absmax > 0 else np.float32(0)
        q[b * bs : (b + 1) * bs] = np.round(block * inv).astype(np.int8)
    return q, scales


def ref_pack_int4(q: np.ndarray, bs: int) -> np.ndarray:
    out = np.zeros(q.size // 2, np.uint8)
    half = bs // 2
    for b in range(q.size // bs):
        for j in range(half):
            lo, hi = int(q[b * bs + j]), int(q[b * bs + j + half])
            out[b * half + j] = ((hi & 0xF) << 4) | (lo & 0xF)
    return out


def ref_dequantize(q: np.ndarray, scales: np.ndarray, bs: int, shape) -> np.ndarray:
    values = q.reshape(-1, bs).astype(np.float32) * scales[:, None]
    return values.ravel()[: int(np.prod(shape))].reshape(shape)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bs", [2, 16, 128])
def test_quantized_codec_matches_naive_reference(name, shape, bs):
    x = randn(shape, seed=len(shape) * 1000 + bs, scale=3.0)
    data = codec.encode({"w": x}, make_header(), codec=name, block_size=bs)
    stored = safetensors.torch.load(data)
    q_ref, s_ref = ref_quantize(x.numpy(), codec.QMAX[name], bs)
    assert np.array_equal(stored["w:scale"].numpy(), s_ref)
    wire_q = ref_pack_int4(q_ref, bs) if name == "int4" else q_ref
    assert np.array_equal(stored["w:q"].numpy(), wire_q)
    _, out = codec.decode(data)
    assert out["w"].dtype == torch.float32 and out["w"].is_contiguous()
    assert tuple(out["w"].shape) == shape
    assert np.array_equal(out["w"].numpy(), ref_dequantize(q_ref, s_ref, bs, shape))


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_error_is_at_most_half_a_scale_per_block(name):
    bs = 64
    x = torch.cat([randn(1000, 1), randn(1000, 2, scale=1e-6), randn(1000, 3, scale=1e4)])
    data = codec.encode({"w": x}, make_header(), codec=name, block_size=bs)
    scales = safetensors.torch.load(data)["w:scale"]
    _, out = codec.decode(data)
    err = torch.zeros(len(scales) * bs)
    err[: x.numel()] = (out["w"] - x).abs()
    bound = scales[:, None] / 2 * (1 + 1e-5) + 1e-30
    assert bool((err.view(-1, bs) <= bound).all())


def test_all_zero_blocks_have_zero_scale_and_decode_to_zero():
    x = torch.zeros(300)
    x[290] = 5.0
    for name in ("int8", "int4"):
        data = codec.encode({"w": x}, make_header(), codec=name, block_size=128)
        scales = safetensors.torch.load(data)["w:scale"]
        assert scales.tolist()[:2] == [0.0, 0.0] and scales[2] > 0
        _, out = codec.decode(data)
        assert torch.equal(out["w"], x)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_is_exact_and_bf16_within_2_to_minus_8(shape):
    x = randn(shape, seed=5, scale=100.0)
    _, out = codec.decode(codec.encode({"w": x}, make_header(), codec="fp32"))
    assert torch.equal(out["w"], x)
    _, out = codec.decode(codec.encode({"w": x}, make_header(), codec="bf16"))
    assert tuple(out["w"].shape) == shape and out["w"].dtype == torch.float32
    assert bool(((out["w"] - x).abs() <= x.abs() * 2**-8).all())


def test_non_fp32_and_non_contiguous_inputs():
    x = randn((64, 96), seed=9)
    tensors = {"t": x.t(), "h": x[:, :10].to(torch.bfloat16)}
    for name in codec.CODECS:
        header, out = codec.decode(codec.encode(tensors, make_header(), codec=name))
        assert header.dtypes == {"h": "bfloat16", "t": "float32"}
        assert tuple(out["t"].shape) == (96, 64) and out["t"].is_contiguous()
        if name in ("fp32", "bf16"):
            assert torch.equal(out["h"], tensors["h"].float())


def test_header_round_trips():
    header = make_header(kind="global", version=17, codec="int4", block_size=64)
    tensors = {"blocks.0.attn.c_attn.weight": randn((8, 24)), "blocks.0.ln_1.bias": randn(8, 1)}
    data = codec.encode(tensors, header)
    back, _ = codec.decode(data, kind="global", run_id="run-1",
                           expect={k: tuple(v.shape) for k, v in tensors.items()})  # fmt: skip
    assert back == header
    assert back.shapes == {k: tuple(v.shape) for k, v in tensors.items()}
    assert back.checksum == codec.checksum_of(safetensors.torch.load(data))
    assert codec.read_header(data) == header
    # read_header needs only the header's bytes, e.g. from a ranged GET
    assert codec.read_header(data[: codec.header_span(data)]) == header
    with meta_reader(data) as m:  # the object is a plain safetensors file
        assert m["ddiloco.format"] == str(codec.FORMAT_VERSION) == "3" and m["codec"] == "int4" and m["block_size"] == "64"
        assert "dtypes" not in m  # format 3: every tensor was float32
    assert back.dtypes == dict.fromkeys(tensors, "float32")


def test_format_3_writes_dtypes_and_extra_only_where_they_say_something():
    header = make_header(extra={"merge": {"contributors": 3}})
    tensors = {"a": randn(4), "b": randn(4).to(torch.bfloat16)}
    data = codec.encode(tensors, header, codec="int4", block_size=4)
    with meta_reader(data) as m:
        assert json.loads(m["dtypes"]) == {"a": "float32", "b": "bfloat16"}
        assert json.loads(m["extra"]) == {"merge": {"contributors": 3}}
    back, _ = codec.decode(data)
    assert back.dtypes == {"a": "float32", "b": "bfloat16"} and back.extra == {"merge": {"contributors": 3}}
    plain = codec.encode({"a": randn(4)}, make_header(extra={}), codec="int4", block_size=4)
    with meta_reader(plain) as m:
        assert "dtypes" not in m and "extra" not in m
    assert codec.decode(plain)[0].extra == {}


@pytest.mark.parametrize("field", ["dtypes", "extra"])
def test_formats_1_and_2_still_need_every_field(field):
    """Format 3 may leave out ``dtypes`` and ``extra``; an object labelled 1 or 2 without them is
    malformed, as it always was."""
    data = valid()
    stored = safetensors.torch.load(data)
    dtypes = json.dumps(dict.fromkeys(codec.decode(data)[0].shapes, "float32"))
    for fmt in (1, 2):
        old = with_meta(data, **{"ddiloco.format": str(fmt), "checksum": codec.checksum_of(stored, fmt),
                                 "extra": "{}", "dtypes": dtypes})
        assert codec.decode(old)[0].format == fmt
        assert reason_of(with_meta(old, **{field: None})) == "bad_header"


class meta_reader:
    """Read __metadata__ with the safetensors library itself (it needs a file)."""

    def __init__(self, data: bytes):
        import tempfile

        self._file = tempfile.NamedTemporaryFile(suffix=".st")
        self._file.write(data)
        self._file.flush()

    def __enter__(self):
        with safetensors.safe_open(self._file.name, "pt") as f:
            return f.metadata()

    def __exit__(self, *exc):
        self._file.close()


def test_default_block_size_and_overrides():
    x = randn(1000)
    header, _ = codec.decode(codec.encode({"w": x}, make_header(codec="int8")))
    assert header.codec == "int8" and header.block_size == codec.DEFAULT_BLOCK_SIZE == 128
    header, _ = codec.decode(codec.encode({"w": x}, make_header(codec="int8"), codec="fp32"))
    assert header.codec == "fp32" and header.block_size == 0


def test_encoding_is_deterministic():
    tensors = {"b": randn(1000, 1), "a": randn((3, 5), 2)}
    reordered = dict(reversed(list(tensors.items())))
    for name in codec.CODECS:
        assert codec.encode(tensors, make_header(), codec=name) == codec.encode(reordered, make_header(), codec=name)


def test_names_that_prefix_each_other_hash_in_sorted_key_order():
    tensors = {"a": randn(5, 1), "a.b": randn(5, 2), "a0": randn(5, 3), "a_": randn(5, 4)}
    for name in codec.CODECS:
        data = codec.encode(tensors, make_header(), codec=name)
        header, out = codec.decode(data)
        assert header.checksum == codec.checksum_of(safetensors.torch.load(data))


def test_int4_wire_ratio_on_a_realistic_fragment():
    tensors = fragment(4.0)
    fp32_bytes = sum(t.numel() * 4 for t in tensors.values())
    data = codec.encode(tensors, make_header(), codec="int4")
    assert len(data) / fp32_bytes <= 0.14
    data8 = codec.encode(tensors, make_header(), codec="int8")
    assert len(data8) / fp32_bytes <= 0.27


def test_encode_rejects_bad_arguments():
    x = {"w": randn(10)}
    with pytest.raises(ValueError):
        codec.encode(x, make_header(), codec="int2")
    with pytest.raises(ValueError):
        codec.encode(x, make_header(), codec="int4", block_size=3)
    with pytest.raises(ValueError):
        codec.encode(x, make_header(kind="weights"))
    with pytest.raises(ValueError):
        codec.encode({"a:q": randn(3)}, make_header())
    with pytest.raises(ValueError):
        codec.encode({"n": torch.arange(3)}, make_header())
    with pytest.raises(ValueError):
        codec.encode(x, make_header(extra={"bad": float("nan")}))


@pytest.mark.parametrize("name", codec.CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_encode_refuses_nonfinite(name, bad):
    x = randn(300)
    x[250] = bad
    with pytest.raises(CodecError) as err:
        codec.encode({"w": x}, make_header(), codec=name)
    assert err.value.reason == "nonfinite"


# --- every rejection, on purpose ------------------------------------------------------------------


def valid(name="int4") -> bytes:
    return codec.encode({"w": randn((40, 9), 3), "b": randn(9, 4)}, make_header(), codec=name, block_size=16)


def split(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<Q", data)[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(entries: dict, payload: bytes) -> bytes:
    head = json.dumps(entries).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + payload


def with_meta(data: bytes, **changes) -> bytes:
    entries, payload = split(data)
    for k, v in changes.items():
        if v is None:
            entries["__metadata__"].pop(k)
        else:
            entries["__metadata__"][k] = v
    return join(entries, payload)


def forge(stored: dict[str, torch.Tensor], name: str, shape, codec_name: str, bs: int = 0) -> bytes:
    """A well-formed object with a correct checksum around arbitrary stored tensors."""
    meta = {"ddiloco.format": str(codec.FORMAT_VERSION), "kind": "delta", "run_id": "run-1", "learner": "", "clock": "{}",
            "codec": codec_name, "extra": "{}", "shapes": json.dumps({name: list(shape)}),
            "dtypes": json.dumps({name: "float32"}), "checksum": codec.checksum_of(stored),
            "fragment": "0", "seq": "0", "base_version": "0", "version": "-1", "num_steps": "1",
            "num_tokens": "1", "block_size": str(bs)}  # fmt: skip
    return serialize(stored, meta)


def reason_of(data, **kwargs) -> str:
    with pytest.raises(CodecError) as err:
        codec.decode(data, **kwargs)
    return err.value.reason


def test_forge_helper_builds_decodable_objects():
    codec.decode(forge({"w": randn(4)}, "w", (4,), "fp32"))


def test_too_large():
    assert reason_of(valid(), max_bytes=100) == "too_large"


@pytest.mark.parametrize("cut", [0, 3, 8, 20, -200, -1])
def test_truncated(cut):
    data = valid()
    assert reason_of(data[:cut]) == "truncated"


def test_absurd_header_length_is_rejected_without_allocating():
    assert reason_of(struct.pack("<Q", 2**63) + b"{}" * 10) == "too_large"
    assert reason_of(struct.pack("<Q", 2**20) + b"{}" * 10) == "truncated"


@pytest.mark.parametrize(
    "data",
    [
        b"\x05\x00\x00\x00\x00\x00\x00\x00hello",
        b"\x04\x00\x00\x00\x00\x00\x00\x00\xff\xfe{}",
        b"\x02\x00\x00\x00\x00\x00\x00\x00[]",
        join({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
        join({"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
        join({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
        join({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 9),
    ],
    ids=["not-json", "not-utf8", "not-object", "size-mismatch", "bad-dtype", "gap", "trailing"],
)
def test_bad_header_framing(data):
    assert reason_of(data) == "bad_header"


def test_not_bytes():
    with pytest.raises(CodecError) as err:
        codec.decode("a string")  # type: ignore[arg-type]
    assert err.value.reason == "bad_header"


def test_foreign_safetensors_files():
    plain = safetensors.torch.save({"w": torch.ones(3)})
    assert reason_of(plain) == "foreign"
    other = safetensors.torch.save({"w": torch.ones(3)}, metadata={"format": "pt"})
    assert reason_of(other) == "foreign"
    with pytest.raises(CodecError) as err:
        codec.read_header(other)
    assert err.value.reason == "foreign"


@pytest.mark.parametrize("fmt", ["0", "4", "", "03", "3 "])
def test_unknown_format_version(fmt):
    assert reason_of(with_meta(valid(), **{"ddiloco.format": fmt})) == "version"
    with pytest.raises(CodecError, match="upgrade this process"):
        codec.decode(with_meta(valid(), **{"ddiloco.format": fmt}))


def test_format_1_objects_are_read_with_their_sha256_checksum():
    """Format 2 changed only the checksum's hash (SHA-256 -> BLAKE3): a format-1 object, as written
    before, still decodes; each format's checksum is refused under the other's label."""
    data = valid()
    stored = safetensors.torch.load(data)
    assert codec.checksum_of(stored, 1) == hashlib.sha256(
        b"".join(stored[k].contiguous().view(torch.uint8).numpy().tobytes() for k in sorted(stored))).hexdigest()
    old = with_meta(data, **{"ddiloco.format": "1", "checksum": codec.checksum_of(stored, 1), "extra": "{}",
                             "dtypes": json.dumps(dict.fromkeys(codec.decode(data)[0].shapes, "float32"))})
    header, tensors = codec.decode(old)
    assert header.format == 1 and codec.decode(data)[0].format == 3
    for name, t in codec.decode(data)[1].items():
        assert torch.equal(tensors[name], t)
    assert reason_of(with_meta(old, checksum=codec.checksum_of(stored, 3))) == "checksum"
    assert reason_of(with_meta(data, checksum=codec.checksum_of(stored, 1))) == "checksum"


@pytest.mark.parametrize(
    "changes",
    [{"kind": "weights"}, {"fragment": "x"}, {"seq": "-5"}, {"clock": '{"A":1}'}, {"extra": "[1]"},
     {"shapes": "{"}, {"checksum": "abc"}, {"num_tokens": None}, {"learner": "../x"},
     {"dtypes": "{}"}],  # fmt: skip
    ids=lambda c: next(iter(c)),
)
def test_bad_header_fields(changes):
    assert reason_of(with_meta(valid(), **changes)) == "bad_header"


def test_metadata_values_must_be_strings():
    entries, payload = split(valid())
    entries["__metadata__"]["seq"] = 5
    assert reason_of(join(entries, payload)) == "bad_header"


def test_wrong_kind_and_run_id():
    data = valid()
    assert reason_of(data, kind="global") == "kind"
    assert reason_of(data, run_id="run-2") == "run_id"
    codec.decode(data, kind="delta", run_id="run-1")


def test_unknown_or_inconsistent_codec():
    assert reason_of(with_meta(valid(), codec="int2")) == "codec"
    assert reason_of(with_meta(valid(), block_size="32")) == "codec"
    assert reason_of(with_meta(valid(), codec="int8")) == "codec"
    assert reason_of(with_meta(valid("int8"), block_size="7")) == "codec"
    # extra or missing stored tensors
    stored = {"w:q": torch.zeros(8, dtype=torch.uint8), "w:scale": torch.ones(1), "x": torch.ones(1)}
    assert reason_of(forge(stored, "w", (16,), "int4", 16)) == "codec"
    assert reason_of(forge({"w:q": torch.zeros(8, dtype=torch.int8), "w:scale": torch.ones(1)},
                           "w", (16,), "int4", 16)) == "codec"  # fmt: skip


def test_stored_tensor_mismatch_for_float_codecs_is_shape():
    assert reason_of(forge({"w": torch.ones(4)}, "w", (2, 2), "fp32")) == "shape"
    assert reason_of(forge({"w": torch.ones(4)}, "w", (4,), "bf16")) == "shape"


@pytest.mark.parametrize("name", codec.CODECS)
def test_flipped_payload_byte_fails_checksum(name):
    data = bytearray(valid(name))
    for pos in (len(data) - 1, len(data) - 50, struct.unpack_from("<Q", data)[0] + 8):
        mutated = bytearray(data)
        mutated[pos] ^= 0x10
        assert reason_of(bytes(mutated)) == "checksum"
    assert reason_of(with_meta(bytes(data), checksum="0" * 64)) == "checksum"


def test_shape_against_expect():
    data = valid()
    good = {"w": (40, 9), "b": (9,)}
    codec.decode(data, expect=good)
    assert reason_of(data, expect={"w": (9, 40), "b": (9,)}) == "shape"
    assert reason_of(data, expect={"w": (40, 9)}) == "shape"
    assert reason_of(data, expect={**good, "c": (1,)}) == "shape"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_values_and_scales(bad):
    x = torch.ones(4)
    x[2] = bad
    assert reason_of(forge({"w": x}, "w", (4,), "fp32")) == "nonfinite"
    assert reason_of(forge({"w": x.bfloat16()}, "w", (4,), "bf16")) == "nonfinite"
    q = torch.ones(16, dtype=torch.int8)
    assert reason_of(forge({"w:q": q, "w:scale": torch.tensor([bad])}, "w", (16,), "int8", 16)) == "nonfinite"
    # a finite scale that overflows once multiplied by q
    assert reason_of(forge({"w:q": q, "w:scale": torch.tensor([3e38])}, "w", (16,), "int8", 16)) == "nonfinite"


def test_negative_scale_is_rejected():
    q = torch.ones(16, dtype=torch.int8)
    assert reason_of(forge({"w:q": q, "w:scale": torch.tensor([-1.0])}, "w", (16,), "int8", 16)) == "codec"


@pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)
def test_encoding_on_the_device_matches_the_cpu():
    tensors = fragment(2.0)
    for name in codec.CODECS:
        cpu = codec.encode(tensors, make_header(), codec=name)
        gpu = codec.encode({k: v.cuda() for k, v in tensors.items()}, make_header(), codec=name)
        assert cpu == gpu


def test_codec_benchmark_smoke():
    from ddiloco_geo.tools.bench.codec import measure

    rows = measure(fragment(0.25), ["fp32", "int4"], repeats=1, block_size=128)
    assert [r["codec"] for r in rows] == ["fp32", "int4"]
    assert rows[0]["max_abs_err"] == 0.0 and rows[1]["wire_ratio"] < 0.2  # tiny: header weighs more
    for key in ("speed_vs_memcpy", "encode_mb_s", "decode_mb_s", "rel_l2_err", "memcpy_mb_s"):
        assert rows[1][key] > 0


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4", "topk"])
def test_roundtrip_is_what_decode_yields_bit_for_bit(name):
    # error feedback and the syncer's update objects rely on it: the residual is exact only if
    # roundtrip(x) is the decoded object, to the bit
    gen = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randn(3, 1000, generator=gen), "b": torch.randn(77, generator=gen) * 1e-3,
               "c": torch.zeros(5, 9)}
    hdr = codec.Header(kind="delta", run_id="run-1", learner="l-1", seq=1)
    for block in (0, 64):
        _, decoded = codec.decode(codec.encode(tensors, hdr, codec=name, block_size=block), kind="delta",
                                  run_id="run-1")
        got = codec.roundtrip(tensors, name, block_size=block)
        assert set(got) == set(decoded)
        for n in got:
            assert got[n].dtype == torch.float32 and got[n].shape == tensors[n].shape
            assert torch.equal(got[n], decoded[n]), (name, block, n)
    with pytest.raises(codec.CodecError):
        codec.roundtrip({"x": torch.tensor([1.0, float("nan")])}, name)


@pytest.mark.unit
def test_all_finite_finds_nan_and_inf_anywhere():
    from ddiloco_geo.codec.quantize import all_finite

    assert all_finite(torch.empty(0)) and all_finite(torch.randn(1000)) and all_finite(torch.zeros(3, dtype=torch.bfloat16))
    for n in (1, 9, 4097):
        for pos in {0, n // 2, n - 1}:
            for bad in (float("nan"), float("inf"), float("-inf")):
                for dtype in (torch.float32, torch.bfloat16):
                    t = torch.randn(n).to(dtype)
                    t[pos] = bad
                    assert not all_finite(t), (n, pos, bad, dtype)
