"""Arrivals, the keys producers queue for the relays.

Writers collide only with writers: a REPEATABLE READ or SERIALIZABLE producer
whose key a relay claims, records or removes after the producer's snapshot still
commits; two producers of one key still fail to serialize, as before. Claims take
every arrival in, whatever their number, and an outbox at schema version 1
upgrades with its queued keys."""

from __future__ import annotations

from collections.abc import Callable

import psycopg2.errors
import pytest
import sqlalchemy as sa

from outbox_kafka import Event, Outbox, migrate
from outbox_kafka.database import make_engine
from outbox_kafka.naming import TableNames
from outbox_kafka.operations import check_consistency
from outbox_kafka.relay import Relay
from outbox_kafka.relay.batch import EventOutcome, KeyOutcome
from outbox_kafka.relay.store import Store
from tests.relay_support import (
    admit_arrivals,
    consume_all,
    enqueue_bulk,
    make_settings,
    migrate_to,
    per_key_order,
    rows,
    scalar,
    topic_outbox,
)

KEY = "k-iso"
LEVELS = ["REPEATABLE READ", "SERIALIZABLE"]


def _relay_claims(store: Store) -> None:
    """Lease the key and read its first event; the lease stays."""
    [key] = store.claim(batch_size=1, lease_seconds=30).keys
    assert key.key == KEY and len(key.events) == 1


def _record_first(store: Store, status: str, park: bool) -> None:
    """Claim the key's first event and record it with ``status``: the key row changes."""
    claim = store.claim(batch_size=1, lease_seconds=30)
    [key] = claim.keys
    event = key.events[0]
    next_seq = event.seq if park else event.seq + 1
    error = "test" if status == "discarded" else None
    store.record(
        claim.token,
        [KeyOutcome(KEY, next_seq, 0.0, park, False)],
        [EventOutcome(event.event_id, KEY, status, int(park), 0.0, None, None, error)],
    )


def _relay_records(store: Store) -> None:
    """Record the key's first event delivered: the key row moves on."""
    _record_first(store, "delivered", park=False)


def _relay_parks(store: Store) -> None:
    """Discard the key's first event and park the key on it."""
    _record_first(store, "discarded", park=True)


RELAY_STEPS: dict[str, Callable[[Store], None]] = {
    "claims": _relay_claims,
    "records": _relay_records,
    "parks": _relay_parks,
}


@pytest.mark.parametrize("step", list(RELAY_STEPS))
@pytest.mark.parametrize("level", LEVELS)
def test_a_writer_commits_whatever_a_relay_did_to_its_key_after_its_snapshot(
    engine: sa.Engine, database_url: str, level: str, step: str
) -> None:
    outbox = topic_outbox()
    enqueue_bulk(engine, outbox, [Event(type="t", key=KEY, data=n, topic="t") for n in range(2)])
    store = Store(database_url, TableNames())
    try:
        admit_arrivals(engine)  # the key is in the relay's queue
        with engine.connect() as writer_conn:
            writer = writer_conn.execution_options(isolation_level=level)
            writer.execute(sa.text("SELECT 1"))  # the writer's snapshot
            RELAY_STEPS[step](store)
            outbox.enqueue(writer, type="t", key=KEY, data=2, topic="t")
            writer.commit()
    finally:
        store.close()
    assert [r[0] for r in rows(engine, "SELECT seq FROM outbox ORDER BY seq")] == [1, 2, 3]
    assert check_consistency(engine).ok


@pytest.mark.parametrize("level", LEVELS)
def test_a_writer_commits_after_a_relay_drained_its_key_and_its_event_is_sent(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    level: str,
) -> None:
    topic = new_topic(partitions=1)
    outbox = topic_outbox()
    [first] = enqueue_bulk(engine, outbox, [Event(type="t", key=KEY, data=0, topic=topic)])
    relay = Relay(make_settings(database_url, kafka_bootstrap))
    try:
        with engine.connect() as writer_conn:
            writer = writer_conn.execution_options(isolation_level=level)
            writer.execute(sa.text("SELECT 1"))
            # The relay sends the key's only event and removes the key from its queue.
            assert relay.drain().delivered == 1
            second = outbox.enqueue(writer, type="t", key=KEY, data=1, topic=topic)
            writer.commit()
        assert relay.drain().delivered == 1
    finally:
        relay.close()
    records = consume_all(kafka_bootstrap, topic, 2)
    assert per_key_order(records) == {KEY: [first, str(second)]}
    assert check_consistency(engine).ok


@pytest.mark.parametrize("level", LEVELS)
def test_two_writers_of_one_key_still_fail_to_serialize(engine: sa.Engine, level: str) -> None:
    outbox: Outbox = topic_outbox()
    with engine.connect() as a_conn, engine.connect() as b_conn:
        a = a_conn.execution_options(isolation_level=level)
        b = b_conn.execution_options(isolation_level=level)
        a.execute(sa.text("SELECT 1"))
        b.execute(sa.text("SELECT 1"))
        outbox.enqueue(a, type="t", key=KEY, data=0, topic="t")
        a.commit()
        with pytest.raises(sa.exc.OperationalError) as caught:
            outbox.enqueue(b, type="t", key=KEY, data=1, topic="t")
        assert isinstance(caught.value.orig, psycopg2.errors.SerializationFailure)
        b.rollback()


