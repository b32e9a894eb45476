"""moto's S3 server with conditional writes that are atomic, as on S3.

moto 5 answers a PutObject with ``If-Match`` / ``If-None-Match`` by checking the ETag and then
storing the object, two steps with no lock between them: under CPU load two writers holding the
same ETag can both win (seen as ``round 7: winners [2, 5]`` in ``tests/storage/test_race.py``).
S3, LocalStack and the GCS server decide a conditional write atomically, and the bucket protocol
depends on it (one commit per version). So every server this project starts for tests, chaos and
benchmarks runs moto with its object writes and deletes serialised by one lock: ``threaded()`` for
an in-process server, ``python -m ddiloco_geo.tools.motoserver`` (moto.server's arguments) for a
child process.
"""

from __future__ import annotations

import functools
import threading

_LOCK = threading.Lock()


def make_writes_atomic() -> None:
    """Serialise moto's PutObject and DeleteObject handlers (idempotent)."""
    from moto.s3.responses import S3Response

    for name in ("put_object", "delete_object"):
        handler = getattr(S3Response, name)
        if getattr(handler, "_ddiloco_atomic", False):
            continue

        def locked(self, _handler=handler):
            with _LOCK:
                return _handler(self)

        functools.update_wrapper(locked, handler)
        locked._ddiloco_atomic = True  # type: ignore[attr-defined]
        setattr(S3Response, name, locked)


def threaded(**kwargs):
    """A started-later ``moto.server.ThreadedMotoServer`` with atomic conditional writes."""
    from moto.server import ThreadedMotoServer

    make_writes_atomic()
    return ThreadedMotoServer(**kwargs)


def main() -> None:
    make_writes_atomic()
    from moto.server import main as moto_main

    moto_main()


if __name__ == "__main__":
    main()
