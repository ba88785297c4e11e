"""enqueue_async and enqueue_many_async against a real PostgreSQL, on asyncpg and on
psycopg's async driver: the rows, per-key order, delays, errors and refusals of the
synchronous API, from async code; and the relay publishing what they wrote.

No async test plugin: each test runs its coroutine with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session

import outbox_kafka
from outbox_kafka import (
    DataSchemaViolation,
    DuplicateEventId,
    Event,
    InvalidKey,
    Outbox,
    UnsafeConnection,
)
from outbox_kafka.relay import Relay
from tests.integration.test_enqueue import count_all, key_seqs, queued_keys, stored_events
from tests.relay_support import (
    consume_all,
    make_settings,
    per_key_order,
    seq_events,
    topic_outbox,
)
from tests.support import EVENT_SCHEMAS, GOOD_TRACEPARENT, ORDER_CREATED, ORDER_PAID, valid_event

T = TypeVar("T")

DRIVERS = ["asyncpg", "psycopg"]


@pytest.fixture(params=DRIVERS)
def driver(request: pytest.FixtureRequest) -> str:
    """The async driver under test."""
    return str(request.param)


def async_url(database_url: str, driver: str) -> URL:
    return make_url(database_url).set(drivername=f"postgresql+{driver}")


def with_async_engine(
    database_url: str,
    driver: str,
    body: Callable[[AsyncEngine], Awaitable[T]],
    **engine_options: Any,
) -> T:
    """``body(engine)`` in a fresh event loop, on an async engine disposed afterwards."""

    async def main() -> T:
        engine = create_async_engine(async_url(database_url, driver), **engine_options)
        try:
            return await body(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


class Statements:
    """The statements an engine sends (``before_cursor_execute``), with their parameters."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def record(self, conn: Any, cursor: Any, statement: str, parameters: Any, *rest: Any) -> None:
        self.seen.append((statement, parameters))

    def listen(self, engine: AsyncEngine) -> None:
        sa.event.listen(engine.sync_engine, "before_cursor_execute", self.record)

    def writes(self) -> list[tuple[str, Any]]:
        """The statements that wrote events: an enqueue function's call or the batch statement."""
        return [(s, p) for s, p in self.seen if "outbox_enqueue_" in s or "batch_keys" in s]


def parameter_values(parameters: Any) -> list[Any]:
    """A statement's parameters, whether the driver takes them by name or by position."""
    if isinstance(parameters, dict):
        return list(parameters.values())
    return list(parameters)


def without_identity(row: dict[str, Any]) -> dict[str, Any]:
    """What a stored event holds besides its id (in the envelope and the ``id`` header), its
    time and when it was written."""
    envelope = json.loads(row["value"])
    del envelope["id"], envelope["time"]
    headers = [
        (name, value)
        for name, value in zip(row["header_names"], row["header_values"], strict=True)
        if name != "id"
    ]
    return {
        "ordering_key": row["ordering_key"],
        "seq": row["seq"],
        "topic": row["topic"],
        "type": row["type"],
        "status": row["status"],
        "attempts": row["attempts"],
        "envelope": envelope,
        "headers": headers,
    }


