"""Hostile input against a live run: a syncer and two honest learners as processes on the moto
server, while the test writes what a compromised learner or a bucket-level attacker could.

Every case checks the same four things:

1. the syncer and both learners keep running (processes alive, heartbeats and the syncer status
   advancing, no traceback in the syncer log);
2. each hostile object is rejected with the expected reason, logged once (one ``delta_rejected``
   line naming its key) and counted (``counters.rejected_by_reason`` in the syncer status);
3. no global version is affected: no merge record lists a hostile key (checked per case and once
   more at the end over every merge record);
4. honest learners' deltas keep being merged after the hostile writes.

The run uses ``--set security.run_secret=...`` when the settings tree has a ``security`` section
(signing wired into learner and syncer); hostile objects are signed with the key a compromised
learner would hold (its own, derived from the run secret) unless the case is about signatures.
The cases run in file order on one shared run (module fixture); the flood and the small-norm
attack run last (the flood gets its learner quarantined; a successful small-norm attack starves
the honest learners for good), then one check over every merge record and for leaked layout.
Budget: about two to three minutes.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import pytest
import torch

from ddiloco_geo import codec

from ddiloco_geo.core import config

from ddiloco_geo.core import layout

from ddiloco_geo import protocol

from ddiloco_geo.core import signing
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.errors import CodecError, NotFoundError
from ddiloco_geo.storage import open_store
from tests.conftest import TEST_REGION, cli_args_for, create_s3_bucket, deadline, storage_config_for, unique_name

pytestmark = pytest.mark.slow

SECRET = "hostile-suite-run-secret-0f3a9c7e5d1b"
WRONG_SECRET = "not-the-run-secret-at-all-7e1d0c9b"
HONEST = ("honest-a", "honest-b")
NUM_FRAGMENTS = 4
MAX_STALENESS = 8  # syncer.max_staleness default
# the settings tree has the security section once the lead wires signing into learner and syncer
SIGNING_WIRED = "security" in config.Settings.model_fields
WIRING = "needs signing/limits wired into the syncer (security.run_secret, size/replay/rate checks)"

# Honest learners step at most 1 / SLOW_STEP_S times a second (one delta per step), whatever the
# machine; the syncer's rate limit is set well above that and the flood well above the limit.
SLOW_STEP_S = 0.3
RATE_LIMIT_PER_MIN = 360
RATE_KNOBS = "max_deltas_per_min" in config.SyncerConfig.model_fields

SEQS_AHEAD = 16  # where put_next_seq writes: past the learner's newest seq by this many (a few seconds of its sends)

SETTINGS = f"""
[model]
name = "nano"
[data]
max_bytes = 400000
[fragments]
num_fragments = {NUM_FRAGMENTS}
sync_every = 4
[learner]
max_steps = 100000
log_every = 50
heartbeat_s = 0.3
slow_step_s = {SLOW_STEP_S}
""" + (f"[syncer]\nmax_deltas_per_min = {RATE_LIMIT_PER_MIN}\n" if RATE_KNOBS else "")

CODEC_REASONS = {"bad_header", "truncated", "too_large", "checksum", "nonfinite", "shape", "foreign", "version",
                 "kind", "run_id", "codec", "unsigned", "bad_signature", "wrong_signer"}  # fmt: skip


def learner_signer(learner: str, secret: str = SECRET) -> signing.Signer:
    return signing.signer_for(secret, "learner", learner)


class LiveRun:
    """The processes, an in-process view of the bucket, and the bookkeeping of hostile layout."""

    def __init__(self, endpoint: str, tmp: Path) -> None:
        self.tmp = tmp
        bucket = unique_name("hostile")
        create_s3_bucket(endpoint, bucket)
        self.bucket, self.prefix = bucket, "run/"
        self.cfg = storage_config_for("moto", f"{bucket}/run", endpoint)
        self.store = open_store(self.cfg)
        self.s3 = boto3.client("s3", endpoint_url=endpoint, region_name=TEST_REGION,
                               aws_access_key_id="testing", aws_secret_access_key="testing")
        self.settings_path = tmp / "settings.toml"
        self.settings_path.write_text(SETTINGS)
        self.env = dict(os.environ, OMP_NUM_THREADS="1")
        self.procs: dict[str, subprocess.Popen] = {}
        self.hostile: set[str] = set()  # every hostile key written (must never be merged)
        self.allowed_merged: set[str] = set()  # hostile-but-valid keys a syncer may merge (flood under quota)
        self.tape: dict[str, dict] = {}
        self.spec: protocol.RunSpec | None = None

    # --- processes -------------------------------------------------------------------------------

    def start(self, name: str, role: str, *args: str) -> None:
        extra = ["--set", f"security.run_secret={SECRET}"] if SIGNING_WIRED else []
        log = open(self.tmp / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "ddiloco_geo", role, "--config", str(self.settings_path),
             *cli_args_for(self.cfg), *extra, *args],
            cwd=self.tmp, env=self.env, stdout=log, stderr=subprocess.STDOUT, text=True)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)[-2500:]}" for n in self.procs)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=deadline(60))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.store.close()

    # --- reading the run -------------------------------------------------------------------------

    def status(self) -> dict:
        try:
            return json.loads(self.store.get(layout.syncer_status_key(0, 1)))
        except NotFoundError:
            return {}

    def reasons(self) -> dict[str, int]:
        return dict(self.status().get("counters", {}).get("rejected_by_reason", {}))

    def heartbeat_step(self, learner: str) -> int:
        try:
            return int(json.loads(self.store.get(layout.heartbeat_key(learner))).get("step") or 0)
        except (NotFoundError, ValueError):
            return 0

    def index(self) -> dict[int, int]:
        return protocol.read_index(self.store)[0]

    def refresh_tape(self) -> list[dict]:
        for key in self.store.list(layout.SYNCER + "tape/"):
            if key not in self.tape:
                try:
                    self.tape[key] = json.loads(self.store.get(key))
                except (NotFoundError, ValueError):
                    continue
        return list(self.tape.values())

    def merged_keys(self) -> set[str]:
        recs = self.refresh_tape()
        return {e["key"] for r in recs for e in r.get("merged", [])} | {k for r in recs for k in r.get("superseded", [])}

    def honest_high_water(self) -> dict[str, int]:
        out = {l: -1 for l in HONEST}
        for r in self.refresh_tape():
            for e in r.get("merged", []):
                if e["learner"] in out:
                    out[e["learner"]] = max(out[e["learner"]], e["seq"])
        return out

    def rejections(self, learner: str) -> dict[str, str]:
        out = {}
        for key in self.store.list(f"{layout.SYNCER}rejected/{learner}/"):
            try:
                rec = json.loads(self.store.get(key))
                out[rec["key"]] = rec["reason"]
            except (NotFoundError, ValueError, KeyError):
                continue
        return out

    def reject_log_lines(self, key: str) -> list[str]:
        pattern = re.compile(r"delta_rejected\b.*\bkey=" + re.escape(repr(key)) + r"(\s|$)")
        return [line for line in self.log("syncer").splitlines() if pattern.search(line)]

    # --- writing ---------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> str:
        assert self.store.put_if_absent(key, data), key
        self.hostile.add(key)
        return key

    def put_raw(self, key: str, data: bytes) -> str:
        """Straight through boto3: S3 keys are plain strings, nothing normalizes them."""
        self.s3.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)
        self.hostile.add(key)
        return key

    def put_next_seq(self, learner: str, fragment: int, data: bytes) -> str:
        """Write into a (possibly honest) learner's prefix a few seqs past its newest, after any
        object written here before; the learner's uploader moves past the taken seq when it gets
        there. A few ahead: the syncer never lists a key below its cursor, which the learner's own
        next deltas move, so a key at the very next seq could land behind it (the learner wrote that
        seq for another fragment and the syncer took it between this listing and this write) and
        never be accounted (CI, stop 45, under load)."""
        seqs, ours = [], []
        for k in self.store.list(layout.deltas_dir(learner)):
            try:
                seq = layout.parse_delta_key(k).seq
            except layout.LayoutError:
                continue  # junk another test left
            if seq < 10**11:  # not the far-future junk of the seq_ahead case
                (ours if k in self.hostile else seqs).append(seq)
        seq = max(max(seqs, default=-1) + 1 + SEQS_AHEAD, max(ours, default=-1) + 1)
        while True:
            key = layout.delta_key(learner, seq, fragment)
            if self.store.put_if_absent(key, data):
                self.hostile.add(key)
                return key
            seq += 1

    def delta(self, who: str, n: int, frag: int, *, scale: float = 1e-3, signer: signing.Signer | None | str = "own",
              codec_name: str = "int4", tensors: dict[str, torch.Tensor] | None = None, **fields) -> bytes:
        """A well-formed delta of learner ``who``, seq ``n``, fragment ``frag``, signed with
        ``who``'s own key by default; ``fields`` override header fields (the header may lie)."""
        if tensors is None:
            gen = torch.Generator().manual_seed(hash((who, n, frag)) % 2**31)
            tensors = {name: scale * torch.randn(s, generator=gen) for name, s in self.spec.plan.expect(frag).items()}
        header = dict(kind="delta", run_id=self.spec.run_id, fragment=frag, learner=who, seq=n,
                      base_version=None, clock=VectorClock({who: n + 1}), num_steps=4, num_tokens=4096,
                      extra={"step": n, "step_s": 0.05})
        header.update(fields)
        if header["base_version"] is None:
            header["base_version"] = self.index().get(frag, 0)
        if signer == "own":
            signer = learner_signer(who)
        return codec.encode(tensors, codec.Header(**header), codec=codec_name, signer=signer)

    # --- checks ----------------------------------------------------------------------------------

    def wait_rejected(self, expected: dict[str, set[str]], timeout: float = 40) -> dict[str, str]:
        """Wait until every key has a rejection record (or was merged: a failure); return key -> reason."""
        end_at = time.monotonic() + deadline(timeout)
        found: dict[str, str] = {}
        while True:
            for learner in {layout.parse_learner(k) for k in expected}:
                found.update({k: r for k, r in self.rejections(learner).items() if k in expected})
            merged = self.merged_keys() & set(expected)
            if set(found) | merged >= set(expected) or time.monotonic() > end_at:
                break
            self.assert_alive()
            time.sleep(0.3)
        missing = {k: "merged" if k in merged else "not accounted" for k in expected if k not in found}
        wrong = {k: (found[k], sorted(expected[k])) for k in found if found[k] not in expected[k]}
        assert not missing and not wrong, (
            f"missing={missing} wrong_reason={wrong} (got, wanted); signing wired={SIGNING_WIRED}\n{self.logs()}")
        return found

    def assert_counted_and_logged_once(self, found: dict[str, str], before: dict[str, int], timeout: float = 15) -> None:
        wanted: dict[str, int] = {}
        for reason in found.values():
            wanted[reason] = wanted.get(reason, 0) + 1
        end_at = time.monotonic() + deadline(timeout)
        while True:
            now = self.reasons()
            short = {r: (now.get(r, 0) - before.get(r, 0), n) for r, n in wanted.items() if now.get(r, 0) - before.get(r, 0) < n}
            if not short or time.monotonic() > end_at:
                break
            time.sleep(0.5)
        assert not short, f"rejected_by_reason did not count (counted, wanted): {short}"
        for key in found:
            lines = self.reject_log_lines(key)
            assert len(lines) == 1, f"{key}: {len(lines)} delta_rejected lines: {lines[:3]}"

    def assert_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        assert not dead, f"processes exited: {dead}\n{self.logs()}"

    def snapshot(self) -> dict:
        return {"steps": {l: self.heartbeat_step(l) for l in HONEST}, "syncer_time": self.status().get("time", 0),
                "high_water": self.honest_high_water(), "reasons": self.reasons(), "hostile": set(self.hostile)}

    def assert_healthy(self, snap: dict, timeout: float = 45) -> None:
        """Alive, heartbeats and syncer status advancing, honest deltas merged after ``snap``,
        none of the hostile keys written since ``snap`` in any merge record, no traceback in the
        syncer log."""
        end_at = time.monotonic() + deadline(timeout)
        while True:
            self.assert_alive()
            steps = {l: self.heartbeat_step(l) for l in HONEST}
            high = self.honest_high_water()
            status_time = self.status().get("time", 0)
            lagging = [l for l in HONEST if steps[l] <= snap["steps"][l]]
            unmerged = [l for l in HONEST if high[l] <= snap["high_water"][l]]
            if not lagging and not unmerged and status_time > snap["syncer_time"]:
                break
            assert time.monotonic() < end_at, (
                f"no progress: heartbeats lagging={lagging} honest unmerged={unmerged} "
                f"syncer status advanced={status_time > snap['syncer_time']}\n{self.logs()}")
            time.sleep(0.5)
        bad = (self.merged_keys() & (self.hostile - snap["hostile"])) - self.allowed_merged
        assert not bad, f"hostile keys merged into a global: {sorted(bad)[:5]}"
        assert "Traceback" not in self.log("syncer"), self.log("syncer")[-3000:]


