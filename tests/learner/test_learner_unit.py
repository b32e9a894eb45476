"""The learner module on its own: the upload queue, refusing forged or corrupt globals, and
resuming past an unusable checkpoint. A memory:// store, a one-layer model, no processes."""

from __future__ import annotations

import json
import logging
import math
import threading

import pytest
import torch

from ddiloco_geo import codec, protocol
from ddiloco_geo.core import layout, signing
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.model import embedding_rule
from ddiloco_geo.core.signing import run_verifier, signer_for, syncer_keys
from ddiloco_geo.learner import Learner, Outgoing, Uploader
from ddiloco_geo.learner.presence import status_record
from ddiloco_geo.learner.schedule import lr_schedule
from ddiloco_geo.syncer import Syncer
from tests.service.conftest import tiny_run  # noqa: F401  (fixture)

pytestmark = pytest.mark.unit

SECRET = "unit-test-run-secret"


def _outgoing(run, p: int, steps: int = 1, increment: bool = False) -> Outgoing:
    pg = {n: torch.full(s, float(steps)) for n, s in run.spec.plan.expect(p).items()}
    return Outgoing(p, pg, 0, steps, steps * 64, steps, 0.1, VectorClock(), increment)


class _GatedStore:
    """The run's store, with writes held until ``gate`` opens (a slow link)."""

    def __init__(self, store) -> None:
        self.store, self.gate, self.entered = store, threading.Event(), threading.Event()

    def put_if_absent(self, key, data):
        self.entered.set()
        assert self.gate.wait(30), "test gate never opened"
        return self.store.put_if_absent(key, data)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_full_upload_queue_coalesces_a_fragment_and_drops_the_oldest_other(tiny_run):
    run = tiny_run()
    gated = _GatedStore(run.store)
    up = Uploader(gated, run.spec, "l0", maxsize=2, codec_name="fp32", block_size=128, first_seq=0)
    up.submit(_outgoing(run, 0))               # taken by the thread, held at the gate
    assert gated.entered.wait(10)
    up.submit(_outgoing(run, 1))               # queued
    up.submit(_outgoing(run, 2))               # queued: the queue is full (2)
    up.submit(_outgoing(run, 1, steps=3))      # same fragment as a queued one: replaces it
    assert up.counters["deltas_coalesced"] == 1 and up.counters["deltas_dropped"] == 0
    up.submit(_outgoing(run, 3))               # full, no fragment match: the oldest queued (f1) goes
    assert up.counters["deltas_dropped"] == 1
    gated.gate.set()
    assert up.close(deadline_s=20)
    keys = run.store.list(layout.deltas_dir("l0"))
    assert [layout.parse_delta_key(k).fragment for k in keys] == [0, 2, 3]
    assert up.thread is not None and not up.thread.is_alive()


def test_a_first_send_on_a_base_keeps_its_mark_when_a_later_one_replaces_it_in_the_queue(tiny_run):
    # the queued first send never went out, so the delta that replaces it is the first on its base
    run = tiny_run()
    gated = _GatedStore(run.store)
    up = Uploader(gated, run.spec, "l0", maxsize=4, codec_name="fp32", block_size=128, first_seq=0)
    up.submit(_outgoing(run, 0))                            # taken by the thread, held at the gate
    assert gated.entered.wait(10)
    first = _outgoing(run, 1)
    first.first_on_base = True
    up.submit(first)                                        # queued
    up.submit(_outgoing(run, 1, steps=3))                   # a resend on the same base: replaces it
    assert up.counters["deltas_coalesced"] == 1
    gated.gate.set()
    assert up.close(deadline_s=20)
    marks = {layout.parse_delta_key(k).fragment: protocol.read_header(run.store, k).extra.get("first_on_base")
             for k in run.store.list(layout.deltas_dir("l0"))}
    assert marks == {0: None, 1: True}


def test_increments_are_summed_in_the_queue_and_a_dropped_one_is_folded_into_the_residual(tiny_run):
    run = tiny_run()
    gated = _GatedStore(run.store)
    up = Uploader(gated, run.spec, "l0", maxsize=2, codec_name="fp32", block_size=128, first_seq=0)
    up.submit(_outgoing(run, 0, increment=True))            # taken by the thread, held at the gate
    assert gated.entered.wait(10)
    up.submit(_outgoing(run, 1, steps=2, increment=True))   # queued
    up.submit(_outgoing(run, 1, steps=3, increment=True))   # same fragment: summed with it (2 + 3)
    assert up.counters["deltas_coalesced"] == 1
    up.submit(_outgoing(run, 2, increment=True))            # queued: full
    up.submit(_outgoing(run, 3, increment=True))            # full: the oldest (f1, 2 + 3) is folded, not lost
    assert up.counters["deltas_dropped"] == 1 and set(up.residual) == {1}
    up.submit(_outgoing(run, 1, steps=4, increment=True))   # f2 goes the same way; f1 goes out with 5 + 4
    gated.gate.set()
    assert up.close(deadline_s=20)
    got = {}
    for key in run.store.list(layout.deltas_dir("l0")):
        header, tensors = codec.decode(run.store.get(key), kind="delta", run_id=run.spec.run_id)
        assert header.extra["increment"] is True
        got.setdefault(header.fragment, []).append((header.num_steps, {float(t.flatten()[0]) for t in tensors.values()}))
    assert got[1] == [(9, {9.0})]  # 2 + 3 (folded) + 4: every step and value arrives, once
    assert up.residual[1] and all(float(t.abs().max()) == 0 for t in up.residual[1].values())  # fp32 drops nothing
    assert 2 not in got and set(up.residual[2]) and up.residual_counts[2] == (1, 64)  # f2 waits in the residual


