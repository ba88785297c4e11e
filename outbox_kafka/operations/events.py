"""Discarded events and parked keys, as the operator commands show them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Row


def _utc(value: datetime | None) -> datetime | None:
    return value.astimezone(UTC) if value is not None else None


def _iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat() if value is not None else None


@dataclass(frozen=True)
class DiscardedEvent:
    """A discarded event, as the operator commands show it."""

    event_id: str
    key: str
    seq: int
    topic: str
    type: str
    attempts: int
    last_error: str | None
    created_at: datetime

    @classmethod
    def from_row(
        cls, row: Row[Any], *, seq: int | None = None, created_at: datetime | None = None
    ) -> DiscardedEvent:
        """The event ``row`` holds; ``seq`` and ``created_at`` stand in where it has none."""
        created = _utc(row.created_at) or created_at
        assert created is not None
        return cls(
            event_id=row.event_id,
            key=row.ordering_key,
            seq=int(row.seq if seq is None else seq),
            topic=row.topic,
            type=row.type,
            attempts=int(row.attempts),
            last_error=row.last_error,
            created_at=created,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "key": self.key,
            "seq": self.seq,
            "topic": self.topic,
            "type": self.type,
            "attempts": self.attempts,
            "last_error": self.last_error,
            "created_at": _iso(self.created_at),
        }


@dataclass(frozen=True)
class ParkedKey:
    """A parked key and the discarded event that parked it (None once purged)."""

    key: str
    next_seq: int
    parked_at: datetime
    event: DiscardedEvent | None

    @classmethod
    def from_row(cls, row: Row[Any]) -> ParkedKey:
        parked_at = _utc(row.parked_at)
        assert parked_at is not None
        event = None
        if row.event_id is not None:
            event = DiscardedEvent.from_row(row, seq=int(row.next_seq), created_at=parked_at)
        return cls(row.ordering_key, int(row.next_seq), parked_at, event)

    @property
    def reason(self) -> str | None:
        return self.event.last_error if self.event is not None else None

    def as_dict(self) -> dict[str, Any]:
        event = self.event
        return {
            "key": self.key,
            "next_seq": self.next_seq,
            "parked_at": _iso(self.parked_at),
            "event_id": event.event_id if event else None,
            "topic": event.topic if event else None,
            "type": event.type if event else None,
            "reason": self.reason,
        }