@pytest.fixture(scope="module")
def live(moto_endpoint, tmp_path_factory):
    run = LiveRun(moto_endpoint, tmp_path_factory.mktemp("hostile"))
    try:
        run.start("syncer", "syncer")
        run.start(HONEST[0], "learner", "--id", HONEST[0], "--set", "data.shard=0/2")
        run.start(HONEST[1], "learner", "--id", HONEST[1], "--set", "data.shard=1/2")
        end_at = time.monotonic() + deadline(90)
        while True:  # both learners merged, and enough accepted deltas per fragment for the norm median
            run.assert_alive()
            if run.spec is None:
                try:
                    run.spec = protocol.load_spec(run.store)
                except (NotFoundError, CodecError):
                    pass
            counters = run.status().get("counters", {})
            accepted = counters.get("deltas_merged", 0) + counters.get("deltas_superseded", 0)
            high = run.honest_high_water()
            if run.spec is not None and accepted >= 10 * NUM_FRAGMENTS and min(high.values()) >= 0:
                break
            assert time.monotonic() < end_at, f"the run did not warm up: {counters}\n{run.logs()}"
            time.sleep(0.5)
        yield run
    finally:
        run.stop()


# --- malformed bytes ---------------------------------------------------------------------------


def test_random_bytes(live):
    snap = live.snapshot()
    gen = torch.Generator().manual_seed(1)
    expected = {}
    for i, size in enumerate((0, 7, 64, 4096, 70_000)):
        blob = bytes(torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8).tolist())
        try:
            codec.decode(blob)
            reason = "decoded?!"
        except CodecError as exc:
            reason = exc.reason
        expected[live.put(layout.delta_key("x-random", i, i % NUM_FRAGMENTS), blob)] = {reason}
    # a header length that claims more than exists, and a JSON header that is not an object
    expected[live.put(layout.delta_key("x-random", 5, 0), struct.pack("<Q", 2**40) + b"{}")] = {"too_large", "truncated"}
    expected[live.put(layout.delta_key("x-random", 6, 1), struct.pack("<Q", 2) + b"[]")] = {"bad_header"}
    found = live.wait_rejected(expected)
    live.assert_counted_and_logged_once(found, snap["reasons"])
    live.assert_healthy(snap)


