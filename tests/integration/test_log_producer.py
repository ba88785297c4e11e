"""The log mode's producer (``Outbox(write_to="log")``): each write is one frame in one
transactional logical decoding message, read back here from the outbox's slot the way
a relay reads it (pgoutput, protocol 1): in commit order, and nothing of a transaction
or a savepoint that rolled back."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from outbox_kafka import Event, Outbox
from outbox_kafka.database import make_engine
from outbox_kafka.errors import ConfigurationError, EventError
from outbox_kafka.producer.writing import OutboxWriter

from ..log_support import NAMES, emit, keys_and_ns, log_outbox, read_log


def event(key: str, n: int) -> Event:
    return Event(type="log.test", key=key, data={"n": n}, topic="log-topic")


def test_commits_arrive_in_commit_order_and_rollbacks_never(
    log_engine: sa.Engine, log_url: str
) -> None:
    outbox = log_outbox()
    with log_engine.begin() as conn:
        emit(outbox, conn, "a", 1)
    with log_engine.connect() as conn:
        outbox.enqueue_many(conn, [event("a", 2), event("b", 2)])
        conn.rollback()
    with log_engine.begin() as conn:
        emit(outbox, conn, "a", 3)
        savepoint = conn.begin_nested()
        emit(outbox, conn, "a", 4)
        savepoint.rollback()
        outbox.enqueue_many(conn, [event("b", 5), event("a", 5)])
    # Two transactions interleaved: the one that began first commits last.
    first, second = log_engine.connect(), log_engine.connect()
    try:
        first.begin()
        emit(outbox, first, "c", 6)
        second.begin()
        emit(outbox, second, "c", 7)
        second.commit()
        first.commit()
    finally:
        first.close()
        second.close()

    transactions, strays = read_log(log_url)
    assert (strays.non_transactional, strays.foreign, strays.malformed) == (0, 0, 0)
    assert keys_and_ns(transactions) == [
        [("a", 1)],
        [("a", 3), ("b", 5), ("a", 5)],
        [("c", 7)],
        [("c", 6)],
    ]
    ends = [t.end_lsn for t in transactions]
    assert ends == sorted(set(ends))


def test_a_frame_carries_the_message_as_encoded(log_engine: sa.Engine, log_url: str) -> None:
    outbox = log_outbox()
    given = Event(
        type="log.test", key="k", data={"x": "é"}, topic="log-topic", headers={"trace": b"\x00\xff"}
    )
    with log_engine.begin() as conn:
        (event_id,) = outbox.enqueue_many(conn, [given])
    encoded = outbox.encode(given)
    (transaction,), _ = read_log(log_url)
    (framed,) = transaction.events
    assert framed.event_id == event_id
    assert (framed.key, framed.topic, framed.type) == ("k", "log-topic", "log.test")
    assert dict(framed.headers)["trace"] == b"\x00\xff"
    assert [name for name, _ in framed.headers] == [name for name, _ in encoded.headers]
    # The envelope is the table mode's, but for its id and time, which each encoding makes.
    assert (
        framed.value.replace(str(event_id).encode(), b"ID")[:40]
        == encoded.value.replace(str(encoded.event_id).encode(), b"ID")[:40]
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"delay": timedelta(seconds=5)}, "delay"),
        ({"available_at": datetime.now(UTC) + timedelta(minutes=1)}, "available_at"),
        # Not a timedelta: the log's refusal, not how to write a delay it would refuse.
        ({"delay": 5}, "delay"),
        ({"available_at": "in a minute"}, "available_at"),
    ],
)
def test_a_delay_is_refused_and_nothing_is_emitted(
    log_engine: sa.Engine, log_url: str, kwargs: dict[str, object], field: str
) -> None:
    outbox = log_outbox()
    with log_engine.begin() as conn:
        with pytest.raises(EventError, match=f"{field}: an outbox that writes to the log"):
            emit(outbox, conn, "a", 1, **kwargs)
        emit(outbox, conn, "a", 2)
    transactions, _ = read_log(log_url)
    assert keys_and_ns(transactions) == [[("a", 2)]]


def test_without_the_slot_the_write_fails(log_engine: sa.Engine) -> None:
    with log_engine.begin() as conn:
        conn.exec_driver_sql("SELECT pg_drop_replication_slot(%(slot)s)", {"slot": NAMES.log_slot})
    with (
        log_engine.begin() as conn,
        pytest.raises(sa.exc.DBAPIError, match=f"no usable replication slot {NAMES.log_slot}"),
    ):
        emit(log_outbox(), conn, "a", 1)


def test_a_session_sees_a_dropped_slot_within_a_second(log_url: str) -> None:
    """The emit function checks the slot once a second per session: a session that
    never checked refuses at once, one that just did within a second."""
    writer = make_engine(log_url, pool_size=1)
    other = make_engine(log_url, poolclass=sa.NullPool)
    outbox = log_outbox()
    refused = pytest.raises(sa.exc.DBAPIError, match=f"no usable replication slot {NAMES.log_slot}")
    try:
        with writer.begin() as conn:
            emit(outbox, conn, "a", 1)  # checks the slot, in the writer's one session
        with other.begin() as conn:
            conn.exec_driver_sql("SELECT pg_drop_replication_slot(%(s)s)", {"s": NAMES.log_slot})
        with other.begin() as conn, refused:
            emit(outbox, conn, "a", 2)
        time.sleep(1.1)
        with writer.begin() as conn, refused:
            emit(outbox, conn, "a", 3)
    finally:
        writer.dispose()
        other.dispose()


def test_below_wal_level_logical_the_write_fails(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        level = conn.exec_driver_sql("SHOW wal_level").scalar_one()
    if level == "logical":
        pytest.skip("the server under test runs with wal_level = logical")
    with (
        engine.begin() as conn,
        pytest.raises(sa.exc.DBAPIError, match=f"wal_level is {level}, not logical"),
    ):
        emit(log_outbox(), conn, "a", 1)


def test_a_role_without_execute_cannot_emit(log_engine: sa.Engine) -> None:
    role = f"bare_{uuid.uuid4().hex[:8]}"
    with log_engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE ROLE "{role}"')
        conn.exec_driver_sql(f'GRANT USAGE ON SCHEMA public TO "{role}"')
    try:
        with log_engine.begin() as conn:
            conn.exec_driver_sql(f'SET LOCAL ROLE "{role}"')
            with pytest.raises(sa.exc.DBAPIError, match="permission denied for function"):
                emit(log_outbox(), conn, "a", 1)
    finally:
        with log_engine.begin() as conn:
            conn.exec_driver_sql(f'REVOKE USAGE ON SCHEMA public FROM "{role}"')
            conn.exec_driver_sql(f'DROP ROLE "{role}"')


def test_write_to_must_be_table_or_log() -> None:
    with pytest.raises(ConfigurationError, match="write_to must be one of 'table', 'log'"):
        Outbox(write_to="wal")


def test_a_writer_given_must_write_where_write_to_says() -> None:
    with pytest.raises(ConfigurationError, match="writer is a OutboxWriter, which does not"):
        Outbox(write_to="log", writer=OutboxWriter(NAMES, notify=False))


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
def test_async_writes_reach_the_log_in_commit_order(log_url: str, driver: str) -> None:
    """enqueue_async and enqueue_many_async of an outbox that writes to the log, on
    each async driver: committed frames arrive, a rolled-back one never."""
    outbox = log_outbox()

    async def main() -> None:
        engine = create_async_engine(make_url(log_url).set(drivername=f"postgresql+{driver}"))
        try:
            async with engine.begin() as conn:
                await outbox.enqueue_async(
                    conn, type="log.test", key="a", data={"n": 1}, topic="log-topic"
                )
            async with engine.connect() as conn:
                await outbox.enqueue_async(
                    conn, type="log.test", key="a", data={"n": 99}, topic="log-topic"
                )
                await conn.rollback()
            async with engine.begin() as conn:
                await outbox.enqueue_many_async(
                    conn,
                    [
                        Event(type="log.test", key="a", data={"n": 2}, topic="log-topic"),
                        Event(type="log.test", key="b", data={"n": 1}, topic="log-topic"),
                    ],
                )
        finally:
            await engine.dispose()

    asyncio.run(main())
    transactions, _ = read_log(log_url)
    assert keys_and_ns(transactions) == [[("a", 1)], [("a", 2), ("b", 1)]]
