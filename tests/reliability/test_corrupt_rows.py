"""Rows changed behind the library's back: the relay sets them aside and keeps relaying.

Each case rewrites one pending event in SQL (as a buggy script or a person
with a psql prompt might) between two good events of the same key. A
running relay must discard it with a reason naming the problem, deliver the
key's other events in order, and never stop. What the schema's CHECK
constraints forbid is refused by PostgreSQL; a superuser can still get such
a row in (drop the constraint, write, add it back NOT VALID) and the relay
must survive that too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import sqlalchemy as sa

from outbox_kafka import Event
from outbox_kafka.relay import Relay
from tests.relay_support import (
    consume_all,
    make_settings,
    outbox_summary,
    per_key_order,
    running_relay,
    scalar,
    topic_outbox,
    wait_until,
)

#: Nesting far beyond Python's recursion limit (1,000), within PostgreSQL's for jsonb.
DEEP = 5_000


@dataclass(frozen=True)
class Corruption:
    id: str
    #: SQL run on the middle event (``:id``), as the superuser.
    sql: str
    #: What ``last_error`` of the discarded event must say; None: not discarded.
    reason: str | None


CORRUPTIONS = [
    Corruption("value-not-json", "UPDATE outbox SET value = 'not json'::bytea", "INVALID_ENVELOPE"),
    Corruption(
        "value-not-utf8", "UPDATE outbox SET value = '\\xfffe00'::bytea", "INVALID_ENVELOPE"
    ),
    Corruption("value-json-array", "UPDATE outbox SET value = '[1, 2]'::bytea", "INVALID_ENVELOPE"),
    Corruption(
        "value-nested-too-deep",
        f"UPDATE outbox SET value = convert_to(repeat('[', {DEEP}) || repeat(']', {DEEP}), 'UTF8')",
        "INVALID_ENVELOPE",
    ),
    Corruption(
        "value-other-id",
        "UPDATE outbox SET value = convert_to(replace(convert_from(value, 'UTF8'), "
        "CAST(event_id AS text), CAST(gen_random_uuid() AS text)), 'UTF8')",
        "INVALID_ENVELOPE",
    ),
    Corruption(
        "value-other-key",
        "UPDATE outbox SET value = convert_to(replace(convert_from(value, 'UTF8'), "
        "'\"partitionkey\":' || CAST(to_json(ordering_key) AS text), "
        "'\"partitionkey\":\"someone else\"'), 'UTF8')",
        "INVALID_ENVELOPE",
    ),
    Corruption(
        "headers-object", 'UPDATE outbox SET headers = \'{"a": "b"}\'::jsonb', "INVALID_HEADERS"
    ),
    Corruption("headers-scalar", "UPDATE outbox SET headers = '42'::jsonb", "INVALID_HEADERS"),
    Corruption(
        "headers-value-number",
        "UPDATE outbox SET headers = '[[\"a\", 5]]'::jsonb",
        "INVALID_HEADERS",
    ),
    Corruption(
        "headers-name-number",
        "UPDATE outbox SET headers = '[[1, \"x\"]]'::jsonb",
        "INVALID_HEADERS",
    ),
    Corruption(
        "headers-bad-base64",
        'UPDATE outbox SET headers = \'[["a", {"base64": "!!!"}]]\'::jsonb',
        "INVALID_HEADERS",
    ),
    Corruption(
        "headers-nested-too-deep",
        f"UPDATE outbox SET headers = CAST(repeat('[', {DEEP}) || repeat(']', {DEEP}) AS jsonb)",
        "INVALID_HEADERS",
    ),
    Corruption("topic-illegal", "UPDATE outbox SET topic = 'no such/topic'", "INVALID_TOPIC"),
    Corruption("type-empty", "UPDATE outbox SET type = ''", None),
    # Beyond the CHECK constraints: only a superuser gets these rows in.
    Corruption(
        "attempts-negative",
        "ALTER TABLE outbox DROP CONSTRAINT outbox_attempts_check; "
        "UPDATE outbox SET attempts = -5; "
        "ALTER TABLE outbox ADD CONSTRAINT outbox_attempts_check CHECK (attempts >= 0) NOT VALID",
        None,
    ),
    Corruption(
        "status-unknown",
        "ALTER TABLE outbox DROP CONSTRAINT outbox_status_check; "
        "UPDATE outbox SET status = 'weird'; "
        "ALTER TABLE outbox ADD CONSTRAINT outbox_status_check "
        "CHECK (status IN ('pending', 'delivered', 'discarded')) NOT VALID",
        None,
    ),
]


def test_rows_altered_behind_the_librarys_back_do_not_stop_the_relay(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """Every corruption at once, each on a key of its own between two good events."""
    topic = new_topic(2)
    outbox = topic_outbox()
    keys = [f"K-{c.id}" for c in CORRUPTIONS]
    with engine.begin() as conn:
        ids = [
            str(i)
            for i in outbox.enqueue_many(
                conn,
                [
                    Event(type="t.e", key=k, data={"n": n}, topic=topic)
                    for n in range(3)
                    for k in [*keys, "good"]
                ],
            )
        ]
    per_key = {k: ids[i :: len(keys) + 1] for i, k in enumerate([*keys, "good"])}
    # Each key's middle event is the one altered.
    with engine.begin() as conn:
        for c, key in zip(CORRUPTIONS, keys, strict=True):
            for statement in c.sql.split("; "):
                where = "" if statement.startswith("ALTER") else " WHERE event_id = :id"
                conn.execute(sa.text(statement + where), {"id": per_key[key][1]})

    relay = Relay(make_settings(database_url, kafka_bootstrap))
    expected = sum(3 if c.reason is None and c.id != "status-unknown" else 2 for c in CORRUPTIONS)
    with running_relay(relay) as thread:
        wait_until(
            lambda: (
                not thread.is_alive()
                or scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'") == 0
            ),
            90,
            what="every pending event settled",
            explain=lambda: outbox_summary(engine),
        )
        assert thread.is_alive(), f"the relay died: {thread.error!r}"
        wait_until(lambda: thread.total("delivered") >= expected + 3, 30)
        assert thread.error is None, thread.error

    records = consume_all(kafka_bootstrap, topic, expected + 3)
    assert len(records) == expected + 3
    order = per_key_order(records)
    assert order["good"] == per_key["good"]
    for c, key in zip(CORRUPTIONS, keys, strict=True):
        first, victim, last = per_key[key]
        status, error = scalar_row(engine, victim)
        if c.reason is not None:
            assert (status, c.reason in (error or "")) == ("discarded", True), (c.id, error)
            assert order[key] == [first, last], c.id
        elif c.id == "status-unknown":
            # Not pending, so never claimed; the key goes on past it.
            assert status == "weird"
            assert order[key] == [first, last], c.id
        else:
            assert status == "delivered", (c.id, status, error)
            assert order[key] == [first, victim, last], c.id


def scalar_row(engine: sa.Engine, event_id: str) -> tuple[str, str | None]:
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT status, last_error FROM outbox WHERE event_id = :id"), {"id": event_id}
        ).one()
    return row[0], row[1]


@pytest.mark.parametrize(
    "assignment",
    ["status = 'weird'", "status = NULL", "attempts = -1", "value = NULL", "headers = NULL"],
)
def test_the_schema_refuses_rows_the_relay_could_not_read(
    engine: sa.Engine, assignment: str
) -> None:
    outbox = topic_outbox()
    with engine.begin() as conn:
        [event_id] = outbox.enqueue_many(conn, [Event(type="t.e", key="K", data={}, topic="t")])
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE outbox SET {assignment} WHERE event_id = :id"), {"id": event_id}
        )
    assert (
        scalar(engine, "SELECT status FROM outbox WHERE event_id = :id", id=event_id) == "pending"
    )
