"""Process setup done by every command (cli/main.py): the allocator keeps freed memory."""

from __future__ import annotations

import sys

import pytest

from ddiloco_geo.cli import main as cli_main

pytestmark = pytest.mark.unit


class _FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


def test_every_command_raises_both_malloc_thresholds(monkeypatch):
    libc = _FakeLibc()
    monkeypatch.setattr(cli_main.ctypes, "CDLL", lambda name: libc)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("DDILOCO_MALLOC_TUNING", raising=False)
    cli_main.setup_malloc()
    assert sorted(libc.calls) == [(-3, 1 << 30), (-1, 1 << 30)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


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
