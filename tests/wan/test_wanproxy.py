"""WanProxy on real loopback sockets: delay, rate, pipelining, integrity, half-close, resets, close,
the thread-hosted variant, the CLI, and a real S3 PUT/GET to a moto server through the proxy.

Timing assertions are lower bounds from physics (delay, rate) with a little slack below; the only
upper bounds are generous ones (many times the ideal) that tell a pipe from stop-and-wait."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.wanproxy import WanProxy, WanProxyThread, is_loopback, parse_host_port
from ddiloco_geo.tools.wanproxy import abort as _abort
from tests.conftest import deadline

MiB = 1024 * 1024
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def _payload(num_bytes: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(num_bytes)


# --- servers behind the proxy --------------------------------------------------------------------


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
    except OSError:
        pass
    finally:
        writer.close()


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads to EOF, then answers ``<num_bytes> <sha256>`` and closes: needs a working half-close."""
    digest, num_bytes = hashlib.sha256(), 0
    while data := await reader.read(65536):
        digest.update(data)
        num_bytes += len(data)
    writer.write(f"{num_bytes} {digest.hexdigest()}".encode())
    await writer.drain()
    writer.close()


async def _resetter(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads one chunk, then resets the connection."""
    await reader.read(1)
    _abort(writer, reset=True)


class _Behind:
    """A server on loopback with a proxy in front of it, inside one running loop."""

    def __init__(self, handler, **proxy_kwargs) -> None:
        self.handler = handler
        self.proxy_kwargs = proxy_kwargs

    async def __aenter__(self) -> WanProxy:
        self.server = await asyncio.start_server(self.handler, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.proxy = WanProxy("127.0.0.1", port, **self.proxy_kwargs)
        await self.proxy.start()
        return self.proxy

    async def __aexit__(self, *exc_info) -> None:
        await self.proxy.close()
        self.server.close()
        await self.server.wait_closed()


async def _connect(proxy: WanProxy):
    return await asyncio.open_connection(*proxy.address)


async def _send_to_sink(proxy: WanProxy, data: bytes) -> tuple[float, bytes]:
    """Send ``data``, half-close, and wait for the sink's answer; returns (seconds, answer)."""
    loop = asyncio.get_running_loop()
    reader, writer = await _connect(proxy)
    started = loop.time()
    writer.write(data)
    await writer.drain()
    writer.write_eof()
    answer = await reader.read()
    elapsed = loop.time() - started
    writer.close()
    return elapsed, answer


def _sink_answer(data: bytes) -> bytes:
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}".encode()


async def _echo_round_trip(reader, writer, data: bytes) -> bytes:
    async def send() -> None:
        for i in range(0, len(data), 256 * 1024):
            writer.write(data[i:i + 256 * 1024])
            await writer.drain()

    sender = asyncio.create_task(send())
    received = await reader.readexactly(len(data))
    await sender
    return received


