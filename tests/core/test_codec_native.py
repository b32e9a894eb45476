"""The fused C kernels for int8/int4 (codec/native.py): built on this machine, bit-identical to the
torch path on every block size and edge case, and optional (no compiler: the torch path runs)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from ddiloco_geo import codec
from ddiloco_geo.codec import native, quantize, sparse
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.errors import CodecError



def _torch_only(monkeypatch) -> None:
    monkeypatch.setattr(native, "usable", lambda *tensors: False)


def _both(monkeypatch, flat: torch.Tensor, name: str, bs: int):
    """(q, scale, decoded) from the native path, then from the torch path."""
    out = []
    for use_native in (True, False):
        if not use_native:
            _torch_only(monkeypatch)
        q, s = quantize.quantize_blocks(flat, name, bs, lambda rows: None)
        out.append((q.clone(), s.clone(), quantize.dequantize_blocks(q, s, name, bs, flat.numel())))
    monkeypatch.undo()
    return out


def _cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ties = torch.tensor([7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5, 6.5, -6.5, 0.0] * 11)  # x * inv = x exactly
    wide = torch.randn(5000, generator=gen) * torch.logspace(-30, 30, 5000)  # scales from 1e-30 to 1e30
    return [
        torch.randn(100_003, generator=gen) * 1e-3,  # several CPU chunks and a tail
        ties, wide, torch.zeros(300), -torch.zeros(300),
        torch.cat([torch.zeros(128), -torch.zeros(128), torch.full((128,), -3.0), torch.tensor([1e-45] * 128)]),
        torch.tensor([3.4e38, -3.4e38] * 64),  # near float32's limit: refused by the scale check in both
    ]


@pytest.mark.slow
def test_the_kernels_build_here(monkeypatch, tmp_path):
    """A fresh build into an empty cache (a compiler subprocess: not the unit tier), then a reload
    from that cache."""
    if shutil.which("cc") is None:
        pytest.fail("no C compiler: the native codec cannot be tested (CI images have cc)")
    monkeypatch.setenv("DDILOCO_NATIVE_DIR", str(tmp_path))
    for _ in range(2):
        monkeypatch.setattr(native, "_LIB", None)
        monkeypatch.setattr(native, "_TRIED", False)
        assert native.kernels() is not None
    assert [p.suffix for p in tmp_path.iterdir()] == [".so"]


@pytest.mark.unit
@pytest.mark.parametrize("name", ["int4", "int8"])
@pytest.mark.parametrize("bs", [2, 4, 6, 32, 128, 130, 1024])
def test_native_matches_the_torch_path_bit_for_bit(monkeypatch, name, bs):
    assert native.kernels() is not None
    for flat in _cases():
        try:
            (qn, sn, dn), (qt, st, dt) = _both(monkeypatch, flat, name, bs)
        except CodecError as exc:  # the float32-limit case: both paths must refuse it
            assert exc.reason == "nonfinite"
            _torch_only(monkeypatch)
            with pytest.raises(CodecError):
                quantize.quantize_blocks(flat, name, bs, lambda rows: None)
            monkeypatch.undo()
            continue
        assert torch.equal(qn, qt)
        assert torch.equal(sn.view(torch.int32), st.view(torch.int32))  # the same bits, zeros' signs too
        assert torch.equal(dn.view(torch.int32), dt.view(torch.int32))


@pytest.mark.unit
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_is_refused_by_the_kernels(bad):
    assert native.kernels() is not None
    x = torch.randn(1000)
    x[517] = bad
    header = codec.Header(kind="delta", run_id="r", fragment=0, learner="a", seq=1, base_version=0,
                          clock=VectorClock({"a": 1}), num_steps=1, num_tokens=1)
    for name in ("int4", "int8"):
        with pytest.raises(CodecError) as err:
            codec.encode({"w": x}, header, codec=name)
        assert err.value.reason == "nonfinite"


@pytest.mark.unit
def test_objects_are_the_same_bytes_with_and_without_the_kernels(monkeypatch):
    header = codec.Header(kind="delta", run_id="r", fragment=0, learner="a", seq=1, base_version=0,
                          clock=VectorClock({"a": 1}), num_steps=1, num_tokens=1)
    tensors = {"a": torch.randn(300, 17), "b": torch.zeros(5), "c": torch.randn(4096) * 1e-6}
    native_bytes = codec.encode(tensors, header, codec="int4")
    _torch_only(monkeypatch)
    assert codec.encode(tensors, header, codec="int4") == native_bytes


@pytest.mark.unit
def test_without_a_compiler_the_torch_path_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "_TRIED", False)
    monkeypatch.setenv("DDILOCO_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "definitely-not-a-compiler")
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.kernels() is None
    assert "native_codec_unavailable" in caplog.text
    q, s = quantize.quantize_blocks(torch.randn(1000), "int4", 128, lambda rows: None)
    assert q.numel() == 8 * 64 and s.numel() == 8


@pytest.mark.slow
def test_a_failing_build_and_the_switch_leave_the_torch_path(monkeypatch, tmp_path, caplog):
    for env in ({"CC": "false"}, {native.ENV_SWITCH: "0"}):
        monkeypatch.setattr(native, "_LIB", None)
        monkeypatch.setattr(native, "_TRIED", False)
        monkeypatch.setenv("DDILOCO_NATIVE_DIR", str(tmp_path / next(iter(env))))
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert native.kernels() is None
        assert not list((tmp_path / next(iter(env))).glob("*.tmp"))  # no half-built file left behind
        monkeypatch.undo()


def _topk_rows_cases(width: int, k: int) -> list[torch.Tensor]:
    """Rows that exercise every path of the C selection: random values, heavy ties (a few distinct
    values), zeros, signed zeros and subnormals; rows whose scale jumps (the bound the previous row
    leaves is far too low, then far too high); rows whose evenly spaced sample sees only the small
    values (the sampled bound is too high and the row is selected whole)."""
    gen = torch.Generator().manual_seed(width + k)
    jumps = torch.tensor([1.0, 1.0, 1e3, 1e3, 1e-3, 1e-3, 1.0, 0.0, 1.0, 1e-30, 1e30, 1.0])[:, None]
    hidden = torch.randn(8, width, generator=gen) * 1e-3
    stride = max(1, width // 256)
    hidden[:, 1::stride] = torch.randn(8, len(range(1, width, stride)), generator=gen)  # off the sample
    return [
        torch.randn(16, width, generator=gen),
        torch.randint(-3, 4, (16, width), generator=gen).float(),  # ties everywhere
        torch.randint(-3, 4, (16, width), generator=gen).float() * 1e-40,  # subnormal ties
        torch.zeros(2, width), -torch.zeros(2, width),
        torch.randn(4, width, generator=gen) * torch.logspace(-38, 38, width),
        torch.randn(12, width, generator=gen) * jumps,
        hidden,
    ]


@pytest.mark.unit
@pytest.mark.parametrize("width,k", [(2, 1), (7, 3), (128, 2), (1000, 999), (4096, 64), (4096, 1), (4096, 4095),
                                     (4096, 84), (4095, 84), (1024, 21), (1030, 300)])
def test_topk_selection_matches_the_torch_path(monkeypatch, width, k):
    """The C selection keeps the same indices as torch.topk with ties toward the lower index."""
    assert native.kernels() is not None
    gen = torch.Generator().manual_seed(width + k)
    for x2 in _topk_rows_cases(width, k):
        got = sparse._top(x2.contiguous(), k)
        _torch_only(monkeypatch)
        want = sparse._top(x2.contiguous(), k)
        monkeypatch.undo()
        assert torch.equal(got, want)
    bad = torch.randn(3, width, generator=gen)
    bad[1, width // 2] = float("nan")
    with pytest.raises(CodecError):
        sparse._top(bad, k)


@pytest.mark.slow
def test_topk_selection_of_the_portable_build_matches(monkeypatch, tmp_path):
    """The kernels built with ``-DDDILOCO_SCALAR`` (no AVX2: the portable gather) select the same
    indices as the build for this CPU. A compiler subprocess, so not the unit tier."""
    native_lib = native.kernels()
    assert native_lib is not None
    monkeypatch.setenv("DDILOCO_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DDDILOCO_SCALAR"))
    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "_TRIED", False)
    baseline = native.kernels()
    assert baseline is not None and baseline is not native_lib
    for width, k in [(4096, 84), (4095, 84), (1030, 300), (7, 3)]:
        for x2 in _topk_rows_cases(width, k):
            x2 = x2.contiguous()
            monkeypatch.setattr(native, "_LIB", native_lib)
            got = native.topk_rows(x2, k)
            monkeypatch.setattr(native, "_LIB", baseline)
            assert torch.equal(native.topk_rows(x2, k), got)


def _decode_both(monkeypatch, parts, chunk, topk, numel):
    """sparse_decode's result (or CodecError message) from the kernel, then from the torch path."""
    out = []
    for use_native in (True, False):
        if not use_native:
            _torch_only(monkeypatch)
        try:
            out.append(sparse.sparse_decode(*parts, chunk, topk, numel))
        except CodecError as exc:
            out.append(exc.detail)
    monkeypatch.undo()
    return out


