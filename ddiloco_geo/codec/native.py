"""Fused int8/int4 and top-k kernels for the CPU: ``_kernels.c``, compiled on first use, called
through ctypes.

The torch fallback in ``quantize`` takes about six passes over a block (max, min, multiply, round,
convert, pack) and the conversions between float and int8 are the slowest of them; the C kernels
take one, with bit-identical results (tests/core/test_codec_native.py compares them on every block
size and edge case). They are optional: without a C compiler, or with ``DDILOCO_NATIVE_CODEC=0``,
the torch path runs and nothing else changes. ``topk_rows`` does the top-k codec's selection by
a radix select (linear in the chunk) where ``torch.topk`` sorts.

Build: ``cc -O3 -march=native -ffp-contract=off`` into a per-user cache
(``$DDILOCO_NATIVE_DIR``, else ``$XDG_CACHE_HOME/ddiloco-geo`` or ``~/.cache/ddiloco-geo``), keyed by
a hash of the source, the flags, the compiler and the CPU's feature flags (``-march=native`` code
must not run on another CPU that shares the home directory). The library is written to a
temporary name and renamed into place, so processes that build at the same time do not see a
half-written file. A failed build is logged once per process and the torch path is used.
ctypes releases the GIL during each call, so the checksum thread keeps hashing meanwhile.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_kernels.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
ENV_SWITCH = "DDILOCO_NATIVE_CODEC"

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False


def _cache_dir() -> Path:
    if os.environ.get("DDILOCO_NATIVE_DIR"):
        return Path(os.environ["DDILOCO_NATIVE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ddiloco-geo"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), compiler.encode(),
                                      platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:20]
    target = _cache_dir() / f"codec-kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("native_codec_unavailable reason=no C compiler (cc); the torch codec path runs (same bytes, "
                    "slower): install cc or point CC at a compiler")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("native_codec_unavailable reason=%s %s; the torch codec path runs (same bytes, slower): "
                    "check that %s can build a shared library and that %s is writable (DDILOCO_NATIVE_DIR)",
                    type(exc).__name__, detail.decode(errors="replace")[:300] if isinstance(detail, bytes) else detail,
                    compiler, _cache_dir())
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in ("ddiloco_quantize_int4", "ddiloco_quantize_int8"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [p, i64, i64, p, p], ctypes.c_int
    for name in ("ddiloco_dequantize_int4", "ddiloco_dequantize_int8"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [p, p, i64, i64, p], None
    lib.ddiloco_check_scales.argtypes, lib.ddiloco_check_scales.restype = [p, i64, ctypes.c_float], ctypes.c_int
    lib.ddiloco_topk_rows.argtypes, lib.ddiloco_topk_rows.restype = [p, i64, i64, i64, p, p, p], ctypes.c_int
    lib.ddiloco_pack_bits.argtypes, lib.ddiloco_pack_bits.restype = [p, i64, ctypes.c_int, p, i64], None
    lib.ddiloco_unpack_bits.argtypes, lib.ddiloco_unpack_bits.restype = [p, i64, ctypes.c_int, i64, p], ctypes.c_int
    lib.ddiloco_rice_encode.argtypes, lib.ddiloco_rice_encode.restype = [p, p, i64, ctypes.c_int, p, i64], i64
    lib.ddiloco_rice_decode.argtypes, lib.ddiloco_rice_decode.restype = [p, i64, p, p, i64, ctypes.c_int, p], ctypes.c_int
    lib.ddiloco_topk_scatter.argtypes, lib.ddiloco_topk_scatter.restype = [p, p, p, i64, i64, i64, p], ctypes.c_int
    return lib


def kernels() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no compiler, a failed build, or ``DDILOCO_NATIVE_CODEC=0`` when
    the process first asked)."""
    global _LIB, _TRIED
    if not _TRIED:
        with _LOCK:
            if not _TRIED:
                _LIB, _TRIED = _load(), True
    return _LIB


def usable(*tensors: torch.Tensor) -> bool:
    """True when the kernels are available and every tensor is a contiguous, aligned CPU tensor."""
    return all(t.device.type == "cpu" and t.is_contiguous() and t.data_ptr() % t.element_size() == 0
               for t in tensors) and kernels() is not None


def quantize_rows(x2: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, codec: str) -> None:
    """Quantize the float32 rows ``x2`` (one block each) into ``q_out``/``s_out``. A block that
    holds NaN or Inf gets a scale that is not finite, which ``quantize_blocks`` refuses, as on
    the torch path."""
    fn = kernels().ddiloco_quantize_int4 if codec == "int4" else kernels().ddiloco_quantize_int8
    rows, bs = x2.shape
    fn(x2.data_ptr(), rows, bs, q_out.data_ptr(), s_out.data_ptr())


