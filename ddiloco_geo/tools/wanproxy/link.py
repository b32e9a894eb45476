"""The emulated link's parts: a shared token bucket (bandwidth), an in-flight window (back-pressure),
a "no earlier than" sleep (delay) and an abort that can reset (failure).

Pure asyncio, no sockets of their own; :class:`~ddiloco_geo.tools.wanproxy.proxy.WanProxy` puts
them together per direction of every connection.
"""

from __future__ import annotations

import asyncio
import socket
import struct


class TokenBucket:
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
            await sleep_until(now - self._tokens / self._rate)


class Window:
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


async def sleep_until(deadline: float) -> None:
    # asyncio may fire a timer up to one clock resolution early; "no earlier than" is the contract.
    loop = asyncio.get_running_loop()
    while (remaining := deadline - loop.time()) > 0:
        await asyncio.sleep(remaining)


def abort(writer: asyncio.StreamWriter, *, reset: bool) -> None:
    """Close a socket now; with ``reset`` the peer sees RST rather than FIN."""
    if reset:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
    writer.transport.abort()

