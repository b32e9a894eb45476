"""The preemption watcher: turn "this VM is about to go away" into one callback, as early as possible.

A learner on a spot/preemptible VM has between ~30 s (GCE) and ~2 min (AWS) between the cloud's
notice and the power cut. It spends that time flushing its uncommitted fragments and a preemption
checkpoint (DESIGN.md, "Real cloud plumbing"), so the watcher's only job is to notice early and
never get in the training loop's way.

Sources (``Notice.source``):

``aws-spot``
    IMDSv2: ``PUT /latest/api/token`` (header ``X-aws-ec2-metadata-token-ttl-seconds``), then every
    ``poll_s`` ``GET /latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token``.
    404 means no notice; 200 with ``{"action": ..., "time": "...Z"}`` is the notice, and ``time``
    gives ``deadline_s``. A 200 whose body does not parse is still a notice (``deadline_s=None``):
    the item only exists when an interruption is scheduled. The token is refreshed once 80% of its
    TTL has passed, and immediately after a 401.
``aws-rebalance``
    ``GET /latest/meta-data/events/recommendations/rebalance`` (200 ``{"noticeTime": ...}``): the
    instance is at elevated risk; delivered so the learner flushes proactively, unless
    ``act_on_rebalance=False`` (then it is logged once and ignored).
``gce-preempted``
    ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``: one plain read
    for the current value and ETag, then long-polls (``wait_for_change=true&last_etag=...&
    timeout_sec=long_poll_s``) so a flip to ``TRUE`` arrives within milliseconds. ``instance/
    maintenance-event`` = ``TERMINATE_ON_HOST_MAINTENANCE`` is watched the same way and reported
    with the same source (the VM goes away either way); ``detail`` says which key fired.
``sigterm``
    SIGTERM (and SIGINT if asked) via :meth:`PreemptionWatcher.install_signal_handlers`, which must
    be called from the main thread because CPython only runs signal handlers there.

``provider="auto"`` probes both metadata servers once, concurrently, with a short timeout; GCE
counts only if the response carries ``Metadata-Flavor: Google``. If neither answers, one line is
logged and only signals are watched.

Delivery and threading: polling runs on aiohttp in a daemon thread with its own event loop, so the
training loop never waits on the network. ``on_notice`` is called at most once per watcher: from the
watcher thread for a cloud notice, from the main thread for a signal. It must be quick and
thread-safe (set a flag or an Event). Later notices are logged once each, never re-delivered.

Failure semantics: an unreachable metadata server, a 5xx, a timeout or a malformed answer is logged
at debug, counted in ``num_poll_errors`` and retried with capped exponential backoff; nothing the
server does stops the thread. An exception raised by ``on_notice`` is logged, not propagated.
Tokens never appear in logs or reprs. :meth:`stop` is idempotent and joins within about a second.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Literal

import aiohttp

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.learner.notices import (
    AWS_MAX_TOKEN_TTL_S, AWS_METADATA_URL, AWS_REBALANCE_PATH, AWS_SPOT_PATH, AWS_TOKEN_HEADER, AWS_TOKEN_PATH,
    AWS_TOKEN_TTL_HEADER, GCE_HEADERS, GCE_METADATA_URL, GCE_PREFIX, GCE_TERMINATE_EVENT, Notice, rebalance_notice,
    spot_notice,
)

log = logging.getLogger(__name__)

Provider = Literal["aws", "gce", "auto", "none"]
PROVIDERS = ("aws", "gce", "auto", "none")


PROBE_TIMEOUT_S = 1.0  # auto-detection: a metadata server on the VM answers in milliseconds
MAX_BACKOFF_S = 5.0  # a GCE notice gives ~30 s; never back off for longer than a few seconds
TOKEN_REFRESH_RATIO = 0.8
STOP_JOIN_S = 1.0


class _BadAnswer(Exception):
    """The metadata server answered, but not with something we can use (5xx, 403, ...)."""


class _Unauthorized(Exception):
    """IMDSv2 said 401: the token expired or was revoked."""


class PreemptionWatcher:
    """Watch the cloud's metadata server and the process's signals; call ``on_notice`` once."""

    def __init__(
        self,
        *,
        provider: Provider,
        on_notice: Callable[[Notice], None],
        metadata_url: str | None = None,
        poll_s: float = 1.0,
        timeout_s: float = 2.0,
        act_on_rebalance: bool = True,
        aws_token_ttl_s: int = AWS_MAX_TOKEN_TTL_S,
        long_poll_s: float = 30.0,
    ) -> None:
        if provider not in PROVIDERS:
            raise ConfigError(f"provider={provider!r} is not one of {', '.join(PROVIDERS)}; use 'auto' to detect the cloud")
        if not callable(on_notice):
            raise ConfigError("on_notice must be a callable taking one Notice")
        if metadata_url is not None and not metadata_url.startswith(("http://", "https://")):
            raise ConfigError(f"metadata_url={metadata_url!r} must start with http:// (e.g. http://169.254.169.254)")
        if not poll_s > 0:
            raise ConfigError(f"poll_s={poll_s} must be > 0 (seconds between AWS polls; 1.0 is the usual value)")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s} must be > 0 (seconds per metadata request)")
        if not 1 <= aws_token_ttl_s <= AWS_MAX_TOKEN_TTL_S:
            raise ConfigError(f"aws_token_ttl_s={aws_token_ttl_s} must be in 1..{AWS_MAX_TOKEN_TTL_S} (IMDSv2's limits)")
        if not long_poll_s >= 1:
            raise ConfigError(f"long_poll_s={long_poll_s} must be >= 1 (GCE's timeout_sec is whole seconds)")
        self._requested = provider
        self._on_notice = on_notice
        self._metadata_url = metadata_url.rstrip("/") if metadata_url else None
        self._poll_s = poll_s
        self._timeout_s = timeout_s
        self._act_on_rebalance = act_on_rebalance
        self._token_ttl_s = int(aws_token_ttl_s)
        self._long_poll_s = long_poll_s

        self._lock = threading.RLock()  # reentrant: a signal handler may interrupt the main thread inside _report
        self._notice: Notice | None = None
        self._delivered = threading.Event()
        self._seen: set[tuple[str, str]] = set()
        self._provider: str | None = provider if provider != "auto" else None
        self._provider_known = threading.Event()
        if self._provider is not None:
            self._provider_known.set()
        self._previous_handlers: dict[int, object] = {}
        self._token: str | None = None
        self._token_refresh_at = 0.0
        self.num_poll_errors = 0

        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._is_started = False
        self._is_stopped = False

    def __repr__(self) -> str:
        return f"PreemptionWatcher(provider={self._provider or self._requested!r}, notice={self._notice!r})"

    # --- public surface -------------------------------------------------------------------------

    @property
    def notice(self) -> Notice | None:
        """The notice that was delivered, or None."""
        return self._notice

    @property
    def provider(self) -> str | None:
        """The provider being watched (``auto`` resolved), or None while auto-detection runs."""
        return self._provider

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Notice | None:
        """Block until a notice is delivered (or ``timeout`` passes); return it or None."""
        self._delivered.wait(timeout)
        return self._notice

    def wait_for_provider(self, timeout: float | None = None) -> str | None:
        """Block until auto-detection has decided; return the provider or None on timeout."""
        self._provider_known.wait(timeout)
        return self._provider

    def start(self) -> PreemptionWatcher:
        """Start the watcher thread; a no-op if already started. A stopped watcher cannot restart."""
        if self._is_stopped:
            raise RuntimeError("this PreemptionWatcher was stopped; create a new one")
        if self._is_started:
            return self
        self._is_started = True
        if self._requested == "none":
            log.info("preemption_watcher_started provider=none watching=signals")
            return self
        self._loop = asyncio.new_event_loop()
        self._task = self._loop.create_task(self._main())
        self._thread = threading.Thread(target=self._run, name="preemption-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Cancel polling and join the thread (within about a second). Idempotent, any thread.

        Signal handlers stay installed (they need no thread); see :meth:`restore_signal_handlers`.
        """
        self._is_stopped = True
        loop, task, thread = self._loop, self._task, self._thread
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop already finished and closed
                pass
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_JOIN_S)
            if thread.is_alive():
                log.warning("preemption_watcher_stop_slow join_s=%.1f", STOP_JOIN_S)

    def __enter__(self) -> PreemptionWatcher:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def install_signal_handlers(self, *, sigint: bool = False) -> None:
        """Route SIGTERM (and SIGINT if ``sigint``) into ``on_notice`` with source ``sigterm``.

        Main thread only (CPython runs signal handlers there and refuses to install them elsewhere).
        The callback then runs in the main thread between two bytecodes of the training loop. With
        ``sigint``, a SIGINT that arrives after a notice was delivered raises KeyboardInterrupt as
        usual, so an operator can still force a hung flush to stop.
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("install_signal_handlers must be called from the main thread")
        signums = [signal.SIGTERM] + ([signal.SIGINT] if sigint else [])
        for signum in signums:
            previous = signal.signal(signum, self._on_signal)
            self._previous_handlers.setdefault(int(signum), previous)

    def restore_signal_handlers(self) -> None:
        """Put back the handlers that :meth:`install_signal_handlers` replaced. Main thread only."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("restore_signal_handlers must be called from the main thread")
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous_handlers.clear()

    # --- delivery -------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT and self._notice is not None:
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        self._report(Notice("sigterm", f"signal={name}", None, time.time()), dedupe=False)

    def _report(self, notice: Notice, *, dedupe: bool = True) -> None:
        """Deliver the first notice; log each later distinct one once. Polls repeat, hence dedupe."""
        with self._lock:
            key = (notice.source, notice.detail)
            if dedupe and key in self._seen:
                return
            self._seen.add(key)
            if notice.source == "aws-rebalance" and not self._act_on_rebalance:
                log.info("preemption_notice_ignored source=aws-rebalance detail=%s reason=act_on_rebalance_false", notice.detail)
                return
            if self._notice is not None:
                log.info("preemption_notice_repeat source=%s detail=%s delivered=%s", notice.source, notice.detail, self._notice.source)
                return
            self._notice = notice
        deadline = "none" if notice.deadline_s is None else f"{notice.deadline_s:.1f}"
        log.warning("preemption_notice source=%s deadline_s=%s detail=%s", notice.source, deadline, notice.detail)
        self._delivered.set()
        try:
            self._on_notice(notice)
        except Exception:
            log.exception("preemption_callback_failed source=%s", notice.source)

    # --- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        assert self._loop is not None and self._task is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug; the training loop must not notice
            log.exception("preemption_watcher_crashed provider=%s", self._provider)
        finally:
            try:
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()

    async def _main(self) -> None:
        # trust_env=False: a metadata request must never go through an HTTP proxy.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout_s), trust_env=False) as session:
            if self._requested == "auto":
                self._provider = await self._detect(session)
                self._provider_known.set()
            if self._provider == "aws":
                log.info("preemption_watcher_started provider=aws url=%s poll_s=%s", self._aws_url(), self._poll_s)
                await self._watch_aws(session)
            elif self._provider == "gce":
                log.info("preemption_watcher_started provider=gce url=%s long_poll_s=%s", self._gce_url(), self._long_poll_s)
                await asyncio.gather(
                    self._watch_gce_key(session, "preempted", lambda v: v.strip().upper() == "TRUE"),
                    self._watch_gce_key(session, "maintenance-event", lambda v: v.strip() == GCE_TERMINATE_EVENT),
                )

    def _aws_url(self) -> str:
        return self._metadata_url or AWS_METADATA_URL

    def _gce_url(self) -> str:
        return self._metadata_url or GCE_METADATA_URL

    def _backoff_s(self, failures: int) -> float:
        cap = max(self._poll_s, MAX_BACKOFF_S)
        return min(cap, self._poll_s * 2 ** min(failures, 16)) * random.uniform(0.5, 1.0)

    def _poll_failed(self, provider: str, exc: BaseException, failures: int) -> float:
        self.num_poll_errors += 1
        delay = self._backoff_s(failures)
        if isinstance(exc, (aiohttp.ClientError, TimeoutError, _BadAnswer, _Unauthorized)):
            log.debug("preemption_poll_failed provider=%s error=%s failures=%d backoff_s=%.2f", provider, _describe(exc), failures, delay)
        else:
            log.warning("preemption_poll_bug provider=%s error=%s backoff_s=%.2f", provider, _describe(exc), delay, exc_info=exc)
        return delay

    # --- auto-detection -------------------------------------------------------------------------

    async def _detect(self, session: aiohttp.ClientSession) -> str:
        is_aws, is_gce = await asyncio.gather(self._probe_aws(session), self._probe_gce(session))
        if is_gce:  # the Metadata-Flavor header is the stronger evidence
            return "gce"
        if is_aws:
            return "aws"
        log.info("preemption_watcher_no_metadata provider=none probed=aws,gce watching=signals")
        return "none"

    async def _probe_aws(self, session: aiohttp.ClientSession) -> bool:
        try:
            await self._refresh_token(session, timeout=aiohttp.ClientTimeout(total=min(self._timeout_s, PROBE_TIMEOUT_S)))
            return True
        except Exception as exc:
            log.debug("preemption_probe provider=aws answered=false error=%s", _describe(exc))
            return False

    async def _probe_gce(self, session: aiohttp.ClientSession) -> bool:
        timeout = aiohttp.ClientTimeout(total=min(self._timeout_s, PROBE_TIMEOUT_S))
        try:
            async with session.get(self._gce_url() + GCE_PREFIX, headers=GCE_HEADERS, timeout=timeout) as resp:
                await resp.read()
                return resp.status == 200 and resp.headers.get("Metadata-Flavor") == "Google"
        except Exception as exc:
            log.debug("preemption_probe provider=gce answered=false error=%s", _describe(exc))
            return False

    # --- AWS ------------------------------------------------------------------------------------

    async def _watch_aws(self, session: aiohttp.ClientSession) -> None:
        failures = 0
        while True:
            try:
                await self._poll_aws_once(session)
                failures, delay = 0, self._poll_s
            except Exception as exc:
                failures += 1
                delay = self._poll_failed("aws", exc, failures)
            await asyncio.sleep(delay)

    async def _poll_aws_once(self, session: aiohttp.ClientSession) -> None:
        body = await self._aws_get(session, AWS_SPOT_PATH)
        if body is not None:
            self._report(spot_notice(body))
        body = await self._aws_get(session, AWS_REBALANCE_PATH)
        if body is not None:
            self._report(rebalance_notice(body))

    async def _aws_get(self, session: aiohttp.ClientSession, path: str) -> str | None:
        """GET an IMDSv2 item: its body, or None on 404. One token refresh on 401."""
        for attempt in range(2):
            if self._token is None or time.monotonic() >= self._token_refresh_at:
                await self._refresh_token(session)
            assert self._token is not None
            async with session.get(self._aws_url() + path, headers={AWS_TOKEN_HEADER: self._token}) as resp:
                text = await resp.text(errors="replace")
                if resp.status == 200:
                    return text
                if resp.status == 404:
                    return None
                if resp.status == 401:
                    self._token = None
                    log.debug("preemption_token_rejected provider=aws path=%s attempt=%d", path, attempt)
                    continue
                raise _BadAnswer(f"GET {path} status={resp.status}")
        raise _Unauthorized(f"GET {path} status=401 after a fresh token")

    async def _refresh_token(self, session: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout | None = None) -> None:
        headers = {AWS_TOKEN_TTL_HEADER: str(self._token_ttl_s)}
        async with session.put(self._aws_url() + AWS_TOKEN_PATH, headers=headers, timeout=timeout) as resp:
            text = (await resp.text(errors="replace")).strip()
            if resp.status != 200 or not text:
                raise _BadAnswer(f"PUT {AWS_TOKEN_PATH} status={resp.status}")
        self._token = text
        self._token_refresh_at = time.monotonic() + TOKEN_REFRESH_RATIO * self._token_ttl_s
        log.debug("preemption_token_refreshed provider=aws ttl_s=%d", self._token_ttl_s)

    # --- GCE ------------------------------------------------------------------------------------

    async def _watch_gce_key(self, session: aiohttp.ClientSession, key: str, is_notice: Callable[[str], bool]) -> None:
        etag: str | None = None
        failures = 0
        while True:
            started = time.monotonic()
            try:
                value, new_etag = await self._gce_get(session, key, etag)
            except Exception as exc:
                failures += 1
                await asyncio.sleep(self._poll_failed("gce", exc, failures))
                continue
            failures = 0
            if is_notice(value):
                self._report(Notice("gce-preempted", f"{key}={value.strip()}", None, time.time()))
            if new_etag is None or (new_etag == etag and time.monotonic() - started < self._poll_s):
                # A server that does not long-poll (no ETag, or an early unchanged answer): don't spin.
                await asyncio.sleep(self._poll_s)
            etag = new_etag

    async def _gce_get(self, session: aiohttp.ClientSession, key: str, etag: str | None) -> tuple[str, str | None]:
        """Read ``instance/<key>``; with an ETag, wait until it changes or ``long_poll_s`` passes."""
        url = self._gce_url() + GCE_PREFIX + key
        params: dict[str, str] = {}
        timeout = None
        if etag is not None:
            wait_s = max(1, int(self._long_poll_s))
            params = {"wait_for_change": "true", "last_etag": etag, "timeout_sec": str(wait_s)}
            timeout = aiohttp.ClientTimeout(total=wait_s + self._timeout_s)
        async with session.get(url, params=params, headers=GCE_HEADERS, timeout=timeout) as resp:
            text = await resp.text(errors="replace")
            if resp.status != 200:
                raise _BadAnswer(f"GET {GCE_PREFIX}{key} status={resp.status}")
            return text, resp.headers.get("ETag")


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}({text})" if text else type(exc).__name__
