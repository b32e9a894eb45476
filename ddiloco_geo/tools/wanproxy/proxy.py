"""Wide-area network emulator: an asyncio TCP proxy on loopback that adds delay and caps bandwidth.

The kernel here has no ``netem``, so the WAN between a learner and a far-away bucket is emulated in
user space. :class:`WanProxy` accepts TCP connections, opens one to the target per accepted
connection, and pumps both directions through an emulated link:

* **Serialisation (bandwidth).** Each direction of the *whole proxy* is one link of ``rate_bps``
  bits/s, shared by all of its connections (a token bucket per direction, ``burst_bytes`` deep).
  A proxy models one region-to-bucket path; parallel uploads share it, as on a real WAN, so
  opening more connections does not buy more bandwidth. ``rate_bps=None`` means unlimited.
* **Propagation (delay).** A chunk that finished serialising at ``t`` is delivered to the other side
  no earlier than ``t + delay_s + U(0, jitter_s)``; delivery stays in order (TCP), so jitter only
  ever adds delay, and a round trip costs at least ``2 * delay_s``. Jitter is drawn from a
  ``random.Random`` seeded by ``(seed, connection number, direction)``.
* **Pipelining.** Reading, serialising and delivering are separate tasks joined by a queue: while a
  chunk waits out its delay the next one is already read, so the path is a long fat pipe, not
  stop-and-wait. In-flight bytes per direction are bounded by ``window_bytes`` (default: twice the
  bandwidth-delay product, at least 1 MiB; 16 MiB when unlimited), after which the proxy stops
  reading and TCP back-pressure reaches the sender.
* **Handshake.** With ``emulate_handshake`` (default) the upstream connection is opened one round
  trip after the client's was accepted, so a fresh connection costs its RTT as on a real path;
  kept-alive connections pay it once.

Failure semantics. End-of-stream travels like data: a half-close (FIN) is delivered after the same
delay as the bytes before it, and the connection is closed once both directions have ended. A reset
or error on either side is delivered after the delay as a reset (``SO_LINGER`` 0) on the other side,
and the connection is torn down. A target that refuses the connection resets the client's.
``close()`` stops accepting, cancels every connection (peers see EOF or a reset) and is idempotent.

Embedding: ``await proxy.start()`` / ``await proxy.close()`` inside a running loop, or
:class:`~ddiloco_geo.tools.wanproxy.thread.WanProxyThread` from synchronous code. It only listens on
loopback unless told otherwise: the proxy has no authentication, so a listener on a public address
would be an open relay to the target.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from typing import Any

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.wanproxy.address import is_loopback, join_host_port
from ddiloco_geo.tools.wanproxy.link import TokenBucket, Window, abort, sleep_until

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 64 * 1024
DEFAULT_BURST_BYTES = 64 * 1024
MIN_WINDOW_BYTES = 1024 * 1024
UNLIMITED_WINDOW_BYTES = 16 * 1024 * 1024

_EOF = "eof"
_RESET = "reset"


class WanProxy:
    """TCP proxy that makes ``target_host:target_port`` look far away. See the module docstring.

    ``rate_bps`` is bits per second per direction, shared by every connection of this proxy.
    Counters (read any time): ``num_connections`` accepted, ``num_active``, ``num_failed_connects``
    (target unreachable), ``num_resets``, ``up_bytes`` (client to target) and ``down_bytes``
    (target to client) delivered.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        delay_s: float = 0.0,
        rate_bps: float | None = None,
        jitter_s: float = 0.0,
        seed: int = 0,
        burst_bytes: int = DEFAULT_BURST_BYTES,
        window_bytes: int | None = None,
        emulate_handshake: bool = True,
        allow_non_loopback: bool = False,
    ) -> None:
        if delay_s < 0 or jitter_s < 0:
            raise ConfigError(f"delay_s={delay_s} and jitter_s={jitter_s} must be >= 0 (seconds, one way)")
        if rate_bps is not None and rate_bps <= 0:
            raise ConfigError(f"rate_bps={rate_bps} must be > 0 bits/s, or None for unlimited")
        if burst_bytes < 1:
            raise ConfigError(f"burst_bytes={burst_bytes} must be >= 1 (e.g. 65536)")
        if not 0 <= int(target_port) <= 65535 or not 0 <= int(listen_port) <= 65535:
            raise ConfigError(f"ports must be in 0..65535, got target {target_port}, listen {listen_port}")
        if not allow_non_loopback and not is_loopback(listen_host):
            raise ConfigError(
                f"refusing to listen on {listen_host!r}, which is not a loopback address: the proxy has no "
                f"authentication, so anyone who can reach it could relay traffic to {target_host}:{target_port}. "
                "Listen on 127.0.0.1, or pass --allow-non-loopback (allow_non_loopback=True) if you mean it"
            )
        self.target_host = target_host
        self.target_port = int(target_port)
        self.listen_host = listen_host
        self.listen_port = int(listen_port)
        self.delay_s = float(delay_s)
        self.rate_bps = None if rate_bps is None else float(rate_bps)
        self.jitter_s = float(jitter_s)
        self.seed = seed
        self.burst_bytes = int(burst_bytes)
        self.window_bytes = int(window_bytes) if window_bytes else self._default_window()
        self.emulate_handshake = emulate_handshake

        self.num_connections = 0
        self.num_active = 0
        self.num_failed_connects = 0
        self.num_resets = 0
        self.up_bytes = 0
        self.down_bytes = 0

        self._server: asyncio.Server | None = None
        self._address: tuple[str, int] | None = None
        self._buckets: dict[str, TokenBucket | None] = {}
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._ids = itertools.count()
        self._is_closed = False
        self._closing: asyncio.Task | None = None

    def _default_window(self) -> int:
        if self.rate_bps is None:
            return UNLIMITED_WINDOW_BYTES
        bdp = self.rate_bps / 8 * (self.delay_s + self.jitter_s)
        return max(MIN_WINDOW_BYTES, int(2 * bdp))

    # lifecycle

    async def start(self) -> tuple[str, int]:
        """Listen; return the (host, port) actually bound."""
        if self._server is not None:
            raise RuntimeError("WanProxy.start() called twice")
        if self._is_closed:
            raise RuntimeError("WanProxy was closed; make a new one")
        for direction in ("up", "down"):
            self._buckets[direction] = (
                TokenBucket(self.rate_bps / 8, self.burst_bytes) if self.rate_bps else None
            )
        self._server = await asyncio.start_server(self._on_accept, self.listen_host, self.listen_port)
        host, port = self._server.sockets[0].getsockname()[:2]
        self._address = (host, port)
        log.info(
            "wanproxy_listen listen=%s target=%s:%d delay_s=%g rate_bps=%s jitter_s=%g",
            self.address_text, self.target_host, self.target_port, self.delay_s, self.rate_bps, self.jitter_s,
        )
        return self._address

    async def close(self) -> None:
        """Stop accepting, tear down every connection, wait for them. Idempotent."""
        if self._closing is None:
            self._is_closed = True
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in list(self._writers):  # connections whose task never got to run
            abort(writer, reset=False)
        self._writers.clear()
        if self._server is not None:
            await self._server.wait_closed()
        log.info("wanproxy_closed %s", " ".join(f"{k}={v}" for k, v in self.stats().items()))

    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise RuntimeError("WanProxy is not started; call start() first")
        return self._address

    @property
    def address_text(self) -> str:
        return join_host_port(*self.address)

    @property
    def url(self) -> str:
        return f"http://{self.address_text}"

    def stats(self) -> dict[str, int]:
        return {
            "num_connections": self.num_connections,
            "num_active": self.num_active,
            "num_failed_connects": self.num_failed_connects,
            "num_resets": self.num_resets,
            "up_bytes": self.up_bytes,
            "down_bytes": self.down_bytes,
        }

    # one connection

    def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback (not a coroutine) so the task is registered before close() can look.
        if self._is_closed:
            abort(writer, reset=False)
            return
        self._writers.add(writer)
        task = asyncio.get_running_loop().create_task(self._serve(next(self._ids), reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn_id: int, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        self.num_active += 1
        upstream_w: asyncio.StreamWriter | None = None
        outcome = "cancelled"
        try:
            if self.emulate_handshake:
                await asyncio.sleep(2 * self.delay_s)
            try:
                upstream_r, upstream_w = await asyncio.open_connection(self.target_host, self.target_port)
            except OSError as exc:
                self.num_failed_connects += 1
                log.warning("wanproxy_connect_failed conn=%d target=%s:%d error=%r",
                            conn_id, self.target_host, self.target_port, exc)
                outcome = _RESET
                return
            self._writers.add(upstream_w)
            log.debug("wanproxy_conn_open conn=%d peer=%s", conn_id, client_w.get_extra_info("peername"))
            outcome = await self._pump_both(conn_id, client_r, client_w, upstream_r, upstream_w)
        finally:
            is_reset = outcome == _RESET
            self.num_resets += is_reset
            for w in (client_w, upstream_w):
                if w is not None:
                    self._writers.discard(w)
                    if outcome == _EOF:
                        w.close()
                    else:
                        abort(w, reset=is_reset)
            self.num_active -= 1
            log.debug("wanproxy_conn_close conn=%d outcome=%s", conn_id, outcome)

    async def _pump_both(self, conn_id, client_r, client_w, upstream_r, upstream_w) -> str:
        """Run both directions; return ``eof`` when both ended cleanly, ``reset`` on the first error."""
        pumps = {
            asyncio.create_task(self._pump(conn_id, "up", client_r, upstream_w)),
            asyncio.create_task(self._pump(conn_id, "down", upstream_r, client_w)),
        }
        try:
            while pumps:
                done, pumps = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
                if any(t.result() == _RESET for t in done):
                    return _RESET
            return _EOF
        finally:
            for t in pumps:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, conn_id: int, direction: str, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> str:
        queue: asyncio.Queue[tuple[float, Any]] = asyncio.Queue()
        window = Window(self.window_bytes)
        rng = random.Random(f"{self.seed}:{conn_id}:{direction}")
        feeder = asyncio.create_task(self._feed(reader, queue, window, self._buckets[direction], rng))
        try:
            return await self._deliver(queue, writer, window, direction)
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)

    def _one_way_delay(self, rng: random.Random) -> float:
        return self.delay_s + (rng.uniform(0.0, self.jitter_s) if self.jitter_s else 0.0)

    async def _feed(self, reader, queue, window, bucket, rng) -> None:
        """Read, serialise (token bucket), and stamp each piece with its delivery time."""
        loop = asyncio.get_running_loop()
        release = 0.0
        end: str = _EOF
        try:
            while data := await reader.read(READ_CHUNK_BYTES):
                view = memoryview(data)
                for start in range(0, len(view), self.burst_bytes):
                    piece = bytes(view[start:start + self.burst_bytes])
                    await window.acquire(len(piece))
                    if bucket is not None:
                        await bucket.take(len(piece))
                    release = max(release, loop.time() + self._one_way_delay(rng))
                    queue.put_nowait((release, piece))
        except OSError:  # ConnectionResetError and friends
            end = _RESET
        queue.put_nowait((max(release, loop.time() + self._one_way_delay(rng)), end))

    async def _deliver(self, queue, writer: asyncio.StreamWriter, window: Window, direction: str) -> str:
        while True:
            release, item = await queue.get()
            await sleep_until(release)
            try:
                if item == _RESET:
                    return _RESET
                if item == _EOF:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return _EOF
                writer.write(item)
                await writer.drain()
            except OSError:
                return _RESET
            window.release(len(item))
            if direction == "up":
                self.up_bytes += len(item)
            else:
                self.down_bytes += len(item)

