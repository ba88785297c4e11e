"""The relay's promises at the edges, against real PostgreSQL and a real broker:
a topic that does not exist yet, and a record batch the broker refuses whole."""

from __future__ import annotations

import uuid
from pathlib import Path

import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from outbox_kafka import Event
from outbox_kafka.demo.embedded import EmbeddedBroker
from outbox_kafka.operations import remaining_work, requeue_events, unpark_keys
from outbox_kafka.relay import Relay
from outbox_kafka.relay.config import RelaySettings
from tests.relay_support import (
    NO_POISON,
    consume_all,
    make_settings,
    per_key_order,
    rows,
    topic_outbox,
)


def _drain(settings: RelaySettings) -> None:
    relay = Relay(settings)
    try:
        relay.drain()
    finally:
        relay.close()


def _create(bootstrap: str, topic: str, partitions: int = 2) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        future.result(timeout=30)


def _due_now(conn: sa.Connection) -> None:
    """Every key and event due again now, instead of after its backoff."""
    conn.exec_driver_sql("UPDATE outbox_keys SET due_at = now()")
    conn.exec_driver_sql("UPDATE outbox SET available_at = now() WHERE status = 'pending'")


def _statuses(engine: sa.Engine) -> list[tuple[str, int, str, int]]:
    return [
        tuple(r)
        for r in rows(
            engine,
            "SELECT ordering_key, seq, status, attempts FROM outbox ORDER BY ordering_key, seq",
        )
    ]


def test_events_for_a_missing_topic_wait_in_order_until_it_is_created(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    topic = f"late-{uuid.uuid4().hex[:12]}"
    outbox = topic_outbox()
    events = [Event(type="t.e", key=k, topic=topic, data={"i": i}) for i in range(3) for k in "ab"]
    with engine.begin() as conn:
        ids = [str(i) for i in outbox.enqueue_many(conn, events)]
    settings = make_settings(database_url, kafka_bootstrap, max_attempts=2)
    for _ in range(3):  # more tries than max_attempts: still nothing is discarded
        _drain(settings)
        with engine.begin() as conn:
            _due_now(conn)
    assert {(status, attempts) for _, _, status, attempts in _statuses(engine)} == {("pending", 0)}
    (error,) = rows(engine, "SELECT DISTINCT last_error FROM outbox WHERE seq = 1")
    assert error[0].startswith("UNKNOWN_TOPIC")

    _create(kafka_bootstrap, topic)
    _drain(settings)
    assert {status for _, _, status, _ in _statuses(engine)} == {"delivered"}
    records = consume_all(kafka_bootstrap, topic, expected=len(ids))
    expected = {k: [i for e, i in zip(events, ids, strict=True) if e.key == k] for k in "ab"}
    assert per_key_order(records) == expected


def test_a_refused_record_batch_discards_only_the_event_the_broker_refuses_alone(
    engine: sa.Engine, database_url: str, validating_broker: tuple[EmbeddedBroker, Path]
) -> None:
    broker, schemas = validating_broker
    topic = f"strict-{uuid.uuid4().hex[:12]}"
    (schemas / f"{topic}.json").write_text(NO_POISON)
    _create(broker.bootstrap, topic, partitions=1)
    outbox = topic_outbox()
    events = [Event(type="t.e", key=k, topic=topic, data={"i": i}) for i in range(3) for k in "abc"]
    events.insert(4, Event(type="t.e", key="b", topic=topic, data={"poison": True}))
    with engine.begin() as conn:
        ids = [str(i) for i in outbox.enqueue_many(conn, events)]
    settings = make_settings(database_url, broker.bootstrap, max_attempts=5)
    for _ in range(5):  # the broker may fence the producer after a refusal: tried again
        _drain(settings)
        with engine.begin() as conn:
            _due_now(conn)
    states = {(key, seq): status for key, seq, status, _ in _statuses(engine)}
    poisoned = ids[4]
    discarded = [
        r[0]
        for r in rows(
            engine, "SELECT CAST(event_id AS text) FROM outbox WHERE status = 'discarded'"
        )
    ]
    assert discarded == [poisoned], states
    assert sorted(states.values()).count("delivered") == len(ids) - 1
    records = consume_all(broker.bootstrap, topic, expected=len(ids) - 1)
    expected = {
        k: [i for e, i in zip(events, ids, strict=True) if e.key == k and i != poisoned]
        for k in "abc"
    }
    assert per_key_order(records) == expected


def test_a_requeue_or_unpark_keeps_a_key_waiting_while_a_message_of_it_may_still_land(
    engine: sa.Engine,
) -> None:
    """The relay holds a key whose message got no delivery report for a lease: the
    message may still land. An operator's requeue or unpark must not make it due
    sooner (found by the model checker: the key was sent again meanwhile)."""
    outbox = topic_outbox()
    with engine.begin() as conn:
        outbox.enqueue_many(
            conn, [Event(type="t.e", key=k, topic="t", data={"i": i}) for k in "ab" for i in (1, 2)]
        )
        conn.exec_driver_sql(
            "INSERT INTO outbox_keys (ordering_key, next_seq, due_at) "
            "SELECT ordering_key, first_seq, due_at FROM outbox_arrivals ON CONFLICT DO NOTHING"
        )
        conn.exec_driver_sql("DELETE FROM outbox_arrivals")
        # Event 1 discarded; event 2 sent, unreported: the key is held for a lease.
        conn.exec_driver_sql(
            "UPDATE outbox SET status = 'discarded', last_error = 'x' WHERE seq = 1"
        )
        conn.exec_driver_sql(
            "UPDATE outbox_keys SET next_seq = 2, due_at = now() + interval '30 seconds', "
            "parked_at = CASE WHEN ordering_key = 'b' THEN now() END"
        )
    [(discarded_a,)] = rows(
        engine, "SELECT event_id FROM outbox WHERE ordering_key = 'a' AND seq = 1"
    )
    assert requeue_events(engine, [discarded_a]) == 1
    assert unpark_keys(engine, ["b"]) == 1
    waits = rows(
        engine,
        "SELECT ordering_key, next_seq, due_at > now() + interval '25 seconds' "
        "FROM outbox_keys ORDER BY ordering_key",
    )
    assert [tuple(r) for r in waits] == [("a", 1, True), ("b", 2, True)]


def test_a_requeued_event_starts_afresh_and_is_not_counted_as_held(engine: sa.Engine) -> None:
    outbox = topic_outbox()
    with engine.begin() as conn:
        [event_id] = outbox.enqueue_many(conn, [Event(type="t.e", key="k", topic="t", data={})])
        conn.exec_driver_sql(
            "UPDATE outbox SET status = 'discarded', attempts = 3, last_error = 'gave up'"
        )
    assert requeue_events(engine, [event_id]) == 1
    [(attempts, error)] = rows(engine, "SELECT attempts, last_error FROM outbox")
    assert (attempts, error) == (0, None)
    with engine.begin() as conn:  # the key waits, as behind a lease taken back
        conn.exec_driver_sql("UPDATE outbox_keys SET due_at = now() + interval '30 seconds'")
    left = remaining_work(engine)
    assert (left.pending, left.held) == (1, 0)
