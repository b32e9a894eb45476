"""Fault proxy: an HTTP/1.1 proxy on loopback, in front of a real storage server (moto, LocalStack,
fake-gcs-server), that injects the faults a real network and a real service produce, from a seed.

Where :mod:`ddiloco_geo.storage.faults` raises errors inside the client, this proxy breaks the
wire: torn uploads the server really receives, error answers in the service's own shape, answers
lost after the server committed a write, latency spikes and stalled connections that only the
client's timeout ends. Decisions are a pure function of (seed, method, target, occurrence).

- :mod:`~ddiloco_geo.tools.faultproxy.plan`: :class:`HttpFaultPlan`, which request fails and how;
- :mod:`~ddiloco_geo.tools.faultproxy.messages`: reading HTTP messages raw, the S3/GCS error bodies;
- :mod:`~ddiloco_geo.tools.faultproxy.proxy`: :class:`FaultProxy`, the asyncio proxy and what each
  fault does on the wire;
- :mod:`~ddiloco_geo.tools.faultproxy.thread`: :class:`FaultProxyThread` for synchronous code.
"""

from ddiloco_geo.tools.faultproxy.plan import ANSWER_LOSING_KINDS, FAULT_KINDS, Fault, HttpFaultPlan
from ddiloco_geo.tools.faultproxy.proxy import FaultProxy
from ddiloco_geo.tools.faultproxy.thread import FaultProxyThread

__all__ = ["ANSWER_LOSING_KINDS", "FAULT_KINDS", "Fault", "FaultProxy", "FaultProxyThread", "HttpFaultPlan"]
