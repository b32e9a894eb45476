"""Object signatures: per-actor HMAC-SHA256 keys derived from one run secret.

Who signs what (``docs/security.md`` has the threat model):

- a learner signs its deltas (and checkpoints) with its own key, key id ``learner:<id>``;
- the syncer signs globals, update objects and its state with the syncer key, key id ``syncer``.

Keys come from configuration or the environment (``security.run_secret``, env
``DDILOCO_SECURITY__RUN_SECRET``), never from the bucket, and never appear in a repr, a log line
or an exception message. Every actor key is derived from the run secret with HMAC-SHA256,
HKDF-style (extract with a fixed salt, expand with a label that names the role and the actor id),
so

- keys of different actors are independent: holding ``learner:a``'s key does not help sign as
  ``learner:b`` or as ``syncer`` (that would need the run secret or an HMAC-SHA256 break);
- the syncer, which holds the run secret, can derive any learner's key to verify its deltas
  (:func:`run_verifier`) without a key list;
- a learner that should not be trusted with the run secret can be given only its own key
  (:func:`derive_key`) and the syncer's verification key (see the caveat below).

HMAC is symmetric: whoever can verify a ``syncer`` signature can also produce one. A learner that
verifies globals therefore holds a key that could sign globals; what stops a compromised learner
from publishing a forged global is the bucket's write permission (``keys.role_prefixes``: learners
write only ``learners/<id>/``), not the signature. The signature on globals defends against
anyone who can write ``globals/`` but does not hold the syncer key. Public-key signatures
(Ed25519) would remove that caveat; they are not implemented (future work).

Signed objects carry two extra header metadata fields, written by ``codec.encode(signer=...)``:
``signer`` (the key id) and ``signature`` (hex HMAC-SHA256 over :func:`signed_message` of every
other metadata field, which includes the tensor checksum, so the signature covers the tensors).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Callable, Mapping

from ddiloco_geo.core.errors import ConfigError

ROLES = ("learner", "syncer")
SYNCER_KEY_ID = "syncer"
LEARNER_KEY_PREFIX = "learner:"
SIGNER_FIELD = "signer"
SIGNATURE_FIELD = "signature"

# version the derivation and the message format separately: either may change on its own
_KDF_SALT = b"ddiloco-geo/kdf/v1"
_KDF_INFO = b"ddiloco-geo/signing-key/v1"
_MESSAGE_CONTEXT = b"ddiloco-geo/object-signature/v1\x00"
_ACTOR_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")  # keys.ID_PATTERN, repeated to stay import-free
KEY_ID_RE = re.compile(r"^(syncer|learner:[a-z0-9][a-z0-9_-]{0,62})$")
SIGNATURE_RE = re.compile(r"^[0-9a-f]{64}$")
MIN_KEY_BYTES = 16


def _secret_bytes(run_secret: bytes | str) -> bytes:
    if isinstance(run_secret, str):
        run_secret = run_secret.encode("utf-8")
    if not isinstance(run_secret, bytes | bytearray) or not run_secret:
        # never echo the value: it is (or is meant to be) a secret
        raise ValueError("run secret: expected a non-empty str or bytes")
    return bytes(run_secret)


def key_id(role: str, actor_id: str = "") -> str:
    """The key id that names an actor's key in object headers: ``learner:<id>`` or ``syncer``."""
    if role == "learner":
        if not isinstance(actor_id, str) or not _ACTOR_RE.match(actor_id):
            raise ValueError(f"learner id {actor_id!r}: expected an id matching {_ACTOR_RE.pattern}")
        return LEARNER_KEY_PREFIX + actor_id
    if role == "syncer":
        return SYNCER_KEY_ID
    raise ValueError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")


def parse_key_id(kid: str) -> tuple[str, str]:
    """``learner:a`` -> ("learner", "a"); ``syncer`` -> ("syncer", ""); ValueError otherwise."""
    if not isinstance(kid, str) or not KEY_ID_RE.match(kid):
        raise ValueError(f"not a key id: {str(kid)[:80]!r}")
    if kid == SYNCER_KEY_ID:
        return "syncer", ""
    return "learner", kid[len(LEARNER_KEY_PREFIX):]