def delete_all(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE outbox, outbox_arrivals, outbox_key_seq"))


def failures(outbox: Outbox, reason: str) -> float:
    value = outbox.producer_metrics.registry.get_sample_value(
        "outbox_enqueue_failures_total", {"reason": reason}
    )
    assert value is not None
    return value


# --- what is stored -----------------------------------------------------------------------

#: The single event's arguments beyond valid_event's, and a batch over two keys.
SINGLE: dict[str, Any] = {
    "headers": [("x-tenant", "acme"), ("x-bin", b"\xff\x00")],
    "traceparent": GOOD_TRACEPARENT,
    "subject": "orders/o-1",
}
BATCH = [
    Event(type="order.created", key="order-2", data=ORDER_CREATED, headers={"x-n": "0"}),
    Event(type="order.paid", key="order-1", data=ORDER_PAID, source="urn:payments"),
    Event(type="order.paid", key="order-2", data=ORDER_PAID),
]


def test_async_writes_store_what_the_sync_api_stores(
    engine: sa.Engine, database_url: str, driver: str
) -> None:
    outbox = Outbox(schema_dir=EVENT_SCHEMAS, routes={"order.*": "orders"}, id_header="id")

    async def body(async_engine: AsyncEngine) -> tuple[uuid.UUID, list[uuid.UUID]]:
        async with async_engine.begin() as conn:
            one = await outbox.enqueue_async(conn, **valid_event(**SINGLE))
            many = await outbox.enqueue_many_async(conn, BATCH)
        return one, many

    one, many = with_async_engine(database_url, driver, body)
    written_async = stored_events(engine)
    assert {row["event_id"] for row in written_async} == {one, *many}
    by_id = {row["event_id"]: row for row in written_async}
    assert json.loads(by_id[one]["value"])["id"] == str(one)
    assert by_id[one]["header_values"][by_id[one]["header_names"].index("id")] == str(one).encode()
    assert json.loads(by_id[one]["value"])["data"] == ORDER_CREATED
    assert by_id[one]["topic"] == "orders"
    assert [(by_id[i]["ordering_key"], by_id[i]["seq"]) for i in many] == [
        ("order-2", 1),
        ("order-1", 2),
        ("order-2", 2),
    ]

    delete_all(engine)
    with engine.begin() as conn:
        outbox.enqueue(conn, **valid_event(**SINGLE))
        outbox.enqueue_many(conn, BATCH)
    written_sync = stored_events(engine)

    assert [without_identity(r) for r in written_async] == [
        without_identity(r) for r in written_sync
    ]
    assert key_seqs(engine) == {"order-1": 2, "order-2": 2}


def test_an_async_session_commits_with_its_block(
    engine: sa.Engine, database_url: str, outbox: Outbox, driver: str
) -> None:
    async def body(async_engine: AsyncEngine) -> list[uuid.UUID]:
        sessions = async_sessionmaker(async_engine)
        async with sessions() as session, session.begin():
            await session.execute(sa.text("CREATE TABLE side (x int)"))
            await session.execute(sa.text("INSERT INTO side VALUES (1)"))
            first = await outbox.enqueue_async(session, **valid_event(key="s-1"))
            rest = await outbox.enqueue_many_async(
                session, [valid_event(key="s-2"), Event(**valid_event(key="s-1"))]
            )
        return [first, *rest]

    ids = with_async_engine(database_url, driver, body)
    assert [(r["ordering_key"], r["seq"], r["event_id"]) for r in stored_events(engine)] == [
        ("s-1", 1, ids[0]),
        ("s-1", 2, ids[2]),
        ("s-2", 1, ids[1]),
    ]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT x FROM side")).scalars().all() == [1]


def test_an_async_scoped_session_and_the_module_level_functions(
    engine: sa.Engine, database_url: str, driver: str
) -> None:
    async def body(async_engine: AsyncEngine) -> list[uuid.UUID]:
        scoped = async_scoped_session(
            async_sessionmaker(async_engine), scopefunc=asyncio.current_task
        )
        try:
            kept = await outbox_kafka.enqueue_async(
                scoped, type="order.created", key="kept", data={"n": 1}, topic="orders"
            )
            kept_too = await outbox_kafka.enqueue_many_async(
                scoped, [Event(type="order.paid", key="kept", data={"n": 2}, topic="orders")]
            )
            await scoped.commit()
            await outbox_kafka.enqueue_async(
                scoped, type="order.created", key="dropped", data={}, topic="orders"
            )
            await scoped.rollback()
        finally:
            await scoped.remove()
        return [kept, *kept_too]

    ids = with_async_engine(database_url, driver, body)
    assert [(r["ordering_key"], r["seq"], r["event_id"]) for r in stored_events(engine)] == [
        ("kept", 1, ids[0]),
        ("kept", 2, ids[1]),
    ]


# --- rollback -----------------------------------------------------------------------------


def test_nothing_is_stored_without_a_commit(
    engine: sa.Engine, database_url: str, outbox: Outbox, driver: str
) -> None:
    async def body(async_engine: AsyncEngine) -> None:
        async with async_engine.connect() as conn, conn.begin() as tx:
            await outbox.enqueue_async(conn, **valid_event())
            await outbox.enqueue_many_async(conn, [valid_event(key="b"), valid_event()])
            assert (await conn.execute(sa.text("SELECT count(*) FROM outbox"))).scalar() == 3
            await tx.rollback()
        with pytest.raises(RuntimeError, match="business failure"):
            async with async_engine.begin() as conn:
                await outbox.enqueue_async(conn, **valid_event())
                raise RuntimeError("business failure")
        # A session closed without a commit rolls back, and its events with it.
        async with AsyncSession(async_engine) as session:
            await outbox.enqueue_async(session, **valid_event())
            await outbox.enqueue_many_async(session, [valid_event(key="c")])

    with_async_engine(database_url, driver, body)
    assert count_all(engine) == (0, 0, 0)


# --- order and delays ---------------------------------------------------------------------


def test_a_batch_keeps_the_order_given_per_key(
    engine: sa.Engine, database_url: str, outbox: Outbox, driver: str
) -> None:
    keys = ["b", 'q"uote', "a", "b", "c", "a", "a", 'q"uote', "b", "c", "a"]

    async def body(async_engine: AsyncEngine) -> list[uuid.UUID]:
        async with async_engine.begin() as conn:
            await outbox.enqueue_async(conn, **valid_event(key="a"))
        async with async_engine.begin() as conn:
            return await outbox.enqueue_many_async(
                conn,
                [
                    Event(**valid_event(key=k, data={**ORDER_CREATED, "order_id": f"o-{n}"}))
                    for n, k in enumerate(keys)
                ],
            )

    ids = with_async_engine(database_url, driver, body)
    assert len(set(ids)) == len(keys)
    rows = {r["event_id"]: r for r in stored_events(engine)}
    for n, event_id in enumerate(ids):
        assert json.loads(rows[event_id]["value"])["data"]["order_id"] == f"o-{n}"
    for key in set(keys):
        given = [event_id for event_id, k in zip(ids, keys, strict=True) if k == key]
        first = 2 if key == "a" else 1  # "a" continues the sequence of the first transaction
        assert [rows[e]["seq"] for e in given] == list(range(first, first + len(given))), key
    assert key_seqs(engine) == {"a": 5, "b": 3, "c": 2, 'q"uote': 2}
    assert {k: v["first_seq"] for k, v in queued_keys(engine).items()} == dict.fromkeys(
        ["a", "b", "c", 'q"uote'], 1
    )


def drop_enqueue_functions(engine: sa.Engine, outbox: Outbox) -> None:
    """Leave only the batch statement: as on tables made from outbox_kafka.schema.metadata."""
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"DROP FUNCTION {outbox.names.enqueue_one_signature}, "
            f"{outbox.names.enqueue_many_signature}"
        )


