"""A :class:`~ddiloco_geo.tools.wanproxy.proxy.WanProxy` for synchronous code: its own event loop in a
daemon thread (what ``chaos`` and the overhead benchmark use)::

    with WanProxyThread("127.0.0.1", s3_port, delay_s=0.05, rate_bps=10e6) as proxy:
        boto3.client("s3", endpoint_url=proxy.url, ...)
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from ddiloco_geo.tools.wanproxy.proxy import WanProxy


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

