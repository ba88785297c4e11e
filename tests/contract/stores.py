"""The two stores the contract suite holds to one behaviour: the relay's `Store` on a
fresh PostgreSQL database and `InMemoryStore`.

Each comes as a :class:`StoreUnderTest`: the store itself (used through its port
only), a way to write events into it as a producer does, to act on it as an
operator does (requeue, unpark), to read its events' rows and its keys' doubt
back, and to let time pass. On PostgreSQL time passes by moving every stored time back (nothing
sleeps); in memory the store's clock moves on.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import sqlalchemy as sa

from outbox_kafka import Event, Outbox
from outbox_kafka.naming import TableNames
from outbox_kafka.operations.requeue import requeue_events, unpark_keys
from outbox_kafka.relay.batch import Claim
from outbox_kafka.relay.ports import ClaimStore
from outbox_kafka.relay.store import Store
from outbox_kafka.testing import InMemoryStore

#: How much each reading of the in-memory clock moves it on: every call commits
#: at a time of its own, as each transaction has its own now() in PostgreSQL.
_TICK = 1e-6

#: Every stored time of the default outbox, by table (see outbox_kafka/tables.py).
_TIMES = {
    "outbox": ("available_at", "delivered_at", "created_at"),
    "outbox_keys": ("due_at", "lease_expires_at", "parked_at", "created_at"),
    "outbox_arrivals": ("due_at",),
    "outbox_floors": ("created_at",),
}


@dataclass(frozen=True)
class Row:
    """One event as the store keeps it."""

    event_id: str
    key: str
    seq: int
    status: str
    attempts: int
    last_error: str | None
    partition: int | None
    offset: int | None


class StoreUnderTest(Protocol):
    """A store of the relay, with what the contract suite needs around it."""

    store: ClaimStore

    def add(self, key: str, count: int = 1, *, size: int = 10, delay: float = 0.0) -> list[str]:
        """Write ``count`` events of ``key`` in one producer transaction; their ids.

        Each value holds ``size`` bytes of padding; ``delay`` seconds hold them back."""
        ...

    def later(self, seconds: float) -> None:
        """Let ``seconds`` pass for everything the store keeps."""
        ...

    def rows(self) -> list[Row]:
        """Every stored event, by key then sequence number."""
        ...

    def parked_keys(self) -> list[str]: ...

    def doubt(self, key: str) -> list[str]:
        """The relay sessions ``key`` is in doubt about, in the order they joined
        (empty: none, or no such key in the queue)."""
        ...

    def requeue(self, event_ids: Sequence[str]) -> int: ...

    def unpark(self, keys: Sequence[str]) -> int: ...


def events(key: str, count: int, size: int, delay: float) -> list[Event]:
    return [
        Event(
            type="contract.e",
            key=key,
            data={"n": n, "pad": "x" * size},
            topic="contract",
            headers={"x-n": str(n)},
            delay=timedelta(seconds=delay) if delay else None,
        )
        for n in range(count)
    ]


def claim(
    store: ClaimStore,
    *,
    batch_size: int = 100,
    lease_seconds: float = 30.0,
    max_keys: int | None = None,
    max_bytes: int = 1 << 20,
    session: uuid.UUID | None = None,
) -> Claim:
    return store.claim(
        batch_size=batch_size,
        lease_seconds=lease_seconds,
        max_keys=max_keys,
        max_bytes=max_bytes,
        session=session,
    )


class PostgresStore:
    """The relay's ``Store`` on a fresh database; the producer and operators as the library's."""

    def __init__(self, engine: sa.Engine, database_url: str) -> None:
        self.engine = engine
        self.outbox = Outbox(allow_unknown_types=True)
        self.store: Store = Store(database_url, TableNames())

    def add(self, key: str, count: int = 1, *, size: int = 10, delay: float = 0.0) -> list[str]:
        with self.engine.begin() as conn:
            ids = self.outbox.enqueue_many(conn, events(key, count, size, delay))
        return [str(i) for i in ids]

    def later(self, seconds: float) -> None:
        shift = {"seconds": seconds}
        with self.engine.begin() as conn:
            for table, columns in _TIMES.items():
                moved = ", ".join(f"{c} = {c} - make_interval(secs => :seconds)" for c in columns)
                conn.execute(sa.text(f"UPDATE {table} SET {moved}"), shift)

    def rows(self) -> list[Row]:
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.text(
                    "SELECT CAST(event_id AS text), ordering_key, seq, status, attempts,"
                    " last_error, kafka_partition, kafka_offset"
                    " FROM outbox ORDER BY ordering_key, seq"
                )
            )
            return [Row(*r) for r in found]

    def parked_keys(self) -> list[str]:
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.text(
                    "SELECT ordering_key FROM outbox_keys WHERE parked_at IS NOT NULL"
                    " ORDER BY ordering_key"
                )
            )
            return list(found.scalars())

    def doubt(self, key: str) -> list[str]:
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.text(
                    "SELECT CAST(doubt_sessions AS text[]) FROM outbox_keys"
                    " WHERE ordering_key = :key"
                ),
                {"key": key},
            ).scalar()
            return list(found or [])

    def requeue(self, event_ids: Sequence[str]) -> int:
        return requeue_events(self.engine, event_ids)

    def unpark(self, keys: Sequence[str]) -> int:
        return unpark_keys(self.engine, keys)

    def close(self) -> None:
        self.store.close()


class MemoryStore:
    """``InMemoryStore`` on a clock that moves when told, and by a tick at each reading."""

    def __init__(self) -> None:
        self.now = 1_000.0
        self.outbox = Outbox(allow_unknown_types=True)
        self.store: InMemoryStore = InMemoryStore(clock=self._clock)

    def _clock(self) -> float:
        self.now += _TICK
        return self.now

    def add(self, key: str, count: int = 1, *, size: int = 10, delay: float = 0.0) -> list[str]:
        return [str(self.store.enqueue(self.outbox, e)) for e in events(key, count, size, delay)]

    def later(self, seconds: float) -> None:
        self.now += seconds

    def rows(self) -> list[Row]:
        return [
            Row(
                e.event_id,
                e.key,
                e.seq,
                str(e.status),
                e.attempts,
                e.error,
                e.partition,
                e.offset,
            )
            for e in self.store.events()
        ]

    def parked_keys(self) -> list[str]:
        return self.store.parked_keys()

    def doubt(self, key: str) -> list[str]:
        return self.store.doubt(key)

    def requeue(self, event_ids: Sequence[str]) -> int:
        return self.store.requeue(event_ids)

    def unpark(self, keys: Sequence[str]) -> int:
        return self.store.unpark(keys)


def postgres(engine: sa.Engine, database_url: str) -> Iterator[StoreUnderTest]:
    under_test = PostgresStore(engine, database_url)
    try:
        yield under_test
    finally:
        under_test.close()


def memory() -> Iterator[StoreUnderTest]:
    yield MemoryStore()
