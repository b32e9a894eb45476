"""The test servers listen on loopback only (nothing reachable from outside the machine)."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest


def _listeners(port: int) -> list[str]:
    """Local addresses of listening TCP sockets on ``port``, from /proc/net/tcp{,6}."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            addr, state = fields[1], fields[3]
            host_hex, port_hex = addr.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                found.append(host_hex)
    return found


@pytest.mark.parametrize("fixture", ["moto_endpoint", "gcs_endpoint", "localstack_endpoint"])
def test_server_listens_on_loopback_only(request, fixture):
    url = urlparse(request.getfixturevalue(fixture))
    assert url.hostname == "127.0.0.1"
    listeners = _listeners(url.port)
    assert listeners, f"nothing listens on {url.port}"
    assert set(listeners) == {"0100007F"}, f"{fixture} also listens on {listeners}"