@pytest.mark.parametrize("path", ["functions", "statement"])
def test_delays_and_available_at_on_both_write_paths(
    engine: sa.Engine, database_url: str, outbox: Outbox, driver: str, path: str
) -> None:
    if path == "statement":
        drop_enqueue_functions(engine, outbox)
    ist = timezone(timedelta(hours=5, minutes=30))
    when = datetime(2040, 1, 1, 12, 30, 0, 123456, tzinfo=ist)
    statements = Statements()

    async def body(async_engine: AsyncEngine) -> datetime:
        statements.listen(async_engine)
        async with async_engine.begin() as conn:
            await outbox.enqueue_many_async(
                conn,
                [
                    Event(**valid_event(key="delayed", delay=timedelta(minutes=5))),
                    Event(**valid_event(key="plain")),
                    Event(**valid_event(key="delayed")),
                    Event(**valid_event(key="scheduled", available_at=when)),
                    Event(**valid_event(key="plain", delay=timedelta(seconds=90))),
                ],
            )
            await outbox.enqueue_async(conn, **valid_event(key="one", delay=timedelta(hours=1)))
            await outbox.enqueue_async(conn, **valid_event(key="two", available_at=when))
            now: datetime = (await conn.execute(sa.text("SELECT now()"))).scalar_one()
        return now

    now = with_async_engine(database_url, driver, body)
    stored = {(r["ordering_key"], r["seq"]): r["available_at"] for r in stored_events(engine)}
    assert stored == {
        ("delayed", 1): now + timedelta(minutes=5),
        ("delayed", 2): now,
        ("one", 1): now + timedelta(hours=1),
        ("plain", 1): now,
        ("plain", 2): now + timedelta(seconds=90),
        ("scheduled", 1): when,
        ("two", 1): when,
    }
    heads = queued_keys(engine)
    assert heads["delayed"]["due_at"] == now + timedelta(minutes=5)
    assert heads["scheduled"]["due_at"] == when
    assert heads["plain"]["due_at"] == now

    writes = statements.writes()
    assert len(writes) == 3
    if path == "functions":
        assert '"outbox_enqueue_many"(' in writes[0][0]
        assert '"outbox_enqueue_one"(' in writes[1][0]
    else:
        assert all(statement.lstrip().startswith("WITH batch_keys") for statement, _ in writes)
        assert all("outbox_enqueue" not in statement for statement, _ in writes)
    # Arrays go to the async drivers as lists, not as psycopg2's array literals.
    batch_values = parameter_values(writes[0][1])
    lists = [v for v in batch_values if isinstance(v, list)]
    assert any(when in v for v in lists)
    assert any(300.0 in v for v in lists)
    assert not any(isinstance(v, str) and v.startswith("{") for v in batch_values)