def check_scales(scale: torch.Tensor, qmax: float) -> int:
    """``quantize.scale_problems`` for a contiguous float32 CPU tensor."""
    return kernels().ddiloco_check_scales(scale.data_ptr(), scale.numel(), qmax)


def topk_rows(x2: torch.Tensor, k: int, *, codes: bool = False):
    """Ascending indices (int64 [rows, k]) of the k largest |x| in each row of the float32 ``x2``,
    ties toward the lower index (k < row width); None if a row holds NaN or Inf. With ``codes``:
    (indices, the kept values' 2-bit codes as uint8 [rows, k], the rows' float32 scales), the topk
    codec's parts (``sparse.sparse_encode``) from the same pass."""
    rows, width = x2.shape
    out = torch.empty((rows, k), dtype=torch.long)
    parts = (torch.empty((rows, k), dtype=torch.uint8), torch.empty(rows, dtype=torch.float32)) if codes else ()
    rc = kernels().ddiloco_topk_rows(x2.data_ptr(), rows, width, k, out.data_ptr(),
                                     *((t.data_ptr() for t in parts) if codes else (None, None)))  # fmt: skip
    if rc == 2:
        raise ValueError(f"topk_rows: a row of {width} values keeping {k} (at most 4096, 1 <= k < width)")
    return None if rc else (out, *parts) if codes else out


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """``sparse.pack_bits`` (int64 ``values``, 1 <= width <= 32): one little-endian bit stream."""
    values = values.to(torch.int64).contiguous()
    out = torch.empty(-(-values.numel() * width // 8), dtype=torch.uint8)
    kernels().ddiloco_pack_bits(values.data_ptr(), values.numel(), width, out.data_ptr(), out.numel())
    return out


def unpack_bits(data: torch.Tensor, width: int, count: int) -> int | torch.Tensor:
    """``sparse.unpack_bits``: the int64 values, or 1 (a padding bit is set) or 2 (too few bytes)."""
    data = data.contiguous()
    out = torch.empty(count, dtype=torch.int64)
    rc = kernels().ddiloco_unpack_bits(data.data_ptr(), data.numel(), width, count, out.data_ptr())
    return out if rc == 0 else rc


def rice_encode(local: torch.Tensor, counts: torch.Tensor, r: int, cap: int) -> torch.Tensor:
    """``sparse.pack_indices``: int64 ``local``, int32 ``counts`` per chunk; at most ``cap`` bytes."""
    local, counts = local.contiguous(), counts.contiguous()
    out = torch.empty(cap + 8, dtype=torch.uint8)
    n = kernels().ddiloco_rice_encode(local.data_ptr(), counts.data_ptr(), counts.numel(), r, out.data_ptr(), cap)
    if n < 0:
        raise ValueError(f"rice_encode: indices out of their chunks (more than {cap} bytes)")
    return out[:n].clone()


def rice_decode(data: torch.Tensor, counts: torch.Tensor, limits: torch.Tensor, r: int) -> int | torch.Tensor:
    """``sparse.unpack_indices``: the int64 indices, or the kernel's code (1 trailing bits or bytes,
    2 an index outside its chunk, 8 the stream ends early)."""
    data, counts, limits = data.contiguous(), counts.contiguous(), limits.contiguous()
    out = torch.empty(int(counts.sum()), dtype=torch.int64)
    rc = kernels().ddiloco_rice_decode(data.data_ptr(), data.numel(), counts.data_ptr(), limits.data_ptr(),
                                       counts.numel(), r, out.data_ptr())
    return out if rc == 0 else rc


def dequantize_rows(q2: torch.Tensor, scale: torch.Tensor, o2: torch.Tensor, codec: str) -> None:
    """The float32 rows ``o2`` that ``q2`` and ``scale`` encode."""
    fn = kernels().ddiloco_dequantize_int4 if codec == "int4" else kernels().ddiloco_dequantize_int8
    rows, bs = o2.shape
    fn(q2.data_ptr(), scale.data_ptr(), rows, bs, o2.data_ptr())


def topk_scatter(local: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, numel: int, chunk: int,
                 topk: int) -> int | torch.Tensor:
    """``sparse.sparse_decode`` after unpacking (int64 ``local``/``codes``, float32 ``scale``): the flat
    float32 values, or the kernel's bitmask (1 reserved code, 2 index outside its chunk, 4 not
    ascending)."""
    local, codes, scale = local.contiguous(), codes.contiguous(), scale.contiguous()
    out = torch.empty(numel, dtype=torch.float32)  # the kernel writes every value
    rc = kernels().ddiloco_topk_scatter(local.data_ptr(), codes.data_ptr(), scale.data_ptr(), numel, chunk, topk,
                                        out.data_ptr())
    return out if rc == 0 else rc
