"""The GCS backend (``gs://BUCKET/PREFIX``): Google Cloud Storage, or fake-gcs-server, over gcsfs's session.

Raw JSON API calls through gcsfs's authenticated session. Create and CAS are single-request
(multipart) uploads with ``ifGenerationMatch=0`` (create) or ``=<generation>`` (replace); the
token is the object generation. Resumable uploads are never used: emulators ignore preconditions
there. gcsfs maps a 412 to ``FileExistsError`` (create: "already exists"; CAS: lost) and a 404 to
``FileNotFoundError``. A range starting past the end (416) reads as empty.

Requests go through gcsfs's undecorated ``_request`` so that gcsfs's own retry loop (up to six
attempts with sleeps up to 32 s) does not stack under the store's: retries happen once.
"""

from __future__ import annotations

import json
import os
from typing import Any

from fsspec.asyn import sync

from ddiloco_geo.core.config import StorageConfig
from ddiloco_geo.core.errors import PreconditionFailedError
from ddiloco_geo.storage.backend import Backend, filter_keys
from ddiloco_geo.storage.keys import split_bucket
from ddiloco_geo.storage.translate import status_and_code


class GCSBackend(Backend):
    """Google Cloud Storage (or fake-gcs-server) through gcsfs's authenticated JSON API session."""

    def __init__(self, cfg: StorageConfig) -> None:
        # gcsfs reads this at import; imported here, so that only GCS runs pay for gcsfs and aiohttp.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        import aiohttp
        import gcsfs

        self.bucket, self.prefix = split_bucket(cfg.url, "gs://")
        self.url = f"gs://{self.bucket}/{self.prefix}".rstrip("/")
        kwargs: dict[str, Any] = {
            "requests_timeout": aiohttp.ClientTimeout(total=cfg.timeout_s),
            "skip_instance_cache": True,
            "use_listings_cache": False,
        }
        if cfg.endpoint_url:
            kwargs["endpoint_url"] = cfg.endpoint_url.rstrip("/")
        if cfg.anonymous:
            kwargs["token"] = "anon"
        self.fs = gcsfs.GCSFileSystem(project="ddiloco", **kwargs)
        self._raw_request = gcsfs.GCSFileSystem._request.__wrapped__
        self._quote = gcsfs.core.quote

    def _request(self, method: str, path: str, *args: Any, **kwargs: Any) -> tuple[int, Any, bytes]:
        async def call() -> tuple[int, Any, bytes]:
            status, headers, _info, contents = await self._raw_request(self.fs, method, path, *args, **kwargs)
            return status, headers, contents

        return sync(self.fs.loop, call)

    def _name(self, key: str) -> str:
        return self.prefix + key

    def _upload(self, key: str, data: bytes, generation: str) -> dict:
        meta = json.dumps({"name": self._name(key)})
        body = (
            b'--==0==\nContent-Type: application/json; charset=UTF-8\n\n' + meta.encode()
            + b"\n--==0==\nContent-Type: application/octet-stream\n\n" + bytes(data) + b"\n--==0==--"
        )
        url = f"{self.fs._location}/upload/storage/v1/b/{self._quote(self.bucket)}/o"
        _, _, contents = self._request(
            "POST", url, uploadType="multipart", ifGenerationMatch=generation,
            headers={"Content-Type": 'multipart/related; boundary="==0=="'}, data=body,
        )
        return json.loads(contents)

    def create(self, key: str, data: bytes) -> bool:
        try:
            self._upload(key, data, "0")
            return True
        except FileExistsError:  # gcsfs maps 412 to FileExistsError
            return False

    def _media(self, key: str, headers: dict[str, str] | None = None) -> tuple[bytes, Any]:
        _, resp_headers, contents = self._request(
            "GET", "b/{}/o/{}", self.bucket, self._name(key), alt="media", headers=headers,
        )
        return contents, resp_headers

    def get(self, key: str, start: int, end: int | None) -> bytes:
        if end is not None and end <= start:
            self._request("GET", "b/{}/o/{}", self.bucket, self._name(key))
            return b""
        if start == 0 and end is None:
            return self._media(key)[0]
        rng = f"bytes={start}-" + ("" if end is None else str(end - 1))
        try:
            return self._media(key, {"Range": rng})[0]
        except Exception as exc:
            if status_and_code(exc)[0] == 416:
                return b""
            raise

    def read_token(self, key: str) -> tuple[bytes, str]:
        data, headers = self._media(key)
        generation = headers.get("x-goog-generation")
        if generation:
            return data, str(generation)
        # No generation header: read metadata, then exactly that generation.
        _, _, meta = self._request("GET", "b/{}/o/{}", self.bucket, self._name(key))
        generation = str(json.loads(meta)["generation"])
        _, _, data = self._request(
            "GET", "b/{}/o/{}", self.bucket, self._name(key), alt="media", generation=generation,
        )
        return data, generation

    def cas(self, key: str, data: bytes, token: str | None) -> str:
        try:
            return str(self._upload(key, data, "0" if token is None else token)["generation"])
        except FileExistsError:
            raise PreconditionFailedError(f"cas {key!r}: object changed since the token was read") from None
        except FileNotFoundError:
            raise PreconditionFailedError(f"cas {key!r}: object is gone since the token was read") from None

    def list(self, prefix: str, start_after: str | None, limit: int | None) -> list[str]:
        out: list[str] = []
        page_token = None
        while limit is None or len(out) < limit:
            params: dict[str, Any] = {"prefix": self._name(prefix), "pageToken": page_token}
            if start_after is not None:
                params["startOffset"] = self._name(start_after)
            if limit is not None:
                params["maxResults"] = min(1000, limit - len(out) + 1)
            _, _, contents = self._request("GET", "b/{}/o", self.bucket, **params)
            page = json.loads(contents)
            out.extend(
                item["name"][len(self.prefix):] for item in page.get("items", [])
                if start_after is None or item["name"][len(self.prefix):] > start_after
            )
            page_token = page.get("nextPageToken")
            if not page_token:
                break
        return filter_keys(out, prefix, start_after, limit)

    def list_prefixes(self, prefix: str) -> list[str]:
        out: list[str] = []
        page_token = None
        while True:
            _, _, contents = self._request(
                "GET", "b/{}/o", self.bucket, prefix=self._name(prefix), delimiter="/", pageToken=page_token,
            )
            page = json.loads(contents)
            out.extend(p[len(self.prefix):] for p in page.get("prefixes", []))
            page_token = page.get("nextPageToken")
            if not page_token:
                break
        return sorted(set(out))

    def delete(self, key: str) -> None:
        try:
            self._request("DELETE", "b/{}/o/{}", self.bucket, self._name(key))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        try:
            session = getattr(self.fs, "_session", None)
            if session is not None and not session.closed:
                sync(self.fs.loop, session.close)
        except Exception:  # best effort
            pass
