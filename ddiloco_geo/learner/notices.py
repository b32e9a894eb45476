"""What a spot/preemption notice is, and where and how AWS and GCE publish one.

AWS (IMDSv2: a session token from ``PUT /latest/api/token``, then ``GET`` with it): the spot
``instance-action`` item exists only once an interruption is scheduled (``{"action", "time"}``,
about two minutes ahead); a rebalance recommendation (``noticeTime``) means elevated risk.
GCE: ``instance/preempted`` turns ``TRUE`` (long-polled with ``wait_for_change``), and
``maintenance-event`` names ``TERMINATE_ON_HOST_MAINTENANCE``; about 30 s of notice.
:mod:`~ddiloco_geo.learner.preemption` watches them; this module only knows their shapes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime

log = logging.getLogger(__name__)

AWS_METADATA_URL = "http://169.254.169.254"


GCE_METADATA_URL = "http://metadata.google.internal"


AWS_TOKEN_PATH = "/latest/api/token"


AWS_SPOT_PATH = "/latest/meta-data/spot/instance-action"


AWS_REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"


AWS_TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"


AWS_TOKEN_HEADER = "X-aws-ec2-metadata-token"


AWS_MAX_TOKEN_TTL_S = 21600


GCE_PREFIX = "/computeMetadata/v1/instance/"


GCE_HEADERS = {"Metadata-Flavor": "Google"}


GCE_TERMINATE_EVENT = "TERMINATE_ON_HOST_MAINTENANCE"


@dataclass(frozen=True)
class Notice:
    """The VM is going away (or is at elevated risk, for ``aws-rebalance``).

    ``deadline_s``: seconds from ``received_at`` until termination if the cloud said (AWS ``time``),
    else None. ``received_at``: wall-clock ``time.time()`` when the watcher saw the notice.
    """

    source: str
    detail: str
    deadline_s: float | None
    received_at: float


def spot_notice(body: str) -> Notice:
    now = time.time()
    try:
        item = json.loads(body)
        action, when = str(item["action"]), str(item["time"])
        deadline_s: float | None = max(0.0, parse_time(when) - now)
        return Notice("aws-spot", f"action={action} time={when}", deadline_s, now)
    except (ValueError, KeyError, TypeError):
        # The item exists only when an interruption is scheduled: act on it even if unreadable.
        log.debug("preemption_notice_unparsed source=aws-spot bytes=%d", len(body))
        return Notice("aws-spot", "unparsed instance-action", None, now)


def rebalance_notice(body: str) -> Notice:
    try:
        when = str(json.loads(body)["noticeTime"])
    except (ValueError, KeyError, TypeError):
        when = "unparsed"
    return Notice("aws-rebalance", f"noticeTime={when}", None, time.time())


def parse_time(text: str) -> float:
    """AWS's ``2026-11-29T18:00:00Z`` to a POSIX timestamp."""
    parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        raise ValueError(f"time without a zone: {text!r}")
    return parsed.timestamp()
