"""``outbox-kafka stats``: what an outbox holds, from one snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from outbox_kafka.database import storage_errors
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.batch import Remaining
from outbox_kafka.schema.statements import queries_for

from .events import DiscardedEvent, ParkedKey


@dataclass(frozen=True)
class TopicCounts:
    topic: str
    pending: int = 0
    delivered: int | None = 0  # None: not counted
    discarded: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "pending": self.pending,
            "delivered": self.delivered,
            "discarded": self.discarded,
        }


@dataclass(frozen=True)
class OutboxStats:
    """One consistent snapshot of an outbox (one REPEATABLE READ transaction)."""

    table: str
    topics: list[TopicCounts]
    oldest_pending_age_seconds: float | None
    keys_queued: int
    keys_leased: int
    parked_count: int
    parked_keys: list[ParkedKey]
    recent_discards: list[DiscardedEvent]
    delivered_counted: bool = True

    @property
    def totals(self) -> TopicCounts:
        return TopicCounts(
            topic="*",
            pending=sum(t.pending for t in self.topics),
            delivered=sum(t.delivered or 0 for t in self.topics)
            if self.delivered_counted
            else None,
            discarded=sum(t.discarded for t in self.topics),
        )

    def as_dict(self) -> dict[str, Any]:
        totals = self.totals.as_dict()
        del totals["topic"]
        return {
            "table": self.table,
            "totals": totals,
            "topics": [t.as_dict() for t in self.topics],
            "oldest_pending_age_seconds": self.oldest_pending_age_seconds,
            "keys": {"queued": self.keys_queued, "leased": self.keys_leased},
            "parked_keys": {
                "count": self.parked_count,
                "keys": [k.as_dict() for k in self.parked_keys],
            },
            "recent_discards": [e.as_dict() for e in self.recent_discards],
        }


#: A slice of the backlog sweep that takes every key at once.
_ALL_KEYS = 2**62


def outbox_stats(
    engine: Engine,
    names: TableNames | None = None,
    *,
    parked_limit: int = 10,
    discard_limit: int = 10,
    count_delivered: bool = True,
) -> OutboxStats:
    """Counts by topic and status, the backlog's age, parked keys and recent discards.

    Pending and discarded counts come from their partial indexes; counting
    delivered events scans the table (``count_delivered=False`` skips it).
    Everything is read from one snapshot.
    """
    names = names or TableNames()
    q = queries_for(names)
    with storage_errors("reading outbox stats"), engine.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        with conn.begin():
            counts: dict[str, dict[str, int]] = {}
            for row in conn.execute(q["stats_topic_counts"], {"count_delivered": count_delivered}):
                counts.setdefault(row.topic, {})[row.status] = int(row.n)
            backlog = conn.execute(q["stats_backlog"]).one()
            # One slice as large as the key queue: an operator's one-off read.
            age = (
                conn.execute(q["backlog_slice"], {"after_key": "", "slice_keys": _ALL_KEYS})
                .one()
                .oldest_age
            )
            parked = [
                ParkedKey.from_row(r)
                for r in conn.execute(q["stats_parked_keys"], {"limit": max(0, parked_limit)})
            ]
            discards = [
                DiscardedEvent.from_row(r)
                for r in conn.execute(q["stats_recent_discards"], {"limit": max(0, discard_limit)})
            ]
    topics = [
        TopicCounts(
            topic=topic,
            pending=found.get("pending", 0),
            delivered=found.get("delivered", 0) if count_delivered else None,
            discarded=found.get("discarded", 0),
        )
        for topic, found in sorted(counts.items())
    ]
    return OutboxStats(
        table=names.qualified_events,
        topics=topics,
        oldest_pending_age_seconds=float(age) if age is not None else None,
        keys_queued=int(backlog.keys_queued),
        keys_leased=int(backlog.keys_leased),
        parked_count=int(backlog.keys_parked),
        parked_keys=parked,
        recent_discards=discards,
        delivered_counted=count_delivered,
    )


def remaining_work(engine: Engine, names: TableNames | None = None) -> Remaining:
    """What is left pending and why, held events and their reasons named (one
    statement; reads every pending event)."""
    with storage_errors("reading the remaining work"), engine.connect() as conn:
        row = conn.execute(queries_for(names or TableNames())["remaining_work"]).one()
        conn.rollback()
    return Remaining.from_row(row)
