"""Outboxes in a known state for the operator-command tests, made by the real producer and relay.

Discards come from events whose stored envelope is corrupted after they were
written (the relay refuses them as a permanent error), as in the relay tests.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from outbox_kafka.relay import CycleReport, Relay
from tests.relay_support import enqueue_bulk, make_settings, rows, seq_events, topic_outbox

CORRUPT = sa.text("UPDATE outbox SET value = 'not json'::bytea WHERE event_id = :id")
RESTORE = sa.text("UPDATE outbox SET value = :v WHERE event_id = :id")


def drain(database_url: str, bootstrap: str, **overrides: Any) -> CycleReport:
    relay = Relay(make_settings(database_url, bootstrap, **overrides))
    try:
        return relay.drain()
    finally:
        relay.close()


def corrupt(engine: sa.Engine, event_id: str) -> bytes:
    """Break an event's envelope so the relay discards it; return the original value."""
    with engine.begin() as conn:
        original = conn.execute(
            sa.text("SELECT value FROM outbox WHERE event_id = :id"), {"id": event_id}
        ).scalar_one()
        conn.execute(CORRUPT, {"id": event_id})
    return bytes(original)


def restore(engine: sa.Engine, event_id: str, value: bytes) -> None:
    with engine.begin() as conn:
        conn.execute(RESTORE, {"v": value, "id": event_id})


def snapshot(engine: sa.Engine) -> tuple[list[Any], list[Any]]:
    """Every event's mutable state and the whole key queue, to prove nothing changed."""
    events = rows(
        engine,
        "SELECT CAST(event_id AS text), status, attempts, available_at, last_error, "
        "claim_token FROM outbox ORDER BY event_id",
    )
    keys = rows(engine, "SELECT * FROM outbox_keys ORDER BY ordering_key")
    return events, keys


def counts_by_topic(engine: sa.Engine) -> dict[str, dict[str, int]]:
    """What a grouped count over the whole table says, topic -> status -> n."""
    found: dict[str, dict[str, int]] = defaultdict(dict)
    for topic, status, n in rows(
        engine, "SELECT topic, status, count(*) FROM outbox GROUP BY 1, 2"
    ):
        found[topic][status] = int(n)
    return dict(found)


@dataclass
class Mix:
    """An outbox holding pending, delivered, discarded and parked events on two topics.

    Topic ``busy`` (keys a, b, C): C's second event was discarded with the key
    continuing. Topic ``parked`` (key P, type ``p.e``): P's second event was
    discarded in park mode, so P's third and fourth and the two written later
    wait behind it. Later, a and b got pending events that no relay has sent.
    """

    busy: str
    parked: str
    #: Event ids per key, in sequence order.
    ids: dict[str, list[str]] = field(default_factory=dict)
    continue_discard: str = ""
    parking_event: str = ""
    parking_value: bytes = b""


def build_mix(
    engine: sa.Engine, database_url: str, bootstrap: str, new_topic: Callable[..., str]
) -> Mix:
    mix = Mix(busy=new_topic(2), parked=new_topic(1))
    outbox = topic_outbox()
    ids: dict[str, list[str]] = defaultdict(list)

    def write(topic: str, keys: list[str], count: int, type: str = "t.e") -> list[str]:
        events = seq_events(topic, keys, count, type=type)
        written = enqueue_bulk(engine, outbox, events)
        for event, event_id in zip(events, written, strict=True):
            ids[event.key].append(event_id)
        return written

    first = write(mix.busy, ["a", "b", "C"], 9)
    mix.continue_discard = first[5]  # C's second event
    corrupt(engine, mix.continue_discard)
    report = drain(database_url, bootstrap)
    assert (report.delivered, report.discarded) == (8, 1)

    second = write(mix.parked, ["P"], 4, type="p.e")
    mix.parking_event = second[1]
    mix.parking_value = corrupt(engine, mix.parking_event)
    report = drain(database_url, bootstrap, on_exhausted="park")
    assert (report.delivered, report.discarded) == (1, 1)

    write(mix.busy, ["a", "b"], 5)
    write(mix.parked, ["P"], 2, type="p.e")
    mix.ids = dict(ids)
    return mix