@pytest.mark.unit
@pytest.mark.parametrize("numel,chunk,topk", [(8_300, 4096, 84), (8192, 4096, 84), (50, 4096, 84), (1000, 7, 3),
                                              (999, 16, 16), (0, 4096, 84)])
def test_topk_decode_matches_the_torch_path(monkeypatch, numel, chunk, topk):
    """The C scatter yields the torch path's values bit for bit (signed zeros and a negative scale
    included), and refuses each malformed payload with the torch path's reason."""
    gen = torch.Generator().manual_seed(numel + chunk)
    x = torch.randn(numel, generator=gen)
    x[::5] = 0.0
    local, q, scale = sparse.sparse_encode(x, chunk, topk)
    got, want = _decode_both(monkeypatch, (local, q, scale), chunk, topk, numel)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    if numel == 0:
        return
    negative = -scale  # not what an encoder writes, but well-formed bytes: both paths must agree
    got, want = _decode_both(monkeypatch, (local, q, negative), chunk, topk, numel)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    kept = sparse.kept_count(numel, chunk, topk)
    codes = sparse.unpack_bits(q, 2, kept)
    width = min(chunk, numel)
    bad_code = codes.clone()
    bad_code[-1] = 2
    swapped = local.clone()
    if min(topk, width) > 1:
        swapped[0], swapped[1] = local[1].item(), local[0].item()
    outside = local.clone()
    outside[-1] = numel % chunk or chunk  # the last chunk's width: one past its last index
    for bad_local, bad_codes in [(local, bad_code), (swapped, codes), (outside, codes), (outside, bad_code)]:
        if torch.equal(bad_local, local) and torch.equal(bad_codes, codes):
            continue
        parts = (bad_local, sparse.pack_bits(bad_codes, 2), scale)
        got, want = _decode_both(monkeypatch, parts, chunk, topk, numel)
        assert isinstance(want, str) and got == want