def test_residual_decay_scales_the_residual_each_time_it_joins_an_increment(tiny_run):
    """learner.residual_decay = beta: the next send carries increment + beta * residual, and the new
    residual is that minus what the object decodes to (beta = 1: the exact sum)."""
    run = tiny_run(**{"run.codec": "topk"})
    assert run.settings.learner.residual_decay == 0.9  # the default
    gen = torch.Generator().manual_seed(3)
    names = run.spec.plan.expect(1)
    increments = [{n: torch.randn(s, generator=gen) for n, s in names.items()} for _ in range(3)]
    for beta in (0.5, 1.0):
        up = Uploader(run.store, run.spec, f"l{int(beta * 10)}", maxsize=4, codec_name="topk", block_size=64, topk=2,
                      first_seq=0, inline=True, residual_decay=beta)
        residual = {n: torch.zeros(s) for n, s in names.items()}
        for i, inc in enumerate(increments):
            up.submit(Outgoing(1, inc, 0, 1, 64, i + 1, 0.1, VectorClock(), True))
            key = run.store.list(layout.deltas_dir(up.learner))[-1]
            _, sent = codec.decode(run.store.get(key), kind="delta", run_id=run.spec.run_id)
            for n in names:
                expected = inc[n] + beta * residual[n] - sent[n]
                torch.testing.assert_close(up.residual[1][n], expected, rtol=0, atol=1e-6)
                assert float(sent[n].abs().max()) > 0 and float(expected.abs().max()) > 0  # top-k kept some, dropped some
            residual = {n: t.clone() for n, t in up.residual[1].items()}


def test_close_gives_up_at_the_deadline_and_joins_the_thread(tiny_run):
    run = tiny_run()
    gated = _GatedStore(run.store)
    up = Uploader(gated, run.spec, "l0", maxsize=4, codec_name="fp32", block_size=128, first_seq=0)
    up.submit(_outgoing(run, 0))
    assert gated.entered.wait(10)
    up.submit(_outgoing(run, 1))
    threading.Timer(0.5, gated.gate.set).start()  # the held write finishes after the deadline
    assert up.close(deadline_s=0.1) is False
    up.thread.join(timeout=10)
    assert not up.thread.is_alive()


def _signed_run(tiny_run):
    run = tiny_run(**{"security.run_secret": SECRET})
    s = Syncer(run.store, run.spec, **run.settings.syncer.model_dump(), is_embedding=embedding_rule(run.settings.model),
               now=run.clock, **syncer_keys(run.settings.security))
    s.bootstrap(run.params)
    return run, s


def _learner(run, **overrides) -> Learner:
    settings = run.settings.model_copy(update={"learner": run.settings.learner.model_copy(
        update={"id": "l0", "max_steps": 50, **overrides})})
    learner = Learner.from_settings(settings, run.store, inline_io=True)
    learner.join()
    learner.start_clock()
    return learner


def _forge_global(run, p: int, version: int, *, signer) -> None:
    params = {n: torch.full(s, 7.0) for n, s in run.spec.plan.expect(p).items()}
    header = codec.Header(kind="global", run_id=run.spec.run_id, fragment=p, version=version, clock=VectorClock())
    assert run.store.put_if_absent(layout.global_key(p, version), codec.encode(params, header, codec="fp32", signer=signer))
    _index_names(run, p, version)


def _index_names(run, p: int, version: int) -> None:
    """The syncer-signed index names ``version`` of ``p`` (as it would after a publish)."""
    protocol.advance_index(run.store, {p: version}, signer=signer_for(SECRET, "syncer"),
                           verifier=run_verifier(SECRET))


@pytest.mark.parametrize("forgery", ["unsigned", "learner_key", "corrupt"])
def test_a_forged_or_corrupt_global_is_refused_and_training_goes_on(tiny_run, forgery, caplog):
    run, _ = _signed_run(tiny_run)
    learner = _learner(run)
    before = {n: t.clone() for n, t in learner.base[0].items()}
    if forgery == "corrupt":
        run.store.put_if_absent(layout.global_key(0, 1), b"\x00garbage" * 100)
        _index_names(run, 0, 1)
    else:
        _forge_global(run, 0, 1, signer=None if forgery == "unsigned" else signer_for(SECRET, "learner", "l0"))
    with caplog.at_level(logging.WARNING):
        learner.poller.poll_once()
    assert learner.poller.counters["globals_rejected"] == 1
    assert learner.poller.take() == {}
    assert "global_rejected" in caplog.text
    assert learner.step_once() is True and learner.step_once() is True
    assert learner.base_version[0] == 0
    assert all(torch.equal(before[n], learner.base[0][n]) for n in before)


