"""Addresses for the WAN proxy: ``HOST:PORT`` parsing and printing (IPv6 in brackets), and the
loopback check that keeps an unauthenticated proxy off public addresses."""

from __future__ import annotations

import ipaddress
import socket

from ddiloco_geo.core.errors import ConfigError


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{what} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9000 (IPv6: [::1]:9000)")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