def test_the_batch_statement_serves_when_the_functions_cannot_be_called(
    engine: sa.Engine, database_url: str, outbox: Outbox, driver: str
) -> None:
    drop_enqueue_functions(engine, outbox)
    keys = ["k1", "k2", "k1", "k3", "k2", "k1"]
    statements = Statements()

    async def body(async_engine: AsyncEngine) -> list[uuid.UUID]:
        statements.listen(async_engine)
        async with async_engine.begin() as conn:
            many = await outbox.enqueue_many_async(
                conn, [Event(**valid_event(key=k, headers={"x-k": k})) for k in keys]
            )
            one = await outbox.enqueue_async(conn, **valid_event(key="k2"))
        async with async_engine.begin() as conn:
            chosen = uuid.uuid4()
            got = await outbox.enqueue_async(conn, **valid_event(key="k3", event_id=chosen))
            assert got == chosen
            with pytest.raises(DuplicateEventId):
                await outbox.enqueue_many_async(
                    conn, [valid_event(key="k4"), valid_event(key="k3", event_id=chosen)]
                )
        return [*many, one, chosen]

    ids = with_async_engine(database_url, driver, body)
    writes = [s for s, _ in statements.writes() if "SAVEPOINT" not in s]
    assert len(writes) == 4
    assert all(s.lstrip().startswith("WITH batch_keys") for s in writes)
    stored = {r["event_id"]: r for r in stored_events(engine)}
    assert set(stored) == set(ids)
    assert [(stored[i]["ordering_key"], stored[i]["seq"]) for i in ids] == [
        ("k1", 1),
        ("k2", 1),
        ("k1", 2),
        ("k3", 1),
        ("k2", 2),
        ("k1", 3),
        ("k2", 3),
        ("k3", 2),
    ]
    for event_id, key in zip(ids[: len(keys)], keys, strict=True):
        assert stored[event_id]["header_names"][-1] == "x-k"
        assert stored[event_id]["header_values"][-1] == key.encode()
    assert key_seqs(engine) == {"k1": 3, "k2": 3, "k3": 2}


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("through", ["connection", "session"])
def test_a_duplicate_event_id_leaves_the_transaction_usable(
    engine: sa.Engine, database_url: str, driver: str, through: str
) -> None:
    outbox = Outbox(
        schema_dir=EVENT_SCHEMAS, routes={"order.*": "orders"}, registry=CollectorRegistry()
    )
    taken = uuid.uuid4()

    async def body(async_engine: AsyncEngine) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
        async with async_engine.begin() as conn:
            assert await outbox.enqueue_async(conn, **valid_event(key="K", event_id=taken)) == (
                taken
            )
        async with AsyncSession(async_engine) as session, session.begin():
            target: Any = session if through == "session" else await session.connection()
            with pytest.raises(DuplicateEventId) as caught:
                await outbox.enqueue_async(target, **valid_event(key="K", event_id=taken))
            assert caught.value.field == "event_id"
            with pytest.raises(DuplicateEventId):
                await outbox.enqueue_many_async(
                    target, [valid_event(key="L"), valid_event(key="K", event_id=taken)]
                )
            other = uuid.uuid4()
            await outbox.enqueue_async(target, **valid_event(key="L", event_id=other))
            with pytest.raises(DuplicateEventId):
                await outbox.enqueue_async(target, **valid_event(key="L", event_id=other))
            # Still usable: later writes commit, and the keys' sequences have no gap.
            assert (await session.execute(sa.text("SELECT 1"))).scalar_one() == 1
            after = await outbox.enqueue_async(target, **valid_event(key="K"))
            [after_other] = await outbox.enqueue_many_async(target, [valid_event(key="L")])
        return other, after, after_other

    other, after, after_other = with_async_engine(database_url, driver, body)
    assert [(r["ordering_key"], r["seq"], r["event_id"]) for r in stored_events(engine)] == [
        ("K", 1, taken),
        ("K", 2, after),
        ("L", 1, other),
        ("L", 2, after_other),
    ]
    assert key_seqs(engine) == {"K": 2, "L": 2}
    assert failures(outbox, "duplicate_event_id") == 3


