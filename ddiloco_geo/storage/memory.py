"""The memory backend (``memory://NAME``): fsspec's process-wide MemoryFileSystem, for tests and demos.

Every store opened on the same name in one process sees the same objects, so a syncer and learners
running as threads share a bucket; a unique name per test keeps tests apart. One process-wide
lock makes create and CAS atomic; the version token is the BLAKE3 of the content.
"""

from __future__ import annotations

import threading

from fsspec.implementations.memory import MemoryFileSystem

from ddiloco_geo.core.errors import PreconditionFailedError
from ddiloco_geo.storage.backend import Backend, common_prefixes, filter_keys, hash_token


_MEMORY_LOCK = threading.RLock()


class MemoryBackend(Backend):
    """fsspec's process-wide MemoryFileSystem; one lock makes create and CAS atomic."""

    def __init__(self, name: str) -> None:
        self.fs = MemoryFileSystem()
        self.root = MemoryFileSystem._strip_protocol(f"memory://{name}").rstrip("/")
        self.url = f"memory://{self.root.lstrip('/')}"

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _exists(self, path: str) -> bool:
        return path in self.fs.store

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        with _MEMORY_LOCK:
            if self._exists(path):
                return False
            self.fs.pipe_file(path, bytes(data))
            return True

    def get(self, key: str, start: int, end: int | None) -> bytes:
        with _MEMORY_LOCK:
            data = self.fs.cat_file(self._path(key))
        return data[start:end]

    def read_token(self, key: str) -> tuple[bytes, str]:
        with _MEMORY_LOCK:
            data = self.fs.cat_file(self._path(key))
        return data, hash_token(data)

    def cas(self, key: str, data: bytes, token: str | None) -> str:
        path = self._path(key)
        with _MEMORY_LOCK:
            current = hash_token(self.fs.cat_file(path)) if self._exists(path) else None
            if current != token:
                raise PreconditionFailedError(f"cas {key!r}: object changed since the token was read")
            self.fs.pipe_file(path, bytes(data))
        return hash_token(data)

    def list(self, prefix: str, start_after: str | None, limit: int | None) -> list[str]:
        head = self.root + "/"
        with _MEMORY_LOCK:
            keys = [p[len(head):] for p in self.fs.store if p.startswith(head + prefix)]
        return filter_keys(keys, prefix, start_after, limit)

    def list_prefixes(self, prefix: str) -> list[str]:
        return common_prefixes(self.list(prefix, None, None), prefix)

    def delete(self, key: str) -> None:
        with _MEMORY_LOCK:
            if self._exists(self._path(key)):
                self.fs.rm_file(self._path(key))

