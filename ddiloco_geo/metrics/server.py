"""The ``/metrics`` and ``/healthz`` HTTP endpoint of one learner or syncer process.

:class:`MetricsServer` runs an aiohttp app on its own daemon thread and event loop, so a blocked
training step never delays a scrape. ``GET /metrics`` is ``prometheus_client``'s aiohttp handler
over the component's :class:`~ddiloco_geo.metrics.registry.Registry`: the text format 0.0.4 by
default, OpenMetrics when the scraper asks for it in ``Accept``, gzip when it accepts it.
``GET /healthz`` is ours: the service's health callable as JSON, ``200`` when its ``"ok"`` is
truthy, else ``503``; a callable that raises is itself unhealthy (``503``), never a ``500``.

The endpoint has no authentication: it binds only loopback hosts (``127.0.0.1`` when the address
leaves the host out) unless ``allow_non_loopback=True`` (scrape through an SSH tunnel or a sidecar
instead). A port that cannot be bound is a ``ConfigError``. ``stop()`` is idempotent, returns
within about a second even with idle keep-alive connections open, and a stopped server cannot be
restarted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import threading
from typing import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.aiohttp import make_aiohttp_handler

from ddiloco_geo.core.config import MetricsConfig
from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.metrics.registry import Registry

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what /metrics answers a scraper that asks for no format
DEFAULT_HOST = "127.0.0.1"


def parse_address(address: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port``, ``:port`` or ``port`` -> (host, port); the host defaults to 127.0.0.1."""
    text = address.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ConfigError(f"metrics.address={address!r}: expected '[IPv6]:PORT', e.g. '[::1]:9400'")
    elif ":" in text:
        host, _, port = text.rpartition(":")
    else:
        host, port = "", text
    try:
        port_num = int(port)
    except ValueError:
        port_num = -1
    if not 0 <= port_num <= 65535:
        raise ConfigError(f"metrics.address={address!r}: expected HOST:PORT with PORT 0-65535, e.g. '127.0.0.1:9400'")
    return host or DEFAULT_HOST, port_num


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class MetricsServer:
    """``GET /metrics`` and ``GET /healthz`` on a daemon thread with its own event loop."""

    def __init__(self, registry: Registry, address: str, health: Callable[[], dict] | None = None,
                 *, allow_non_loopback: bool = False, shutdown_timeout_s: float = 1.0) -> None:
        self.host, self.port = parse_address(address)
        if self.host.lower() == "localhost":
            self.host = DEFAULT_HOST  # one socket: "localhost" with port 0 could bind ::1 and 127.0.0.1 apart
        if not allow_non_loopback and not is_loopback(self.host):
            raise ConfigError(
                f"metrics.address={address!r} binds non-loopback host {self.host!r}, but the metrics and "
                "health endpoints have no authentication; use 127.0.0.1:PORT and scrape through a tunnel "
                "or sidecar, or pass allow_non_loopback=True if the network is private"
            )
        self.registry = registry
        self.health = health
        self.shutdown_timeout_s = shutdown_timeout_s
        self._lock = threading.Lock()
        self._state = "new"  # new -> running -> stopped
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._bound: tuple[str, int] | None = None
        self._stop_event: asyncio.Event | None = None  # created on the server's loop

    # -- handlers (run on the server's loop)

    async def _healthz(self, request: web.Request) -> web.Response:
        try:
            report = dict(self.health()) if self.health is not None else {"ok": True}
        except Exception as exc:  # a broken health check is itself unhealthy, never a 500
            log.warning("health_check_failed error=%r", exc)
            report = {"ok": False, "error": repr(exc)}
        status = 200 if report.get("ok") else 503
        return web.Response(text=json.dumps(report, default=str), status=status, content_type="application/json")

    # -- lifecycle

    def start(self) -> tuple[str, int]:
        """Bind and serve; returns the bound (host, port). Port 0 picks a free port."""
        with self._lock:
            if self._state == "running":
                assert self._bound is not None
                return self._bound
            if self._state == "stopped":
                raise RuntimeError("MetricsServer cannot be restarted after stop(); create a new one")
            ready = threading.Event()
            failure: list[BaseException] = []
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._serve, args=(ready, failure),
                                            name="ddiloco-metrics", daemon=True)
            self._thread.start()
            ready.wait()
            if failure:
                self._thread.join()
                self._state = "stopped"
                raise ConfigError(
                    f"metrics server cannot bind {self.host}:{self.port}: {failure[0]}; "
                    "choose a free port (or port 0) for metrics.address"
                ) from failure[0]
            self._state = "running"
            assert self._bound is not None
            log.info("metrics_server_started host=%s port=%d", *self._bound)
            return self._bound

    def _serve(self, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._run(ready))
        except BaseException as exc:  # a bind failure; start() reports it
            failure.append(exc)
        finally:
            ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _run(self, ready: threading.Event) -> None:
        """Serve until stop(); then close the site, the open connections and every leftover task."""
        self._stop_event = asyncio.Event()
        try:
            await self._setup()
            ready.set()
            await self._stop_event.wait()
        finally:
            if self._runner is not None:
                # Let connections the kernel has already accepted reach their protocol before the
                # listener closes: on Python 3.11 a connection accepted in the same loop turn as
                # Server.close() fails transport creation and leaks its socket.
                await asyncio.sleep(0.01)
                for _ in range(3):
                    await asyncio.sleep(0)
                await self._runner.cleanup()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for _ in range(3):  # let closed transports run their connection_lost callbacks
                await asyncio.sleep(0)

    async def _setup(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", make_aiohttp_handler(self.registry))
        app.router.add_get("/healthz", self._healthz)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=self.shutdown_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockname = self._runner.addresses[0]
        self._bound = (sockname[0], sockname[1])

    def stop(self) -> None:
        """Stop serving and join the thread. Idempotent; safe before start()."""
        with self._lock:
            if self._state != "running":
                self._state = "stopped"
                return
            self._state = "stopped"
            loop, thread = self._loop, self._thread
        assert loop is not None and thread is not None and self._stop_event is not None
        try:
            loop.call_soon_threadsafe(self._stop_event.set)
        except RuntimeError:  # the loop already closed: nothing left to stop
            pass
        thread.join(timeout=self.shutdown_timeout_s + 5.0)
        if thread.is_alive():
            log.warning("metrics_server_stop_timeout timeout_s=%.1f", self.shutdown_timeout_s + 5.0)
        log.info("metrics_server_stopped host=%s port=%d", self.host, self._bound[1] if self._bound else self.port)

    @property
    def address(self) -> tuple[str, int] | None:
        return self._bound

    def __enter__(self) -> "MetricsServer":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def serve_from_config(cfg: MetricsConfig, registry: Registry, health: Callable[[], dict] | None = None,
                      *, allow_non_loopback: bool = False) -> MetricsServer | None:
    """Start a server for ``metrics.address``; None (and nothing started) when it is unset."""
    if cfg.address is None:
        return None
    server = MetricsServer(registry, cfg.address, health, allow_non_loopback=allow_non_loopback)
    server.start()
    return server