def derive_key(run_secret: bytes | str, role: str, actor_id: str = "") -> bytes:
    """The 32-byte signing key of one actor (HKDF-SHA256, one output block).

    ``role`` is ``learner`` (``actor_id`` is the learner id) or ``syncer`` (every syncer shard
    shares one key; ``actor_id`` is ignored). Domain-separated by role and id: the info string is
    ``_KDF_INFO || 0x00 || key_id || 0x01``, and key ids cannot contain NUL, so no two actors share
    an input."""
    kid = key_id(role, actor_id)
    prk = hmac.new(_KDF_SALT, _secret_bytes(run_secret), hashlib.sha256).digest()
    return hmac.new(prk, _KDF_INFO + b"\x00" + kid.encode("ascii") + b"\x01", hashlib.sha256).digest()


def signed_message(metadata: Mapping[str, str]) -> bytes:
    """The bytes a signature covers: a context string, then the sorted, compact JSON of every
    header metadata field except ``signature`` (so ``signer`` and ``checksum`` are covered)."""
    body = {k: v for k, v in metadata.items() if k != SIGNATURE_FIELD}
    return _MESSAGE_CONTEXT + json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


class Signer:
    """Signs messages with one actor's key. The key is never shown (repr, str, errors)."""

    __slots__ = ("__key", "key_id")

    def __init__(self, key: bytes, key_id: str) -> None:
        if not isinstance(key, bytes | bytearray) or len(key) < MIN_KEY_BYTES:
            raise ValueError(f"signing key: expected at least {MIN_KEY_BYTES} bytes")
        if not isinstance(key_id, str) or not KEY_ID_RE.match(key_id):
            raise ValueError(f"key id {str(key_id)[:80]!r}: expected 'syncer' or 'learner:<id>'")
        self.__key = bytes(key)
        self.key_id = key_id

    def sign(self, message: bytes) -> str:
        """Hex HMAC-SHA256 of ``message``."""
        return hmac.new(self.__key, bytes(message), hashlib.sha256).hexdigest()

    def __repr__(self) -> str:
        return f"Signer(key_id={self.key_id!r}, key=<hidden>)"

    __str__ = __repr__

    def __reduce__(self):  # no pickling: a pickled signer would carry its key around
        raise TypeError("Signer holds a secret key and cannot be pickled")


class Verifier:
    """Checks signatures. ``resolve(key_id)`` returns that key id's key, or None if unknown."""

    __slots__ = ("_resolve",)

    def __init__(self, resolve: Callable[[str], bytes | None]) -> None:
        self._resolve = resolve

    def verify(self, key_id: str, message: bytes, signature: str) -> bool:
        """True only if ``signature`` is ``key_id``'s HMAC of ``message``. Never raises: unknown
        key ids, malformed signatures and resolver errors are all False."""
        if not isinstance(key_id, str) or not KEY_ID_RE.match(key_id):
            return False
        if not isinstance(signature, str) or not SIGNATURE_RE.match(signature):
            return False
        try:
            key = self._resolve(key_id)
        except Exception:  # noqa: BLE001 - a resolver failure is "unknown key", not a crash
            return False
        if not isinstance(key, bytes | bytearray) or not key:
            return False
        expected = hmac.new(bytes(key), bytes(message), hashlib.sha256).hexdigest()
        return hmac.compare_digest(expected, signature)

    def knows(self, key_id: str) -> bool:
        try:
            key = self._resolve(key_id)
        except Exception:  # noqa: BLE001
            return False
        return isinstance(key, bytes | bytearray) and bool(key)

    def __repr__(self) -> str:
        return "Verifier(<resolver>)"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("Verifier may hold secret keys and cannot be pickled")


# --- convenience constructors --------------------------------------------------------------------


def signer_for(run_secret: bytes | str, role: str, actor_id: str = "") -> Signer:
    """The signer of one actor, derived from the run secret."""
    return Signer(derive_key(run_secret, role, actor_id), key_id(role, actor_id))