def test_truncated_and_bit_flipped_objects(live):
    snap = live.snapshot()
    honest_key = sorted(live.merged_keys() & set(live.store.list(layout.deltas_dir(HONEST[0]))))[-1]
    honest = live.store.get(honest_key)
    p = layout.parse_delta_key(honest_key).fragment
    expected = {
        live.put(layout.delta_key("x-trunc", 0, p), honest[: len(honest) // 2]): {"truncated"},
        live.put(layout.delta_key("x-trunc", 1, p), honest[:5]): {"truncated"},
        live.put(layout.delta_key("x-trunc", 2, p), honest[: codec.header_span(honest) - 3]): {"truncated"},
    }
    own = live.delta("x-flip", 0, p)
    flipped = bytearray(own)
    flipped[-10] ^= 0x10  # a tensor byte
    expected[live.put(layout.delta_key("x-flip", 0, p), bytes(flipped))] = {"checksum"}
    flipped = bytearray(live.delta("x-flip", 1, p))
    flipped[3] ^= 0x80  # the header length
    expected[live.put(layout.delta_key("x-flip", 1, p), bytes(flipped))] = {"too_large", "truncated", "bad_header"}
    found = live.wait_rejected(expected)
    live.assert_counted_and_logged_once(found, snap["reasons"])
    live.assert_healthy(snap)


def test_tampered_header_is_bad_signature(live):
    """[wiring] a signed delta whose counters were inflated after signing (stays valid JSON)."""
    snap = live.snapshot()
    data = live.delta("x-tamper", 0, 1)
    assert b'"num_tokens":"4096"' in data
    tampered = data.replace(b'"num_tokens":"4096"', b'"num_tokens":"9096"')
    key = live.put(layout.delta_key("x-tamper", 0, 1), tampered)
    found = live.wait_rejected({key: {"bad_signature"}})
    live.assert_counted_and_logged_once(found, snap["reasons"])
    live.assert_healthy(snap)


# --- well-formed objects with bad content ------------------------------------------------------


def _resign(data: bytes, mutate, signer: signing.Signer, **meta: str) -> bytes:
    """Parse a safetensors object, let ``mutate(entries, body)`` change the tensor bytes and
    ``meta`` header fields, then fix the checksum and re-sign: what a compromised learner holding
    its own key can produce (and much cheaper than encoding again)."""
    n = struct.unpack_from("<Q", data)[0]
    entries, body = json.loads(data[8 : 8 + n]), bytearray(data[8 + n :])
    if mutate is not None:
        mutate(entries, body)
    entries["__metadata__"].update(meta)
    dtypes = {"F32": torch.float32, "U8": torch.uint8, "I8": torch.int8, "BF16": torch.bfloat16}
    stored = {name: torch.frombuffer(bytearray(body[e["data_offsets"][0] : e["data_offsets"][1]]) or bytearray(1),
                                     dtype=dtypes[e["dtype"]])[: math.prod(e["shape"])]
              for name, e in entries.items() if name != "__metadata__"}  # fmt: skip
    meta = entries["__metadata__"]
    meta["checksum"] = codec.checksum_of(stored)
    meta.pop("signature", None)
    meta["signer"] = signer.key_id
    meta["signature"] = signer.sign(signing.signed_message(meta))
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + bytes(body)


def _poke(tensor_name: str, value: float):
    def mutate(entries, body):
        start = entries[tensor_name]["data_offsets"][0]
        body[start : start + 4] = struct.pack("<f", value)
    return mutate


def _stamp(n: int):
    """Make the payload unique (any byte of packed int4 values is valid; scales stay as they were),
    so copies of one template are distinct deltas rather than replays."""
    def mutate(entries, body):
        start = entries[min(k for k in entries if k.endswith(":q"))]["data_offsets"][0]
        body[start : start + 4] = struct.pack("<I", n)
    return mutate


def test_nan_and_inf(live):
    snap = live.snapshot()
    p = 2
    signer = learner_signer("x-nan")
    fp32 = live.delta("x-nan", 0, p, codec_name="fp32")
    name = sorted(live.spec.plan.expect(p))[0]
    int4 = live.delta("x-nan", 2, p)
    expected = {
        live.put(layout.delta_key("x-nan", 0, p), _resign(fp32, _poke(name, float("nan")), signer)): {"nonfinite"},
        live.put(layout.delta_key("x-nan", 1, p), _resign(live.delta("x-nan", 1, p, codec_name="fp32"),
                                                         _poke(name, float("-inf")), signer)): {"nonfinite"},
        live.put(layout.delta_key("x-nan", 2, p), _resign(int4, _poke(f"{name}:scale", float("inf")), signer)): {"nonfinite"},
        live.put(layout.delta_key("x-nan", 3, p), _resign(live.delta("x-nan", 3, p),
                                                         _poke(f"{name}:scale", 3e38), signer)): {"nonfinite"},
    }
    for key, data in [(k, live.store.get(k)) for k in expected]:  # the objects are what we meant
        with pytest.raises(CodecError) as err:
            codec.decode(data, verify=signing.run_verifier(SECRET), require_signature=True)
        assert err.value.reason == "nonfinite", key
    found = live.wait_rejected(expected)
    live.assert_counted_and_logged_once(found, snap["reasons"])
    live.assert_healthy(snap)


def test_wrong_shapes(live):
    snap = live.snapshot()
    p = 3
    expect = live.spec.plan.expect(p)
    bigger = {n: torch.zeros((s[0] + 1, *s[1:]) if s else (2,)) for n, s in expect.items()}
    missing = {n: torch.zeros(s) for n, s in list(expect.items())[1:]}
    extra = {**{n: torch.zeros(s) for n, s in expect.items()}, "evil.extra": torch.zeros(3)}
    other_fragment = {n: torch.zeros(s) for n, s in live.spec.plan.expect(0).items()}
    expected = {}
    for seq, tensors in enumerate((bigger, missing, extra, other_fragment)):
        key = layout.delta_key("x-shape", seq, p)
        expected[live.put(key, live.delta("x-shape", seq, p, tensors=tensors))] = {"shape"}
    found = live.wait_rejected(expected)
    live.assert_counted_and_logged_once(found, snap["reasons"])
    live.assert_healthy(snap)


def test_absurd_norm(live):
    snap = live.snapshot()
    expected = {}
    for seq, p in enumerate(range(NUM_FRAGMENTS)):
        expected[live.put(layout.delta_key("x-norm", seq, p), live.delta("x-norm", seq, p, scale=1e4, num_steps=1))] = {"norm"}
    found = live.wait_rejected(expected)
    live.assert_counted_and_logged_once(found, snap["reasons"])
    live.assert_healthy(snap)


def test_headers_that_lie(live):
    snap = live.snapshot()
    index = live.index()
    L = "x-lies"
    expected = {
        live.put(layout.delta_key(L, 0, 0), live.delta(L, 0, 0, num_steps=0)): {"no_steps"},
        live.put(layout.delta_key(L, 1, 0), live.delta(L, 1, 0, num_tokens=0)): {"no_steps"},
        live.put(layout.delta_key(L, 2, 1), live.delta(L, 2, 1, base_version=10**6)): {"future_base"},
        # fragment 1's tensors, header says fragment 2: the codec's shape check passes, the key check does not
        live.put(layout.delta_key(L, 3, 1), live.delta(L, 3, 1, fragment=2, tensors={
            n: torch.zeros(s) for n, s in live.spec.plan.expect(1).items()})): {"wrong_fragment"},
        live.put(layout.delta_key(L, 4, 2), live.delta(L, 4, 2, seq=40)): {"wrong_seq"},
        live.put(layout.delta_key(L, 5, 999), live.delta(L, 5, 0)): {"wrong_fragment"},
        live.put(layout.delta_key(L, 6, 3), live.delta(L, 6, 3, run_id="another-run")): {"run_id"},
        live.put(layout.delta_key(L, 7, 3), live.delta(L, 7, 3, kind="global")): {"kind"},
    }
    p = max(index, key=index.get)
    if index[p] > MAX_STALENESS + 1:
        expected[live.put(layout.delta_key(L, 8, p), live.delta(L, 8, p, base_version=0))] = {"stale"}
    found = live.wait_rejected(expected)
    live.assert_counted_and_logged_once(found, snap["reasons"])
    live.assert_healthy(snap)


# --- forgery -----------------------------------------------------------------------------------


def test_forged_and_missing_signatures(live):
    """[wiring] signed with a key not derived from the run secret; claiming the syncer; unsigned."""
    snap = live.snapshot()
    L = "x-forged"
    expected = {
        live.put(layout.delta_key(L, 0, 0), live.delta(L, 0, 0, signer=learner_signer(L, WRONG_SECRET))): {"bad_signature"},
        live.put(layout.delta_key(L, 1, 1), live.delta(L, 1, 1, signer=signing.signer_for(WRONG_SECRET, "syncer"))): {
            "bad_signature", "wrong_signer"},
        # another learner's valid key under this learner's key id
        live.put(layout.delta_key(L, 2, 2), live.delta(L, 2, 2, signer=signing.Signer(
            signing.derive_key(SECRET, "learner", HONEST[0]), f"learner:{L}"))): {"bad_signature"},
        live.put(layout.delta_key(L, 3, 3), live.delta(L, 3, 3, signer=None)): {"unsigned"},
    }
    found = live.wait_rejected(expected)
    live.assert_counted_and_logged_once(found, snap["reasons"])
    live.assert_healthy(snap)


def test_objects_under_the_wrong_prefix(live):
    """An honest learner's signed delta copied under another prefix, and a delta signed by one
    learner that claims to be another ([wiring] for wrong_signer)."""
    snap = live.snapshot()
    b_key = sorted(live.merged_keys() & set(live.store.list(layout.deltas_dir(HONEST[1]))))[-1]
    b_data = live.store.get(b_key)
    p = layout.parse_delta_key(b_key).fragment
    expected = {
        # b's object (signed learner:b, header learner b) under x-prefix's prefix
        live.put(layout.delta_key("x-prefix", 0, p), b_data): {"wrong_signer", "wrong_learner"},
        # x-prefix signs with its own key but the header claims b
        live.put(layout.delta_key("x-prefix", 1, p), live.delta("x-prefix", 1, p, learner=HONEST[1],
                                                              signer=learner_signer("x-prefix"))): {"wrong_learner", "wrong_signer"},
        # a bucket-level attacker drops b's object into honest-a's prefix (at a's next free seq)
        live.put_next_seq(HONEST[0], p, b_data): {"wrong_signer", "wrong_learner"},
    }
    found = live.wait_rejected(expected)
    live.assert_counted_and_logged_once(found, snap["reasons"])
    live.assert_healthy(snap)


def test_replayed_delta(live):
    """[wiring] a copy of honest-a's merged delta under a new seq of honest-a."""
    snap = live.snapshot()
    a_key = sorted(live.merged_keys() & set(live.store.list(layout.deltas_dir(HONEST[0]))))[-1]
    data = live.store.get(a_key)
    key = live.put_next_seq(HONEST[0], layout.parse_delta_key(a_key).fragment, data)
    found = live.wait_rejected({key: {"replay", "clock_backwards"}})
    live.assert_counted_and_logged_once(found, snap["reasons"])
    live.assert_healthy(snap)


# --- size and keys -----------------------------------------------------------------------------


def test_huge_object(live):
    """[wiring] 64 MB under a delta key: a valid, signed delta plus 64 MB of padding tensor."""
    snap = live.snapshot()
    p = 0
    tensors = {n: 1e-3 * torch.ones(s) for n, s in live.spec.plan.expect(p).items()}
    tensors["pad"] = torch.zeros(16 * 2**20)
    data = live.delta("x-huge", 0, p, tensors=tensors, codec_name="fp32")
    assert len(data) >= 64 * 2**20
    key = live.put(layout.delta_key("x-huge", 0, p), data)
    del data, tensors
    found = live.wait_rejected({key: {"too_large"}}, timeout=60)
    live.assert_counted_and_logged_once(found, snap["reasons"])
    live.assert_healthy(snap)


def test_path_traversal_and_bad_keys(live):
    snap = live.snapshot()
    before_globals = set(live.store.list(layout.GLOBALS))
    index_before = live.index()
    payload = live.delta("x-trav", 0, 0)
    raw = [
        "learners/x-trav/deltas/../../globals/f000/v9999999999.st",
        "learners/../globals/f000/v9999999998.st",
        "learners/x-trav/deltas/s000000000001-f000.st/../../../../globals/HEAD",
        "learners/x-trav/deltas/..\\..\\globals\\f000\\v9999999997.st",
        "learners/EVIL/deltas/s000000000000-f000.st",
        "learners/x-trav/deltas/s1-f0.st",
        "learners/x-trav/deltas/s000000000002-f000.st.exe",
    ]
    for key in raw:
        live.put_raw(key, payload)
    # what the syncer reports: a learner "directory" that is not an id is reported once as that
    # prefix; a key under a valid learner that is not a delta key is reported once as itself
    reported = ["learners/x-trav/deltas/../../globals/f000/v9999999999.st", "learners/../",
                "learners/x-trav/deltas/s000000000001-f000.st/../../../../globals/HEAD",
                "learners/x-trav/deltas/..\\..\\globals\\f000\\v9999999997.st", "learners/EVIL/",
                "learners/x-trav/deltas/s1-f0.st", "learners/x-trav/deltas/s000000000002-f000.st.exe"]
    end_at = time.monotonic() + deadline(30)
    while True:
        counted = live.reasons().get("bad_key", 0) - snap["reasons"].get("bad_key", 0)
        logged = {k: len(live.reject_log_lines(k)) for k in reported}
        if (counted >= len(reported) and all(logged.values())) or time.monotonic() > end_at:
            break
        time.sleep(0.5)
    assert counted >= len(reported), f"bad_key counted {counted}, wanted {len(reported)}\n{live.logs()}"
    assert all(n == 1 for n in logged.values()), logged
    live.assert_healthy(snap)
    # nothing escaped into globals/: every new key there is an honest version, update or the index
    for key in set(live.store.list(layout.GLOBALS)) - before_globals:
        m = re.fullmatch(r"globals/f\d{3}/[uv](\d{10})\.st", key)
        assert key == layout.globals_index_key() or (m and int(m.group(1)) < 10**6), key
    index_after = live.index()
    assert all(index_before[p] <= index_after[p] < 10**6 for p in index_before), index_after


# --- availability (issue #17): no write without the run secret silences, quarantines or fools ---


def verifier() -> signing.Verifier:
    return signing.run_verifier(SECRET)


def honest_merged_count(live, learner: str) -> int:
    return sum(1 for r in live.refresh_tape() for e in r.get("merged", []) if e["learner"] == learner)


def wait_merged_more(live, learner: str, before: int, more: int = 3, timeout: float = 60) -> int:
    end_at = time.monotonic() + deadline(timeout)
    while True:
        live.assert_alive()
        now = honest_merged_count(live, learner)
        if now >= before + more:
            return now
        assert time.monotonic() < end_at, f"{learner}: {now - before} deltas merged while attacked\n{live.logs()}"
        time.sleep(0.5)


def test_junk_in_an_honest_prefix_cannot_silence_or_quarantine_it(live):
    """learners/ write: a key sorting last, an object at a huge sequence number, unsigned junk at the
    learner's next sequence numbers (more than quarantine_after), a neighbour's signed delta. The
    learner keeps being merged (counted), is never quarantined, and every junk object is recorded."""
    snap = live.snapshot()
    A = HONEST[0]
    before = honest_merged_count(live, A)
    junk = [live.put_next_seq(A, 0, live.delta(A, 0, 0, signer=None, scale=1e-3 * (i + 1))) for i in range(25)]
    live.put_raw(f"learners/{A}/deltas/zzz-sorts-last", b"junk")
    huge = live.put(layout.delta_key(A, 10**12 - 1, 0), live.delta(A, 10**12 - 1, 0, signer=None))
    b_key = sorted(live.merged_keys() & set(live.store.list(layout.deltas_dir(HONEST[1]))))[-1]
    copied = live.put_next_seq(A, layout.parse_delta_key(b_key).fragment, live.store.get(b_key))
    expected = {huge: {"seq_ahead"}, copied: {"wrong_signer"}, **{k: {"unsigned"} for k in junk}}
    found = live.wait_rejected(expected)
    live.assert_counted_and_logged_once(found, snap["reasons"])
    wait_merged_more(live, A, before, more=4)
    assert A not in protocol.quarantined_learners(live.store, verifier())
    assert A not in live.status().get("quarantined", [])
    live.assert_healthy(snap)


def test_forged_quarantine_record_is_ignored(live):
    """anywhere write: an unsigned quarantine record for an honest learner, and one signed with a
    key not derived from the run secret. The syncer keeps merging it; status does not show it."""
    snap = live.snapshot()
    B = HONEST[1]
    before = honest_merged_count(live, B)
    record = {"learner": B, "at": time.time(), "last_reason": "norm", "strikes": 99}
    live.put_raw(layout.quarantine_key(B), json.dumps(record).encode())
    live.put_raw(layout.quarantine_key("x-qforged"), json.dumps(signing.sign_record(
        {**record, "learner": "x-qforged"}, signing.signer_for(WRONG_SECRET, "syncer"))).encode())
    wait_merged_more(live, B, before)
    assert B not in live.status().get("quarantined", [])
    from ddiloco_geo.ops.status import collect

    view = {l["learner"]: l for l in collect(live.store, verifier=verifier())["learners"]}
    assert not view[B]["quarantined"]
    assert "quarantine_record_ignored" in live.log("syncer")
    live.store.delete(layout.quarantine_key(B))
    live.assert_healthy(snap)


def test_forged_records_do_not_fool_or_crash_the_tools(live):
    """learners/ write: an unsigned exit record for a running learner, a heartbeat whose time is a
    string; anywhere write: a ghost syncer shard, a forged rejection record for an honest delta."""
    from ddiloco_geo.ops.status import collect, render

    snap = live.snapshot()
    A = HONEST[0]
    live.put_raw(layout.exit_key(A), json.dumps({"reason": "max_steps", "time": time.time() + 5, "step": 1}).encode())
    live.put_raw(layout.heartbeat_key("x-hb"), json.dumps({"time": "yesterday\nlearner_quarantined", "step": "x",
                                                           "loss": "nan", "storage": []}).encode())
    live.put_raw(f"{layout.SYNCER}status/shard-001-of-002.json", json.dumps({"shard": "1/2", "time": time.time()}).encode())
    a_key = sorted(live.merged_keys() & set(live.store.list(layout.deltas_dir(A))))[-1]
    dk = layout.parse_delta_key(a_key)
    live.put_raw(layout.rejected_key(A, dk.seq + 10**6, dk.fragment),
                 json.dumps({"key": a_key, "learner": A, "reason": "norm", "at": time.time()}).encode())
    for v in (None, verifier()):  # validated either way (no crash); only signed records with a verifier
        render(collect(live.store, verifier=v))
    view = collect(live.store, verifier=verifier())
    learners = {l["learner"]: l for l in view["learners"]}
    assert learners[A]["state"] == "alive", learners[A]
    assert learners["x-hb"]["state"] == "silent" and learners["x-hb"]["step"] is None
    assert [s["shard"] for s in view["syncers"]] == ["0/1"], view["syncers"]
    assert view["skipped_unverified"]["total"] >= 3
    led = protocol.ledger(live.store, verifier())
    assert "norm" not in led["rejected_by_reason"] or a_key not in led["unaccounted_keys"]
    assert led["skipped_unverified"]["by_kind"].get("reject_record", 0) >= 1
    live.store.delete(layout.exit_key(A))
    live.assert_healthy(snap)


def _forge_globals(live, p: int, count: int) -> list[int]:
    forged, v = [], max(protocol.list_versions(live.store, p)) + 1
    tensors = {n: torch.full(s, 7.0) for n, s in live.spec.plan.expect(p).items()}
    while len(forged) < count:
        header = codec.Header(kind="global", run_id=live.spec.run_id, fragment=p, version=v, clock=VectorClock(),
                              extra={"kind": "merge", "merged": [], "published_at": time.time()})
        data = codec.encode(tensors, header, codec="fp32", signer=signing.signer_for(WRONG_SECRET, "syncer"))
        if live.store.put_if_absent(layout.global_key(p, v), data):
            forged.append(v)
            live.hostile.add(layout.global_key(p, v))
        v += 1
    return forged


def _wait_published_above(live, p: int, forged: list[int], timeout: float = 60) -> None:
    end_at = time.monotonic() + deadline(timeout)
    while True:
        live.assert_alive()
        if protocol.newest_global(live.store, live.spec, p, verifier(), True)[0] > max(forged):
            return
        assert time.monotonic() < end_at, f"no verified version above forged {forged}\n{live.logs()}"
        time.sleep(0.5)


def test_forged_globals_are_set_aside_and_the_tools_show_the_truth(live, tmp_path):
    """anywhere write: forged globals at a fragment's next versions (signed with a wrong key). The
    syncer loses the publish race, sets them aside (syncer/forged/) and publishes above them; a
    restarted syncer does the same at start-up; evaluation, export and the ledger skip them."""
    from ddiloco_geo.ops.snapshot import export_model

    snap = live.snapshot()
    p = 1
    forged = _forge_globals(live, p, 2)
    _wait_published_above(live, p, forged)
    assert all(live.store.list(layout.forged_key(p, v)) for v in forged)
    # a restarted syncer whose newest global is forged
    proc = live.procs["syncer"]
    proc.terminate()
    proc.wait(timeout=deadline(60))
    forged += _forge_globals(live, p, 1)
    live.start("syncer", "syncer")
    _wait_published_above(live, p, forged, timeout=90)
    assert "Traceback" not in live.log("syncer"), live.log("syncer")[-3000:]
    found = protocol.global_model(live.store, live.spec, verifier(), True)
    assert found.versions[p] > max(forged)
    out = export_model(live.store, str(tmp_path / "model.safetensors"), verifier=verifier(), require_signatures=True)
    assert int(json.loads(json.dumps(out["versions"]))[str(p)]) not in forged
    from safetensors.torch import load_file

    exported = load_file(out["out"])
    assert not any(torch.equal(t, torch.full_like(t, 7.0)) for t in exported.values())
    led = protocol.ledger(live.store, verifier())
    assert led["versions_published"][p] not in forged
    assert led["skipped_unverified"]["by_kind"].get("global", 0) >= len(forged)
    live.assert_healthy(snap, timeout=90)


def _adopted_after(live, at: dict[int, int]) -> set[str]:
    """Honest learners with a merged delta trained on a version published after ``at``."""
    return {e["learner"] for r in live.refresh_tape() for e in r.get("merged", [])
            if e["learner"] in HONEST and e["base_version"] > at[r["fragment"]]}


def test_forged_index_cannot_stop_adoption(live):
    """anywhere write: ``globals/HEAD`` overwritten, unsigned and naming versions that do not exist,
    then signed with a wrong key. Learners ignore it, the syncer's next publish replaces it (a
    forged entry is not "raised" past), and both honest learners go on adopting: deltas merged
    after the attack were trained on versions published after it. None is quarantined."""
    snap = live.snapshot()
    for forger in (None, signing.signer_for(WRONG_SECRET, "syncer")):
        at = {p: protocol.newest_global(live.store, live.spec, p, verifier(), True)[0] for p in range(NUM_FRAGMENTS)}
        forged = {"versions": {str(p): 10**9 + p for p in range(NUM_FRAGMENTS)}}
        live.put_raw(layout.globals_index_key(), json.dumps(signing.sign_record(forged, forger)).encode())
        live.hostile.discard(layout.globals_index_key())  # not a delta: never in a merge record anyway
        end_at = time.monotonic() + deadline(90)
        while _adopted_after(live, at) != set(HONEST):
            live.assert_alive()
            assert time.monotonic() < end_at, (
                f"learners adopting after the forged index: {_adopted_after(live, at)}\n{live.logs()}")
            time.sleep(0.5)
        index, _ = protocol.read_index(live.store, verifier())
        assert index and all(index[p] < 10**9 for p in index), index
    assert "index_unverified" in live.log(HONEST[0]) + live.log(HONEST[1]) + live.log("syncer")
    for learner in HONEST:
        assert learner not in protocol.quarantined_learners(live.store, verifier())
    live.assert_healthy(snap)


def test_signed_hostile_deltas_reach_the_content_checks(live):
    """A key holder (its own valid key): NaN, an absurd norm and a clock that goes back, all properly
    signed and naming their keys, so the signature passes and the content checks reject them."""
    snap = live.snapshot()
    L, p = "x-keyholder", 2
    signer = learner_signer(L)
    name = sorted(live.spec.plan.expect(p))[0]
    expected = {
        live.put(layout.delta_key(L, 0, p), _resign(live.delta(L, 0, p, codec_name="fp32"), _poke(name, float("nan")),
                                                     signer)): {"nonfinite"},
        live.put(layout.delta_key(L, 1, p), live.delta(L, 1, p, scale=1e4, num_steps=1)): {"norm"},
        live.put(layout.delta_key(L, 2, p), live.delta(L, 2, p, clock=VectorClock({L: 1}))): {"clock_backwards"},
    }
    for key in expected:  # properly signed by the key holder
        assert protocol.verified_header(live.store, key, verifier(), f"learner:{L}").seq == layout.parse_delta_key(key).seq
    found = live.wait_rejected(expected)
    live.assert_counted_and_logged_once(found, snap["reasons"])
    live.assert_healthy(snap)


# --- volume ------------------------------------------------------------------------------------


def test_flood_is_rate_limited_then_quarantined(live):
    """[wiring] one learner writes deltas far faster than any honest learner can (honest: one per
    inner step, at most 1 / SLOW_STEP_S a second), past the syncer's per-minute limit."""
    snap = live.snapshot()
    L, n = "x-flood", RATE_LIMIT_PER_MIN + 60
    index = live.index()
    t0 = time.monotonic()
    signer = learner_signer(L)
    first = {p: live.delta(L, p, p, base_version=index[p]) for p in range(NUM_FRAGMENTS)}
    blobs = [(layout.delta_key(L, seq, seq % NUM_FRAGMENTS),
              _resign(first[seq % NUM_FRAGMENTS], _stamp(seq), signer, seq=str(seq), clock=json.dumps({L: seq + 1}, separators=(",", ":"))))
             for seq in range(n)]
    assert codec.decode(blobs[-1][1], verify=signing.run_verifier(SECRET))[0].seq == n - 1
    encode_s, t0 = time.monotonic() - t0, time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kb: live.put(*kb), blobs))
    write_s = time.monotonic() - t0
    flood = [k for k, _ in blobs]

    def quarantined() -> bool:  # a quarantine record, or per-delta 'quarantined' rejections
        if "quarantined" in set(live.rejections(L).values()):
            return True
        qkey = layout.quarantine_key(L) if hasattr(layout, "quarantine_key") else f"{layout.SYNCER}quarantine/{L}.json"
        return bool(live.store.list(qkey))

    end_at = time.monotonic() + deadline(45)
    while True:
        rejected = live.rejections(L)
        reasons = set(rejected.values())
        is_quarantined = quarantined()
        if ("rate_limit" in reasons and is_quarantined) or time.monotonic() > end_at:
            break
        if len(set(rejected) | (live.merged_keys() & set(flood))) == n and not is_quarantined:
            break  # every flood key accounted for, and no quarantine
        time.sleep(0.5)
    merged = live.merged_keys() & set(flood)
    assert "rate_limit" in reasons and is_quarantined, (
        f"{n} deltas written in {write_s:.1f} s (encoded in {encode_s:.1f} s): reasons {sorted(reasons)}, "
        f"quarantined={is_quarantined}, {len(merged)} merged; {WIRING}")
    first_limited = min(layout.parse_delta_key(k).seq for k, r in rejected.items() if r == "rate_limit")
    if "quarantined" in reasons:
        assert first_limited < min(layout.parse_delta_key(k).seq for k, r in rejected.items() if r == "quarantined")
    live.allowed_merged |= {k for k in flood if layout.parse_delta_key(k).seq < first_limited}
    late = {k for k in merged if layout.parse_delta_key(k).seq >= first_limited}
    assert not late, f"flood deltas merged after the rate limit hit: {sorted(late)[:5]}"
    assert set(rejected.values()) <= {"rate_limit", "quarantined"} | CODEC_REASONS
    live.assert_counted_and_logged_once(rejected, snap["reasons"])
    live.assert_healthy(snap, timeout=60)


