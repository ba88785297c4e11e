"""The backlog sampler and the monitoring reads behind it and behind readiness.

:class:`Monitor` reads one outbox: a ping for readiness probes, and the backlog
and consistency samples behind the relay's gauges. Cheap statements, each with a
timeout, on a small engine of their own so that probes never wait behind the
relay's work.

:class:`BacklogSampler` sets the gauges (pending events, oldest pending age,
parked keys and consistency violations) every few seconds. It runs in a supervised
loop of the relay's (:class:`~outbox_kafka.relay.loop.SupervisedLoop`)
and on a database connection of its own, so the claim loop never waits for it,
and a failed sample (logged, counted in ``outbox_database_errors_total``) only
leaves the gauges at their last value.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine

from outbox_kafka.database import make_engine, storage_errors
from outbox_kafka.errors import StorageError
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.observe import RelayObserver
from outbox_kafka.schema.statements import millis, queries_for


@dataclass(frozen=True)
class Backlog:
    """One sample of the outbox's backlog."""

    pending: int
    oldest_age_seconds: float | None
    parked_keys: int


class Monitor:
    """Monitoring reads of one outbox."""

    def __init__(self, engine: Engine, names: TableNames) -> None:
        self._engine = engine
        self._q = queries_for(names)

    @classmethod
    def connect(
        cls, database_url: str, names: TableNames, *, connect_timeout: float = 2.0
    ) -> Monitor:
        """A monitor with its own engine (one pooled connection, short connect timeout)."""
        engine = make_engine(
            database_url,
            pool_size=1,
            max_overflow=1,
            connect_args={"connect_timeout": max(1, round(connect_timeout))},
        )
        return cls(engine, names)

    def ping(self, timeout: float) -> None:
        """Run ``SELECT 1`` within ``timeout`` seconds; raise StorageError otherwise."""
        with storage_errors("checking the database"), self._engine.begin() as conn:
            conn.execute(self._q["statement_timeout"], {"milliseconds": millis(timeout)})
            conn.execute(self._q["ping"])

    def backlog(self, timeout: float) -> Backlog:
        """Pending events, the oldest one's age and parked keys, in one snapshot.

        Reads the key queue, the key counters and each queued key's first
        pending event, never the rest of the event rows, so a sample costs
        one probe per key with work at any backlog.
        """
        with storage_errors("sampling the backlog"), self._engine.connect() as conn:
            snapshot = conn.execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            )
            with snapshot.begin():
                snapshot.execute(self._q["statement_timeout"], {"milliseconds": millis(timeout)})
                pending = snapshot.execute(self._q["pending_events_estimate"]).scalar_one()
                age = snapshot.execute(self._q["oldest_pending_age"]).scalar_one()
                parked = snapshot.execute(self._q["parked_key_count"]).scalar_one()
        return Backlog(
            pending=int(pending),
            oldest_age_seconds=None if age is None else max(0.0, float(age)),
            parked_keys=int(parked),
        )

    def consistency_violations(self, timeout: float) -> int:
        """Keys whose pending events no relay will reach, plus broken queue rows.

        One statement: a probe of the claim index per key with pending events
        and a pass over the key queue, so its cost grows with the keys that
        have work, not with the events; 0 in a consistent outbox.
        """
        with storage_errors("counting consistency violations"), self._engine.begin() as conn:
            conn.execute(self._q["statement_timeout"], {"milliseconds": millis(timeout)})
            return int(conn.execute(self._q["consistency_violation_count"]).scalar_one())

    def close(self) -> None:
        self._engine.dispose()


class BacklogSampler:
    """Sets ``outbox_pending_events``, ``outbox_oldest_pending_age_seconds``,
    ``outbox_parked_keys`` and ``outbox_consistency_violations`` every
    ``settings.sample_interval`` seconds, announcing each sample (and each failed
    one) to ``observer``: the metrics set the gauges, the logs say what failed."""

    def __init__(
        self, settings: RelaySettings, observer: RelayObserver, *, monitor: Monitor | None = None
    ) -> None:
        self.interval = settings.sample_interval
        self.observer = observer
        self._monitor = monitor or Monitor.connect(settings.database_url, settings.names)
        # A sample may take at most one interval (and never more than 30 s).
        self._timeout = min(30.0, max(1.0, self.interval))
        self._first = True

    def sample_once(self) -> Backlog | None:
        """Take one sample and set the gauges; None (logged and counted) when it failed."""
        try:
            backlog = self._monitor.backlog(self._timeout)
        except StorageError as exc:
            self.observer.sample_failed("backlog", exc)
            return None
        self.observer.sampled(backlog.pending, backlog.oldest_age_seconds, backlog.parked_keys)
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
            self.observer.sample_failed("consistency", exc)
            return None
        self.observer.violations_counted(violations)
        return violations

    def delay(self) -> float:
        """Seconds to the next sample: none before the first, then the interval."""
        if self._first:
            self._first = False
            return 0.0
        return self.interval

    def stop(self) -> None:
        """Close the sampler's connection (once its supervised loop has stopped)."""
        self._monitor.close()
