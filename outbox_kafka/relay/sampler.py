"""The backlog sampler: pending events, oldest pending age, parked keys and consistency
violations, every few seconds.

It runs in a thread and on a database connection of its own, so the claim
loop never waits for it, and a failed sample (logged, counted in
``outbox_database_errors_total``) only leaves the gauges at their last value.
"""

from __future__ import annotations

import logging
import threading

from outbox_kafka.errors import StorageError
from outbox_kafka.relay.metrics import RelayMetrics
from outbox_kafka.relay.settings import RelaySettings
from outbox_kafka.relay.store import Backlog, Store

log = logging.getLogger("outbox_kafka.sampler")


class BacklogSampler:
    """Sets ``outbox_pending_events``, ``outbox_oldest_pending_age_seconds``,
    ``outbox_parked_keys`` and ``outbox_consistency_violations`` every
    ``settings.sample_interval`` seconds."""

    def __init__(
        self, settings: RelaySettings, metrics: RelayMetrics, *, store: Store | None = None
    ) -> None:
        self.interval = settings.sample_interval
        self.metrics = metrics
        self._store = store or Store.for_monitoring(settings.database_url, settings.names)
        # A sample may take at most one interval (and never more than 30 s).
        self._timeout = min(30.0, max(1.0, self.interval))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> Backlog | None:
        """Take one sample and set the gauges; None (logged and counted) when it failed."""
        try:
            backlog = self._store.backlog(self._timeout)
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
            violations = self._store.consistency_violations(self._timeout)
        except StorageError as exc:
            self.metrics.db_errors.inc()
            log.warning(
                "consistency count failed", extra={"action": "sample_failed", "error": str(exc)}
            )
            return None
        self.metrics.consistency_violations.set(violations)
        return violations

    def start(self) -> BacklogSampler:
        """Sample now, then every interval, in a daemon thread, until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="outbox-sampler", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            try:
                self.sample_once()
            except Exception:
                # Whatever happens here, the relay keeps relaying.
                log.exception("backlog sampler error", extra={"action": "sample_failed"})
            if self._stop.wait(self.interval):
                return

    def stop(self, timeout: float = 5.0) -> None:
        """Stop sampling and close the sampler's connection."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._store.close()
