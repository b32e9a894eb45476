"""Error translation against real servers: classes, retries on real outages, no credentials."""

from __future__ import annotations

import logging

import pytest

from conftest import free_port, storage_config_for
from ddiloco_geo.core.errors import NotFoundError, PreconditionFailedError, StorageError, TransientStorageError
from ddiloco_geo.storage import open_store, register_secret, scrub, translate

SENTINEL_KEY_ID = "AKIASENTINEL0KEYID77"
SENTINEL_SECRET = "SeCrEtSentinel/9f8e7d6c5b4a+zz"


def _fast(**kw):
    return {"retry_attempts": 3, "retry_initial_s": 0.001, "retry_max_s": 0.002, "timeout_s": 5.0, **kw}


def test_no_credentials_in_errors_or_logs(moto_endpoint, monkeypatch, caplog):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SENTINEL_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SENTINEL_SECRET)
    cfg = storage_config_for("moto", "no-such-bucket-for-this-test/run", moto_endpoint, **_fast())
    messages = []
    with caplog.at_level(logging.DEBUG), open_store(cfg) as store:
        for op in (lambda: store.get("k"), lambda: store.put_if_absent("k", b"x"),
                   lambda: store.cas("HEAD", b"x", None), lambda: store.list("")):
            with pytest.raises(StorageError) as info:
                op()
            assert not isinstance(info.value, (NotFoundError, TransientStorageError))
            messages.append(str(info.value))
            messages.append(repr(info.value))
    assert all("NoSuchBucket" in m for m in messages[::2])
    text = "\n".join(messages) + "\n" + caplog.text
    assert SENTINEL_SECRET not in text
    assert "SeCrEtSentinel" not in text


@pytest.mark.unit
def test_transient_errors_keep_the_secret_out_of_retry_logs(monkeypatch, caplog):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SENTINEL_SECRET)
    port = free_port()  # nothing listens here
    cfg = storage_config_for("moto", "bucket/run", f"http://127.0.0.1:{port}", **_fast())
    with caplog.at_level(logging.DEBUG), open_store(cfg) as store:
        with pytest.raises(TransientStorageError) as info:
            store.get("k")
    assert SENTINEL_SECRET not in str(info.value) + caplog.text


@pytest.mark.unit
def test_scrub_removes_credential_shapes():
    register_secret("literal-secret-value-123")
    text = (
        "GET https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAXXXX%2F2026&X-Amz-Signature=abcdef0123 "
        "aws_secret_access_key=wJalrXUtnFEMI/K7MDENG access_key: AKIAIOSFODNN7EXAMPLE "
        "Authorization: AWS4-HMAC-SHA256 Credential=AKIA/2026, Signature=deadbeef "
        "https://user:hunter2@example.com/x literal-secret-value-123"
    )
    clean = scrub(text)
    for secret in ("AKIAXXXX", "abcdef0123", "wJalrXUtnFEMI", "AKIAIOSFODNN7EXAMPLE", "deadbeef", "hunter2",
                   "literal-secret-value-123"):
        assert secret not in clean, (secret, clean)
    assert "GET https://b.s3.amazonaws.com/k" in clean


@pytest.mark.unit
def test_store_url_never_contains_credentials(tmp_path):
    from ddiloco_geo.core.config import StorageConfig

    with open_store(StorageConfig(url=f"file://{tmp_path}")) as store:
        assert store.url == f"file://{tmp_path}"
    from ddiloco_geo.storage.translate import safe_url as _safe_url

    assert _safe_url("s3://KEY:SECRET@bucket/run?X-Amz-Signature=abc") == "s3://bucket/run"


def test_stopped_server_gives_transient_error_after_retries():
    from ddiloco_geo.tools import motoserver

    from conftest import create_s3_bucket

    server = motoserver.threaded(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    create_s3_bucket(endpoint, "doomed")
    store = open_store(storage_config_for("moto", "doomed/run", endpoint, **_fast()))
    try:
        assert store.put_if_absent("k", b"x")
        server.stop()
        with pytest.raises(TransientStorageError, match="get 'k'"):
            store.get("k")
        snap = store.stats.snapshot()
        assert snap["requests"]["get"] == 3
        assert sum(snap["retries"].values()) == 2
    finally:
        store.close()


@pytest.mark.unit
def test_unreachable_gcs_endpoint_is_transient():
    cfg = storage_config_for("gcs", "bucket/run", f"http://127.0.0.1:{free_port()}", **_fast())
    with open_store(cfg) as store:
        with pytest.raises(TransientStorageError):
            store.get("k")
        assert sum(store.stats.snapshot()["retries"].values()) == 2


class _BotoLike(Exception):
    def __init__(self, code: str, status: int) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}


@pytest.mark.unit
@pytest.mark.parametrize(
    "exc, expected",
    [
        (FileNotFoundError("x"), NotFoundError),
        (_BotoLike("NoSuchKey", 404), NotFoundError),
        (_BotoLike("PreconditionFailed", 412), PreconditionFailedError),
        (FileExistsError("x"), PreconditionFailedError),
        (_BotoLike("SlowDown", 503), TransientStorageError),
        (_BotoLike("InternalError", 500), TransientStorageError),
        (_BotoLike("RequestLimitExceeded", 400), TransientStorageError),
        (_BotoLike("ThrottlingException", 400), TransientStorageError),
        (_BotoLike("TooManyRequests", 429), TransientStorageError),
        (ConnectionResetError(), TransientStorageError),
        (ConnectionRefusedError(), TransientStorageError),
        (TimeoutError(), TransientStorageError),
        (_BotoLike("AccessDenied", 403), StorageError),
        (_BotoLike("InvalidArgument", 400), StorageError),
        (_BotoLike("NoSuchBucket", 404), StorageError),
        (PermissionError("denied"), StorageError),
    ],
)
def test_translation_table(exc, expected):
    out = translate(exc, "get", "some/key")
    assert type(out) is expected
    assert "get 'some/key'" in str(out)
    assert out.reason


@pytest.mark.unit
def test_translation_of_library_exceptions():
    import aiohttp
    import botocore.exceptions as bx

    assert isinstance(translate(bx.EndpointConnectionError(endpoint_url="http://x"), "get", "k"), TransientStorageError)
    assert isinstance(translate(bx.ReadTimeoutError(endpoint_url="http://x"), "get", "k"), TransientStorageError)
    assert isinstance(translate(aiohttp.ServerDisconnectedError(), "get", "k"), TransientStorageError)
    from gcsfs.retry import HttpError

    assert isinstance(translate(HttpError({"code": 503, "message": "busy"}), "get", "k"), TransientStorageError)
    assert isinstance(translate(HttpError({"code": 429, "message": "rate"}), "get", "k"), TransientStorageError)
    assert type(translate(HttpError({"code": 400, "message": "bad"}), "get", "k")) is StorageError
