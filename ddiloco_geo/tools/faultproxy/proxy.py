"""The fault proxy: an asyncio HTTP/1.1 proxy on loopback that breaks requests on purpose.

:class:`FaultProxy` accepts client connections (kept alive across requests) and relays each
request to the target on a fresh upstream connection (``Connection: close`` upstream, so a server
answer always ends cleanly). It reads every request and response whole, so a fault can cut a
message exactly where it wants. For each request it asks the :class:`~.plan.HttpFaultPlan`, keyed
by (method, target, occurrence), and applies the answer:

* errors (503 SlowDown / 429 / 500): answered by the proxy in the service's error shape; the
  server never sees the request;
* ``reset_request``: the head and half the body (or, with no body, half the head) go to the
  server, then both sides are reset (``SO_LINGER`` 0): the server gets a torn upload and must
  not store anything;
* ``reset_response``: the server's answer is read whole; the client gets its head and half its
  body (half the head if there is no body), then a reset;
* ``lost_response``: the server's answer is read whole (a write is committed); the client gets a
  reset and nothing else;
* ``latency``: the request waits ``delay_s`` before it is relayed;
* ``stall``: the request is read and never answered; the connection is held until the client
  closes it (its timeout), or ``stall_max_s``.

``Expect: 100-continue`` is answered by the proxy itself (it needs the body to decide) and removed
upstream. Counters (:meth:`stats`): requests, faults by kind, and ``fault_ratio`` (requests given a
failing fault, latency excluded, over all requests). ``log`` keeps every decision that was a fault
as ``(method, target, occurrence, kind)``.

Embedding: ``await proxy.start()`` / ``await proxy.close()`` in a running loop, or
:class:`~ddiloco_geo.tools.faultproxy.thread.FaultProxyThread` from synchronous code. It listens on
loopback only: it has no authentication.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.faultproxy import messages
from ddiloco_geo.tools.faultproxy.plan import ERROR_KINDS, Fault, HttpFaultPlan
from ddiloco_geo.tools.wanproxy.link import abort

log = logging.getLogger(__name__)

STREAM_LIMIT_BYTES = 1024 * 1024
_ERROR_STATUS = {"slowdown_503": 503, "throttle_429": 429, "internal_500": 500}


class FaultProxy:
    """HTTP proxy to ``target_host:target_port`` that injects the faults of ``plan``."""

    def __init__(self, target_host: str, target_port: int, plan: HttpFaultPlan, *,
                 listen_host: str = "127.0.0.1", listen_port: int = 0, stall_max_s: float = 300.0) -> None:
        if listen_host not in ("127.0.0.1", "::1", "localhost"):
            raise ConfigError(f"fault proxy listen host {listen_host!r}: only loopback (it has no authentication)")
        self.target_host, self.target_port = target_host, target_port
        self.plan = plan
        self.listen_host, self.listen_port = listen_host, listen_port
        self.stall_max_s = stall_max_s
        self.occurrences: collections.Counter[tuple[str, str]] = collections.Counter()
        self.counts: collections.Counter[str] = collections.Counter()
        self.log: list[tuple[str, str, int, str]] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.listen_host, self.listen_port,
                                                  limit=STREAM_LIMIT_BYTES)
        self.listen_port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop accepting and drop every connection. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://{self.listen_host}:{self.listen_port}"

    def stats(self) -> dict:
        requests = self.counts["requests"]
        failing = sum(n for k, n in self.counts.items() if k not in ("requests", "latency"))
        return {"requests": requests, "faults": dict(sorted((k, n) for k, n in self.counts.items() if k != "requests")),
                "fault_ratio": failing / requests if requests else 0.0}

    # --- one client connection -------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            log.debug("fault_proxy_connection_ended error=%s", type(exc).__name__)
        except asyncio.CancelledError:
            pass
        finally:
            if not writer.is_closing():
                abort(writer, reset=True)
            self._tasks.discard(task)

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Relay one request (with its fault); False when the client connection is done."""
        request = await messages.read_head(reader)
        if request is None:
            return False
        method, target = request.start.split()[0], request.start.split()[1]
        if (request.header("expect") or "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        await messages.read_body(reader, request, until_eof=False)
        n = self.occurrences[(method, target)]
        self.occurrences[(method, target)] += 1
        self.counts["requests"] += 1
        fault = self.plan.decide(method, target, n)
        if fault is not None:
            self.counts[fault.kind] += 1
            self.log.append((method, target, n, fault.kind))
            log.info("fault_proxy_fault method=%s target=%s occurrence=%d kind=%s", method, target, n, fault.kind)
        keep_alive = (request.header("connection") or "").lower() != "close"
        return await self._apply(fault, method, target, request, reader, writer) and keep_alive

    async def _apply(self, fault: Fault | None, method: str, target: str, request: messages.Message,
                     reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        kind = fault.kind if fault is not None else None
        if kind in ERROR_KINDS:
            writer.write(messages.error_response(_ERROR_STATUS[kind], method, target, f"FAULT{self.counts['requests']:08d}"))
            await writer.drain()
            return True
        if kind == "stall":
            try:
                await asyncio.wait_for(reader.read(), self.stall_max_s)
            except asyncio.TimeoutError:
                pass
            abort(writer, reset=True)
            return False
        if kind == "latency":
            await asyncio.sleep(fault.delay_s)
        upstream = request.head_bytes(request.without("expect", *messages.HOP_BY_HOP) + [("Connection", "close")])
        if kind == "reset_request":
            await self._torn_upload(upstream, request.body)
            abort(writer, reset=True)
            return False
        response = await self._exchange(upstream + request.body, method)
        if response is None:  # the target refused or dropped us: the client sees a reset
            abort(writer, reset=True)
            return False
        head = response.head_bytes(response.without(*messages.HOP_BY_HOP, "content-length")
                                   + _length_header(response) + [("Connection", "keep-alive")])
        if kind == "lost_response":
            abort(writer, reset=True)
            return False
        if kind == "reset_response":
            writer.write(head + response.body[: len(response.body) // 2] if response.body else head[: len(head) // 2])
            await writer.drain()
            abort(writer, reset=True)
            return False
        writer.write(head + response.body)
        await writer.drain()
        return True

    async def _torn_upload(self, head: bytes, body: bytes) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            return
        up_writer.write(head + body[: len(body) // 2] if body else head[: len(head) // 2])
        await up_writer.drain()
        await asyncio.sleep(0.05)  # let the server read the part it got before the reset
        abort(up_writer, reset=True)

    async def _exchange(self, data: bytes, method: str) -> messages.Message | None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port,
                                                                 limit=STREAM_LIMIT_BYTES)
        except OSError:
            return None
        try:
            up_writer.write(data)
            await up_writer.drain()
            while True:
                response = await messages.read_head(up_reader)
                if response is None:
                    return None
                if not 100 <= messages.status_of(response) < 200:
                    break
            if messages.response_has_body(method, messages.status_of(response)):
                await messages.read_body(up_reader, response, until_eof=True)
            return response
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return None
        finally:
            up_writer.close()


def _length_header(response: messages.Message) -> list[tuple[str, str]]:
    if (response.header("transfer-encoding") or "").lower().endswith("chunked"):
        return []
    if response.header("content-length") is not None:
        return [("Content-Length", response.header("content-length"))]
    return [("Content-Length", str(len(response.body)))]