def _drain_in_key_order(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    names: TableNames,
    topic: str,
    expected: list[str],
) -> None:
    """A relay sends everything; KEY's events arrive as ``expected``, nothing is stranded."""
    records_wanted = scalar(engine, f"SELECT count(*) FROM {names.table}")
    relay = Relay(make_settings(database_url, kafka_bootstrap, table=names.table))
    try:
        assert relay.drain().delivered == records_wanted
    finally:
        relay.close()
    records = consume_all(kafka_bootstrap, topic, records_wanted)
    assert per_key_order(records)[KEY] == expected
    assert check_consistency(engine, names).ok


def test_an_outbox_at_version_1_upgrades_with_its_queued_keys_and_drains(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """Keys queued the version-1 way (producers wrote the relay's key queue) are still
    sent after the migration that adds the arrivals, before and with new events."""
    topic = new_topic(partitions=1)
    names = TableNames(table="legacy")
    outbox = Outbox(allow_unknown_types=True, table="legacy")
    old_events = [outbox.encode(Event(type="t", key=KEY, data=n, topic=topic)) for n in (0, 1)]
    migrate_to(engine, names, 1)
    with engine.begin() as conn:
        # What a version-1 enqueue wrote: the event, the counter, the queue row.
        for seq, encoded in enumerate(old_events, start=1):
            conn.execute(
                sa.text(
                    "INSERT INTO legacy (event_id, ordering_key, seq, topic, type, value, headers) "
                    "VALUES (:id, :k, :seq, :topic, 't', :value, CAST(:headers AS jsonb))"
                ),
                {
                    "id": str(encoded.event_id),
                    "k": KEY,
                    "seq": seq,
                    "topic": topic,
                    "value": encoded.value,
                    "headers": encoded.stored_headers,
                },
            )
        conn.execute(sa.text("INSERT INTO legacy_key_seq VALUES (:k, 2)"), {"k": KEY})
        conn.execute(
            sa.text("INSERT INTO legacy_keys (ordering_key, next_seq) VALUES (:k, 1)"), {"k": KEY}
        )
    assert migrate(engine, names).applied == [2, 3, 4, 5, 6, 7, 8]
    with engine.begin() as conn:
        third = outbox.enqueue(conn, type="t", key=KEY, data=2, topic=topic)
        outbox.enqueue(conn, type="t", key="other", data=0, topic=topic)
    assert scalar(engine, "SELECT count(*) FROM legacy") == 4
    _drain_in_key_order(
        engine,
        database_url,
        kafka_bootstrap,
        names,
        topic,
        [*(str(e.event_id) for e in old_events), str(third)],
    )


def test_a_producer_ahead_of_its_schema_writes_with_the_statement_until_it_is_migrated(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """A single event goes through the function of migration 0003 where a session can
    call it; on an outbox at version 2 the producer writes with the batch statement,
    and sessions opened after the migration use the function."""
    topic = new_topic(partitions=1)
    names = TableNames(table="behind")
    outbox = Outbox(allow_unknown_types=True, table="behind")
    migrate_to(engine, names, 2)
    before = make_engine(database_url)
    try:
        with before.begin() as conn:
            assert not outbox.writer.functions(conn).one
            first = outbox.enqueue(conn, type="t", key=KEY, data=0, topic=topic)
        assert migrate(engine, names).applied == [3, 4, 5, 6, 7, 8]
        with before.begin() as conn:  # the same pooled session keeps its answer
            assert not outbox.writer.functions(conn).one
            second = outbox.enqueue(conn, type="t", key=KEY, data=1, topic=topic)
    finally:
        before.dispose()
    after = make_engine(database_url)
    try:
        with after.begin() as conn:
            assert outbox.writer.functions(conn).one
            third = outbox.enqueue(conn, type="t", key=KEY, data=2, topic=topic)
    finally:
        after.dispose()
    assert scalar(engine, "SELECT count(*) FROM behind") == 3
    _drain_in_key_order(
        engine, database_url, kafka_bootstrap, names, topic, [str(first), str(second), str(third)]
    )


def test_claims_take_in_every_arrival_in_sweeps_and_say_when_some_are_left(
    engine: sa.Engine, database_url: str
) -> None:
    keys = [f"k{n:03d}" for n in range(100)]
    enqueue_bulk(engine, topic_outbox(), [Event(type="t", key=k, data=0, topic="t") for k in keys])
    store = Store(database_url, TableNames())
    try:
        # Up to 2 x 5 keys per pass, 4 passes: 40 of the 100 keys join the queue.
        store.claim(batch_size=5, lease_seconds=30)
        assert store.arrivals_left
        queued = [r[0] for r in rows(engine, "SELECT ordering_key FROM outbox_keys ORDER BY 1")]
        assert queued == keys[:40]
        # A key arriving behind the sweep's position is taken in when it wraps around.
        enqueue_bulk(engine, topic_outbox(), [Event(type="t", key="a-late", data=0, topic="t")])
        store.claim(batch_size=5, lease_seconds=30)
        store.claim(batch_size=5, lease_seconds=30)
        assert not store.arrivals_left
    finally:
        store.close()
    assert rows(engine, "SELECT count(*) FROM outbox_arrivals") == [(0,)]
    assert rows(engine, "SELECT count(*) FROM outbox_keys") == [(101,)]