def run(coro, timeout_s: float = 60.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


# --- delay ---------------------------------------------------------------------------------------


def test_round_trip_costs_at_least_two_one_way_delays():
    async def main():
        async with _Behind(_echo, delay_s=0.05) as proxy:
            reader, writer = await _connect(proxy)
            loop = asyncio.get_running_loop()
            round_trips = []
            for i in range(3):
                started = loop.time()
                writer.write(b"ping %d" % i)
                assert await reader.readexactly(6) == b"ping %d" % i
                round_trips.append(loop.time() - started)
            writer.close()
            return round_trips

    first, *later = run(main())
    assert first >= 0.195  # the emulated handshake: one RTT before the first byte can go
    for rtt in later:
        assert 0.095 <= rtt < 2.0


def test_without_handshake_the_first_round_trip_is_one_rtt():
    async def main():
        async with _Behind(_echo, delay_s=0.05, emulate_handshake=False) as proxy:
            reader, writer = await _connect(proxy)
            started = asyncio.get_running_loop().time()
            writer.write(b"x")
            await reader.readexactly(1)
            writer.close()
            return asyncio.get_running_loop().time() - started

    assert 0.095 <= run(main()) < 2.0


def test_data_keeps_flowing_during_the_delay():
    # 4 MiB in 64 KiB reads at 100 ms one way: stop-and-wait would need >= 6.4 s; a pipe ~0.2 s.
    data = _payload(4 * MiB)

    async def main():
        async with _Behind(_sink, delay_s=0.1) as proxy:
            return await _send_to_sink(proxy, data)

    elapsed, answer = run(main())
    assert answer == _sink_answer(data)
    assert elapsed >= 0.2  # the delay was added (how long beyond it: a benchmark figure)


def test_jitter_adds_delay_and_keeps_order():
    data = _payload(2 * MiB, seed=3)

    async def main():
        async with _Behind(_echo, delay_s=0.02, jitter_s=0.03, seed=7) as proxy:
            reader, writer = await _connect(proxy)
            started = asyncio.get_running_loop().time()
            echoed = await _echo_round_trip(reader, writer, data)
            writer.close()
            return asyncio.get_running_loop().time() - started, echoed

    elapsed, echoed = run(main())
    assert echoed == data
    assert elapsed >= 0.04 * 0.95


# --- rate ----------------------------------------------------------------------------------------


def test_throughput_is_capped_by_the_rate():
    # 1 MiB at 8 Mbit/s is 1.05 s; the first 64 KiB burst is free, so >= 0.98 s in theory.
    data = _payload(MiB)

    async def main():
        async with _Behind(_sink, delay_s=0.0, rate_bps=8e6) as proxy:
            return await _send_to_sink(proxy, data)

    elapsed, answer = run(main())
    assert answer == _sink_answer(data)
    assert elapsed >= 0.8


def test_rate_is_shared_by_all_connections_of_a_proxy():
    # 8 connections x 128 KiB = 1 MiB through one 8 Mbit/s link: >= ~1 s in all, not 1/8 of it.
    chunks = [_payload(128 * 1024, seed=i) for i in range(8)]

    async def main():
        async with _Behind(_sink, delay_s=0.0, rate_bps=8e6) as proxy:
            started = asyncio.get_running_loop().time()
            results = await asyncio.gather(*(_send_to_sink(proxy, c) for c in chunks))
            return asyncio.get_running_loop().time() - started, [answer for _, answer in results]

    elapsed, answers = run(main())
    assert answers == [_sink_answer(c) for c in chunks]
    assert elapsed >= 0.8


def test_unlimited_rate_passes_4_mib_both_ways_intact():
    data = _payload(4 * MiB, seed=1)

    async def main():
        async with _Behind(_echo, delay_s=0.01, rate_bps=None) as proxy:
            reader, writer = await _connect(proxy)
            echoed = await _echo_round_trip(reader, writer, data)
            writer.write_eof()
            assert await reader.read() == b""  # the echo's FIN came back after ours
            writer.close()
            await writer.wait_closed()
            return echoed, proxy.stats()

    echoed, stats = run(main())
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(data).digest()
    assert stats["up_bytes"] == stats["down_bytes"] == len(data)
    assert stats["num_connections"] == 1


def test_small_window_still_delivers_everything():
    data = _payload(256 * 1024, seed=2)

    async def main():
        async with _Behind(_sink, delay_s=0.005, window_bytes=8 * 1024, burst_bytes=4096) as proxy:
            return await _send_to_sink(proxy, data)

    assert run(main())[1] == _sink_answer(data)


# --- many connections, close, errors -------------------------------------------------------------


def test_many_concurrent_connections_each_get_their_own_bytes():
    payloads = [_payload(64 * 1024, seed=i) for i in range(50)]

    async def one(proxy, data):
        reader, writer = await _connect(proxy)
        echoed = await _echo_round_trip(reader, writer, data)
        writer.close()
        return echoed

    async def main():
        async with _Behind(_echo, delay_s=0.02, rate_bps=200e6) as proxy:
            echoed = await asyncio.gather(*(one(proxy, p) for p in payloads))
            return echoed, proxy.stats()

    echoed, stats = run(main())
    assert echoed == payloads
    assert stats["num_connections"] == 50
    assert stats["up_bytes"] == stats["down_bytes"] == 50 * 64 * 1024


def test_close_ends_open_connections_and_is_idempotent():
    async def main():
        async with _Behind(_echo, delay_s=0.01) as proxy:
            conns = [await _connect(proxy) for _ in range(5)]
            for reader, writer in conns:
                writer.write(b"hi")
                assert await reader.readexactly(2) == b"hi"
            assert proxy.stats()["num_active"] == 5
            await asyncio.gather(proxy.close(), proxy.close())
            await proxy.close()
            assert proxy.stats()["num_active"] == 0
            for reader, writer in conns:
                try:
                    assert await reader.read() == b""
                except ConnectionResetError:
                    pass
                writer.close()
            with pytest.raises(OSError):
                await _connect(proxy)

    run(main())


def test_half_close_lets_the_reply_come_back():
    async def main():
        async with _Behind(_sink, delay_s=0.02) as proxy:
            return await _send_to_sink(proxy, b"abc")

    elapsed, answer = run(main())
    assert answer == _sink_answer(b"abc")
    assert elapsed >= 0.075  # handshake (one RTT, 40 ms) + the FIN out and the answer back (40 ms)


def test_refused_target_ends_the_client_connection():
    async def main():
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()  # nothing listens on `port` any more
        proxy = WanProxy("127.0.0.1", port, delay_s=0.0)
        await proxy.start()
        try:
            reader, writer = await _connect(proxy)
            try:
                assert await reader.read() == b""
            except ConnectionResetError:
                pass
            writer.close()
            return proxy.stats()
        finally:
            await proxy.close()

    stats = run(main())
    assert stats["num_failed_connects"] == 1


def test_reset_by_the_target_reaches_the_client():
    async def main():
        async with _Behind(_resetter, delay_s=0.01) as proxy:
            reader, writer = await _connect(proxy)
            writer.write(b"x")
            with pytest.raises(ConnectionResetError):
                await reader.read()
            writer.close()
            return proxy.stats()

    assert run(main())["num_resets"] == 1


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"delay_s": -1}, {"jitter_s": -0.1}, {"rate_bps": 0}, {"burst_bytes": 0}, {"listen_port": 70000},
])
def test_bad_settings_are_refused_at_construction(kwargs):
    with pytest.raises(ConfigError):
        WanProxy("127.0.0.1", 9000, **kwargs)