@pytest.mark.unit
@pytest.mark.parametrize("width", [1, 2, 3, 7, 8, 12, 13, 31])
def test_bit_packing_matches_the_torch_path(monkeypatch, width):
    assert native.kernels() is not None
    gen = torch.Generator().manual_seed(width)
    for count in (0, 1, 5, 8, 1001):
        values = torch.randint(0, 2**width, (count,), generator=gen)
        packed = sparse.pack_bits(values, width)
        monkeypatch.setattr(native, "kernels", lambda: None)
        monkeypatch.setattr(native, "usable", lambda *tensors: False)
        assert torch.equal(packed, sparse.pack_bits(values, width))
        assert torch.equal(sparse.unpack_bits(packed, width, count), values)
        monkeypatch.undo()
        assert torch.equal(sparse.unpack_bits(packed, width, count), values)
        if count * width % 8:  # a set padding bit is refused, by both paths
            bad = packed.clone()
            bad[-1] |= 0x80
            with pytest.raises(CodecError, match="padding"):
                sparse.unpack_bits(bad, width, count)
    with pytest.raises(CodecError, match="padding"):
        sparse.unpack_bits(torch.tensor([0, 0, 1], dtype=torch.uint8), width, 1 if width <= 8 else 0)


@pytest.mark.unit
def test_a_bit_stream_too_short_for_its_count_is_a_codec_error():
    assert native.kernels() is not None
    with pytest.raises(CodecError, match="fewer than 3 values of 12 bits") as err:
        sparse.unpack_bits(torch.zeros(4, dtype=torch.uint8), 12, 3)  # 36 bits needed, 32 given
    assert err.value.reason == "codec"


def _rice_both(monkeypatch, fn, *args):
    """``fn(*args)`` (or its CodecError detail) with the kernels, then on the Python path."""
    out = []
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setattr(native, "kernels", lambda: None)
            _torch_only(monkeypatch)
        try:
            out.append(fn(*args))
        except CodecError as exc:
            out.append(exc.detail)
    monkeypatch.undo()
    return out


@pytest.mark.unit
@pytest.mark.parametrize("numels,chunk,topk", [([8_300, 4096, 50], 4096, 84), ([1000, 999], 16, 3), ([64], 64, 64),
                                               ([70_000], 128, 2), ([5000], 4096, 1), ([300, 0, 17], 7, 3)])
def test_rice_index_stream_matches_the_python_path(monkeypatch, numels, chunk, topk):
    """The C index coder writes the Python path's bytes, both read them back, and every corruption
    (flipped bits, cut or added bytes, a stream of ones) gets the same verdict and reason on both."""
    assert native.kernels() is not None
    gen = torch.Generator().manual_seed(sum(numels) + chunk + topk)
    local = torch.cat([sparse.select(torch.randn(n, generator=gen), chunk, topk)[0] % chunk for n in numels])
    streams = _rice_both(monkeypatch, sparse.pack_indices, local, numels, chunk, topk)
    assert torch.equal(streams[0], streams[1])
    stream = streams[0]
    lo, hi = sparse.index_stream_bytes(numels, chunk, topk)
    assert lo <= stream.numel() <= hi
    for got in _rice_both(monkeypatch, sparse.unpack_indices, stream, numels, chunk, topk):
        assert torch.equal(got, local)
    variants = [stream[:-1], torch.cat([stream, torch.zeros(1, dtype=torch.uint8)]), torch.full_like(stream, 255)]
    for i in range(0, stream.numel(), max(1, stream.numel() // 40)):
        for bit in (0, 3, 7):
            flipped = stream.clone()
            flipped[i] ^= 1 << bit
            variants.append(flipped)
    verdicts = set()
    for bad in variants:
        got, want = _rice_both(monkeypatch, sparse.unpack_indices, bad, numels, chunk, topk)
        assert type(got) is type(want) and (torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want)
        verdicts.add(got if isinstance(got, str) else "decoded")
    if stream.numel() > 8:
        assert {"the index stream ends before its last index", "an index lies outside its chunk"} <= verdicts