def test_an_invalid_event_is_refused_before_any_write_and_counted(
    engine: sa.Engine, database_url: str, driver: str
) -> None:
    outbox = Outbox(
        schema_dir=EVENT_SCHEMAS, routes={"order.*": "orders"}, registry=CollectorRegistry()
    )
    statements = Statements()

    async def body(async_engine: AsyncEngine) -> uuid.UUID:
        statements.listen(async_engine)
        async with async_engine.begin() as conn:
            with pytest.raises(DataSchemaViolation) as caught:
                await outbox.enqueue_async(
                    conn, **valid_event(data={**ORDER_CREATED, "currency": "euro"})
                )
            assert caught.value.field == "data"
            batch = [valid_event(key=f"k{i}") for i in range(4)]
            batch[2] = valid_event(key="")
            with pytest.raises(InvalidKey, match=r"^event 2: key: ") as bad_key:
                await outbox.enqueue_many_async(conn, batch)
            assert bad_key.value.index == 2
            assert statements.seen == []
            good = await outbox.enqueue_async(conn, **valid_event(key="good"))
        return good

    good = with_async_engine(database_url, driver, body)
    assert [r["event_id"] for r in stored_events(engine)] == [good]
    assert failures(outbox, "validation") == 2
    assert failures(outbox, "database") == 0


# --- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["engine", "connection-option", "session"])
def test_autocommit_is_refused(engine: sa.Engine, database_url: str, driver: str, how: str) -> None:
    outbox = Outbox(routes={"order.*": "orders"}, registry=CollectorRegistry())

    async def body(async_engine: AsyncEngine) -> None:
        with pytest.raises(UnsafeConnection, match="AUTOCOMMIT"):
            if how == "engine":
                async with async_engine.connect() as conn:
                    await outbox.enqueue_async(conn, **valid_event())
            elif how == "connection-option":
                async with async_engine.connect() as conn:
                    autocommit = await conn.execution_options(isolation_level="AUTOCOMMIT")
                    await outbox.enqueue_many_async(autocommit, [valid_event()])
            else:
                async with AsyncSession(async_engine) as session:
                    await outbox.enqueue_async(session, **valid_event())

    options = {} if how == "connection-option" else {"isolation_level": "AUTOCOMMIT"}
    with_async_engine(database_url, driver, body, **options)
    assert count_all(engine) == (0, 0, 0)
    assert failures(outbox, "unsafe_connection") == 1