# --- the run as a whole ------------------------------------------------------------------------


def test_small_norm_deltas_do_not_starve_honest_learners(live):
    """A learner sends valid, signed deltas with tiny norms to one fragment, at a few per second
    for ten seconds. They may be merged (they are harmless) or rate-limited, but they must not
    drag the fragment's running norm median so low that honest deltas look absurd (``norm``):
    honest learners' deltas on that fragment must keep being merged afterwards."""
    snap = live.snapshot()
    L, p = "x-tiny", 0
    signer = learner_signer(L)
    template = live.delta(L, 0, p, scale=1e-7)
    written = []
    end = time.monotonic() + 10
    while time.monotonic() < end:
        n = len(written)
        data = _resign(template, _stamp(n), signer, seq=str(n), clock=json.dumps({L: n + 1}, separators=(",", ":")),
                       base_version=str(live.index()[p]))
        written.append(live.put(layout.delta_key(L, n, p), data))
        time.sleep(0.2)
    live.allowed_merged |= set(written)
    def merged_on_p() -> dict[str, int]:
        return {l: max((e["seq"] for r in live.refresh_tape() if r["fragment"] == p
                        for e in r.get("merged", []) if e["learner"] == l), default=-1) for l in HONEST}

    # the newest honest delta merged on p when the flood ended (the honest prefixes may hold junk
    # keys and huge sequence numbers from the other attacks: their listings say nothing)
    after = merged_on_p()
    end_at = time.monotonic() + deadline(40)
    while True:
        live.assert_alive()
        merged_now = merged_on_p()
        starved = [l for l in HONEST if merged_now[l] <= after[l]]
        if not starved:
            break
        if time.monotonic() > end_at:
            honest_norm = {k: r for l in HONEST for k, r in live.rejections(l).items()
                           if r == "norm" and layout.parse_delta_key(k).fragment == p}
            raise AssertionError(
                f"honest deltas on fragment {p} no longer merged after {len(written)} tiny deltas from {L}: "
                f"{starved}; honest deltas rejected as 'norm' on it: {len(honest_norm)}; tiny deltas "
                f"rejected: {sorted(set(live.rejections(L).values()))}")
        time.sleep(0.5)
    live.assert_healthy(snap)