def run_verifier(run_secret: bytes | str) -> Verifier:
    """For the syncer (holds the run secret): verifies every learner's key and the syncer's."""
    secret = _secret_bytes(run_secret)

    def resolve(kid: str) -> bytes | None:
        try:
            role, actor = parse_key_id(kid)
        except ValueError:
            return None
        return derive_key(secret, role, actor)

    return Verifier(resolve)


def syncer_verifier(syncer_key: bytes) -> Verifier:
    """For learners: accepts only the ``syncer`` key id (a delta-signing learner key never
    verifies as a global). ``syncer_key`` is ``derive_key(run_secret, "syncer")``."""
    if not isinstance(syncer_key, bytes | bytearray) or len(syncer_key) < MIN_KEY_BYTES:
        raise ValueError(f"syncer key: expected at least {MIN_KEY_BYTES} bytes")
    key = bytes(syncer_key)
    return Verifier(lambda kid: key if kid == SYNCER_KEY_ID else None)


def learner_verifier(run_secret: bytes | str) -> Verifier:
    """:func:`syncer_verifier` from the run secret (for learners configured with it)."""
    return syncer_verifier(derive_key(run_secret, "syncer"))


def static_verifier(keys: Mapping[str, bytes]) -> Verifier:
    """A verifier over an explicit {key_id: key} table (tests, or keys provisioned one by one)."""
    table = {k: bytes(v) for k, v in keys.items()}
    return Verifier(table.get)


# --- JSON records (heartbeats, exit records) ------------------------------------------------------

_RECORD_CONTEXT = b"ddiloco-record-v1\x00"


def _record_message(record: Mapping) -> bytes:
    body = {k: v for k, v in record.items() if k != "signature"}
    return _RECORD_CONTEXT + json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def sign_record(record: dict, signer: Signer | None) -> dict:
    """A JSON record with ``signer`` and ``signature`` fields added (unchanged without a signer)."""
    if signer is None:
        return record
    signed = {**record, "signer": signer.key_id}
    signed["signature"] = signer.sign(_record_message(signed))
    return signed


def verify_record(record: Mapping, verifier: Verifier, expected_signer: str) -> bool:
    """True only if the record is signed by ``expected_signer`` and the signature verifies."""
    kid, sig = record.get("signer"), record.get("signature")
    if kid != expected_signer or not isinstance(sig, str):
        return False
    return verifier.verify(kid, _record_message(record), sig)


# --- the keys each role holds, from the security settings ---------------------------------------


def _secret_or_none(security) -> str | None:
    if security.run_secret is None:
        if security.required():
            raise ConfigError("security.require_signatures is set but no security.run_secret: "
                              "set DDILOCO_SECURITY__RUN_SECRET on every learner and syncer")
        return None
    return security.run_secret.get_secret_value()


def syncer_keys(security) -> dict:
    """Keyword arguments for the syncer: its signer (its own key) and a verifier for every
    learner's key and its own; empty when the run is unsigned."""
    secret = _secret_or_none(security)
    if secret is None:
        return {}
    return {"signer": signer_for(secret, "syncer"), "verifier": run_verifier(secret),
            "require_signatures": security.required()}


def learner_keys(security, learner_id: str) -> tuple[Signer | None, Verifier | None, Verifier | None]:
    """(signer for this learner's objects, verifier of the syncer's, verifier of its own)."""
    secret = _secret_or_none(security)
    if secret is None:
        return None, None, None
    own_key, own_id = derive_key(secret, "learner", learner_id), key_id("learner", learner_id)
    return (signer_for(secret, "learner", learner_id), syncer_verifier(derive_key(secret, "syncer")),
            Verifier(lambda kid: own_key if kid == own_id else None))


def tool_signer(security) -> Signer | None:
    """For operator tools that write what others trust (snapshot manifests): the run's syncer key,
    which whoever holds the run secret holds; None in an unsigned run."""
    secret = _secret_or_none(security)
    return signer_for(secret, "syncer") if secret is not None else None


def tool_keys(security) -> tuple[Verifier | None, bool]:
    """For operator tools (status, report, export, replay, snapshot, local's evaluation): a verifier
    of every key and whether signatures are required; (None, False) in an unsigned run."""
    secret = _secret_or_none(security)
    if secret is None:
        return None, False
    return run_verifier(secret), security.required()
