"""Object signatures: key derivation, Signer/Verifier, and signed encode/decode in the codec.

A signature must cover every header field and (through the checksum) every tensor byte; decode
with a verifier must reject tampering, forgery, other actors' keys and missing signatures with
the documented reasons, and never let anything but CodecError escape. Keys never show up in
reprs, strings or exception messages."""

from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco_geo import codec

from ddiloco_geo.core import signing
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.codec import CodecError, Header
from ddiloco_geo.core.signing import Signer, Verifier

SECRET = "test-run-secret-0123456789abcdef"
OTHER_SECRET = "a-different-run-secret-not-ours!"
CODEC_REASONS = {"too_large", "truncated", "bad_header", "foreign", "version", "kind", "run_id", "codec",
                 "checksum", "shape", "nonfinite"}  # fmt: skip
SIGNATURE_REASONS = {"unsigned", "bad_signature", "wrong_signer"}

fuzz = settings(max_examples=300, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {"w": torch.randn((6, 5), generator=gen), "b": torch.randn(7, generator=gen)}


def delta_header(learner: str = "a", seq: int = 3) -> Header:
    return Header(kind="delta", run_id="run-1", fragment=2, learner=learner, seq=seq, base_version=4,
                  clock=VectorClock({learner: seq + 1}), num_steps=4, num_tokens=512, extra={"step_s": 0.1})


def signed(learner: str = "a", codec_name: str = "fp32", secret: str = SECRET) -> bytes:
    return codec.encode(tensors(), delta_header(learner), codec=codec_name, block_size=16,
                        signer=signing.signer_for(secret, "learner", learner))


VERIFIER = signing.run_verifier(SECRET)


def split(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<Q", data)[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(entries: dict, body: bytes) -> bytes:
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + body


def reason_of(data: bytes, **kwargs) -> str:
    with pytest.raises(CodecError) as err:
        codec.decode(data, **kwargs)
    return err.value.reason


# --- key derivation ------------------------------------------------------------------------------


@pytest.mark.unit
def test_derived_keys_are_distinct_deterministic_and_domain_separated():
    ka, kb = signing.derive_key(SECRET, "learner", "a"), signing.derive_key(SECRET, "learner", "b")
    ks = signing.derive_key(SECRET, "syncer")
    assert len({ka, kb, ks}) == 3 and all(len(k) == 32 for k in (ka, kb, ks))
    assert ka == signing.derive_key(SECRET.encode(), "learner", "a")  # str and bytes agree
    assert ka != signing.derive_key(OTHER_SECRET, "learner", "a")
    assert SECRET.encode() not in ka and ka != SECRET.encode()
    # a learner named "syncer" is a different actor from the syncer
    assert signing.derive_key(SECRET, "learner", "syncer") != ks
    assert signing.derive_key(SECRET, "syncer", "x") == ks  # one syncer key for every shard


@pytest.mark.unit
@pytest.mark.parametrize("role, actor", [("admin", "a"), ("learner", ""), ("learner", "A"), ("learner", "a/b"),
                                         ("learner", "../x"), ("learner", "a:b")])
def test_derive_key_refuses_bad_roles_and_ids(role, actor):
    with pytest.raises(ValueError):
        signing.derive_key(SECRET, role, actor)


@pytest.mark.unit
@pytest.mark.parametrize("secret", ["", b"", None, 123])
def test_derive_key_refuses_empty_or_non_text_secrets(secret):
    with pytest.raises(ValueError) as err:
        signing.derive_key(secret, "learner", "a")
    assert "123" not in str(err.value)


@pytest.mark.unit
def test_key_ids():
    assert signing.key_id("learner", "a") == "learner:a"
    assert signing.key_id("syncer") == "syncer"
    assert signing.parse_key_id("learner:a-1") == ("learner", "a-1")
    assert signing.parse_key_id("syncer") == ("syncer", "")
    for bad in ("learner:", "learner:A", "root", "learner:a/../b", "syncer:x", ""):
        with pytest.raises(ValueError):
            signing.parse_key_id(bad)


# --- Signer / Verifier ---------------------------------------------------------------------------


@pytest.mark.unit
def test_sign_and_verify():
    s = signing.signer_for(SECRET, "learner", "a")
    sig = s.sign(b"hello")
    assert len(sig) == 64 and sig == s.sign(b"hello")
    assert VERIFIER.verify("learner:a", b"hello", sig)
    assert not VERIFIER.verify("learner:a", b"hellO", sig)
    assert not VERIFIER.verify("learner:b", b"hello", sig)
    assert not VERIFIER.verify("syncer", b"hello", sig)
    assert not VERIFIER.verify("learner:a", b"hello", sig.upper())
    assert not VERIFIER.verify("learner:a", b"hello", sig[:-1])
    assert not VERIFIER.verify("learner:a", b"hello", "é" * 64)  # non-ASCII: False, not TypeError
    assert not VERIFIER.verify("nobody", b"hello", sig)
    assert not VERIFIER.verify(None, b"hello", sig)  # type: ignore[arg-type]
    assert not VERIFIER.verify("learner:a", b"hello", None)  # type: ignore[arg-type]


@pytest.mark.unit
def test_verifier_resolver_failures_are_false():
    def boom(kid):
        raise RuntimeError("resolver down")

    sig = signing.signer_for(SECRET, "learner", "a").sign(b"m")
    assert not Verifier(boom).verify("learner:a", b"m", sig)
    assert not Verifier(lambda kid: None).verify("learner:a", b"m", sig)
    assert not Verifier(lambda kid: b"").verify("learner:a", b"m", sig)


@pytest.mark.unit
def test_learner_verifier_accepts_only_the_syncer():
    v = signing.learner_verifier(SECRET)
    assert v.verify("syncer", b"m", signing.signer_for(SECRET, "syncer").sign(b"m"))
    assert not v.verify("learner:a", b"m", signing.signer_for(SECRET, "learner", "a").sign(b"m"))
    assert not v.knows("learner:a") and v.knows("syncer")


@pytest.mark.unit
def test_signer_refuses_short_keys_and_bad_key_ids():
    with pytest.raises(ValueError):
        Signer(b"short", "learner:a")
    with pytest.raises(ValueError):
        Signer(b"k" * 32, "root")
    with pytest.raises(ValueError):
        signing.syncer_verifier(b"")


@pytest.mark.unit
def test_keys_never_appear_in_repr_str_pickle_or_errors():
    key = signing.derive_key(SECRET, "learner", "a")
    s = Signer(key, "learner:a")
    shown = [repr(s), str(s), repr(VERIFIER), str(VERIFIER), repr(signing.learner_verifier(SECRET))]
    for text in shown:
        for secret in (key.hex(), repr(key), SECRET):
            assert secret not in text
    assert "learner:a" in repr(s)
    for obj in (s, VERIFIER):
        with pytest.raises(TypeError) as err:
            pickle.dumps(obj)
        assert key.hex() not in str(err.value) and SECRET not in str(err.value)
    assert not hasattr(s, "key") and not hasattr(s, "_key")
    # every rejection message: key ids yes, keys and signatures no
    data = signed("a")
    meta, body = split(data)
    good_sig = meta["__metadata__"]["signature"]
    meta["__metadata__"]["num_tokens"] = "9999"
    for attempt in (join(meta, body), signed("a", secret=OTHER_SECRET)):
        with pytest.raises(CodecError) as err:
            codec.decode(attempt, verify=VERIFIER, require_signature=True, expected_signer="learner:a")
        message = f"{err.value} {err.value.detail!r} {err.value!r}"
        for secret in (key.hex(), SECRET, good_sig, signing.derive_key(SECRET, "syncer").hex()):
            assert secret not in message


# --- signed objects ------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("codec_name", codec.CODECS)
def test_round_trip(codec_name):
    data = signed("a", codec_name)
    header, out = codec.decode(data, kind="delta", run_id="run-1", verify=VERIFIER, require_signature=True,
                               expected_signer="learner:a")
    ref_header, ref = codec.decode(codec.encode(tensors(), delta_header("a"), codec=codec_name, block_size=16))
    assert header == ref_header and header.checksum == ref_header.checksum
    assert header.signer == "learner:a" and header.learner == "a" and ref_header.signer == ""
    for name in ref:
        assert torch.equal(out[name], ref[name])
    # signing adds two metadata fields and changes nothing else
    meta = split(data)[0]["__metadata__"]
    unsigned = split(codec.encode(tensors(), delta_header("a"), codec=codec_name, block_size=16))[0]["__metadata__"]
    assert {k: v for k, v in meta.items() if k not in ("signer", "signature")} == unsigned
    assert meta["signer"] == "learner:a"


@pytest.mark.unit
def test_signed_objects_still_decode_without_a_verifier_and_read_header_is_unverified():
    data = signed("a")
    header, _ = codec.decode(data)
    assert header.signer == "learner:a"  # a claim only
    forged = signed("a", secret=OTHER_SECRET)
    assert codec.read_header(forged).signer == "learner:a"  # read_header never verifies
    assert codec.decode(forged)[0].signer == "learner:a"
    assert reason_of(forged, verify=VERIFIER) == "bad_signature"


@pytest.mark.unit
def test_syncer_signed_global_round_trip_and_learner_key_cannot_pass_as_syncer():
    header = Header(kind="global", run_id="run-1", fragment=0, version=7, clock=VectorClock({"syncer": 7}))
    good = codec.encode(tensors(), header, signer=signing.signer_for(SECRET, "syncer"))
    learner_view = signing.learner_verifier(SECRET)
    h, _ = codec.decode(good, kind="global", verify=learner_view, require_signature=True, expected_signer="syncer")
    assert h.signer == "syncer"
    # a compromised learner signs a "global" with its own key: the learner-side verifier does not know it
    forged = codec.encode(tensors(), header, signer=signing.signer_for(SECRET, "learner", "a"))
    assert reason_of(forged, verify=learner_view, require_signature=True, expected_signer="syncer") == "bad_signature"
    # the syncer-side verifier knows learner keys, and the expected signer catches it
    assert reason_of(forged, verify=VERIFIER, require_signature=True, expected_signer="syncer") == "wrong_signer"
    # a learner-key holder cannot fake the key id either: it cannot compute the syncer's HMAC
    meta, body = split(forged)
    meta["__metadata__"]["signer"] = "syncer"
    assert reason_of(join(meta, body), verify=learner_view, expected_signer="syncer") == "bad_signature"


@pytest.mark.unit
@pytest.mark.parametrize("field, value", [
    ("num_tokens", "999999"), ("num_steps", "1"), ("learner", "b"), ("seq", "4"), ("fragment", "3"),
    ("base_version", "5"), ("run_id", "run-2"), ("extra", '{"step_s":0.2}'), ("clock", '{"a":9}'),
    ("signer", "learner:b"), ("kind", "global"),
])
def test_tampered_header_field_is_bad_signature(field, value):
    meta, body = split(signed("a"))
    assert meta["__metadata__"][field] != value
    meta["__metadata__"][field] = value
    assert reason_of(join(meta, body), verify=VERIFIER) == "bad_signature"


@pytest.mark.unit
def test_added_or_removed_metadata_field_is_bad_signature():
    meta, body = split(signed("a"))
    meta["__metadata__"]["note"] = "x"
    assert reason_of(join(meta, body), verify=VERIFIER) == "bad_signature"
    meta, body = split(signed("a"))
    del meta["__metadata__"]["shapes"]  # a missing required field fails earlier, as bad_header
    assert reason_of(join(meta, body), verify=VERIFIER) == "bad_header"
    meta, body = split(signed("a"))  # a field format 3 leaves out, added with its default value
    assert "dtypes" not in meta["__metadata__"]
    meta["__metadata__"]["dtypes"] = json.dumps(dict.fromkeys(json.loads(meta["__metadata__"]["shapes"]), "float32"))
    assert reason_of(join(meta, body), verify=VERIFIER) == "bad_signature"
    meta, body = split(signed("a"))
    del meta["__metadata__"]["signer"]
    assert reason_of(join(meta, body), verify=VERIFIER) == "bad_signature"


@pytest.mark.unit
def test_tampered_tensor_byte_is_checksum_and_re_hashed_tensor_is_bad_signature():
    data = bytearray(signed("a"))
    data[-3] ^= 0x01
    assert reason_of(bytes(data), verify=VERIFIER) == "checksum"
    # an attacker who also fixes the checksum still cannot re-sign
    meta, body = split(signed("a"))
    body = bytearray(body)
    body[5] ^= 0x40
    stored = {}
    for name, entry in meta.items():
        if name != "__metadata__":
            start, end = entry["data_offsets"]
            stored[name] = torch.frombuffer(bytearray(body[start:end]), dtype=torch.float32).view(entry["shape"])
    meta["__metadata__"]["checksum"] = codec.checksum_of(stored)
    assert reason_of(join(meta, bytes(body)), verify=VERIFIER) == "bad_signature"
    assert codec.decode(join(meta, bytes(body)))  # without a verifier it decodes: the point of signing


@pytest.mark.unit
@pytest.mark.parametrize("fmt", [1, 2])
def test_relabelled_format_version_is_bad_signature(fmt):
    """The format version is signed: a signed format-3 object relabelled as format 1 or 2, with the
    checksum that format uses (SHA-256 for 1) and the fields format 3 leaves out (so it is a
    well-formed object of that format), is refused, not read in the older format."""
    meta, body = split(signed("a"))
    stored = {name: torch.frombuffer(bytearray(body[e["data_offsets"][0]:e["data_offsets"][1]]),
                                     dtype=torch.float32).view(e["shape"])
              for name, e in meta.items() if name != "__metadata__"}  # fmt: skip
    shapes = json.loads(meta["__metadata__"]["shapes"])
    meta["__metadata__"].update({"ddiloco.format": str(fmt), "checksum": codec.checksum_of(stored, fmt),
                                 "extra": "{}", "dtypes": json.dumps(dict.fromkeys(shapes, "float32"))})
    assert reason_of(join(meta, body), verify=VERIFIER) == "bad_signature"
    assert codec.decode(join(meta, body))[0].format == fmt  # a well-formed object of that format otherwise


@pytest.mark.unit
def test_swapped_signature_is_bad_signature():
    a, b = split(signed("a")), split(codec.encode(tensors(), delta_header("a", seq=4),
                                                  signer=signing.signer_for(SECRET, "learner", "a")))
    a[0]["__metadata__"]["signature"] = b[0]["__metadata__"]["signature"]
    assert reason_of(join(*a), verify=VERIFIER) == "bad_signature"


@pytest.mark.unit
def test_other_learners_key():
    # b signs an object that claims to be a's (header learner a, signer b): wrong_signer
    by_b = codec.encode(tensors(), delta_header("a"), signer=signing.signer_for(SECRET, "learner", "b"))
    assert reason_of(by_b, verify=VERIFIER, expected_signer="learner:a") == "wrong_signer"
    # b relabels its signature as a's: bad_signature
    meta, body = split(by_b)
    meta["__metadata__"]["signer"] = "learner:a"
    assert reason_of(join(meta, body), verify=VERIFIER, expected_signer="learner:a") == "bad_signature"
    # b uses its key under a's key id from the start (Signer with a's id, b's key)
    fake = Signer(signing.derive_key(SECRET, "learner", "b"), "learner:a")
    assert reason_of(codec.encode(tensors(), delta_header("a"), signer=fake), verify=VERIFIER) == "bad_signature"


@pytest.mark.unit
def test_missing_signature():
    plain = codec.encode(tensors(), delta_header("a"))
    assert reason_of(plain, verify=VERIFIER, require_signature=True) == "unsigned"
    assert reason_of(plain, verify=VERIFIER, require_signature=True, expected_signer="learner:a") == "unsigned"
    header, _ = codec.decode(plain, verify=VERIFIER)  # accepted when not required, with no signer
    assert header.signer == ""
    meta, body = split(signed("a"))
    del meta["__metadata__"]["signature"]  # stripped signature: a claimed signer does not count
    assert reason_of(join(meta, body), verify=VERIFIER, require_signature=True) == "unsigned"
    assert codec.decode(join(meta, body), verify=VERIFIER)[0].signer == ""


@pytest.mark.unit
def test_require_signature_without_a_verifier_is_a_programming_error():
    with pytest.raises(ValueError):
        codec.decode(signed("a"), require_signature=True)
    with pytest.raises(ValueError):
        codec.encode(tensors(), delta_header("a"), signer="learner:a")  # type: ignore[arg-type]


@pytest.mark.unit
def test_unknown_key_id():
    meta, body = split(signed("a"))
    for kid in ("learner:zz", "admin", "learner:A", "", "x" * 500):
        meta["__metadata__"]["signer"] = kid
        assert reason_of(join(meta, body), verify=VERIFIER) == "bad_signature"
    only_a = signing.static_verifier({"learner:a": signing.derive_key(SECRET, "learner", "a")})
    assert codec.decode(signed("a"), verify=only_a)[0].signer == "learner:a"
    assert reason_of(signed("b"), verify=only_a) == "bad_signature"


@pytest.mark.unit
def test_wrong_secret_is_bad_signature():
    assert reason_of(signed("a", secret=OTHER_SECRET), verify=VERIFIER, require_signature=True) == "bad_signature"


@pytest.mark.unit
def test_signature_is_checked_after_the_checksum_and_before_nonfinite():
    # NaN in the tensors, signed by a stranger: checksum matches, so the signature decides
    meta, body = split(codec.encode(tensors(), delta_header("a")))
    body = bytearray(body)
    body[0:4] = struct.pack("<f", float("nan"))
    stored = {name: torch.frombuffer(bytearray(body[e["data_offsets"][0]:e["data_offsets"][1]]), dtype=torch.float32)
              for name, e in meta.items() if name != "__metadata__"}
    meta["__metadata__"]["checksum"] = codec.checksum_of(stored)
    md = meta["__metadata__"]
    md["signer"] = "learner:a"
    md["signature"] = signing.signer_for(OTHER_SECRET, "learner", "a").sign(signing.signed_message(md))
    assert reason_of(join(meta, bytes(body)), verify=VERIFIER) == "bad_signature"
    md["signature"] = signing.signer_for(SECRET, "learner", "a").sign(signing.signed_message(md))
    assert reason_of(join(meta, bytes(body)), verify=VERIFIER) == "nonfinite"
    assert reason_of(join(meta, bytes(body))) == "nonfinite"


# --- fuzz ----------------------------------------------------------------------------------------


VALID = {name: signed("a", name) for name in codec.CODECS}
DECODED = {name: codec.decode(data, verify=VERIFIER) for name, data in VALID.items()}


def check_mutant(name: str, mutated: bytes) -> None:
    """Only CodecError escapes; whatever verifies is exactly the original object."""
    try:
        header, out = codec.decode(mutated, verify=VERIFIER, require_signature=True, expected_signer="learner:a")
    except CodecError as exc:
        assert exc.reason in CODEC_REASONS | SIGNATURE_REASONS, exc
        return
    ref_header, ref = DECODED[name]
    assert header == ref_header and header.signer == "learner:a"
    assert header.shapes == ref_header.shapes and header.checksum == ref_header.checksum
    assert set(out) == set(ref) and all(torch.equal(out[k], ref[k]) for k in ref)
    # and the bytes that changed were only ones that carry no meaning (the header's padding)
    assert split(mutated)[0] == split(VALID[name])[0]


@fuzz
@given(st.sampled_from(codec.CODECS),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4))  # fmt: skip
def test_byte_mutations_never_verify(name, edits):
    mutated = bytearray(VALID[name])
    for pos, value in edits:
        mutated[pos % len(mutated)] = value
    check_mutant(name, bytes(mutated))


@fuzz
@given(st.sampled_from(codec.CODECS), st.data())
def test_metadata_mutations_never_verify(name, data):
    meta, body = split(VALID[name])
    md = meta["__metadata__"]
    key = data.draw(st.sampled_from(sorted(md) + ["new-field"]))
    value = data.draw(st.text(max_size=40) | st.sampled_from(["learner:b", "syncer", "1", "0", "-1", "{}"]))
    if md.get(key) == value:
        return
    md[key] = value
    mutated = join(meta, body)
    check_mutant(name, mutated)
    with pytest.raises(CodecError):  # a real change never verifies
        codec.decode(mutated, verify=VERIFIER, require_signature=True, expected_signer="learner:a")


@fuzz
@given(st.sampled_from(codec.CODECS), st.data())
def test_truncations_and_extensions_never_verify(name, data):
    full = VALID[name]
    if data.draw(st.booleans()):
        mutated = full[: data.draw(st.integers(0, len(full) - 1))]
    else:
        mutated = full + data.draw(st.binary(min_size=1, max_size=64))
    with pytest.raises(CodecError) as err:
        codec.decode(mutated, verify=VERIFIER, require_signature=True, expected_signer="learner:a")
    assert err.value.reason in CODEC_REASONS | SIGNATURE_REASONS


@fuzz
@given(st.binary(max_size=2048))
def test_random_bytes_only_codec_errors(blob):
    with pytest.raises(CodecError) as err:
        codec.decode(blob, verify=VERIFIER, require_signature=True)
    assert err.value.reason in CODEC_REASONS | SIGNATURE_REASONS
