"""enqueue_many against a real PostgreSQL: what the batch statement's parameters carry.

Keys and types with characters that need escaping, values and headers of any
size and content, delays on some events of a key and not others: each batch is
read back and compared with what was given.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from outbox_kafka import Event, Outbox
from outbox_kafka.stored_headers import headers_from_json

#: Keys a careless array literal would break: quotes, backslashes, separators, NULL.
AWKWARD_KEYS = [
    'a"b',
    "back\\slash",
    "comma,key",
    "{braces}",
    "NULL",
    "null",
    " spaced ",
    "ünïcödé ☃ 𝄞",
    "tab\tand\nnewline",
    "'single'",
]


def rows(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        result = conn.execute(
            sa.text(
                "SELECT event_id, ordering_key, seq, topic, type, value, headers, available_at "
                "FROM outbox ORDER BY ordering_key, seq"
            )
        ).mappings()
        return [{**row, "value": bytes(row["value"])} for row in result]


def table(engine: sa.Engine, name: str) -> dict[str, dict[str, Any]]:
    with engine.connect() as conn:
        result = conn.execute(sa.text(f"SELECT * FROM {name}")).mappings()
        return {row["ordering_key"]: dict(row) for row in result}


def test_awkward_keys_and_types_are_stored_exactly(engine: sa.Engine) -> None:
    box = Outbox(routes={"*": "events"})
    rng = random.Random(3)
    types = ['type "quoted"', "type \\ slashed", "type, with {braces}", "NULL"]
    batch = [
        Event(type=rng.choice(types), key=rng.choice(AWKWARD_KEYS), data={"n": n})
        for n in range(200)
    ]
    with engine.begin() as conn:
        ids = box.enqueue_many(conn, batch)

    stored = {row["event_id"]: row for row in rows(engine)}
    assert len(stored) == 200
    for event_id, event in zip(ids, batch, strict=True):
        row = stored[event_id]
        assert (row["ordering_key"], row["type"]) == (event.key, event.type)
        envelope = json.loads(row["value"])
        assert (envelope["partitionkey"], envelope["type"]) == (event.key, event.type)
        assert envelope["data"] == event.data
    # Per key, sequence numbers 1..n in the order the events were given.
    for key in set(e.key for e in batch):
        given = [i for i, e in zip(ids, batch, strict=True) if e.key == key]
        assert [stored[i]["seq"] for i in given] == list(range(1, len(given) + 1))
    counts = {k: sum(e.key == k for e in batch) for k in set(e.key for e in batch)}
    assert {k: v["last_seq"] for k, v in table(engine, "outbox_key_seq").items()} == counts
    arrivals = table(engine, "outbox_arrivals")
    assert {k: v["first_seq"] for k, v in arrivals.items()} == dict.fromkeys(counts, 1)


def test_values_and_headers_of_any_size_come_back_byte_for_byte(engine: sa.Engine) -> None:
    box = Outbox(routes={"*": "events"})
    rng = random.Random(5)
    batch = []
    given_headers: list[list[tuple[str, bytes]]] = []
    for n in range(60):
        text = "".join(rng.choice('aé☃𝄞"\\\n') for _ in range(rng.randrange(0, 3_000)))
        headers = [("x-n", str(n).encode()), ("x-text", text[:50].encode())]
        if n % 3 == 0:
            headers.append(("x-bin", bytes(rng.randrange(256) for _ in range(rng.randrange(40)))))
        given_headers.append(headers)
        batch.append(Event(type="t", key=f"k{n % 7}", data={"text": text}, headers=headers))
    with engine.begin() as conn:
        ids = box.enqueue_many(conn, batch)

    stored = {row["event_id"]: row for row in rows(engine)}
    for event_id, event, headers in zip(ids, batch, given_headers, strict=True):
        envelope = json.loads(stored[event_id]["value"])
        assert envelope["data"] == event.data
        assert envelope["id"] == str(event_id)
        sent = headers_from_json(stored[event_id]["headers"])
        assert sent is not None
        assert sent == [("content-type", b"application/cloudevents+json"), *headers]


def test_delays_on_some_events_of_a_key(engine: sa.Engine) -> None:
    box = Outbox(routes={"*": "events"})
    later = datetime(2040, 1, 1, tzinfo=UTC)
    sooner = later - timedelta(days=1)
    batch = [
        Event(type="t", key="delayed-first", data=0, available_at=later),
        Event(type="t", key="plain-first", data=1),
        Event(type="t", key="delayed-first", data=2),
        Event(type="t", key="plain-first", data=3, available_at=sooner),
        Event(type="t", key="never", data=4),
    ]
    with engine.begin() as conn:
        box.enqueue_many(conn, batch)
        now = conn.execute(sa.text("SELECT now()")).scalar_one()

    by_data = {json.loads(row["value"])["data"]: row for row in rows(engine)}
    assert [by_data[n]["available_at"] for n in range(5)] == [later, now, now, sooner, now]
    heads = table(engine, "outbox_arrivals")
    assert heads["delayed-first"]["due_at"] == later
    assert heads["plain-first"]["due_at"] == now
    assert heads["never"]["due_at"] == now


def test_a_batch_continues_sequences_and_keeps_queue_rows(engine: sa.Engine) -> None:
    box = Outbox(routes={"*": "events"})
    with engine.begin() as conn:
        box.enqueue_many(conn, [Event(type="t", key=k, data=0) for k in ("a", "b", "a")])
    with engine.begin() as conn:
        box.enqueue_many(conn, [Event(type="t", key=k, data=1) for k in ("b", "c", "a", "b")])

    assert [(r["ordering_key"], r["seq"]) for r in rows(engine)] == [
        ("a", 1),
        ("a", 2),
        ("a", 3),
        ("b", 1),
        ("b", 2),
        ("b", 3),
        ("c", 1),
    ]
    assert {k: v["last_seq"] for k, v in table(engine, "outbox_key_seq").items()} == {
        "a": 3,
        "b": 3,
        "c": 1,
    }
    # A key already queued keeps its arrival; a new key starts at 1.
    assert {k: v["first_seq"] for k, v in table(engine, "outbox_arrivals").items()} == {
        "a": 1,
        "b": 1,
        "c": 1,
    }


def test_one_event_is_written_by_the_single_event_statement(engine: sa.Engine) -> None:
    box = Outbox(routes={"*": "events"})
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    later = datetime(2040, 1, 1, tzinfo=UTC)
    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        with engine.begin() as conn:
            box.enqueue(conn, type="t", key='k"1', data=1, available_at=later)
            box.enqueue_many(conn, [Event(type="t", key='k"1', data=2)])
            box.enqueue_many(conn, [Event(type="t", key="k2", data=3)])
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)

    writes = [statement for statement in seen if "has_function_privilege" not in statement]
    assert len(seen) - len(writes) <= 1  # whether the function is callable: once per connection
    assert len(writes) == 3
    assert all("unnest" not in statement for statement in writes)
    assert [(r["ordering_key"], r["seq"]) for r in rows(engine)] == [
        ('k"1', 1),
        ('k"1', 2),
        ("k2", 1),
    ]
    heads = table(engine, "outbox_arrivals")
    assert heads['k"1']["due_at"] == later and heads['k"1']["first_seq"] == 1