@pytest.mark.parametrize("forger", ["unsigned", "wrong_key"])
def test_a_forged_index_is_ignored_and_adoption_goes_on(tiny_run, forger, caplog):
    """globals/HEAD forged (anywhere write) to name a version that does not exist: the learner
    ignores it; when the syncer-signed index names a real new version, the learner adopts it."""
    run, _ = _signed_run(tiny_run)
    learner = _learner(run)
    body = signing.sign_record({"versions": {"0": 10**9}}, None if forger == "unsigned" else
                               signer_for("not-the-run-secret-0123456789abcdef", "syncer"))
    _, token = protocol.read_index(run.store)
    run.store.cas(layout.globals_index_key(), json.dumps(body).encode(), token)
    with caplog.at_level(logging.WARNING):
        learner.poller.poll_once()
    assert "index_unverified" in caplog.text
    assert learner.poller.counters["globals_rejected"] == 0 and learner.poller.take() == {}
    params = {n: torch.full(s, 0.5) for n, s in run.spec.plan.expect(0).items()}
    header = codec.Header(kind="global", run_id=run.spec.run_id, fragment=0, version=1, clock=VectorClock())
    run.store.put_if_absent(layout.global_key(0, 1), codec.encode(params, header, codec="fp32",
                                                                  signer=signer_for(SECRET, "syncer")))
    _index_names(run, 0, 1)  # replaces the forged index: a forged entry is not raised past
    assert protocol.read_index(run.store, run_verifier(SECRET))[0] == {0: 1}
    learner.poller.poll_once()
    assert learner.poller.take()[0][0] == 1


