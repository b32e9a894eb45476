"""Child processes of the developer tools (``local``, ``chaos``): start, watch, stop, by PID.

A child is ``python -m <module> ARGS`` (``ddiloco_geo`` for a syncer or a learner, ``moto.server``
for the chaos S3 server) with its own log file (stdout and stderr, appended), an explicit
environment (what the caller passes is all the child gets: nothing here edits ``os.environ``) and
no stdin. A daemon thread per child waits for it and records when it exited, so a caller can tell
"exited at t" from "still running" without polling.

Stopping is always by PID and always ends: :func:`stop` sends SIGTERM (a learner flushes and
checkpoints, a syncer drains), waits up to a deadline, then SIGKILLs and reaps. :func:`stop_all`
does the same for many children under one shared deadline; :func:`kill_all` SIGKILLs at once.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Child:
    """One started process. ``exit_time`` (``time.time()``) is set by its reaper thread."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    argv: list[str]
    started: float
    log_offset: int = 0                 # the log's size when this process started: logs are appended to
    exit_time: float | None = None
    _reaped: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def is_running(self) -> bool:
        return self.exit_time is None and self.popen.poll() is None

    def send_signal(self, sig: signal.Signals) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def log_text(self) -> str:
        """What this process has written to its log. The file is appended to, so it may also hold
        earlier processes' output (an earlier run in the same directory, an earlier incarnation):
        a reader looking for this process's lines must not see theirs."""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the exit (``subprocess.TimeoutExpired`` after ``timeout_s``); the exit time is
        recorded once this returns."""
        code = self.popen.wait(timeout=timeout_s)
        self._reaped.wait(1.0)
        return code


def child_env(base: Mapping[str, str] | None = None, *, drop_prefix: str | None = None,
              defaults: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment for a child: ``base`` (default: this process's environment) without the
    variables starting with ``drop_prefix``, then ``defaults`` where unset, then ``extra``.

    Every child gets ``OMP_NUM_THREADS=1`` unless set: M learners and a syncer share the machine's
    cores, one intra-op thread each."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if drop_prefix is None or not k.startswith(drop_prefix)}
    env.setdefault("OMP_NUM_THREADS", "1")
    for k, v in (defaults or {}).items():
        env.setdefault(k, v)
    env.update(extra or {})
    return env


def start(name: str, args: list[str], *, log_path: Path, env: Mapping[str, str], cwd: Path | None = None,
          module: str = "ddiloco_geo") -> Child:
    """Start ``python -m module *args`` with its output appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", module, *args]
    with open(log_path, "ab") as logfile:
        offset = os.fstat(logfile.fileno()).st_size
        popen = subprocess.Popen(argv, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=dict(env), cwd=cwd)
    child = Child(name=name, popen=popen, log_path=log_path, argv=argv, started=time.time(), log_offset=offset)
    threading.Thread(target=_reap, args=(child,), daemon=True, name=f"reap-{name}").start()
    log.debug("process_started name=%s pid=%d argv=%s", name, popen.pid, argv)
    return child


def _reap(child: Child) -> None:
    child.popen.wait()
    child.exit_time = time.time()
    child._reaped.set()


def stop(child: Child, timeout_s: float, sig: signal.Signals = signal.SIGTERM) -> bool:
    """Send ``sig`` (if it still runs), wait up to ``timeout_s``, then SIGKILL and reap.
    True when it exited within the deadline, False when it had to be killed."""
    child.send_signal(sig)
    try:
        child.wait(timeout_s)
        return True
    except subprocess.TimeoutExpired:
        child.popen.kill()
        child.wait()
        return False


def stop_all(children: Iterable[Child], timeout_s: float, sig: signal.Signals = signal.SIGTERM) -> None:
    """Signal every running child, then wait for all of them under one deadline; SIGKILL the rest."""
    children = list(children)
    for child in children:
        child.send_signal(sig)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("process_kill name=%s pid=%d reason=deadline", child.name, child.pid)
            child.popen.kill()
            child.wait()


def kill_all(children: Iterable[Child]) -> None:
    """SIGKILL every child that still runs (no reaping: their reaper threads do it)."""
    for child in children:
        if child.popen.poll() is None:
            child.popen.kill()