def test_non_loopback_listen_is_refused_unless_allowed():
    with pytest.raises(ConfigError, match="allow-non-loopback"):
        WanProxy("127.0.0.1", 9000, listen_host="0.0.0.0")
    WanProxy("127.0.0.1", 9000, listen_host="0.0.0.0", allow_non_loopback=True)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


def test_parse_host_port():
    assert parse_host_port("127.0.0.1:9000", "--target") == ("127.0.0.1", 9000)
    assert parse_host_port("[::1]:0", "--listen") == ("::1", 0)
    for bad in ("9000", "host:", "host:port", ":80", "h:99999"):
        with pytest.raises(ConfigError):
            parse_host_port(bad, "--target")


# --- synchronous embedding, CLI, S3 --------------------------------------------------------------


def test_thread_variant_serves_from_synchronous_code():
    with WanProxyThread("127.0.0.1", 1, delay_s=0.0) as idle:  # nothing needs to listen behind it
        assert idle.url.startswith("http://127.0.0.1:")
    idle.stop()  # idempotent

    # A blocking echo through the proxy, from plain sockets.
    listener = socket.create_server(("127.0.0.1", 0))
    target_port = listener.getsockname()[1]
    with WanProxyThread("127.0.0.1", target_port, delay_s=0.02) as proxy:
        client = socket.create_connection(proxy.address, timeout=deadline(10))
        listener.settimeout(10)
        upstream, _ = listener.accept()
        started = time.monotonic()
        client.sendall(b"hello")
        assert upstream.recv(5) == b"hello"
        upstream.sendall(b"world")
        assert client.recv(5) == b"world"
        assert time.monotonic() - started >= 0.038
        client.close()
        upstream.close()
    listener.close()
    assert proxy.stats()["up_bytes"] == 5 and proxy.stats()["num_active"] == 0


def test_cli_prints_the_url_runs_until_sigterm_and_prints_counters():
    listener = socket.create_server(("127.0.0.1", 0))
    target = f"127.0.0.1:{listener.getsockname()[1]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddiloco_geo", "wan-proxy", "--target", target, "--delay-ms", "5",
         "--rate-mbit", "0", "--json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        started = json.loads(proc.stdout.readline())
        assert started["target"] == target and started["delay_ms"] == 5 and started["rate_mbit"] is None
        assert started["url"] == f"http://{started['listen']}"
        client = socket.create_connection(parse_host_port(started["listen"], "listen"), timeout=deadline(10))
        listener.settimeout(10)
        upstream, _ = listener.accept()
        client.sendall(b"12345")
        assert upstream.recv(5) == b"12345"
        client.close()
        upstream.close()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=deadline(30))
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()
    assert proc.returncode == 0, err
    counters = json.loads(out.strip().splitlines()[-1])
    assert counters["num_connections"] == 1 and counters["up_bytes"] == 5


def test_cli_refuses_a_non_loopback_listen_address():
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco_geo", "wan-proxy", "--target", "127.0.0.1:9000",
         "--listen", "0.0.0.0:0"],
        cwd=REPO, capture_output=True, text=True, timeout=deadline(60), env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2
    assert "--allow-non-loopback" in proc.stderr and "authentication" in proc.stderr


@pytest.fixture(scope="module")
def moto_endpoint():
    from ddiloco_geo.tools import motoserver

    server = motoserver.threaded(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield host, port
    server.stop()


def _s3(endpoint_url: str):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=endpoint_url, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                      connect_timeout=10, read_timeout=60),
    )


def test_s3_put_and_get_through_the_proxy(moto_endpoint):
    host, port = moto_endpoint
    data = _payload(MiB, seed=9)
    _s3(f"http://{host}:{port}").create_bucket(Bucket="wan")
    with WanProxyThread(host, port, delay_s=0.05, rate_bps=10e6) as proxy:
        s3 = _s3(proxy.url)
        started = time.monotonic()
        s3.put_object(Bucket="wan", Key="blob", Body=data)
        put_s = time.monotonic() - started
        echoed = s3.get_object(Bucket="wan", Key="blob")["Body"].read()
    assert put_s >= 0.8  # 1 MiB at 10 Mbit/s is 0.84 s of serialisation, plus round trips
    assert echoed == data
    assert proxy.stats()["up_bytes"] >= MiB and proxy.stats()["down_bytes"] >= MiB
