"""The local backend: a directory on a POSIX filesystem (``file://DIR`` or a plain path).

Create = temp file + fsync + ``os.link`` (atomic, fails if the name exists; readers never see a
partial object). CAS = ``fcntl.flock`` on a per-key lock file under ``.ddiloco-locks/``, compare
the BLAKE3 of the current content, temp file + ``os.replace``. Safe across threads and processes
on one host (not across hosts sharing an NFS mount).

Hidden ``.ddiloco-`` names are temp files (next to their object, so that link/replace stay on one
filesystem) and ``.ddiloco-locks/`` at the root (one CAS lock file per pointer key; kept forever,
since unlinking a lock file races with lockers). Listings skip them. Delete prunes directories it
empties, so a deleted tree leaves nothing behind.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import uuid

from ddiloco_geo.core.errors import PreconditionFailedError
from ddiloco_geo.storage.backend import Backend, filter_keys, hash_token
from ddiloco_geo.storage.keys import RESERVED_PREFIX


class LocalBackend(Backend):
    """A directory on a POSIX filesystem; see the module docstring for the layout and the locking."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = f"file://{self.root}"
        self.lock_dir = os.path.join(self.root, f"{RESERVED_PREFIX}locks")
        os.makedirs(self.lock_dir, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _temp(self, path: str, data: bytes) -> str:
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f"{RESERVED_PREFIX}tmp-{name}-{uuid.uuid4().hex}")
        for _ in range(10):  # a concurrent delete may prune the directory between the two calls
            os.makedirs(directory, exist_ok=True)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileNotFoundError:
                continue
        else:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        return tmp

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        tmp = self._temp(path, data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def get(self, key: str, start: int, end: int | None) -> bytes:
        with open(self._path(key), "rb") as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(max(0, end - start))

    def read_token(self, key: str) -> tuple[bytes, str]:
        with open(self._path(key), "rb") as f:
            data = f.read()
        return data, hash_token(data)

    def cas(self, key: str, data: bytes, token: str | None) -> str:
        path = self._path(key)
        lock_name = hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock"
        lock_fd = os.open(os.path.join(self.lock_dir, lock_name), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                with open(path, "rb") as f:
                    current: str | None = hash_token(f.read())
            except FileNotFoundError:
                current = None
            if current != token:
                state = "exists" if token is None else ("is gone" if current is None else "changed")
                raise PreconditionFailedError(f"cas {key!r}: object {state} since the token was read")
            tmp = self._temp(path, data)
            try:
                if token is None:
                    os.link(tmp, path)  # also loses against a concurrent put_if_absent
                else:
                    os.replace(tmp, path)
                    tmp = ""
            except FileExistsError:
                raise PreconditionFailedError(f"cas {key!r}: object was created concurrently") from None
            finally:
                if tmp:
                    os.unlink(tmp)
            return hash_token(data)
        finally:
            os.close(lock_fd)  # releases the flock

    def list(self, prefix: str, start_after: str | None, limit: int | None) -> list[str]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self._path(base) if base else self.root
        keys = []
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if not d.startswith(RESERVED_PREFIX)]
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            rel = "" if rel == "." else rel + "/"
            keys += [rel + n for n in filenames if not n.startswith(RESERVED_PREFIX)]
        return filter_keys(keys, prefix, start_after, limit)

    def list_prefixes(self, prefix: str) -> list[str]:
        base, _, stem = prefix.rpartition("/")
        top = self._path(base) if base else self.root
        head = base + "/" if base else ""
        try:
            entries = sorted(os.scandir(top), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [
            f"{head}{e.name}/" for e in entries
            if e.name.startswith(stem) and not e.name.startswith(RESERVED_PREFIX)
            and e.is_dir(follow_symlinks=False) and self._has_object(e.path)
        ]

    @staticmethod
    def _has_object(directory: str) -> bool:
        # S3 shows a prefix only while an object lives under it; emptied directories stay here.
        for _, dirnames, filenames in os.walk(directory):
            dirnames[:] = [d for d in dirnames if not d.startswith(RESERVED_PREFIX)]
            if any(not n.startswith(RESERVED_PREFIX) for n in filenames):
                return True
        return False

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        directory = os.path.dirname(path)
        while directory != self.root and directory.startswith(self.root + os.sep):
            try:
                os.rmdir(directory)  # only succeeds on an empty directory
            except OSError:
                break
            directory = os.path.dirname(directory)

    def torn_write(self, key: str, data: bytes) -> None:
        self._temp(self._path(key), data[: len(data) // 2])  # the stray temp file stays
