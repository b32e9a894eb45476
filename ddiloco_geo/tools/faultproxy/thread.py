"""A :class:`~ddiloco_geo.tools.faultproxy.proxy.FaultProxy` for synchronous code (tests, a job
orchestrator): its own event loop in a daemon thread::

    plan = HttpFaultPlan(seed=7, rate=0.1)
    with FaultProxyThread("127.0.0.1", moto_port, plan) as proxy:
        cfg = cfg.model_copy(update={"endpoint_url": proxy.url})
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

from ddiloco_geo.tools.faultproxy.plan import HttpFaultPlan
from ddiloco_geo.tools.faultproxy.proxy import FaultProxy


class FaultProxyThread:
    """A :class:`FaultProxy` on its own loop in a daemon thread. ``start()`` returns once it
    listens; ``stop()`` drops every connection and joins the thread (idempotent). :meth:`stats`
    and :meth:`log` are read on the proxy's loop, so they are consistent snapshots."""

    def __init__(self, target_host: str, target_port: int, plan: HttpFaultPlan, **kwargs: Any) -> None:
        self.proxy = FaultProxy(target_host, target_port, plan, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._started = False

    def start(self, timeout_s: float = 10.0) -> FaultProxyThread:
        if self._started:
            raise RuntimeError("FaultProxyThread.start() called twice")
        self._started = True
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self._loop).result(timeout_s)
        return self

    def _on_loop(self, fn: Any, timeout_s: float = 10.0) -> Any:
        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout_s)

    def stats(self) -> dict:
        return self._on_loop(self.proxy.stats)

    def log(self) -> list[tuple[str, str, int, str]]:
        return self._on_loop(lambda: list(self.proxy.log))

    def set_plan(self, plan: HttpFaultPlan) -> None:
        """Decide the following requests by ``plan`` (occurrence counts carry on)."""
        def swap() -> None:
            self.proxy.plan = plan

        self._on_loop(swap)

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.proxy.close(), self._loop).result(timeout_s)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> FaultProxyThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return self.proxy.url
