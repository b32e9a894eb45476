"""Process setup done by every command (cli/main.py): the allocator keeps freed memory."""

from __future__ import annotations

import sys

import pytest

from ddiloco_geo.cli import main as cli_main

pytestmark = pytest.mark.unit


class _FakeLibc:
    def __init__(self, max_mmap_threshold: int = 1 << 40) -> None:
        self.calls: list[tuple[int, int]] = []
        self.max_mmap_threshold = max_mmap_threshold

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return int(param != -3 or value <= self.max_mmap_threshold)


def test_every_command_raises_both_malloc_thresholds(monkeypatch):
    libc = _FakeLibc()
    monkeypatch.setattr(cli_main.ctypes, "CDLL", lambda name: libc)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("DDILOCO_MALLOC_TUNING", raising=False)
    cli_main.setup_malloc()
    assert sorted(libc.calls) == [(-3, 1 << 30), (-1, 1 << 30)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    capped = _FakeLibc(max_mmap_threshold=32 << 20)  # glibc versions that refuse more than 32 MiB
    monkeypatch.setattr(cli_main.ctypes, "CDLL", lambda name: capped)
    cli_main.setup_malloc()
    assert capped.calls == [(-3, 1 << 30), (-3, 32 << 20), (-1, 1 << 30)]


def test_the_switch_and_a_libc_without_mallopt_leave_the_defaults(monkeypatch):
    libc = _FakeLibc()
    monkeypatch.setattr(cli_main.ctypes, "CDLL", lambda name: libc)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("DDILOCO_MALLOC_TUNING", "0")
    cli_main.setup_malloc()
    assert libc.calls == []
    monkeypatch.delenv("DDILOCO_MALLOC_TUNING")
    monkeypatch.setattr(cli_main.ctypes, "CDLL", lambda name: object())  # musl: no mallopt
    cli_main.setup_malloc()  # no error
