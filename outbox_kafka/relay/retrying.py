"""Retrying the relay's database steps through transient failures, with backoff."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential_jitter

from outbox_kafka.errors import StorageError
from outbox_kafka.relay.metrics import RelayMetrics

log = logging.getLogger("outbox_kafka.relay")

T = TypeVar("T")

#: A database step unanswered this long counts as waiting for the database.
SLOW_STEP_SECONDS = 5.0


class DatabaseRetry:
    """Runs a database step until it succeeds or the relay may give it up.

    Claims give up when the relay is stopping; recording an outcome keeps
    trying until the shutdown deadline, since Kafka already has the messages.
    """

    def __init__(
        self,
        stopping: threading.Event,
        past_shutdown_deadline: Callable[[], bool],
        metrics: RelayMetrics,
    ) -> None:
        self._stopping = stopping
        self._past_deadline = past_shutdown_deadline
        self._metrics = metrics
        #: By thread (the claim and the record run on their own): when its step began.
        self._running_since: dict[int, float] = {}
        #: Threads whose step failed and waits to be retried.
        self._failing: set[int] = set()

    @property
    def waiting(self) -> bool:
        """Whether a step waits for the database: failed and retrying, or long unanswered.

        A connection to a host that vanished without a reset hangs until the
        operating system gives up, with no error to retry on meanwhile.
        """
        now = time.monotonic()
        running = list(self._running_since.values())
        return bool(self._failing) or any(now - began > SLOW_STEP_SECONDS for began in running)

    def run(
        self,
        action: Callable[[], T],
        *,
        stop_on_shutdown: bool,
        give_up: Callable[[], bool] = lambda: False,
    ) -> T:
        """``action()``, retried on StorageError; ``give_up`` may end the retries sooner."""
        me = threading.get_ident()

        def should_stop(state: RetryCallState) -> bool:
            if give_up():
                return True
            return self._stopping.is_set() if stop_on_shutdown else self._past_deadline()

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            self._metrics.db_errors.inc()
            self._failing.add(me)
            log.warning(
                "database error, retrying",
                extra={"action": "db_retry", "attempt": state.attempt_number, "error": str(exc)},
            )

        def sleep(seconds: float) -> None:
            if stop_on_shutdown:
                self._stopping.wait(seconds)
            else:
                time.sleep(seconds)

        retrying = Retrying(
            retry=retry_if_exception_type(StorageError),
            wait=wait_exponential_jitter(multiplier=0.1, max=5.0, jitter=0.1),
            stop=should_stop,
            before_sleep=before_sleep,
            sleep=sleep,
            reraise=True,
        )
        self._running_since[me] = time.monotonic()
        try:
            return retrying(action)
        finally:
            self._running_since.pop(me, None)
            self._failing.discard(me)
