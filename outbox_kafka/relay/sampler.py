"""The backlog sampler: pending events, oldest pending age, parked keys and consistency
violations, every few seconds.

It runs in a thread and on a database connection of its own, so the claim
loop never waits for it, and a failed sample (logged, counted in
``outbox_database_errors_total``) only leaves the gauges at their last value.
"""

from __future__ import annotations

import logging

from outbox_kafka.errors import StorageError
from outbox_kafka.relay.background import SupervisedLoop
from outbox_kafka.relay.metrics import RelayMetrics
from outbox_kafka.relay.monitoring import Backlog, Monitor
from outbox_kafka.relay.settings import RelaySettings

log = logging.getLogger("outbox_kafka.sampler")


class BacklogSampler:
    """Sets ``outbox_pending_events``, ``outbox_oldest_pending_age_seconds``,
    ``outbox_parked_keys`` and ``outbox_consistency_violations`` every
    ``settings.sample_interval`` seconds."""

    def __init__(
        self, settings: RelaySettings, metrics: RelayMetrics, *, monitor: Monitor | None = None
    ) -> None:
        self.interval = settings.sample_interval
        self.metrics = metrics
        self._monitor = monitor or Monitor.connect(settings.database_url, settings.names)
        # A sample may take at most one interval (and never more than 30 s).
        self._timeout = min(30.0, max(1.0, self.interval))
        self._loop: SupervisedLoop | None = None

    def sample_once(self) -> Backlog | None:
        """Take one sample and set the gauges; None (logged and counted) when it failed."""
        try:
            backlog = self._monitor.backlog(self._timeout)
        except StorageError as exc:
            self.metrics.db_errors.inc()
            log.warning(
                "backlog sample failed", extra={"action": "sample_failed", "error": str(exc)}
            )
            return None
        self.metrics.observe_backlog(
            backlog.pending, backlog.oldest_age_seconds, backlog.parked_keys
        )
        self.count_violations()
        return backlog

    def count_violations(self) -> int | None:
        """Set ``outbox_consistency_violations``; None (logged and counted) when it failed.

        Apart from the backlog sample, so that a slow count on a huge key
        queue never costs the other gauges their value.
        """
        try:
            violations = self._monitor.consistency_violations(self._timeout)
        except StorageError as exc:
            self.metrics.db_errors.inc()
            log.warning(
                "consistency count failed", extra={"action": "sample_failed", "error": str(exc)}
            )
            return None
        self.metrics.consistency_violations.set(violations)
        return violations

    def start(self) -> BacklogSampler:
        """Sample now, then every interval, in a supervised thread, until :meth:`stop`."""
        first = [True]

        def delay() -> float:
            if first[0]:
                first[0] = False
                return 0.0
            return self.interval

        self._loop = SupervisedLoop("sampler", self.sample_once, delay, self.metrics).start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop sampling and close the sampler's connection."""
        if self._loop is not None:
            self._loop.stop(timeout)
        self._monitor.close()
