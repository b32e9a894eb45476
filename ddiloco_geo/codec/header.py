"""The wire header (format version 3): the ``Header`` dataclass and its metadata fields.

The header lives in safetensors' ``__metadata__`` (``dict[str, str]``)::

    ddiloco.format  "3"                       (FORMAT_VERSION; a reader also reads "1" and "2", refuses others)
    kind            delta | global | update | state | checkpoint
    run_id, learner, fragment, seq, base_version, version, num_steps, num_tokens
    clock           VectorClock JSON
    codec           fp32 | bf16 | int8 | int4 | topk
    block_size      values per scale block ("0" for fp32/bf16; the chunk C for topk)
    topk            (topk objects only) values kept per chunk; absent for every other codec, so
                    objects of the older codecs are byte for byte what they were
    shapes          JSON {name: [dims]}: what decode restores (always as float32)
    dtypes          JSON {name: "bfloat16" | ...}, the dtypes the tensors had before encoding; absent
                    when every one was float32 (format 3; formats 1 and 2 always write it)
    extra           one JSON object (merge record, data cursor, ...); absent when empty (format 3)
    checksum        BLAKE3 hex (format 1: SHA-256) over the raw bytes of every stored tensor, in sorted
                    key order
    signer          (signed objects only) key id: "learner:<id>" or "syncer"
    signature       (signed objects only) hex HMAC-SHA256 over every other metadata field

The fields are a frozen surface: a change of meaning needs a new ``FORMAT_VERSION`` (2 changed the
checksum's hash; 3 leaves out ``dtypes`` and ``extra`` where they say nothing, about 100 bytes of a
2.4 KB top-k delta of a small fragment, and Rice-codes top-k's indices, ``sparse``). Objects of
formats 1 and 2 are still read,
``Header.format`` says which. Writing
(``check_header``, ``header_metadata``) raises ValueError for a header that could not be read back;
reading (``parse_metadata``) raises ``CodecError``: ``foreign`` (no metadata, or no format key),
``version`` (another format version) or ``bad_header`` (a missing or malformed field). This module
checks the fields one by one; whether they agree with the stored tensors is ``wire``'s business.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ddiloco_geo.codec.framing import INT64_MAX, is_int_list
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.errors import CodecError
from ddiloco_geo.core.layout import ID_PATTERN
from ddiloco_geo.core.signing import SIGNER_FIELD

FORMAT_VERSION = 3
READABLE_FORMATS = (1, 2, 3)
DEFAULT_DTYPE = "float32"  # format 3 leaves out ``dtypes`` when every tensor had it
FORMAT_KEY = "ddiloco.format"
KINDS = ("delta", "global", "update", "state", "checkpoint")
INT_FIELDS = ("fragment", "seq", "base_version", "version", "num_steps", "num_tokens", "block_size")

_INT_RE = re.compile(r"-?[0-9]{1,19}")


@dataclass
class Header:
    """What an object says about itself. ``shapes``, ``dtypes`` and ``checksum`` are filled in by
    ``decode``/``read_header`` (``encode`` derives them from the tensors) and take no part in
    equality."""

    kind: str
    run_id: str
    fragment: int = -1
    learner: str = ""
    seq: int = -1
    base_version: int = -1
    version: int = -1
    clock: VectorClock = VectorClock()
    num_steps: int = 0
    num_tokens: int = 0
    codec: str = "fp32"
    block_size: int = 0
    topk: int = 0  # values kept per chunk of the topk codec (0 for every other codec)
    extra: dict = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False)
    dtypes: dict[str, str] = field(default_factory=dict, compare=False)
    checksum: str = field(default="", compare=False)
    format: int = field(default=FORMAT_VERSION, compare=False)  # the format version it was read in
    signer: str = field(default="", compare=False)  # key id; trustworthy only after decode(verify=...)


def check_header(h: Header) -> None:
    """Refuse (ValueError) a header whose fields would not read back (before anything is encoded)."""
    if h.kind not in KINDS:
        raise ValueError(f"header kind {h.kind!r}: expected one of {', '.join(KINDS)}")
    if not isinstance(h.run_id, str) or not h.run_id:
        raise ValueError(f"header run_id {h.run_id!r}: expected a non-empty string")
    if not isinstance(h.learner, str) or (h.learner and not ID_PATTERN.match(h.learner)):
        raise ValueError(f"header learner {h.learner!r}: expected '' or a learner id")
    if not isinstance(h.clock, VectorClock):
        raise ValueError(f"header clock: expected a VectorClock, got {type(h.clock).__name__}")
    if not isinstance(h.extra, dict):
        raise ValueError(f"header extra: expected a dict, got {type(h.extra).__name__}")
    for f in INT_FIELDS:
        value = getattr(h, f)
        if type(value) is not int or not -1 <= value <= INT64_MAX:
            raise ValueError(f"header {f} {value!r}: expected an integer >= -1")
    if type(h.topk) is not int or not 0 <= h.topk <= INT64_MAX:
        raise ValueError(f"header topk {h.topk!r}: expected an integer >= 0")


def header_metadata(
    h: Header, *, codec: str, block_size: int, shapes: dict[str, list[int]], dtypes: dict[str, str], checksum: str,
    topk: int = 0,
) -> dict[str, str]:
    """The unsigned ``__metadata__`` of an object (``codec``/``block_size``/``topk`` as resolved by
    encode; ``topk`` is written for the topk codec only)."""
    meta = {
        FORMAT_KEY: str(FORMAT_VERSION),
        "kind": h.kind,
        "run_id": h.run_id,
        "learner": h.learner,
        "clock": h.clock.to_json(),
        "codec": codec,
        "shapes": _json(shapes),
        "checksum": checksum,
        **{f: str(getattr(h, f)) for f in INT_FIELDS},
        "block_size": str(block_size),
    }
    if codec == "topk":
        meta["topk"] = str(topk)
    if h.extra:
        meta["extra"] = _json(h.extra)
    if any(d != DEFAULT_DTYPE for d in dtypes.values()):
        meta["dtypes"] = _json(dtypes)
    return meta


def _json(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"header value is not plain JSON: {exc}") from None


def parse_metadata(entries: dict[str, Any]) -> Header:
    """The ``Header`` of a framed object (``entries`` is its safetensors header JSON)."""
    meta = entries.get("__metadata__")
    if meta is None:
        raise CodecError("foreign", "safetensors file without metadata")
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CodecError("bad_header", "__metadata__ is not a map of strings")
    if FORMAT_KEY not in meta:
        raise CodecError("foreign", f"no {FORMAT_KEY!r} in the metadata: not a ddiloco-geo object")
    fmt = next((v for v in READABLE_FORMATS if meta[FORMAT_KEY] == str(v)), None)
    if fmt is None:
        raise CodecError("version", f"format {meta[FORMAT_KEY][:20]!r}, this reader knows "
                                    f"{', '.join(map(str, READABLE_FORMATS))}: an object from a newer "
                                    "ddiloco-geo, so upgrade this process to the release that wrote it")  # fmt: skip

    def text(key: str) -> str:
        if key not in meta:
            raise CodecError("bad_header", f"missing header field {key!r}")
        return meta[key]

    def integer(key: str) -> int:
        value = text(key)
        if not _INT_RE.fullmatch(value) or not -1 <= int(value) <= INT64_MAX:
            raise CodecError("bad_header", f"header field {key!r}={value[:30]!r} is not an integer >= -1")
        return int(value)

    def obj(key: str, default: Any = None) -> Any:
        """A JSON field; from format 3 on, ``default`` where the writer left it out."""
        if default is not None and fmt >= 3 and key not in meta:
            return default
        try:
            return json.loads(text(key))
        except (ValueError, RecursionError) as exc:
            raise CodecError("bad_header", f"header field {key!r} is not JSON: {exc}"[:300]) from None

    kind, learner, run = text("kind"), text("learner"), text("run_id")
    if kind not in KINDS:
        raise CodecError("bad_header", f"unknown kind {kind[:30]!r}")
    if not run or (learner and not ID_PATTERN.match(learner)):
        raise CodecError("bad_header", "empty run_id or invalid learner id")
    try:
        clock = VectorClock.from_json(text("clock"))
    except CodecError as exc:
        raise CodecError("bad_header", f"header field 'clock': {exc.detail}") from None
    extra, shapes = obj("extra", {}), obj("shapes")
    dtypes = obj("dtypes", dict.fromkeys(shapes, DEFAULT_DTYPE) if isinstance(shapes, dict) else {})
    if not isinstance(extra, dict):
        raise CodecError("bad_header", "header field 'extra' is not a JSON object")
    if not isinstance(shapes, dict) or not all(is_int_list(s, 0) for s in shapes.values()):
        raise CodecError("bad_header", "header field 'shapes' is not {name: [dims]}")
    if not isinstance(dtypes, dict) or set(dtypes) != set(shapes) or not all(
        isinstance(d, str) for d in dtypes.values()
    ):
        raise CodecError("bad_header", "header field 'dtypes' does not match 'shapes'")
    checksum = text("checksum")
    if not re.fullmatch(r"[0-9a-f]{64}", checksum):
        raise CodecError("bad_header", "header field 'checksum' is not a 64-digit hex digest")
    ints = {f: integer(f) for f in INT_FIELDS}
    codec = text("codec")
    return Header(
        kind=kind, run_id=run, learner=learner, clock=clock, codec=codec, extra=extra,
        topk=integer("topk") if codec == "topk" else 0,
        shapes={n: tuple(s) for n, s in shapes.items()}, dtypes=dtypes, checksum=checksum, format=fmt,
        signer=meta.get(SIGNER_FIELD, ""), **ints,
    )  # fmt: skip
