"""A fake cloud metadata server on 127.0.0.1 for the preemption watcher's tests.

One aiohttp app, in its own thread and event loop, that speaks enough of both clouds:

- AWS IMDSv2: ``PUT /latest/api/token`` (needs ``X-aws-ec2-metadata-token-ttl-seconds`` in
  1..21600, else 400; the token expires after that TTL), then ``/latest/meta-data/spot/instance-action``
  and ``/latest/meta-data/events/recommendations/rebalance`` (401 without a live token, 404 until
  triggered, 200 JSON after).
- GCE: ``/computeMetadata/v1/instance/`` and ``instance/{preempted,maintenance-event}`` (403 without
  ``Metadata-Flavor: Google``; answers carry that header and an ETag). ``wait_for_change=true``
  waits until the value's ETag differs from ``last_etag`` or ``timeout_sec`` passes.

``cloud`` chooses which half answers ("aws", "gce", "both", or "none": 404 for everything). State
changes run on the server's loop and return once applied, so a test never races its own trigger.
"""

from __future__ import annotations

import asyncio
import collections
import json
import secrets
import threading
import time

from aiohttp import web

TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
GCE_KEYS = ("preempted", "maintenance-event")


class FakeMetadata:
    def __init__(self, *, cloud: str = "both") -> None:
        assert cloud in ("aws", "gce", "both", "none")
        self.cloud = cloud
        self.counts: collections.Counter[str] = collections.Counter()  # "METHOD path" and "status NNN"
        self.token_ttls: list[str] = []  # TTL header of every token request
        self.issued_tokens: list[str] = []
        self.fail_status: int | None = None  # answer every request with this status while set
        self._tokens: dict[str, float] = {}
        self._spot: str | None = None
        self._rebalance: str | None = None
        self._gce = {"preempted": "FALSE", "maintenance-event": "NONE"}
        self._etags = {key: 1 for key in GCE_KEYS}
        self._changed: asyncio.Event | None = None
        self._is_closing = False
        self._waiting = collections.Counter[str]()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-metadata", daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> FakeMetadata:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        if self._runner is not None:
            self._call(self._release_waiters())  # parked long-polls would hold up the runner's cleanup
            self._call(self._runner.cleanup())
            self._runner = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> FakeMetadata:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _start(self) -> None:
        self._changed = asyncio.Event()
        app = web.Application()
        app.router.add_put("/latest/api/token", self._token)
        app.router.add_get("/latest/meta-data/spot/instance-action", self._aws_item)
        app.router.add_get("/latest/meta-data/events/recommendations/rebalance", self._aws_item)
        app.router.add_get("/computeMetadata/v1/instance/", self._gce_dir)
        app.router.add_get("/computeMetadata/v1/instance/{key}", self._gce_item)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def _call(self, coro):  # run on the server loop and wait for it
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # --- what the tests flip --------------------------------------------------------------------

    def trigger_spot(self, *, action: str = "terminate", at: float | None = None, raw: str | None = None) -> str:
        """Schedule a spot interruption ``at`` (POSIX time; default in 120 s). Returns the ``time``."""
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120 if at is None else at))
        body = raw if raw is not None else json.dumps({"action": action, "time": when})
        self._call(self._set_aws("_spot", body))
        return when

    def trigger_rebalance(self) -> None:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._call(self._set_aws("_rebalance", json.dumps({"noticeTime": when})))

    def preempt(self) -> None:
        self._call(self._set_gce("preempted", "TRUE"))

    def set_maintenance_event(self, value: str) -> None:
        self._call(self._set_gce("maintenance-event", value))

    def revoke_tokens(self) -> None:
        self._call(self._revoke())

    def num_waiting(self, key: str) -> int:
        """Long-polls on ``instance/<key>`` currently parked in the server."""
        return self._waiting[key]

    async def _set_aws(self, attr: str, body: str) -> None:
        setattr(self, attr, body)

    async def _set_gce(self, key: str, value: str) -> None:
        self._gce[key] = value
        self._etags[key] += 1
        assert self._changed is not None
        self._changed.set()  # wake every long-poll; each re-checks its own key
        self._changed = asyncio.Event()

    async def _release_waiters(self) -> None:
        self._is_closing = True
        assert self._changed is not None
        self._changed.set()

    async def _revoke(self) -> None:
        self._tokens.clear()

    # --- AWS ------------------------------------------------------------------------------------

    def _count(self, request: web.Request, status: int) -> None:
        self.counts[f"{request.method} {request.path}"] += 1
        self.counts[f"status {status}"] += 1

    def _answer(self, request: web.Request, status: int, text: str = "", headers: dict | None = None) -> web.Response:
        if self.fail_status is not None:
            status, text, headers = self.fail_status, "injected failure", None
        self._count(request, status)
        return web.Response(status=status, text=text, headers=headers)

    async def _token(self, request: web.Request) -> web.Response:
        if self.cloud not in ("aws", "both"):
            return self._answer(request, 404)
        ttl = request.headers.get(TTL_HEADER, "")
        self.token_ttls.append(ttl)
        if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return self._answer(request, 400, "bad ttl")
        token = secrets.token_urlsafe(24)
        self._tokens[token] = time.monotonic() + int(ttl)
        self.issued_tokens.append(token)
        return self._answer(request, 200, token)

    async def _aws_item(self, request: web.Request) -> web.Response:
        if self.cloud not in ("aws", "both"):
            return self._answer(request, 404)
        expires = self._tokens.get(request.headers.get(TOKEN_HEADER, ""))
        if expires is None or time.monotonic() >= expires:
            return self._answer(request, 401)
        body = self._spot if request.path.endswith("instance-action") else self._rebalance
        if body is None:
            return self._answer(request, 404, "Not Found")
        return self._answer(request, 200, body, {"Content-Type": "text/plain"})

    # --- GCE ------------------------------------------------------------------------------------

    def _gce_refused(self, request: web.Request) -> web.Response | None:
        if self.cloud not in ("gce", "both"):
            return self._answer(request, 404)
        if request.headers.get("Metadata-Flavor") != "Google":
            return self._answer(request, 403, "Missing Metadata-Flavor:Google header.")
        return None

    async def _gce_dir(self, request: web.Request) -> web.Response:
        refused = self._gce_refused(request)
        if refused is not None:
            return refused
        return self._answer(request, 200, "\n".join(GCE_KEYS) + "\n", {"Metadata-Flavor": "Google"})

    async def _gce_item(self, request: web.Request) -> web.Response:
        refused = self._gce_refused(request)
        if refused is not None:
            return refused
        key = request.match_info["key"]
        if key not in self._gce:
            return self._answer(request, 404)
        if request.query.get("wait_for_change") == "true":
            await self._wait_for_change(key, request.query.get("last_etag"), float(request.query.get("timeout_sec", "3600")))
        headers = {"Metadata-Flavor": "Google", "ETag": str(self._etags[key])}
        return self._answer(request, 200, self._gce[key], headers)

    async def _wait_for_change(self, key: str, last_etag: str | None, timeout_s: float) -> None:
        # Like GCE: without last_etag, wait for the next change; with a stale one, answer at once.
        target = last_etag if last_etag is not None else str(self._etags[key])
        deadline = time.monotonic() + timeout_s
        self._waiting[key] += 1
        try:
            while str(self._etags[key]) == target and not self._is_closing:
                assert self._changed is not None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    return
        finally:
            self._waiting[key] -= 1
