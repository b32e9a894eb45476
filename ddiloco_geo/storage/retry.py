"""Retry once, here: the attempt loop every storage operation runs in (habit 6).

Each attempt is counted in :class:`~ddiloco_geo.storage.stats.StoreStats` by operation; whatever
it raises is translated (:func:`~ddiloco_geo.storage.translate.translate`) before it is classified.
The classifier is the translated class: only :class:`TransientStorageError` is retried, never
not-found, a lost precondition or a plain :class:`StorageError`. Policy (tenacity):
``attempts`` attempts in all, full-jitter exponential backoff from ``initial_s`` capped at
``max_s``, one ``storage_retry`` warning per retry, and each retry counted by its reason
(``SlowDown``, ``EndpointConnectionError``, ``http_503``, an injected fault kind, ...). Errors that
reach the caller are counted too, except not-found and lost preconditions, which are answers.
The client libraries' own retry loops are switched off by the backends, so retries never stack.

The 1-based attempt number of the running operation is visible to code under the loop through
:func:`current_attempt` (a context variable, so threads and tasks each see their own): the fault
injector keys its decisions by it without widening the backend interface.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable
from typing import Any

import tenacity

from ddiloco_geo.core.errors import NotFoundError, PreconditionFailedError, TransientStorageError
from ddiloco_geo.storage.stats import StoreStats
from ddiloco_geo.storage.translate import translate

log = logging.getLogger(__name__)

_ATTEMPT: contextvars.ContextVar[int] = contextvars.ContextVar("ddiloco_storage_attempt", default=1)


def current_attempt() -> int:
    """The attempt number (1-based) of the storage operation running in this thread or task."""
    return _ATTEMPT.get()


class RetryPolicy:
    """How many attempts and how long between them; :meth:`call` runs one operation under it."""

    def __init__(
        self,
        *,
        attempts: int = 8,
        initial_s: float = 0.1,
        max_s: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if attempts < 1:
            raise ValueError("retry_attempts must be >= 1 (the first attempt counts)")
        self.attempts = attempts
        self._wait = tenacity.wait_random_exponential(multiplier=initial_s, max=max_s)
        self._sleep = sleep

    def call(self, op: str, key: str, fn: Callable[[], Any], stats: StoreStats) -> Any:
        """Run ``fn`` until it succeeds, fails for good, or the attempts run out; raise ours."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(TransientStorageError),
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=self._wait,
            sleep=self._sleep,
            before_sleep=lambda state: _on_retry(op, key, state, stats),
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                token = _ATTEMPT.set(attempt.retry_state.attempt_number)
                stats.count_request(op)
                try:
                    return fn()
                except Exception as exc:
                    err = translate(exc, op, key)
                    if isinstance(err, TransientStorageError) and attempt.retry_state.attempt_number >= self.attempts:
                        stats.count_error(getattr(err, "reason", "transient"))
                    elif not isinstance(err, (TransientStorageError, NotFoundError, PreconditionFailedError)):
                        stats.count_error(getattr(err, "reason", "error"))
                    if err is exc:
                        raise
                    raise err from None
                finally:
                    _ATTEMPT.reset(token)
        raise AssertionError("unreachable")  # pragma: no cover


def _on_retry(op: str, key: str, state: tenacity.RetryCallState, stats: StoreStats) -> None:
    exc = state.outcome.exception() if state.outcome else None
    reason = getattr(exc, "reason", type(exc).__name__)
    stats.count_retry(reason)
    log.warning(
        "storage_retry op=%s key=%s attempt=%d error=%s sleep_s=%.3f",
        op, key, state.attempt_number, reason, state.upcoming_sleep,
    )
