"""HTTP/1.1 messages as the fault proxy needs them: read a head and a body off a stream, keep the
raw bytes (so a torn message is cut from exactly what was sent), and write the error answers the
real services give.

Bodies are framed by ``Content-Length`` or ``Transfer-Encoding: chunked`` (kept raw, chunk framing
included); a response with neither ends at end-of-stream. Error answers have the service's shape:
S3's ``<Error><Code>SlowDown</Code>...`` XML (what botocore parses into an error code) and GCS's
``{"error": {"code": 503, "errors": [{"reason": "backendError"}]}}`` JSON; which one is chosen
from the request path (the GCS JSON API lives under ``/storage/v1``, ``/upload/storage/v1`` and
``/download/storage/v1``; everything else is S3).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

MAX_HEAD_BYTES = 64 * 1024
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"}


@dataclass
class Message:
    """One request or response: the start line, headers in order, and the raw body bytes."""

    start: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def without(self, *names: str) -> list[tuple[str, str]]:
        drop = {n.lower() for n in names}
        return [(k, v) for k, v in self.headers if k.lower() not in drop]

    def head_bytes(self, headers: list[tuple[str, str]] | None = None) -> bytes:
        lines = [self.start] + [f"{k}: {v}" for k, v in (self.headers if headers is None else headers)]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def read_head(reader: asyncio.StreamReader) -> Message | None:
    """The next message head, or None at a clean end of stream before one starts."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise
    lines = raw.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
    return Message(lines[0], headers)


async def read_body(reader: asyncio.StreamReader, msg: Message, *, until_eof: bool) -> bool:
    """Read ``msg``'s body into ``msg.body`` (raw). Returns True if the body ended at end-of-stream
    (no framing), so the connection cannot carry another message."""
    if (msg.header("transfer-encoding") or "").lower().endswith("chunked"):
        parts = []
        while True:
            line = await reader.readuntil(b"\r\n")
            parts.append(line)
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = await reader.readuntil(b"\r\n")
                    parts.append(trailer)
                    if trailer == b"\r\n":
                        break
                break
            parts.append(await reader.readexactly(size + 2))
        msg.body = b"".join(parts)
        return False
    length = msg.header("content-length")
    if length is not None:
        msg.body = await reader.readexactly(int(length))
        return False
    if until_eof:
        msg.body = await reader.read()
        return True
    return False


def response_has_body(method: str, status: int) -> bool:
    return not (method == "HEAD" or 100 <= status < 200 or status in (204, 304))


def status_of(response: Message) -> int:
    return int(response.start.split()[1])


def is_gcs(target: str) -> bool:
    return target.startswith(("/storage/v1", "/upload/storage/v1", "/download/storage/v1"))


_S3_ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    429: ("TooManyRequests", "Too many requests, please slow down."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
}
_GCS_ERRORS = {
    503: ("backendError", "Backend Error"),
    429: ("rateLimitExceeded", "The rate of change requests to the object exceeds the rate limit."),
    500: ("internalError", "Internal Error"),
}
_REASONS = {503: "Service Unavailable", 429: "Too Many Requests", 500: "Internal Server Error"}


def error_response(status: int, method: str, target: str, request_id: str) -> bytes:
    """The whole error answer (head and body) the service behind ``target`` would give."""
    if is_gcs(target):
        reason, message = _GCS_ERRORS[status]
        body = json.dumps({"error": {"code": status, "message": message,
                                     "errors": [{"domain": "global", "reason": reason, "message": message}]}}).encode()
        ctype = "application/json; charset=UTF-8"
    else:
        code, message = _S3_ERRORS[status]
        resource = target.split("?", 1)[0]
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                f"<Resource>{resource}</Resource><RequestId>{request_id}</RequestId></Error>").encode()
        ctype = "application/xml"
    headers = [("Content-Type", ctype), ("Content-Length", str(len(body))), ("x-amz-request-id", request_id)]
    if status in (503, 429):
        headers.append(("Retry-After", "0"))
    msg = Message(f"HTTP/1.1 {status} {_REASONS[status]}", headers)
    return msg.head_bytes() + (body if response_has_body(method, status) else b"")