def test_globals_only_contain_honest_deltas_and_the_secret_never_leaks(live):
    live.assert_alive()
    assert "Traceback" not in live.log("syncer"), live.log("syncer")[-3000:]
    records = live.refresh_tape()
    taped = {(r["fragment"], r["version"]) for r in records}
    for key in live.store.list(layout.GLOBALS):  # a global whose tape entry is missing: its header has the record
        m = re.fullmatch(r"globals/f(\d{3})/v(\d{10})\.st", key)
        if m and (int(m.group(1)), int(m.group(2))) not in taped:
            records.append(protocol.read_header(live.store, key).extra)
    merged = {e["key"]: e["learner"] for r in records for e in r.get("merged", [])}
    superseded = {k for r in records for k in r.get("superseded", [])}
    bad = (set(merged) | superseded) & (live.hostile - live.allowed_merged)
    assert not bad, f"hostile keys in merge records: {sorted(bad)[:10]}"
    strangers = {k: l for k, l in merged.items() if l not in HONEST and k not in live.allowed_merged}
    assert not strangers, sorted(strangers.items())[:5]
    assert {HONEST[0], HONEST[1]} <= set(merged.values())
    # the run secret and derived keys appear in no log and no object the run wrote outside learners' deltas
    secrets_ = [SECRET, signing.derive_key(SECRET, "syncer").hex()] + [
        signing.derive_key(SECRET, "learner", l).hex() for l in HONEST]
    for name in live.procs:
        text = live.log(name)
        assert not any(s in text for s in secrets_), f"a key or the run secret is in the {name} log"
    small = [k for k in live.store.list(layout.SYNCER) if not k.startswith((layout.SYNCER + "state/", layout.SYNCER + "tape/"))]
    for key in small + [layout.heartbeat_key(l) for l in HONEST]:
        body = live.store.get(key)
        assert not any(s.encode() in body for s in secrets_), key