def test_a_corrupt_or_truncated_checkpoint_is_ignored_with_a_warning(tiny_run, caplog):
    run, _ = _signed_run(tiny_run)
    first = _learner(run)
    for _ in range(3):
        first.step_once()
    summary = first.finish()
    good_key = summary["checkpoint"]
    assert good_key
    good = run.store.get(good_key)
    run.store.put_if_absent(layout.checkpoint_key("l0", 1), good[: len(good) // 2])   # truncated
    run.store.put_if_absent(layout.checkpoint_key("l0", 2), b"not a checkpoint at all")  # corrupt
    with caplog.at_level(logging.WARNING):
        second = _learner(run)
    assert second.resumed_from == good_key  # the newest usable one
    assert caplog.text.count("checkpoint_unusable") == 2
    assert second.step == 3


def test_a_restart_after_a_flushed_exit_takes_the_latest_globals(tiny_run):
    """A flushed exit put every step's work in the bucket: the restarted learner keeps its step, data
    cursors and AdamW state but starts from the latest globals, so it does not send that work a second
    time as a pull of the global back toward its old model (chaos seed 11). A checkpoint that holds
    work no delta carries (an exit whose flush did not finish) still resumes its parameters."""
    import asyncio

    run = tiny_run()
    syncer = run.syncer()
    first = _learner(run)
    for _ in range(6):
        first.step_once()
    summary = first.finish()
    assert summary["flushed"] and summary["checkpoint"]
    old = {n: t.detach().clone() for n, t in first.model.named_parameters()}
    asyncio.run(syncer.poll_once())
    syncer.draining = True
    assert syncer.merge_ready() > 0  # new globals hold the flushed work
    index, _ = protocol.read_index(run.store)
    P = run.spec.plan.num_fragments
    assert any(index[p] > 0 for p in range(P))
    latest = {n: t for p in range(P) for n, t in run.fragment_params(p, index[p]).items()}

    second = _learner(run)
    assert second.resumed_from == summary["checkpoint"] and second.step == 6
    assert second.base_version == [index[p] for p in range(P)] and second.c_steps == [0] * P
    for n, t in second.model.named_parameters():
        assert torch.equal(t.detach(), latest[n]), n
    assert any(not torch.equal(old[n], latest[n]) for n in old)  # the old parameters were not taken

    for _ in range(3):  # work that no delta carries yet, then a checkpoint without a flush
        second.step_once()
    unsent = {n: t.detach().clone() for n, t in second.model.named_parameters()}
    key = second.write_checkpoint([second.reader.state_dict()])
    third = _learner(run)
    assert third.resumed_from == key and third.step == 9
    for n, t in third.model.named_parameters():
        assert torch.equal(t.detach(), unsent[n]), n


def test_only_the_first_send_on_a_base_is_marked_first_on_base(tiny_run):
    """The syncer applies a delta marked first_on_base as the learner's progress even on a base it had
    merged a delta of before (syncer.anchoring=base): only a send with no earlier send on the same
    base may carry the mark, so a resend that contains a merged delta is never applied twice."""
    run = tiny_run()
    run.syncer()
    learner = _learner(run)
    P = run.spec.plan.num_fragments
    for _ in range(3 * run.spec.sync_every):  # no merges: every send of a fragment is on base 0
        learner.step_once()
    marks: dict[int, list] = {}
    for key in sorted(run.store.list(layout.deltas_dir("l0"))):
        header = protocol.read_header(run.store, key)
        assert header.base_version == 0
        marks.setdefault(header.fragment, []).append(header.extra.get("first_on_base", False))
    assert set(marks) == set(range(P))
    assert all(m[0] is True and not any(m[1:]) and len(m) >= 2 for m in marks.values()), marks


@pytest.mark.parametrize("reason", ["max_steps", "signal"])
def test_only_the_exit_flush_at_the_schedules_end_is_marked_final(tiny_run, reason):
    """syncer.final_merge=average merges a learner's final deltas as a plain average: only the exit
    flush of a learner whose schedule ended (reason max_steps) may mark them; a learner stopped by a
    signal or a preemption notice leaves the run unfinished, and its flush is an ordinary send."""
    run = tiny_run()
    run.syncer()
    H = run.spec.sync_every
    learner = _learner(run, **({"max_steps": H + 3} if reason == "max_steps" else {}))
    while learner.step < H + 3:
        assert learner.step_once()
    if reason == "signal":
        learner.request_stop("signal")
    assert not learner.step_once()
    before = set(run.store.list(layout.deltas_dir("l0")))
    learner.finish()
    flushed = sorted(set(run.store.list(layout.deltas_dir("l0"))) - before)
    marks = [protocol.read_header(run.store, k).extra.get("final") for k in before]
    assert flushed and not any(marks)
    assert all(protocol.read_header(run.store, k).extra.get("final") is (True if reason == "max_steps" else None)
               for k in flushed)


def test_only_unusable_checkpoints_mean_a_fresh_start(tiny_run, caplog):
    run, _ = _signed_run(tiny_run)
    run.store.put_if_absent(layout.checkpoint_key("l0", 0), b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with caplog.at_level(logging.WARNING):
        learner = _learner(run)
    assert learner.resumed_from is None and learner.step == 0
    assert "checkpoint_unusable" in caplog.text
    assert learner.step_once() is True


def test_a_learner_joining_late_follows_the_runs_progress(tiny_run):
    """learner.follow_run: a learner that joins (or restarts without a checkpoint) mid-run starts
    its schedule where the run is, not at step 0 with a fresh warm-up at full rate."""
    run = tiny_run()
    syncer = run.syncer()
    first = _learner(run, max_steps=200)
    for _ in range(20):
        first.step_once()
    import asyncio

    asyncio.run(syncer.poll_once())
    syncer.draining = True
    assert syncer.merge_ready() > 0
    late = _learner(run, id="l1", max_steps=200, follow_run=True, schedule="own")
    assert 16 <= late.step <= 20  # the largest step in the newest merge records
    fresh = _learner(run, id="l2", max_steps=200, schedule="own")
    assert fresh.step == 0
    # learner.schedule=run: a learner restarted without a checkpoint starts at its own latest merged
    # step (a restart at 0 repeated those steps: one learner took 278 steps of a 120-step run), not
    # at the largest (chaos seed 21: two restarted learners jumped to the end a third had reached and
    # stopped at once); a new learner's steps are new tokens, so it starts at 0. Both take their
    # place on the learning-rate schedule from the run's position.
    restarted = _learner(run, id=first.learner_id, max_steps=200, schedule="run", warmup_steps=4)
    assert restarted.resumed_from is None and 16 <= restarted.step <= 20
    # ... and one whose deltas no merge holds yet starts at the step of its newest delta
    gone = _learner(run, id="l4", max_steps=200)
    for _ in range(6):
        gone.step_once()
    sent = protocol.newest_delta(run.store, "l4", read_header=True)
    assert sent is not None and 1 <= sent[1].extra["step"] <= 6
    assert _learner(run, id="l4", max_steps=200, schedule="run").step == sent[1].extra["step"]
    joined = _learner(run, id="l3", max_steps=200, schedule="run", warmup_steps=4)
    assert joined.step == 0
    joined.step_once()
    assert 8 <= joined.position <= 10  # the median (of two: the mean) of its step 0 and the first's
    # a fresh optimizer joining past the run's warm-up warms up again from its own first step (its
    # first AdamW steps would move every weight by about lr: chaos seed 24 under load lost 4.6%);
    # learners that start with the run, or resume a checkpoint, keep the schedule as it is
    assert first.fresh_from is None and joined.fresh_from == 0 and restarted.fresh_from == restarted.step
    w = joined.cfg.warmup_steps
    assert joined.lr_at(joined.position) == pytest.approx(
        (joined.step + 1) / w * lr_schedule(joined.position, joined.cfg.lr, w, joined.cfg.max_steps))


def test_a_learner_whose_run_settings_differ_from_the_run_is_refused_with_the_fix(tiny_run):
    from ddiloco_geo.core.errors import ConfigError

    run = tiny_run()
    run.syncer()
    settings = run.settings.model_copy(update={
        "run": run.settings.run.model_copy(update={"codec": "int4"}),
        "learner": run.settings.learner.model_copy(update={"id": "l0"})})
    learner = Learner.from_settings(settings, run.store, inline_io=True)
    with pytest.raises(ConfigError) as info:
        learner.join()
    assert "run.codec='int4' but the run uses 'fp32'" in str(info.value)
    assert "start it with the run's settings" in str(info.value)


def check_trains_in_fp32(tiny_run, **options) -> Learner:
    """A learner with ``options`` steps 8 times: the loss falls, the parameters stay fp32."""
    run, _ = _signed_run(tiny_run)
    learner = _learner(run, lr=1e-2, warmup_steps=0, **options)
    losses = []
    for _ in range(8):
        assert learner.step_once() is True
        losses.append(learner.loss_ema)
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    assert math.isfinite(losses[-1]) and losses[-1] < losses[0]
    return learner


def test_bf16_autocast_trains_and_keeps_fp32_parameters(tiny_run):
    """learner.precision=bf16: the forward runs under bf16 autocast (on CPU here, on CUDA on GPUs);
    parameters, AdamW state and so the deltas stay fp32."""
    check_trains_in_fp32(tiny_run, precision="bf16")


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"versions": {"0": "7"}}', b'{"versions": {"0": -1}}',
                                  b'{"versions": {"x": 1}}', b'{"versions": {"0": 99999999999}}', b'{"no": 1}'])
