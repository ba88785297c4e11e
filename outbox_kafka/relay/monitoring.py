"""Monitoring reads of one outbox: a ping for readiness probes, and the backlog and
consistency samples behind the relay's gauges. Cheap statements, each with a timeout,
on a small engine of their own so that probes never wait behind the relay's work."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine

from outbox_kafka.database import make_engine, storage_errors
from outbox_kafka.naming import TableNames
from outbox_kafka.queries import millis, queries_for


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
