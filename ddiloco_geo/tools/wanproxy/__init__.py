"""Wide-area network emulator: a TCP proxy on loopback that adds delay and caps bandwidth.

The kernel here has no ``netem``, so the WAN between a learner and a far-away bucket is emulated in
user space:

- :mod:`~ddiloco_geo.tools.wanproxy.proxy`: :class:`WanProxy`, the asyncio proxy (one shared link
  per direction, propagation delay with jitter, pipelining, handshake cost) and its failure
  semantics;
- :mod:`~ddiloco_geo.tools.wanproxy.link`: the link's parts (token bucket, in-flight window, abort);
- :mod:`~ddiloco_geo.tools.wanproxy.thread`: :class:`WanProxyThread`, a proxy on its own loop in a
  daemon thread for synchronous code (``chaos``, the overhead benchmark);
- :mod:`~ddiloco_geo.tools.wanproxy.address`: ``HOST:PORT`` handling and the loopback check.

``ddiloco-geo wan-proxy`` (:mod:`ddiloco_geo.cli.wan_proxy`) runs one until SIGINT/SIGTERM.
"""

from ddiloco_geo.tools.wanproxy.address import is_loopback, join_host_port, parse_host_port
from ddiloco_geo.tools.wanproxy.link import abort
from ddiloco_geo.tools.wanproxy.proxy import WanProxy
from ddiloco_geo.tools.wanproxy.thread import WanProxyThread

__all__ = ["WanProxy", "WanProxyThread", "abort", "is_loopback", "join_host_port", "parse_host_port"]