def test_a_malformed_index_reads_as_empty_and_is_replaced(tiny_run, body, caplog):
    """Even in an unsigned run a malformed globals/HEAD is never believed (wrong types, negative or
    out-of-layout versions, not JSON): it reads as empty with a log line, and the next advance
    replaces it instead of failing."""
    run = tiny_run()
    _, token = protocol.read_index(run.store)
    run.store.cas(layout.globals_index_key(), body, token)
    with caplog.at_level(logging.WARNING):
        versions, token = protocol.read_index(run.store)
    assert versions == {} and token is not None and "index_unverified" in caplog.text
    assert protocol.advance_index(run.store, {0: 3}) == {0: 3}
    assert protocol.read_index(run.store)[0] == {0: 3}


def test_error_feedback_sends_all_progress_and_its_residual_survives_a_restart(tiny_run):
    """run.codec=topk (error feedback on by default): every delta is an increment since the previous
    send; what top-k dropped stays in a residual and goes out later, so (with no residual decay)
    everything decoded plus the residual is exactly the progress made, and the residual comes back
    from the exit checkpoint."""
    run = tiny_run(**{"run.codec": "topk", "learner.residual_decay": 1.0})
    run.syncer()
    start = {p: run.fragment_params(p, 0) for p in range(run.spec.plan.num_fragments)}
    first = _learner(run, max_steps=40)
    assert first.increments
    for _ in range(30):
        first.step_once()
    summary = first.finish()  # flushes every fragment, drains, checkpoints
    sent = {p: {n: torch.zeros_like(t) for n, t in start[p].items()} for p in start}
    steps = dict.fromkeys(start, 0)
    for key in run.store.list(layout.deltas_dir("l0")):
        header, tensors = codec.decode(run.store.get(key), kind="delta", run_id=run.spec.run_id)
        assert header.extra["increment"] is True
        assert (header.block_size, header.topk) == (run.spec.topk_chunk, run.spec.topk_keep) == (4096, 84)
        steps[header.fragment] += header.num_steps
        for n, t in tensors.items():
            sent[header.fragment][n] += t
    residual = first.uploader.residuals()
    dropped = 0.0
    for p in start:
        assert steps[p] == 30  # every step of every fragment counted once
        local = {n: t.detach().cpu() for n, t in first.model.named_parameters() if n in start[p]}
        for n in start[p]:
            progress = start[p][n] - local[n]
            torch.testing.assert_close(sent[p][n] + residual[p][n], progress, rtol=0, atol=1e-5)
            dropped += float(residual[p][n].norm())
    assert dropped > 0  # top-k did drop something: the residual is what carries it
    second = _learner(run, max_steps=40)
    assert second.resumed_from == summary["checkpoint"]
    again = second.uploader.residuals()
    assert set(again) == set(residual)
    for p in residual:
        for n in residual[p]:
            assert torch.equal(again[p][n], residual[p][n])


def test_run_schedule_reads_steps_from_merges_and_takes_the_mean():
    from ddiloco_geo.learner.schedule import RunClock, merged_steps

    extra = {"merged": [{"learner": "a", "step": 40}, {"learner": "b", "step": 12}, {"learner": "a", "step": 44},
                        {"learner": "c", "step": True}, {"learner": 7, "step": 3}, "junk", {"learner": "d", "step": -1}],
             "steps": {"e": 20, "f": "x", "g": 2**41}}
    assert merged_steps(extra) == {"a": 44, "b": 12, "e": 20}
    assert merged_steps({"merged": "not a list", "steps": []}) == {}
    clock = RunClock("a", sync_every=10, max_steps=1000)
    assert clock.position(30, {"a": 44, "b": 12, "e": 20}) == 20  # its own step counts, not its old one
    assert clock.position(40, {"a": 44, "b": 12}) == 24  # e unheard of this time: still counted


