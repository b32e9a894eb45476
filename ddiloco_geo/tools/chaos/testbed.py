"""The world a chaos run lives in: an S3 server, a bucket with fresh prefixes, the WAN regions.

The S3 endpoint is ``storage.endpoint_url`` (LocalStack, MinIO, a moto server) or, when none is
set, a moto server started here on 127.0.0.1 (a child process, stopped by its PID in
:meth:`Testbed.close`). The bucket is ``--store s3://BUCKET[/PREFIX]`` or a fresh
``ddiloco-chaos-<random>`` bucket; the chaos run and its baseline each get a fresh prefix under it.

Children get their environment from here, explicitly: this process's environment without any
``DDILOCO_*`` variable (the settings reach them as a file and ``--set`` flags, never through the
environment), ``OMP_NUM_THREADS=1`` and, for an emulator on this machine, dummy AWS credentials
(:func:`emulator_credentials`) where none are set. Nothing here edits ``os.environ``.

A WAN region is one :class:`~ddiloco_geo.tools.wanproxy.WanProxyThread` (one-way delay plus a
bandwidth cap shared by every learner placed there) in front of the endpoint.
"""

from __future__ import annotations

import logging
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3

from ddiloco_geo.core.config import StorageConfig
from ddiloco_geo.core.errors import ConfigError, DdilocoError
from ddiloco_geo.tools import processes
from ddiloco_geo.tools.wanproxy import WanProxyThread

log = logging.getLogger(__name__)

DEFAULT_BUCKET_REGION = "us-east-1"
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def emulator_credentials(endpoint_url: str | None) -> dict[str, str]:
    """Dummy credentials when the S3 endpoint is an emulator on this machine (no endpoint: the moto
    server a chaos run starts here), else none: real credentials come from the usual AWS chain."""
    if endpoint_url is None or (urllib.parse.urlsplit(endpoint_url).hostname or "") in LOOPBACK_HOSTS:
        return dict(DUMMY_CREDENTIALS)
    return {}


@dataclass
class Testbed:
    """Where a chaos run and its baseline run; :meth:`close` stops what was started here."""

    endpoint: str                      # the S3 endpoint every process (or its WAN proxy) talks to
    region: str
    url: str                           # the chaos run's prefix, s3://BUCKET/chaos-<tag>
    baseline_url: str                  # the fault-free baseline's prefix
    child_env: dict[str, str]
    moto: processes.Child | None = None
    proxies: dict[str, WanProxyThread] = field(default_factory=dict)

    def start_proxies(self, plan: dict[str, Any]) -> None:
        """One proxy per region some learner is placed in (``home`` means no proxy)."""
        parts = urllib.parse.urlsplit(self.endpoint)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        used = sorted({r for r in plan["placement"].values() if r != "home"})
        for i, region in enumerate(used):
            spec = plan["regions"][region]
            proxy = WanProxyThread(parts.hostname, port, delay_s=spec["delay_s"], rate_bps=spec["rate_bps"],
                                   seed=plan["seed"] * 100 + i).start()
            self.proxies[region] = proxy
            log.info("chaos_wan_proxy region=%s url=%s delay_s=%.3f rate_mbps=%.0f", region, proxy.url,
                     spec["delay_s"], spec["rate_bps"] / 1e6)

    def stop_proxies(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()

    def close(self) -> None:
        """Stop the proxies and the moto server if it was started here. Idempotent."""
        self.stop_proxies()
        if self.moto is not None:
            processes.stop(self.moto, 10)


def open_testbed(storage: StorageConfig, plan: dict[str, Any], *, base_url: str | None, logs: Path,
                 env: Mapping[str, str] | None = None) -> Testbed:
    """Choose the endpoint and the bucket (starting moto and creating a bucket if needed) and the
    fresh prefixes of the chaos and baseline runs. ``env``: the children's base environment
    (default: this process's)."""
    endpoint = storage.endpoint_url
    if endpoint is None and base_url:
        raise ConfigError(f"--store {base_url}: chaos needs an S3 endpoint; add --set storage.endpoint_url=URL "
                          "(moto, LocalStack, MinIO) or drop --store to use a moto server started here")
    credentials = emulator_credentials(endpoint)
    child_env = processes.child_env(env, drop_prefix="DDILOCO_", defaults=credentials)
    moto = None
    if endpoint is None:
        endpoint, moto = start_moto(logs, child_env)
    try:
        region = storage.region or DEFAULT_BUCKET_REGION
        if base_url:
            if not base_url.startswith("s3://"):
                raise ConfigError(f"--store {base_url}: chaos runs on an S3 server: use s3://BUCKET[/PREFIX]")
            base = base_url.rstrip("/")
        else:
            bucket = f"ddiloco-chaos-{uuid.uuid4().hex[:12]}"
            create_bucket(endpoint, bucket, region, child_env)
            base = f"s3://{bucket}"
    except BaseException:
        if moto is not None:
            processes.stop(moto, 10)
        raise
    tag = f"s{plan['seed']}-{uuid.uuid4().hex[:8]}"
    return Testbed(endpoint=endpoint, region=region, url=f"{base}/chaos-{tag}", baseline_url=f"{base}/baseline-{tag}",
                   child_env=child_env, moto=moto)


def start_moto(logs: Path, env: Mapping[str, str]) -> tuple[str, processes.Child]:
    """A moto S3 server on a free loopback port: (endpoint URL, its process). Three tries."""
    last = None
    for _ in range(3):
        port = free_port()
        proc = processes.start("moto", ["-H", "127.0.0.1", "-p", str(port)], log_path=logs / "moto.log",
                               env=env, module="ddiloco_geo.tools.motoserver")
        url = f"http://127.0.0.1:{port}"
        if wait_http(url + "/moto-api/", 30, proc):
            log.info("chaos_moto_started pid=%d endpoint=%s", proc.pid, url)
            return url, proc
        last = proc.returncode
        processes.stop(proc, 5)
    raise DdilocoError(f"could not start the moto S3 server (exit code {last}); see {logs / 'moto.log'}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: processes.Child) -> bool:
    """True once ``url`` answers below 500; False if ``proc`` exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status < 500:
                    return True
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False


def create_bucket(endpoint: str, bucket: str, region: str, env: Mapping[str, str]) -> None:
    """Create ``bucket`` with the credentials in ``env`` (the children's), else the usual AWS chain."""
    client = boto3.client("s3", endpoint_url=endpoint, region_name=region,
                          aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
                          aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
                          aws_session_token=env.get("AWS_SESSION_TOKEN"))
    kwargs: dict[str, Any] = {"Bucket": bucket}
    if region != "us-east-1":
        kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
    client.create_bucket(**kwargs)
