"""Storage: the one place that talks to fsspec, boto and gcsfs, translates errors and retries.

The contract (operations, conditional writes, failure semantics) is in :mod:`.store`. Modules:

* :mod:`.store`: :class:`Store`, :func:`open_store`, :func:`make_backend`
* :mod:`.keys`: valid keys and prefixes, bucket URLs
* :mod:`.translate`: backend exceptions -> :mod:`ddiloco_geo.core.errors`, credential scrubbing
* :mod:`.retry`: the attempt loop (tenacity, full jitter), the retry classifier
* :mod:`.stats`: :class:`StoreStats`
* :mod:`.backend`: the raw :class:`Backend` interface
* :mod:`.local`, :mod:`.memory`, :mod:`.s3`, :mod:`.gcs`: one backend each
* :mod:`.faults`: deterministic fault injection (:class:`FaultPlan`)

This facade re-exports the public API, so callers write ``from ddiloco_geo.storage import Store``.
"""

from ddiloco_geo.storage.backend import Backend
from ddiloco_geo.storage.faults import FAULT_KINDS, OPS, PUT_OPS, FaultInjectingBackend, FaultPlan
from ddiloco_geo.storage.gcs import GCSBackend
from ddiloco_geo.storage.keys import RESERVED_PREFIX, check_key, check_prefix
from ddiloco_geo.storage.local import LocalBackend
from ddiloco_geo.storage.memory import MemoryBackend
from ddiloco_geo.storage.retry import RetryPolicy
from ddiloco_geo.storage.s3 import S3Backend
from ddiloco_geo.storage.stats import StoreStats
from ddiloco_geo.storage.store import Store, make_backend, open_store
from ddiloco_geo.storage.translate import register_secret, safe_url, scrub, translate

__all__ = [
    "FAULT_KINDS", "OPS", "PUT_OPS", "RESERVED_PREFIX",
    "Backend", "FaultInjectingBackend", "FaultPlan", "GCSBackend", "LocalBackend", "MemoryBackend",
    "RetryPolicy", "S3Backend", "Store", "StoreStats",
    "check_key", "check_prefix", "make_backend", "open_store", "register_secret", "safe_url", "scrub",
    "translate",
]