def test_the_run_schedule_counts_every_learner_seen_silent_ones_too():
    """The steps a silent learner took are the run's. Chaos seed 21: two learners stopped below the
    end, and a clock that held their steps in a median kept the third below it forever; the mean
    reaches the end when the run's M x max_steps steps are spent. Chaos seed 49 (loaded): a clock
    that dropped silent peers let the fast learner whose two peers were restarting take its own step
    as the run's (position 58 to 97 in 20 steps). Chaos seed 13 (quiet): a learner restarted after a
    fast peer had spent most of the budget took its own step as the run's and trained 70 steps alone
    from 83% of the peak learning rate."""
    from ddiloco_geo.learner.schedule import RunClock

    clock = RunClock("a", sync_every=10, max_steps=120)
    for own in range(0, 101, 5):
        pos = clock.position(own, {"a": own, "b": own, "c": own})
    assert pos == 100
    # b and c stop at 100; a keeps stepping, its deltas merged
    assert clock.position(131, {"a": 131, "b": 100, "c": 100}) == 110
    assert clock.position(159, {"a": 159, "b": 100, "c": 100}) == 119
    assert clock.position(160, {"a": 160, "b": 100, "c": 100}) == 120  # the run's 360 steps are spent
    fast = RunClock("a", sync_every=10, max_steps=120)
    for own in range(0, 59, 2):
        fast.position(own, {"a": own, "b": own, "c": own})
    assert fast.position(97, {"a": 96, "b": 58, "c": 58}) == 71  # not 97: their 116 steps count as taken
    assert fast.position(98, {"a": 97, "b": 70, "c": 58}) == 75  # one is back
    late = RunClock("a", sync_every=10, max_steps=120)
    assert late.position(50, {"b": 200, "c": 49}) == 99  # the run's place, not its own step
    assert late.position(71, {"a": 60, "b": 200, "c": 49}) == 106
    assert late.position(111, {"a": 100, "b": 200, "c": 49}) == 120  # what was left of the budget: spent
    # a slow learner that advances every 40 of our steps counts while it is silent too
    slow = RunClock("a", sync_every=10, max_steps=1000)
    for own in range(0, 201, 40):
        slow.position(own, {"a": own, "s": own // 4})
    assert slow.position(321, {"a": 321, "s": 50}) == (321 + 50) // 2


def test_the_run_schedule_never_goes_back_and_stops_a_learner_cut_off_past_its_share():
    """Chaos seed 39: while the syncer was down the position rose with this learner's steps against
    its peers' frozen ones, instead of freezing near the peak learning rate; when merges resume it
    does not go back. A learner never merged stops at its own max_steps rather than spend the run's
    whole budget alone. A learner first seen late lowers the mean: the position holds."""
    from ddiloco_geo.learner.schedule import RunClock

    clock = RunClock("a", sync_every=10, max_steps=120)
    for own in range(0, 31, 5):
        clock.position(own, {"a": own, "b": own, "c": own})
    for own in range(31, 110):  # the syncer is down: nothing new merged, a keeps stepping
        assert clock.position(own, {"a": 30, "b": 30, "c": 30}) == (own + 60) // 3
    assert clock.position(110, {"a": 110, "b": 30, "c": 30}) == 56
    assert clock.position(140, {"a": 140, "b": 30, "c": 30}) == 66
    assert clock.position(141, {"a": 140, "b": 30, "c": 30, "new": 0}) == 66  # a new learner: the mean is 52
    alone = RunClock("a", sync_every=10, max_steps=120)
    alone.position(0, {"a": 0, "b": 0})
    assert alone.position(119, {"a": 0, "b": 0}) == 59
    assert alone.position(120, {"a": 0, "b": 0}) == 120  # never merged, past its own share: it stops
    merged = RunClock("a", sync_every=10, max_steps=120)
    merged.position(0, {"a": 0, "b": 0})
    assert merged.position(130, {"a": 125, "b": 0}) == 65  # merged: it trains on toward the run's budget


def test_the_run_schedule_ends_when_the_runs_budget_is_spent_and_bounds_an_absurd_step():
    """Chaos seed 24: a learner restarted at step 53 behind two peers that had finished at 120 stopped
    at 60 on a median (the run took 323 of its 360 steps); on the mean it trains its share, at the
    run's place on the schedule. Fast learners past the end carry the mean for slow ones. A learner
    reporting an absurd step counts as 2 x max_steps: it can spend two shares of the budget, never
    end the others' schedules at once."""
    from ddiloco_geo.learner.schedule import RunClock

    clock = RunClock("a", sync_every=10, max_steps=120)
    assert clock.position(53, {"b": 120, "c": 120}) == 97
    assert clock.position(119, {"a": 110, "b": 120, "c": 120}) == 119
    assert clock.position(120, {"a": 110, "b": 120, "c": 120}) == 120
    mixed = RunClock("a", sync_every=10, max_steps=120)
    assert mixed.position(90, {"b": 150, "c": 130, "d": 100}) == 117
    assert mixed.position(100, {"b": 150, "c": 130, "d": 100}) == 120  # 480 steps: the run's budget
    liar = RunClock("a", sync_every=10, max_steps=120)
    assert liar.position(30, {"b": 2**39, "c": 30}) == 100  # counted as 240
    assert liar.position(59, {"a": 50, "b": 2**39, "c": 60}) == 119


def test_with_the_run_schedule_learners_of_different_speeds_anneal_together_and_stop_at_the_runs_budget():
    """learner.schedule=run: a learner three times faster than the other takes about three times
    the steps, both follow the mean on the learning-rate schedule, and the run stops when the two
    together have taken 2 x max_steps (within a sync period of lag; the default); with 'own'
    schedule each takes max_steps."""
    from ddiloco_geo.tools.inprocess import InProcessRun, LearnerSpeed
    from tests.service.conftest import tiny_settings

    def run(schedule):
        settings = tiny_settings(**{"storage.url": "memory://unused", "learner.max_steps": 60,
                                    "learner.warmup_steps": 2, "learner.schedule": schedule,
                                    "syncer.grace_gamma": 0.0})
        r = InProcessRun(settings, [LearnerSpeed(1.0), LearnerSpeed(3.0)])
        try:
            r.run()
            return [ln.step for ln in r.learners], [ln.position for ln in r.learners]
        finally:
            r.close()

    assert run("own")[0] == [60, 60]
    (fast, slow), (p_fast, p_slow) = run("run")
    assert 2.4 <= fast / slow <= 3.6, (fast, slow)
    assert 120 - 2 * 4 * 3 <= fast + slow <= 120 + 4, (fast, slow)  # 4 = H: the merges the mean is read from lag
    assert p_fast >= 60 and p_slow >= 60 - 4 * 3  # both stopped on the run's budget, not their own


def test_residuals_in_a_checkpoint_that_do_not_fit_the_plan_are_dropped_with_a_warning(tiny_run, caplog):
    from ddiloco_geo.learner import checkpoint as ckpt

    run = tiny_run()
    plan = run.spec.plan
    good = {n: torch.ones(plan.shapes[n]) for n in plan.fragments[0]}
    name = plan.fragments[1][0]
    tensors = {**ckpt.residual_tensors({0: good}),
               f"residual.1.{name}": torch.ones(3),          # wrong shape
               "residual.x.y": torch.ones(1), "residual.": torch.ones(1),  # malformed names
               f"residual.{plan.num_fragments}.{name}": torch.ones(plan.shapes[name])}  # no such fragment
    with caplog.at_level(logging.WARNING):
        got = ckpt.residuals_of(tensors, plan)
    assert set(got) == {0} and all(torch.equal(got[0][n], good[n]) for n in good)
    assert "checkpoint_residuals_dropped tensors=4" in caplog.text


def test_aligned_sends_keep_learners_of_different_speeds_in_step_with_the_merges():
    """learner.send_schedule=aligned: with a slower learner and step-time jitter, deltas arrive just
    before each merge, so far fewer fragment-steps are trained past a send before the merge holding it
    arrives (under 'overwrite' those steps are discarded, which makes them countable)."""
    from ddiloco_geo.tools.inprocess import InProcessRun, LearnerSpeed
    from tests.service.conftest import tiny_settings

    def out_of_step(send_schedule):
        settings = tiny_settings(**{"storage.url": "memory://unused", "learner.max_steps": 240,
                                    "learner.warmup_steps": 2, "learner.adopt": "overwrite",
                                    "learner.send_schedule": send_schedule, "fragments.sync_every": 12})
        r = InProcessRun(settings, [LearnerSpeed(1.0, 0.1), LearnerSpeed(1.18, 0.1)], seed=3)
        try:
            status = r.run()
            assert status["counters"]["merges"] > 0
            # under overwrite every step past a send at adoption is discarded: two counts of one thing
            assert r.discarded_ratio() == r.out_of_step_ratio()
            return r.out_of_step_ratio()
        finally:
            r.close()

    fixed, aligned = out_of_step("fixed"), out_of_step("aligned")
    assert 0 < aligned < 0.6 * fixed, (fixed, aligned)


@pytest.mark.parametrize("update_codec", ["int4", "none"])
def test_an_adoption_says_whether_its_merge_took_the_learners_send(tiny_run, update_codec):
    """The aligned send lead's feedback: the poller reports this learner's newest step in the merges
    an adoption holds (-1: none took its delta, from update objects or from a global one version on;
    None over skipped versions read as a full global), and the learner's lead grows after a send that
    missed its merge. Its status shows the lead and how its sends fared."""
    import asyncio

    run = tiny_run(**{"syncer.grace_gamma": 0.0, "syncer.merge_spacing": 0.0, "syncer.update_codec": update_codec})
    syncer = run.syncer()
    learner = _learner(run)
    P = run.spec.plan.num_fragments
    sent: dict[int, int] = {}
    while len(sent) < P:  # the fixed schedule until the first merges: every fragment sent once
        before = list(learner.last_sent_step)
        learner.step_once()
        sent.update({p: learner.step for p in range(P) if learner.last_sent_step[p] != before[p]})
    asyncio.run(syncer.poll_once())
    assert syncer.merge_ready() == P
    learner.poller.poll_once()
    inbox = learner.poller.take()
    assert {p: entry[3] for p, entry in inbox.items()} == sent
    learner.adopt(inbox)  # the first adoption of each fragment: nothing judged yet
    assert learner.schedule.timing == {"lead": run.spec.overlap, "on_time": 0, "late": 0}

    p = 0  # a merge of p (another learner's delta) is published just before this learner sends p again
    while learner.step + 1 < learner.schedule.next_due[p]:
        learner.step_once()
    run.write_delta("other", p, base_version=1)
    asyncio.run(syncer.poll_once())
    assert syncer.merge_ready() >= 1
    learner.step_once()
    assert learner.last_sent_step[p] == learner.step
    learner.poller.poll_once()
    inbox = learner.poller.take()
    assert inbox[p][3] == -1  # the merge did not take the learner's send
    learner.adopt(inbox)
    assert learner.schedule.timing["late"] == 1 and learner.schedule.lead == run.spec.overlap + 1
    record = status_record(learner)
    assert record["send_timing"] == learner.schedule.timing and record["send_timing"]["late"] == 1
    clean = protocol.verified.clean_learner_record(json.loads(json.dumps(record, default=str)))
    assert clean["send_timing"] == record["send_timing"]
    assert protocol.verified.clean_learner_record({"send_timing": {"lead": "x", "late": -1}})["send_timing"] == \
        {"lead": None, "on_time": None, "late": None}

    # two versions on, read as a full global (no update objects to chain, or too far): not known
    if update_codec == "none":
        for _ in range(2):
            run.write_delta("other", 1, base_version=1)
            asyncio.run(syncer.poll_once())
            assert syncer.merge_ready() >= 1
        learner.poller.poll_once()
        assert learner.poller.take()[1][3] is None


class _GlobalsUnreachable:
    """The run's store as a learner behind a slow link sees it: the index reads, but no version of
    ``fragment`` (global or update object) arrives."""

    def __init__(self, store, fragment: int) -> None:
        self.store, self.prefix = store, f"globals/f{fragment:03d}/"

    def get(self, key, *args, **kwargs):
        if key.startswith(self.prefix):
            from ddiloco_geo.core.errors import TransientStorageError
            raise TransientStorageError(f"injected: {key} did not arrive")
        return self.store.get(key, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_learner_two_versions_behind_holds_its_send_until_it_adopts_or_three_periods_are_unsent(tiny_run):
    """A learner whose base of a fragment is HOLD_LAG versions behind the index (it has not downloaded
    them: a slow link) holds that fragment's sends, keeping the work, while less than HOLD_PERIODS x H
    steps of it are unsent; then it sends; after the adoption its work goes out from the new base.
    Other fragments are sent as usual."""
    import asyncio

    from ddiloco_geo.core.errors import StorageError
    from ddiloco_geo.learner.schedule import HOLD_LAG, HOLD_PERIODS

    run = tiny_run(**{"syncer.grace_gamma": 0.0})
    syncer = run.syncer()
    learner = _learner(run)
    H = run.spec.sync_every
    for v in range(1, HOLD_LAG + 1):  # another learner's merges move fragment 0 ahead
        run.write_delta("b", 0, base_version=v - 1)
        asyncio.run(syncer.poll_once())
        assert syncer.merge_ready() == 1
    learner.poller.store = _GlobalsUnreachable(run.store, 0)
    with pytest.raises(StorageError):
        learner.poller.poll_once()
    assert learner.poller.newest[0] == HOLD_LAG and learner.base_version[0] == 0
    assert learner.poller.lag()[0] == HOLD_LAG  # the adoption_lag_versions metric

    def sends(p):
        return [protocol.read_header(run.store, k) for k in run.store.list(layout.deltas_dir("l0"))
                if layout.parse_delta_key(k).fragment == p]

    while not sends(0):
        learner.step_once()
        assert learner.step <= (HOLD_PERIODS + 1) * H, "the held fragment was never sent"
    first = sends(0)[0]
    assert first.base_version == 0 and first.num_steps >= HOLD_PERIODS * H  # the bound: sent anyway
    assert learner.sends_held >= HOLD_PERIODS - 1 and status_record(learner)["sends_held"] == learner.sends_held
    assert all(len(sends(p)) >= HOLD_PERIODS - 1 for p in range(1, run.spec.plan.num_fragments))  # not held
    held_before = learner.sends_held
    learner.poller.store = run.store
    learner.poller.poll_once()
    assert learner.poller.lag()[0] == 0  # caught up: the metric says so (it kept the last lag before)
    for _ in range(2 * H):
        learner.step_once()
    assert learner.base_version[0] == HOLD_LAG and learner.sends_held == held_before  # caught up: nothing held
    assert [h.base_version for h in sends(0)][-1] == HOLD_LAG
    P = run.spec.plan.num_fragments
    protocol.advance_index(run.store, {P + 3: 9})  # an index naming a fragment outside the plan: ignored
    learner.poller.poll_once()
    assert P + 3 not in learner.poller.lag() and learner._stale_bases({}) == set()
    learner.poller.newest, learner.poller.refused = {0: HOLD_LAG + 5}, {0: HOLD_LAG + 5}  # forged: never arrives
    assert learner._stale_bases({}) == set()
