"""The preemption watcher against a fake metadata server on 127.0.0.1 (tests/agent/fake_metadata.py)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import deadline, wait_until
from tests.agent.fake_metadata import FakeMetadata

from ddiloco_geo.learner.preemption import Notice, PreemptionWatcher
from ddiloco_geo.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SPOT_PATH = "GET /latest/meta-data/spot/instance-action"
REBALANCE_PATH = "GET /latest/meta-data/events/recommendations/rebalance"
TOKEN_PATH = "PUT /latest/api/token"
LONG_POLL_S = 120  # GCE long polls: a notice or a stop must never have to wait for one to end


class Inbox:
    """An ``on_notice`` that records every call."""

    def __init__(self) -> None:
        self.notices: list[Notice] = []
        self.event = threading.Event()

    def __call__(self, notice: Notice) -> None:
        self.notices.append(notice)
        self.event.set()

    def first(self, timeout_s: float = 10.0) -> Notice:
        assert self.event.wait(deadline(timeout_s)), "no notice delivered"
        return self.notices[0]


def reached(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    wait_until(predicate, timeout_s, interval_s=0.01)


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def fake_aws() -> Iterator[FakeMetadata]:
    with FakeMetadata(cloud="aws") as fake:
        yield fake


@pytest.fixture
def fake_gce() -> Iterator[FakeMetadata]:
    with FakeMetadata(cloud="gce") as fake:
        yield fake


def watcher(url: str, inbox: Inbox, **kwargs) -> PreemptionWatcher:
    kwargs.setdefault("provider", "aws")
    kwargs.setdefault("poll_s", 0.02)
    return PreemptionWatcher(metadata_url=url, on_notice=inbox, **kwargs)


# --- AWS ----------------------------------------------------------------------------------------


def test_aws_spot_notice_is_delivered_with_parsed_deadline(fake_aws: FakeMetadata) -> None:
    inbox = Inbox()
    with watcher(fake_aws.url, inbox) as w:
        reached(lambda: fake_aws.counts[SPOT_PATH] >= 2)
        at = time.time() + 120
        when = fake_aws.trigger_spot(action="terminate", at=at)
        notice = inbox.first()
        seen_by = time.time()
        assert notice.source == "aws-spot"
        assert notice.detail == f"action=terminate time={when}"
        # wall-clock received_at, and deadline_s counted from it to the notice's (whole-second) time
        assert at - 120 <= notice.received_at <= seen_by
        assert notice.deadline_s is not None and 0 < notice.deadline_s <= 120
        assert notice.deadline_s == pytest.approx(int(at) - notice.received_at, abs=1.0)
        assert w.notice == notice
    assert fake_aws.counts["status 401"] == 0


def test_aws_notice_is_delivered_at_most_once(fake_aws: FakeMetadata) -> None:
    inbox = Inbox()
    with watcher(fake_aws.url, inbox):
        fake_aws.trigger_rebalance()
        assert inbox.first().source == "aws-rebalance"
        fake_aws.trigger_spot()
        polls = fake_aws.counts[SPOT_PATH]
        reached(lambda: fake_aws.counts[SPOT_PATH] >= polls + 3)
    assert [n.source for n in inbox.notices] == ["aws-rebalance"]


def test_aws_rebalance_is_ignored_when_act_on_rebalance_is_false(fake_aws: FakeMetadata) -> None:
    inbox = Inbox()
    with watcher(fake_aws.url, inbox, act_on_rebalance=False):
        fake_aws.trigger_rebalance()
        polls = fake_aws.counts[REBALANCE_PATH]
        reached(lambda: fake_aws.counts[REBALANCE_PATH] >= polls + 3)  # seen, and ignored
        assert inbox.notices == []
        fake_aws.trigger_spot()
        assert inbox.first().source == "aws-spot"
    assert [n.source for n in inbox.notices] == ["aws-spot"]


def test_aws_unparseable_spot_item_is_still_a_notice(fake_aws: FakeMetadata) -> None:
    inbox = Inbox()
    with watcher(fake_aws.url, inbox):
        fake_aws.trigger_spot(raw="{not json")
        notice = inbox.first()
    assert notice.source == "aws-spot" and notice.deadline_s is None


def test_aws_token_header_is_sent_and_refreshed_after_401(fake_aws: FakeMetadata) -> None:
    inbox = Inbox()
    with watcher(fake_aws.url, inbox):
        reached(lambda: fake_aws.counts[SPOT_PATH] >= 3)
        assert fake_aws.counts[TOKEN_PATH] == 1  # one token serves many polls
        assert fake_aws.counts["status 401"] == 0  # every GET carried a live token
        assert fake_aws.token_ttls == ["21600"]
        fake_aws.revoke_tokens()
        reached(lambda: fake_aws.counts[TOKEN_PATH] == 2)
        fake_aws.trigger_spot()
        assert inbox.first().source == "aws-spot"
    assert fake_aws.counts["status 401"] >= 1


def test_aws_token_is_refreshed_before_it_expires(fake_aws: FakeMetadata) -> None:
    inbox = Inbox()
    with watcher(fake_aws.url, inbox, aws_token_ttl_s=1):
        reached(lambda: fake_aws.counts[TOKEN_PATH] >= 3)
    assert fake_aws.token_ttls[:3] == ["1", "1", "1"]
    assert fake_aws.counts["status 401"] == 0


def test_aws_token_never_appears_in_logs(fake_aws: FakeMetadata, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="ddiloco_geo.learner.preemption")
    inbox = Inbox()
    with watcher(fake_aws.url, inbox) as w:
        reached(lambda: fake_aws.counts[SPOT_PATH] >= 2)
        fake_aws.revoke_tokens()
        reached(lambda: fake_aws.counts[TOKEN_PATH] >= 2)
        text = caplog.text + repr(w)
    assert "preemption_token_refreshed" in text
    assert len(fake_aws.issued_tokens) >= 2
    assert not [token for token in fake_aws.issued_tokens if token in text]


def test_aws_5xx_and_recovery_never_crash(fake_aws: FakeMetadata) -> None:
    inbox = Inbox()
    fake_aws.fail_status = 503
    with watcher(fake_aws.url, inbox, poll_s=0.01) as w:
        reached(lambda: w.num_poll_errors >= 3)
        assert w.is_running and fake_aws.counts["status 503"] >= 3
        fake_aws.fail_status = None
        fake_aws.trigger_spot()
        assert inbox.first().source == "aws-spot"


# --- GCE ----------------------------------------------------------------------------------------


def test_gce_preemption_arrives_through_the_long_poll(fake_gce: FakeMetadata) -> None:
    inbox = Inbox()
    answered = "GET /computeMetadata/v1/instance/preempted"
    with watcher(fake_gce.url, inbox, provider="gce", long_poll_s=LONG_POLL_S):
        reached(lambda: fake_gce.num_waiting("preempted") == 1)
        polls = fake_gce.counts[answered]
        fake_gce.preempt()
        notice = inbox.first()
        # the parked request itself woke up and answered (it would otherwise end after LONG_POLL_S,
        # far beyond any wait here)
        assert fake_gce.counts[answered] == polls + 1
    assert notice.source == "gce-preempted" and notice.detail == "preempted=TRUE"
    assert notice.deadline_s is None
    assert fake_gce.counts["status 403"] == 0  # the Metadata-Flavor header was always sent


def test_gce_terminate_on_host_maintenance_is_a_notice_and_migrate_is_not(fake_gce: FakeMetadata) -> None:
    inbox = Inbox()
    with watcher(fake_gce.url, inbox, provider="gce", long_poll_s=LONG_POLL_S):
        reached(lambda: fake_gce.num_waiting("maintenance-event") == 1)
        answered = fake_gce.counts["GET /computeMetadata/v1/instance/maintenance-event"]
        fake_gce.set_maintenance_event("MIGRATE_ON_HOST_MAINTENANCE")
        # The parked poll answers MIGRATE; once the next one parks, the watcher has judged it.
        reached(lambda: fake_gce.counts["GET /computeMetadata/v1/instance/maintenance-event"] > answered)
        reached(lambda: fake_gce.num_waiting("maintenance-event") == 1)
        assert inbox.notices == []
        fake_gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
        notice = inbox.first()
    assert notice.source == "gce-preempted"
    assert notice.detail == "maintenance-event=TERMINATE_ON_HOST_MAINTENANCE"


def test_gce_already_preempted_at_start_is_delivered_without_waiting(fake_gce: FakeMetadata) -> None:
    fake_gce.preempt()
    inbox = Inbox()
    with watcher(fake_gce.url, inbox, provider="gce", long_poll_s=LONG_POLL_S):
        assert inbox.first().detail == "preempted=TRUE"


def test_fake_gce_refuses_requests_without_the_flavor_header(fake_gce: FakeMetadata) -> None:
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(fake_gce.url + "/computeMetadata/v1/instance/preempted", timeout=5)
    refused.value.close()
    assert refused.value.code == 403


# --- auto-detection -----------------------------------------------------------------------------


@pytest.mark.parametrize("cloud", ["aws", "gce"])
def test_auto_detection_picks_the_cloud_that_answers(cloud: str) -> None:
    inbox = Inbox()
    with FakeMetadata(cloud=cloud) as fake, watcher(fake.url, inbox, provider="auto") as w:
        assert w.wait_for_provider(timeout=deadline(10)) == cloud
        fake.trigger_spot() if cloud == "aws" else fake.preempt()
        assert inbox.first().source == ("aws-spot" if cloud == "aws" else "gce-preempted")


@pytest.mark.parametrize("where", ["nothing_listening", "not_a_metadata_server"])
def test_auto_detection_falls_back_to_signals_only(where: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ddiloco_geo.learner.preemption")
    with FakeMetadata(cloud="none") as fake:
        url = closed_port_url() if where == "nothing_listening" else fake.url
        w = watcher(url, Inbox(), provider="auto").start()
        assert w.wait_for_provider(timeout=deadline(10)) == "none"
        w.stop()
    lines = [r.getMessage() for r in caplog.records if "provider=none" in r.getMessage()]
    assert len(lines) == 1 and "watching=signals" in lines[0]


# --- robustness and lifecycle -------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["aws", "gce"])
def test_unreachable_metadata_server_never_crashes(provider: str) -> None:
    w = watcher(closed_port_url(), Inbox(), provider=provider, poll_s=0.01).start()
    reached(lambda: w.num_poll_errors >= 3)
    assert w.is_running and w.notice is None
    w.stop()
    reached(lambda: not w.is_running)


def test_callback_exception_is_logged_and_the_watcher_keeps_running(fake_aws: FakeMetadata, caplog: pytest.LogCaptureFixture) -> None:
    def explode(notice: Notice) -> None:
        raise RuntimeError("learner bug")

    with PreemptionWatcher(provider="aws", metadata_url=fake_aws.url, poll_s=0.02, on_notice=explode) as w:
        fake_aws.trigger_spot()
        assert w.wait(timeout=deadline(10)) is not None
        polls = fake_aws.counts[SPOT_PATH]
        reached(lambda: fake_aws.counts[SPOT_PATH] >= polls + 2)
        assert w.is_running
    assert "preemption_callback_failed source=aws-spot" in caplog.text


def test_stop_is_prompt_during_a_long_poll_and_idempotent(fake_gce: FakeMetadata) -> None:
    w = watcher(fake_gce.url, Inbox(), provider="gce", long_poll_s=LONG_POLL_S).start()
    assert w.start() is w  # a second start is a no-op
    reached(lambda: fake_gce.num_waiting("preempted") == 1)
    w.stop()
    # stop cancels the parked request: the thread ends long before the poll's LONG_POLL_S would
    reached(lambda: not w.is_running, timeout_s=LONG_POLL_S / 10)
    w.stop()
    with pytest.raises(RuntimeError, match="create a new one"):
        w.start()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"provider": "azure"}, "use 'auto'"),
        ({"provider": "aws", "poll_s": 0}, "poll_s"),
        ({"provider": "aws", "timeout_s": -1}, "timeout_s"),
        ({"provider": "aws", "metadata_url": "169.254.169.254"}, "http://"),
        ({"provider": "aws", "aws_token_ttl_s": 0}, "aws_token_ttl_s"),
    ],
)
def test_invalid_arguments_say_how_to_fix_them(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PreemptionWatcher(on_notice=Inbox(), **kwargs)


# --- signals ------------------------------------------------------------------------------------


def test_sigterm_in_a_subprocess_is_delivered_through_install_signal_handlers() -> None:
    child = textwrap.dedent(
        """
        import sys, time
        from ddiloco_geo.learner.preemption import PreemptionWatcher
        notices = []
        w = PreemptionWatcher(provider="none", on_notice=notices.append)
        w.install_signal_handlers()
        w.start()
        print("ready", flush=True)
        deadline = time.monotonic() + float(sys.argv[1])
        while not notices and time.monotonic() < deadline:
            time.sleep(0.01)
        w.stop()
        print(notices[0].source if notices else "none", flush=True)
        sys.exit(0 if notices else 1)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", child, str(deadline(20))], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=deadline(30))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert out.strip() == "sigterm"


def test_signal_after_a_notice_is_logged_not_redelivered(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ddiloco_geo.learner.preemption")
    inbox = Inbox()
    w = PreemptionWatcher(provider="none", on_notice=inbox)
    w.install_signal_handlers()
    try:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
    finally:
        w.restore_signal_handlers()
    assert [n.detail for n in inbox.notices] == ["signal=SIGTERM"]
    assert "preemption_notice_repeat source=sigterm" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is not w._on_signal


def test_install_signal_handlers_refuses_other_threads() -> None:
    w = PreemptionWatcher(provider="none", on_notice=Inbox())
    errors: list[BaseException] = []

    def install() -> None:
        try:
            w.install_signal_handlers()
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])
