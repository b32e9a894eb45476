"""The S3 backend (``s3://BUCKET/PREFIX``): S3 and S3-compatible servers through s3fs's aiobotocore client.

Raw API calls, no s3fs file semantics. Create = PutObject with ``If-None-Match: *``; CAS =
PutObject with ``If-None-Match: *`` (token None) or ``If-Match: <ETag>``; the token is the ETag.
A 412 on create is the answer "already exists"; a 404 on ``If-Match`` (the object was deleted
since its token was read) is a lost CAS. Ranged gets use the ``Range`` header; a range starting at
or past the end (``InvalidRange``) reads as empty.

botocore's own retries are switched off (``total_max_attempts=1``) so that retries happen once, in the
store. With ``storage.endpoint_url`` (MinIO, moto, LocalStack, a WAN proxy) addressing is
path-style. Once the client has resolved credentials, their secret parts are registered with
:func:`~ddiloco_geo.storage.translate.register_secret` so no error message can carry them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from fsspec.asyn import sync

from ddiloco_geo.core.config import StorageConfig
from ddiloco_geo.core.errors import NotFoundError, PreconditionFailedError
from ddiloco_geo.storage.backend import Backend, filter_keys
from ddiloco_geo.storage.keys import split_bucket
from ddiloco_geo.storage.translate import register_secret, status_and_code, translate


class S3Backend(Backend):
    """S3 and S3-compatible servers through s3fs's aiobotocore client (raw API calls)."""

    def __init__(self, cfg: StorageConfig) -> None:
        from s3fs import S3FileSystem  # heavy (aiobotocore); only S3 runs pay for it

        self.bucket, self.prefix = split_bucket(cfg.url, "s3://")
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        config_kwargs: dict[str, Any] = {
            "retries": {"total_max_attempts": 1, "mode": "standard"},  # one attempt: retries are ours, once
            "connect_timeout": cfg.timeout_s,
            "read_timeout": cfg.timeout_s,
            "max_pool_connections": 64,
        }
        if cfg.endpoint_url:
            config_kwargs["s3"] = {"addressing_style": "path"}
        client_kwargs = {"region_name": cfg.region} if cfg.region else {}
        self.fs = S3FileSystem(
            anon=cfg.anonymous,
            endpoint_url=cfg.endpoint_url,
            client_kwargs=client_kwargs,
            config_kwargs=config_kwargs,
            skip_instance_cache=True,
            use_listings_cache=False,
        )
        self._client_lock = threading.Lock()
        self._client: Any = None

    def _run(self, coro_fn: Callable[..., Any], *args: Any) -> Any:
        return sync(self.fs.loop, coro_fn, *args)

    def _s3(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._run(self.fs.set_session)
                self._register_credentials()
            return self._client

    def _register_credentials(self) -> None:
        try:
            creds = self._client._request_signer._credentials
            if creds is not None:
                register_secret(getattr(creds, "secret_key", None))
                register_secret(getattr(creds, "token", None))
        except AttributeError:
            pass

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _put(self, key: str, data: bytes, **cond: str) -> dict:
        client = self._s3()

        async def call() -> dict:
            return await client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **cond)

        return self._run(call)

    def create(self, key: str, data: bytes) -> bool:
        try:
            self._put(key, data, IfNoneMatch="*")
            return True
        except Exception as exc:
            if translate(exc, "put_if_absent", key).__class__ is PreconditionFailedError:
                return False
            raise

    def _get_object(self, key: str, range_header: str | None) -> tuple[bytes, str]:
        client = self._s3()
        kwargs = {"Range": range_header} if range_header else {}

        async def call() -> tuple[bytes, str]:
            resp = await client.get_object(Bucket=self.bucket, Key=self._key(key), **kwargs)
            async with resp["Body"] as body:
                data = await body.read()
            return data, resp["ETag"]

        return self._run(call)

    def get(self, key: str, start: int, end: int | None) -> bytes:
        if end is not None and end <= start:
            self._head(key)
            return b""
        if start == 0 and end is None:
            return self._get_object(key, None)[0]
        range_header = f"bytes={start}-" + ("" if end is None else str(end - 1))
        try:
            return self._get_object(key, range_header)[0]
        except Exception as exc:
            _, code = status_and_code(exc)
            if code == "InvalidRange":  # start at or past the end of the object
                return b""
            raise

    def _head(self, key: str) -> dict:
        client = self._s3()

        async def call() -> dict:
            return await client.head_object(Bucket=self.bucket, Key=self._key(key))

        return self._run(call)

    def read_token(self, key: str) -> tuple[bytes, str]:
        return self._get_object(key, None)

    def cas(self, key: str, data: bytes, token: str | None) -> str:
        cond = {"IfNoneMatch": "*"} if token is None else {"IfMatch": token}
        try:
            return self._put(key, data, **cond)["ETag"]
        except Exception as exc:
            err = translate(exc, "cas", key)
            if isinstance(err, NotFoundError):  # If-Match on a deleted object
                raise PreconditionFailedError(f"cas {key!r}: object is gone since the token was read") from None
            raise

    def list(self, prefix: str, start_after: str | None, limit: int | None) -> list[str]:
        client = self._s3()
        out: list[str] = []

        async def call() -> None:
            token = None
            while limit is None or len(out) < limit:
                kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._key(prefix)}
                if limit is not None:
                    kwargs["MaxKeys"] = min(1000, limit - len(out))
                if token:
                    kwargs["ContinuationToken"] = token
                elif start_after is not None:
                    kwargs["StartAfter"] = self._key(start_after)
                page = await client.list_objects_v2(**kwargs)
                out.extend(o["Key"][len(self.prefix):] for o in page.get("Contents", []))
                token = page.get("NextContinuationToken")
                if not page.get("IsTruncated") or not token:
                    break

        self._run(call)
        return filter_keys(out, prefix, start_after, limit)

    def list_prefixes(self, prefix: str) -> list[str]:
        client = self._s3()
        out: list[str] = []

        async def call() -> None:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._key(prefix), "Delimiter": "/"}
            while True:
                page = await client.list_objects_v2(**kwargs)
                out.extend(p["Prefix"][len(self.prefix):] for p in page.get("CommonPrefixes", []))
                token = page.get("NextContinuationToken")
                if not page.get("IsTruncated") or not token:
                    break
                kwargs["ContinuationToken"] = token

        self._run(call)
        return sorted(set(out))

    def delete(self, key: str) -> None:
        client = self._s3()

        async def call() -> None:
            await client.delete_object(Bucket=self.bucket, Key=self._key(key))

        try:
            self._run(call)
        except Exception as exc:
            if not isinstance(translate(exc, "delete", key), NotFoundError):
                raise

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                self._run(client.close)
            except Exception:  # closing is best effort; the loop may be gone at exit
                pass
