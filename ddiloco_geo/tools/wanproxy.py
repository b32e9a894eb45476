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
:class:`WanProxyThread` from synchronous code (its own loop in a daemon thread)::

    with WanProxyThread("127.0.0.1", s3_port, delay_s=0.05, rate_bps=10e6) as proxy:
        boto3.client("s3", endpoint_url=proxy.url, ...)

The CLI subcommand ``ddiloco-geo wan-proxy`` runs one until SIGINT/SIGTERM. It only listens on
loopback unless told otherwise: the proxy has no authentication, so a listener on a public address
would be an open relay to the target.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import itertools
import json
import logging
import random
import signal
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from ddiloco_geo.core.errors import ConfigError

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 64 * 1024
DEFAULT_BURST_BYTES = 64 * 1024
MIN_WINDOW_BYTES = 1024 * 1024
UNLIMITED_WINDOW_BYTES = 16 * 1024 * 1024

_EOF = "eof"
_RESET = "reset"


# --- the emulated link ---------------------------------------------------------------------------


class _TokenBucket:
    """Paces bytes at ``rate_bytes_s`` with bursts of at most ``burst_bytes``.

    Deficit form: a caller takes its bytes at once and sleeps off any debt, so concurrent callers
    queue up behind each other's reservations (a shared link, served in arrival order)."""

    def __init__(self, rate_bytes_s: float, burst_bytes: int) -> None:
        self._rate = rate_bytes_s
        self._burst = float(burst_bytes)
        self._tokens = float(burst_bytes)
        self._stamp: float | None = None

    async def take(self, num_bytes: int) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._stamp is not None:
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        self._tokens -= num_bytes
        if self._tokens < 0:
            await _sleep_until(now - self._tokens / self._rate)


class _Window:
    """Bytes in flight in one direction (read but not yet written to the far side).

    One acquirer (the direction's reader task); a chunk bigger than the window passes alone."""

    def __init__(self, capacity_bytes: int) -> None:
        self._capacity = capacity_bytes
        self._used = 0
        self._freed = asyncio.Event()

    async def acquire(self, num_bytes: int) -> None:
        while self._used and self._used + num_bytes > self._capacity:
            self._freed.clear()
            await self._freed.wait()
        self._used += num_bytes

    def release(self, num_bytes: int) -> None:
        self._used -= num_bytes
        self._freed.set()


async def _sleep_until(deadline: float) -> None:
    # asyncio may fire a timer up to one clock resolution early; "no earlier than" is the contract.
    loop = asyncio.get_running_loop()
    while (remaining := deadline - loop.time()) > 0:
        await asyncio.sleep(remaining)


def _abort(writer: asyncio.StreamWriter, *, reset: bool) -> None:
    """Close a socket now; with ``reset`` the peer sees RST rather than FIN."""
    if reset:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
    writer.transport.abort()


# --- the proxy -----------------------------------------------------------------------------------


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
        self._buckets: dict[str, _TokenBucket | None] = {}
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
                _TokenBucket(self.rate_bps / 8, self.burst_bytes) if self.rate_bps else None
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
            _abort(writer, reset=False)
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
        return _join_host_port(*self.address)

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
            _abort(writer, reset=False)
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
                        _abort(w, reset=is_reset)
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
        window = _Window(self.window_bytes)
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

    async def _deliver(self, queue, writer: asyncio.StreamWriter, window: _Window, direction: str) -> str:
        while True:
            release, item = await queue.get()
            await _sleep_until(release)
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


# --- synchronous embedding -----------------------------------------------------------------------


class WanProxyThread:
    """A :class:`WanProxy` on its own event loop in a daemon thread, for synchronous code.

    Same arguments as :class:`WanProxy`. ``start()`` returns once it listens (raising what the
    proxy raised if it could not); ``stop()`` closes every connection and joins the thread."""

    def __init__(self, target_host: str, target_port: int, **kwargs: Any) -> None:
        self.proxy = WanProxy(target_host, target_port, **kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout_s: float = 10.0) -> WanProxyThread:
        if self._thread is not None:
            raise RuntimeError("WanProxyThread.start() called twice")
        self._thread = threading.Thread(target=self._main, name="wan-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"wan proxy did not start listening within {timeout_s} s")
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def _main(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            try:
                loop.run_until_complete(self.proxy.start())
            except BaseException as exc:  # handed to start()'s caller
                self._error = exc
                return
            finally:
                self._ready.set()
            loop.run_forever()
            loop.run_until_complete(self.proxy.close())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the proxy and join its thread. Idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or not thread.is_alive() or loop is None:
            return
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # loop already closed
            pass
        thread.join(timeout_s)

    def __enter__(self) -> WanProxyThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def address(self) -> tuple[str, int]:
        return self.proxy.address

    @property
    def url(self) -> str:
        return self.proxy.url

    def stats(self) -> dict[str, int]:
        return self.proxy.stats()


# --- addresses -----------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{what} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9000 (IPv6: [::1]:9000)")
    return host.strip("[]"), int(port)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- `wan-proxy` subcommand ----------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, metavar="HOST:PORT", help="where to relay, e.g. 127.0.0.1:9000")
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where to listen (default 127.0.0.1:0, a free port)")
    p.add_argument("--delay-ms", type=float, default=50.0, help="one-way delay in ms (default 50; RTT is twice)")
    p.add_argument("--rate-mbit", type=float, default=20.0,
                   help="bandwidth per direction in Mbit/s, shared by all connections (default 20; 0 = unlimited)")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="extra one-way delay, uniform in [0, J] ms (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the jitter (default 0)")
    p.add_argument("--allow-non-loopback", action="store_true",
                   help="allow --listen on a non-loopback address (the proxy has no authentication)")


def run(args: argparse.Namespace) -> int:
    target_host, target_port = parse_host_port(args.target, "--target")
    listen_host, listen_port = parse_host_port(args.listen, "--listen")
    if args.rate_mbit < 0:
        raise ConfigError(f"--rate-mbit {args.rate_mbit}: must be >= 0 (0 = unlimited)")
    proxy = WanProxy(
        target_host, target_port,
        listen_host=listen_host, listen_port=listen_port,
        delay_s=args.delay_ms / 1000, rate_bps=args.rate_mbit * 1e6 or None,
        jitter_s=args.jitter_ms / 1000, seed=args.seed,
        allow_non_loopback=args.allow_non_loopback,
    )
    asyncio.run(_serve_until_signal(proxy, args))
    return 0


async def _serve_until_signal(proxy: WanProxy, args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await proxy.start()
    _emit(args.json, {
        "listen": proxy.address_text, "url": proxy.url, "target": _join_host_port(proxy.target_host, proxy.target_port),
        "delay_ms": args.delay_ms, "rate_mbit": args.rate_mbit or None, "jitter_ms": args.jitter_ms,
    }, lambda d: f"{d['url']} -> {d['target']} delay_ms={d['delay_ms']:g} rate_mbit={d['rate_mbit']} "
                 f"jitter_ms={d['jitter_ms']:g} (Ctrl-C to stop)")
    try:
        await stop.wait()
    finally:
        await proxy.close()
    _emit(args.json, proxy.stats(), lambda d: " ".join(f"{k}={v}" for k, v in d.items()))


def _emit(as_json: bool, record: dict[str, Any], text: Callable[[dict[str, Any]], str]) -> None:
    print(json.dumps(record) if as_json else text(record), flush=True)