def test_a_synchronous_connection_or_session_is_refused_naming_enqueue(
    engine: sa.Engine, outbox: Outbox
) -> None:
    async def body() -> None:
        with Session(engine) as session, engine.connect() as conn:
            for target in (session, conn):
                with pytest.raises(UnsafeConnection) as caught:
                    await outbox.enqueue_async(target, **valid_event())  # type: ignore[arg-type]
                message = str(caught.value)
                assert f"{type(target).__name__} given: enqueue_async" in message
                assert "use enqueue(...) or enqueue_many(...)" in message
            with pytest.raises(UnsafeConnection, match=r"use enqueue\(\.\.\.\)"):
                await outbox_kafka.enqueue_many_async(session, [valid_event(topic="t")])  # type: ignore[arg-type]
            with pytest.raises(UnsafeConnection, match="got Engine"):
                await outbox.enqueue_async(engine, **valid_event())  # type: ignore[arg-type]

    asyncio.run(body())
    assert count_all(engine) == (0, 0, 0)


def test_an_async_session_given_to_enqueue_is_refused_naming_enqueue_async(
    engine: sa.Engine, database_url: str, outbox: Outbox, driver: str
) -> None:
    async def body(async_engine: AsyncEngine) -> None:
        async with AsyncSession(async_engine) as session, async_engine.connect() as conn:
            targets: list[Any] = [session, conn]
            for target in targets:
                with pytest.raises(UnsafeConnection) as one:
                    outbox.enqueue(target, **valid_event())
                with pytest.raises(UnsafeConnection) as many:
                    outbox.enqueue_many(target, [valid_event()])
                for caught in (one, many):
                    message = str(caught.value)
                    assert f"{type(target).__name__} given: enqueue and enqueue_many" in message
                    assert "await enqueue_async(...) or await enqueue_many_async(...)" in message

    with_async_engine(database_url, driver, body)


# --- the relay publishes what enqueue_async wrote -----------------------------------------


def test_the_relay_publishes_async_enqueued_events_in_key_order(
    database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(3)
    outbox = topic_outbox(source="urn:test:async")
    events = seq_events(topic, [f"key-{i}" for i in range(7)], 300)

    async def body(async_engine: AsyncEngine) -> list[str]:
        ids: list[str] = []
        # Transactions of varied shapes: single events and batches, on connections and sessions.
        position = 0
        sizes = iter([1, 40, 1, 1, 97, 60, 1, 99])
        while position < len(events):
            size = next(sizes)
            chunk = events[position : position + size]
            position += size
            if size == 1:
                async with AsyncSession(async_engine) as session, session.begin():
                    e = chunk[0]
                    got = await outbox.enqueue_async(
                        session, type=e.type, key=e.key, data=e.data, topic=e.topic
                    )
                ids.append(str(got))
            else:
                async with async_engine.begin() as conn:
                    ids += [str(i) for i in await outbox.enqueue_many_async(conn, chunk)]
        return ids

    ids = with_async_engine(database_url, "asyncpg", body)
    assert len(ids) == 300

    relay = Relay(make_settings(database_url, kafka_bootstrap))
    try:
        report = relay.drain()
    finally:
        relay.close()
    assert report.delivered == 300

    records = consume_all(kafka_bootstrap, topic, 300)
    assert sorted(r.event_id for r in records) == sorted(ids)
    expected: dict[str, list[str]] = {}
    for event, event_id in zip(events, ids, strict=True):
        expected.setdefault(event.key, []).append(event_id)
    assert per_key_order(records) == expected
    for r in records:
        assert r.value["source"] == "urn:test:async"
    # Per key, the payloads' counters arrive 0, 1, 2, ...
    counters: dict[str, list[int]] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        assert r.key is not None
        counters.setdefault(r.key, []).append(r.value["data"]["n"])
    assert all(values == list(range(len(values))) for values in counters.values())
