"""Outbox.enqueue against a real PostgreSQL: atomicity, per-key sequences, bad input."""

from __future__ import annotations

import json
import random
import select
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg2
import psycopg2.errors
import psycopg2.extensions
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox_kafka import (
    DataSchemaViolation,
    DuplicateEventId,
    Event,
    InvalidIdentifier,
    InvalidKey,
    InvalidTimestamp,
    Outbox,
    TableNames,
    UnsafeConnection,
    migrate,
)
from outbox_kafka.database import make_engine
from outbox_kafka.schema.metadata import build_tables
from outbox_kafka.stored_headers import headers_from_json
from tests.support import (
    BAD_INPUTS,
    EVENT_SCHEMAS,
    GOOD_TRACEPARENT,
    ORDER_CREATED,
    ORDER_PAID,
    BadInput,
    libpq_url,
    valid_event,
)

# --- reading back -------------------------------------------------------------------------


def stored_events(engine: sa.Engine, table: str = '"outbox"') -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT event_id, ordering_key, seq, topic, type, value, headers, "
                "status, attempts, available_at, created_at "
                f"FROM {table} ORDER BY ordering_key, seq"
            )
        ).mappings()
        result = []
        for row in rows:
            item = dict(row)
            item["value"] = bytes(item["value"])
            decoded = headers_from_json(item["headers"])
            assert decoded is not None, item["headers"]
            item["header_names"] = [name for name, _ in decoded]
            item["header_values"] = [value for _, value in decoded]
            result.append(item)
        return result


def key_seqs(engine: sa.Engine, table: str = '"outbox_key_seq"') -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT ordering_key, last_seq FROM {table}")).all()
    return {k: s for k, s in rows}


def queued_keys(engine: sa.Engine, table: str = '"outbox_arrivals"') -> dict[str, dict[str, Any]]:
    """The keys producers queued: their arrivals, which the relay moves to its key queue."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT * FROM {table}")).mappings().all()
    return {row["ordering_key"]: dict(row) for row in rows}


def seqs_by_key(engine: sa.Engine) -> dict[str, list[tuple[int, uuid.UUID]]]:
    result: dict[str, list[tuple[int, uuid.UUID]]] = {}
    for row in stored_events(engine):
        result.setdefault(row["ordering_key"], []).append((row["seq"], row["event_id"]))
    return result


def count_all(engine: sa.Engine) -> tuple[int, ...]:
    """Rows in (outbox, outbox_arrivals, outbox_key_seq)."""
    with engine.connect() as conn:
        return tuple(
            conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one()
            for t in ("outbox", "outbox_arrivals", "outbox_key_seq")
        )


def txid(conn: sa.Connection) -> int:
    return int(conn.execute(sa.text("SELECT pg_current_xact_id()::text")).scalar_one())


@pytest.fixture
def side_table(engine: sa.Engine) -> str:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE side (x int)"))
    return "side"


# --- commit and rollback ------------------------------------------------------------------


def test_committed_event_is_stored(engine: sa.Engine, outbox: Outbox) -> None:
    with engine.begin() as conn:
        event_id = outbox.enqueue(
            conn,
            type="order.created",
            key="order-1",
            data=ORDER_CREATED,
            headers=[("x-tenant", "acme"), ("x-bin", b"\xff\x00")],
            traceparent=GOOD_TRACEPARENT,
        )
        now = conn.execute(sa.text("SELECT now()")).scalar_one()

    [row] = stored_events(engine)
    assert row["event_id"] == event_id
    assert row["ordering_key"] == "order-1"
    assert row["seq"] == 1
    assert row["status"] == "pending"
    assert row["attempts"] == 0
    assert row["topic"] == "orders"
    assert row["type"] == "order.created"
    assert row["available_at"] == now
    envelope = json.loads(row["value"])
    assert envelope["id"] == str(event_id)
    assert envelope["type"] == "order.created"
    assert envelope["partitionkey"] == "order-1"
    assert envelope["data"] == ORDER_CREATED
    assert row["header_names"] == [
        "content-type",
        "traceparent",
        "x-tenant",
        "x-bin",
    ]
    assert row["header_values"] == [
        b"application/cloudevents+json",
        GOOD_TRACEPARENT.encode(),
        b"acme",
        b"\xff\x00",
    ]
    # Binary values are stored as base64; text values as text.
    assert row["headers"][-2] == ["x-tenant", "acme"]
    assert row["headers"][-1] == ["x-bin", {"base64": "/wA="}]
    assert key_seqs(engine) == {"order-1": 1}
    [head] = queued_keys(engine).values()
    assert head["ordering_key"] == "order-1"
    assert head["first_seq"] == 1
    assert head["due_at"] == row["available_at"]


def test_rolled_back_enqueue_leaves_nothing(engine: sa.Engine, outbox: Outbox) -> None:
    with engine.connect() as conn, conn.begin() as tx:
        outbox.enqueue(conn, **valid_event())
        outbox.enqueue(conn, **valid_event(key="order-2"))
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 2
        tx.rollback()
    assert count_all(engine) == (0, 0, 0)


def test_exception_in_the_callers_block_rolls_back(engine: sa.Engine, outbox: Outbox) -> None:
    with pytest.raises(RuntimeError, match="business failure"), engine.begin() as conn:
        outbox.enqueue(conn, **valid_event())
        raise RuntimeError("business failure")
    assert count_all(engine) == (0, 0, 0)


def test_works_with_a_session(engine: sa.Engine, outbox: Outbox, side_table: str) -> None:
    with Session(engine) as session, session.begin():
        session.execute(sa.text("INSERT INTO side VALUES (1)"))
        event_id = outbox.enqueue(session, **valid_event())
    assert [row["event_id"] for row in stored_events(engine)] == [event_id]

    with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
        session.execute(sa.text("INSERT INTO side VALUES (2)"))
        outbox.enqueue(session, **valid_event(key="order-2"))
        raise RuntimeError("roll back")
    # The event went with the business write in both cases.
    assert [row["event_id"] for row in stored_events(engine)] == [event_id]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT x FROM side")).scalars().all() == [1]
    assert key_seqs(engine) == {"order-1": 1}


def test_works_with_a_connection_commit_as_you_go(engine: sa.Engine, outbox: Outbox) -> None:
    with engine.connect() as conn:
        first = outbox.enqueue(conn, **valid_event())
        conn.commit()
        outbox.enqueue(conn, **valid_event(key="order-2"))
        # Closed without commit: rolled back.
    assert [row["event_id"] for row in stored_events(engine)] == [first]
    assert key_seqs(engine) == {"order-1": 1}


@pytest.mark.parametrize("use_session", [False, True], ids=["connection", "session"])
def test_enqueue_never_commits(engine: sa.Engine, outbox: Outbox, use_session: bool) -> None:
    with engine.connect() as observer:

        def visible() -> int:
            n: int = observer.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one()
            observer.rollback()
            return n

        if use_session:
            with Session(engine) as session:
                with session.begin():
                    outbox.enqueue(session, **valid_event())
                    outbox.enqueue_many(session, [Event(**valid_event(key="order-2"))])
                    assert visible() == 0
                assert visible() == 2
        else:
            with engine.connect() as conn:
                tx = conn.begin()
                outbox.enqueue(conn, **valid_event())
                outbox.enqueue_many(conn, [Event(**valid_event(key="order-2"))])
                assert conn.in_transaction()
                assert visible() == 0
                tx.commit()
                assert visible() == 2


# --- connections that cannot keep the guarantee ------------------------------------------


@pytest.mark.parametrize(
    "how", ["connection-option", "engine-option", "create-engine", "session-on-create-engine"]
)
def test_autocommit_connection_is_unsafe(
    engine: sa.Engine, database_url: str, outbox: Outbox, how: str
) -> None:
    autocommit_engine = make_engine(database_url, isolation_level="AUTOCOMMIT")
    try:
        with pytest.raises(UnsafeConnection, match="AUTOCOMMIT"):
            if how == "connection-option":
                with engine.connect() as conn:
                    outbox.enqueue(
                        conn.execution_options(isolation_level="AUTOCOMMIT"), **valid_event()
                    )
            elif how == "engine-option":
                with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
                    outbox.enqueue(conn, **valid_event())
            elif how == "create-engine":
                with autocommit_engine.connect() as conn:
                    outbox.enqueue(conn, **valid_event())
            else:
                with Session(autocommit_engine) as session:
                    outbox.enqueue(session, **valid_event())
    finally:
        autocommit_engine.dispose()
    assert count_all(engine) == (0, 0, 0)


# --- savepoints and sequence order --------------------------------------------------------


def test_rolled_back_savepoint_leaves_no_gap(engine: sa.Engine, outbox: Outbox) -> None:
    with engine.begin() as conn:
        savepoint = conn.begin_nested()
        discarded = outbox.enqueue(conn, **valid_event(key="K"))
        savepoint.rollback()
        kept = outbox.enqueue(conn, **valid_event(key="K"))
    assert [(r["event_id"], r["seq"]) for r in stored_events(engine)] == [(kept, 1)]
    assert discarded != kept
    assert key_seqs(engine) == {"K": 1}
    assert queued_keys(engine)["K"]["first_seq"] == 1


def test_released_savepoint_keeps_its_event(engine: sa.Engine, outbox: Outbox) -> None:
    with engine.begin() as conn:
        with conn.begin_nested():
            first = outbox.enqueue(conn, **valid_event(key="K"))
        second = outbox.enqueue(conn, **valid_event(key="K"))
    assert [(r["event_id"], r["seq"]) for r in stored_events(engine)] == [(first, 1), (second, 2)]


def test_older_transaction_committing_later_gets_the_later_seq(
    engine: sa.Engine, outbox: Outbox, side_table: str
) -> None:
    with engine.connect() as t1, engine.connect() as t2:
        t2.execute(sa.text("INSERT INTO side VALUES (2)"))
        t2_txid = txid(t2)
        t1.execute(sa.text("SELECT 1"))
        first = outbox.enqueue(t1, **valid_event(key="K"))
        t1_txid = txid(t1)
        assert t2_txid < t1_txid
        t1.commit()
        second = outbox.enqueue(t2, **valid_event(key="K"))
        t2.commit()
    assert seqs_by_key(engine)["K"] == [(1, first), (2, second)]


def test_writers_of_one_key_wait_until_commit(
    engine: sa.Engine, outbox: Outbox, side_table: str
) -> None:
    """T2 (older) blocks behind T1's uncommitted enqueue and then follows it."""
    with engine.connect() as t1, engine.connect() as t2, engine.connect() as observer:
        t2.execute(sa.text("INSERT INTO side VALUES (2)"))
        t2_pid = t2.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        t2_txid = txid(t2)
        first = outbox.enqueue(t1, **valid_event(key="K"))
        assert t2_txid < txid(t1)

        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(outbox.enqueue, t2, **valid_event(key="K"))
            deadline = time.monotonic() + 10
            waiting = None
            while time.monotonic() < deadline and waiting != "Lock":
                waiting = observer.execute(
                    sa.text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"),
                    {"pid": t2_pid},
                ).scalar_one()
                observer.rollback()
                time.sleep(0.02)
            assert waiting == "Lock"
            assert not future.done()
            t1.commit()
            second = future.result(timeout=10)
        t2.commit()
    assert seqs_by_key(engine)["K"] == [(1, first), (2, second)]


def test_concurrent_writers_keep_per_key_commit_order(engine: sa.Engine, outbox: Outbox) -> None:
    keys = [f"k{i:02d}" for i in range(50)]
    threads, per_thread = 8, 1_000
    commit_lock = threading.Lock()
    committed: list[tuple[str, uuid.UUID]] = []
    rolled_back: list[uuid.UUID] = []

    def worker(seed: int) -> int:
        rng = random.Random(seed)
        remaining, transactions = per_thread, 0
        with engine.connect() as conn:
            while remaining:
                size = min(rng.randint(1, 5), remaining)
                remaining -= size
                chosen = [rng.choice(keys) for _ in range(size)]
                tx = conn.begin()
                if rng.random() < 0.5:
                    # One statement; the statement takes the key locks in key order.
                    batch = [
                        Event(type="order.paid", key=k, data={**ORDER_PAID, "order_id": k})
                        for k in chosen
                    ]
                    pairs = list(zip(chosen, outbox.enqueue_many(conn, batch), strict=True))
                else:
                    # One statement per event, in key order (no deadlock between writers).
                    chosen.sort()
                    pairs = [
                        (
                            k,
                            outbox.enqueue(
                                conn, **valid_event(type="order.paid", key=k, data=ORDER_PAID)
                            ),
                        )
                        for k in chosen
                    ]
                if rng.random() < 0.8:
                    # Commits are recorded in the order they happen; the lock is never held
                    # while waiting for a row lock, so it cannot deadlock with the database.
                    with commit_lock:
                        tx.commit()
                        committed.extend(pairs)
                else:
                    tx.rollback()
                    rolled_back.extend(event_id for _, event_id in pairs)
                transactions += 1
        return transactions

    with ThreadPoolExecutor(threads) as pool:
        transactions = sum(pool.map(worker, range(threads)))
    assert transactions >= threads * per_thread // 5
    assert len(committed) + len(rolled_back) == threads * per_thread
    assert rolled_back and committed

    stored = seqs_by_key(engine)
    expected_order: dict[str, list[uuid.UUID]] = {}
    for key, event_id in committed:
        expected_order.setdefault(key, []).append(event_id)
    assert set(stored) == set(expected_order)
    for key, rows in stored.items():
        seqs = [seq for seq, _ in rows]
        assert seqs == list(range(1, len(rows) + 1)), key
        assert [event_id for _, event_id in rows] == expected_order[key], key
    assert key_seqs(engine) == {key: len(rows) for key, rows in stored.items()}
    all_ids = {event_id for rows in stored.values() for _, event_id in rows}
    assert all_ids.isdisjoint(rolled_back)
    assert len(all_ids) == len(committed)
    assert {k: v["first_seq"] for k, v in queued_keys(engine).items()} == dict.fromkeys(stored, 1)


# --- batches ------------------------------------------------------------------------------


@pytest.fixture
def statements(engine: sa.Engine) -> Iterator[list[str]]:
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    yield seen
    sa.event.remove(engine, "before_cursor_execute", record)


def test_enqueue_many_is_one_round_trip(
    engine: sa.Engine, outbox: Outbox, statements: list[str]
) -> None:
    rng = random.Random(7)
    keys = [rng.choice([f"key-{i}" for i in range(10)]) for _ in range(100)]
    batch = [
        Event(
            type="order.created",
            key=k,
            data={**ORDER_CREATED, "order_id": f"o-{n}"},
            headers={"x-n": str(n)},
        )
        for n, k in enumerate(keys)
    ]
    with engine.begin() as conn:
        # Which enqueue functions the session may call is asked once per connection.
        assert outbox.writer.functions(conn) == (True, True)
        statements.clear()
        ids = outbox.enqueue_many(conn, batch)
        assert len(statements) == 1
        assert '"outbox_enqueue_many"(' in statements[0]
    assert len(ids) == len(set(ids)) == 100

    rows = {row["event_id"]: row for row in stored_events(engine)}
    assert len(rows) == 100
    for key in set(keys):
        in_input_order = [event_id for event_id, k in zip(ids, keys, strict=True) if k == key]
        assert [rows[e]["seq"] for e in in_input_order] == list(range(1, len(in_input_order) + 1))
    for n, event_id in enumerate(ids):
        row = rows[event_id]
        assert json.loads(row["value"])["data"]["order_id"] == f"o-{n}"
        assert row["header_names"][-1] == "x-n"
        assert row["header_values"][-1] == str(n).encode()
    assert key_seqs(engine) == {k: keys.count(k) for k in set(keys)}


def test_enqueue_many_continues_existing_sequences(engine: sa.Engine, outbox: Outbox) -> None:
    with engine.begin() as conn:
        outbox.enqueue(conn, **valid_event(key="a"))
    with engine.begin() as conn:
        ids = outbox.enqueue_many(
            conn,
            [
                valid_event(key="b"),
                {**valid_event(key="a"), "headers": {"x": "1"}},
                Event(**valid_event(key="a")),
                valid_event(key="b"),
            ],
        )
    stored = seqs_by_key(engine)
    assert [e for _, e in stored["a"]][1:] == [ids[1], ids[2]]
    assert [s for s, _ in stored["a"]] == [1, 2, 3]
    assert stored["b"] == [(1, ids[0]), (2, ids[3])]
    assert key_seqs(engine) == {"a": 3, "b": 2}


def test_enqueue_many_of_nothing_sends_nothing(
    engine: sa.Engine, outbox: Outbox, statements: list[str]
) -> None:
    with engine.begin() as conn:
        statements.clear()
        assert outbox.enqueue_many(conn, []) == []
        assert statements == []


def test_enqueue_many_with_event_ids_uses_a_savepoint(
    engine: sa.Engine, outbox: Outbox, statements: list[str]
) -> None:
    given = [uuid.uuid4(), uuid.uuid4()]
    with engine.begin() as conn:
        assert outbox.writer.functions(conn) == (True, True)
        statements.clear()
        ids = outbox.enqueue_many(
            conn, [Event(**valid_event(event_id=given[0])), Event(**valid_event(event_id=given[1]))]
        )
    assert ids == given
    assert [s.split()[0] for s in statements] == ["SAVEPOINT", "SELECT", "RELEASE"]
    assert '"outbox_enqueue_many"(' in statements[1]
    assert [row["event_id"] for row in stored_events(engine)] == given


# --- bad input on a real connection ------------------------------------------------------


@pytest.fixture
def shared_engine(module_engine: sa.Engine) -> sa.Engine:
    """The module's database, emptied: cheaper than a database per bad-input case."""
    with module_engine.begin() as conn:
        for table in ("outbox", "outbox_arrivals", "outbox_key_seq"):
            conn.execute(sa.text(f"DELETE FROM {table}"))
    return module_engine


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c.id)
def test_bad_input_leaves_the_transaction_usable(
    shared_engine: sa.Engine, outbox: Outbox, case: BadInput
) -> None:
    engine = shared_engine
    bad = valid_event(key="bad-key")
    bad.update(case.overrides)
    with engine.connect() as conn:
        with conn.begin():
            with pytest.raises(case.error) as excinfo:
                outbox.enqueue(conn, **bad)
            assert excinfo.value.field == case.field
            assert case.field in str(excinfo.value)
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
            good = outbox.enqueue(conn, **valid_event(key="good-key"))
        assert not conn.in_transaction()
    assert [(r["event_id"], r["ordering_key"], r["seq"]) for r in stored_events(engine)] == [
        (good, "good-key", 1)
    ]
    assert key_seqs(engine) == {"good-key": 1}
    assert list(queued_keys(engine)) == ["good-key"]


def test_bad_event_in_a_batch_writes_nothing(engine: sa.Engine, outbox: Outbox) -> None:
    batch = [Event(**valid_event(key=f"k{i}")) for i in range(5)]
    batch[2] = Event(**valid_event(key="k2", data={**ORDER_CREATED, "currency": "euro"}))
    with engine.begin() as conn:
        with pytest.raises(DataSchemaViolation) as excinfo:
            outbox.enqueue_many(conn, batch)
        assert excinfo.value.index == 2
        assert "event 2" in str(excinfo.value)
        assert "event 3" not in str(excinfo.value)
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 0
    assert count_all(engine) == (0, 0, 0)
    # A batch with a bad key is rejected the same way, naming its index.
    batch[2] = Event(**valid_event(key=""))
    with engine.begin() as conn:
        with pytest.raises(InvalidKey, match=r"^event 2: key: "):
            outbox.enqueue_many(conn, batch)
        good = outbox.enqueue_many(conn, batch[:2])
    assert [r["event_id"] for r in stored_events(engine)] == good


def test_duplicate_event_id(engine: sa.Engine, outbox: Outbox) -> None:
    event_id = uuid.uuid4()
    with engine.begin() as conn:
        assert outbox.enqueue(conn, **valid_event(key="K", event_id=event_id)) == event_id
    with engine.begin() as conn:
        with pytest.raises(DuplicateEventId) as excinfo:
            outbox.enqueue(conn, **valid_event(key="K", event_id=event_id))
        assert excinfo.value.field == "event_id"
        # Also a duplicate inside one transaction, for another key.
        other = uuid.uuid4()
        outbox.enqueue(conn, **valid_event(key="L", event_id=other))
        with pytest.raises(DuplicateEventId):
            outbox.enqueue(conn, **valid_event(key="L", event_id=other))
        # The transaction is still usable and the key's sequence has no gap.
        assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
        after = outbox.enqueue(conn, **valid_event(key="K"))
        after_other = outbox.enqueue(conn, **valid_event(key="L"))
    stored = seqs_by_key(engine)
    assert stored["K"] == [(1, event_id), (2, after)]
    assert stored["L"] == [(1, other), (2, after_other)]
    assert key_seqs(engine) == {"K": 2, "L": 2}


def test_duplicate_event_id_within_one_batch(engine: sa.Engine, outbox: Outbox) -> None:
    event_id = uuid.uuid4()
    with engine.begin() as conn:
        with pytest.raises(DuplicateEventId):
            outbox.enqueue_many(
                conn,
                [Event(**valid_event(event_id=event_id)), Event(**valid_event(event_id=event_id))],
            )
        outbox.enqueue(conn, **valid_event())
    assert [r["seq"] for r in stored_events(engine)] == [1]


# --- isolation levels ---------------------------------------------------------------------


@pytest.mark.parametrize("existing_key", [False, True], ids=["new-key", "existing-key"])
def test_repeatable_read_concurrent_enqueue_is_a_serialization_failure(
    engine: sa.Engine, outbox: Outbox, existing_key: bool
) -> None:
    if existing_key:
        with engine.begin() as conn:
            outbox.enqueue(conn, **valid_event(key="K"))
    base = 1 if existing_key else 0
    with engine.connect() as a_conn, engine.connect() as b_conn:
        a = a_conn.execution_options(isolation_level="REPEATABLE READ")
        b = b_conn.execution_options(isolation_level="REPEATABLE READ")
        a.execute(sa.text("SELECT 1"))
        b.execute(sa.text("SELECT 1"))
        outbox.enqueue(a, **valid_event(key="K"))
        a.commit()
        with pytest.raises(sa.exc.OperationalError) as excinfo:
            outbox.enqueue(b, **valid_event(key="K"))
        assert isinstance(excinfo.value.orig, psycopg2.errors.SerializationFailure)
        b.rollback()
        # The caller's retry in a fresh transaction succeeds.
        retried = outbox.enqueue(b, **valid_event(key="K"))
        b.commit()
    assert seqs_by_key(engine)["K"][-1] == (base + 2, retried)
    assert key_seqs(engine) == {"K": base + 2}


def test_repeatable_read_different_keys_do_not_conflict(engine: sa.Engine, outbox: Outbox) -> None:
    with engine.connect() as a_conn, engine.connect() as b_conn:
        a = a_conn.execution_options(isolation_level="REPEATABLE READ")
        b = b_conn.execution_options(isolation_level="REPEATABLE READ")
        a.execute(sa.text("SELECT 1"))
        b.execute(sa.text("SELECT 1"))
        outbox.enqueue(a, **valid_event(key="A"))
        a.commit()
        outbox.enqueue(b, **valid_event(key="B"))
        b.commit()
    assert key_seqs(engine) == {"A": 1, "B": 1}


# --- scheduling ---------------------------------------------------------------------------


def test_future_available_at_is_stored(engine: sa.Engine, outbox: Outbox) -> None:
    ist = timezone(timedelta(hours=5, minutes=30))
    when = datetime.now(ist).replace(microsecond=123456) + timedelta(hours=2)
    with engine.begin() as conn:
        outbox.enqueue(conn, **valid_event(key="later", available_at=when))
        outbox.enqueue(conn, **valid_event(key="now"))
    rows = {row["ordering_key"]: row for row in stored_events(engine)}
    stored = rows["later"]["available_at"]
    assert stored.tzinfo is not None
    assert stored == when
    assert stored.astimezone(UTC) == when.astimezone(UTC)
    assert rows["now"]["available_at"] < when - timedelta(hours=1)
    heads = queued_keys(engine)
    assert heads["later"]["due_at"] == when
    assert heads["now"]["due_at"] == rows["now"]["available_at"]


def test_first_event_of_a_new_key_sets_due_at(engine: sa.Engine, outbox: Outbox) -> None:
    later = datetime(2040, 1, 1, tzinfo=UTC)
    with engine.begin() as conn:
        outbox.enqueue_many(
            conn,
            [
                Event(**valid_event(key="K", available_at=later)),
                Event(**valid_event(key="K")),
            ],
        )
    assert queued_keys(engine)["K"]["due_at"] == later


def test_a_delay_counts_from_the_databases_clock(engine: sa.Engine, outbox: Outbox) -> None:
    with engine.begin() as conn:
        outbox.enqueue(conn, **valid_event(key="one", delay=timedelta(seconds=90)))
        outbox.enqueue_many(
            conn,
            [
                Event(**valid_event(key="many", delay=timedelta(minutes=5))),
                Event(**valid_event(key="many")),
                Event(**valid_event(key="other", delay=timedelta(0))),
            ],
        )
        now = conn.execute(sa.text("SELECT now()")).scalar_one()
    stored = {(r["ordering_key"], r["seq"]): r["available_at"] for r in stored_events(engine)}
    assert stored[("one", 1)] == now + timedelta(seconds=90)
    assert stored[("many", 1)] == now + timedelta(minutes=5)
    assert stored[("many", 2)] == now
    assert stored[("other", 1)] == now
    heads = queued_keys(engine)
    assert heads["one"]["due_at"] == now + timedelta(seconds=90)
    assert heads["many"]["due_at"] == now + timedelta(minutes=5)  # its first event's


@pytest.mark.parametrize(
    ("delay", "available_at", "message"),
    [
        (timedelta(seconds=-1), None, "must not be negative"),
        (30, None, "must be a datetime.timedelta, not int"),
        (timedelta(days=40_000), None, "must be at most"),
        (timedelta(seconds=5), datetime(2040, 1, 1, tzinfo=UTC), "not both"),
    ],
)
def test_a_bad_delay_is_refused_before_anything_is_written(
    engine: sa.Engine, outbox: Outbox, delay: Any, available_at: datetime | None, message: str
) -> None:
    with engine.begin() as conn:
        with pytest.raises(InvalidTimestamp, match=message) as caught:
            outbox.enqueue(conn, **valid_event(key="bad", delay=delay, available_at=available_at))
        assert caught.value.field == "delay"
    assert stored_events(engine) == []


# --- LISTEN / NOTIFY ----------------------------------------------------------------------


def _listener(database_url: str, channel: str) -> psycopg2.extensions.connection:
    conn = psycopg2.connect(libpq_url(database_url))
    conn.set_session(autocommit=True)
    with conn.cursor() as cur:
        cur.execute(f'LISTEN "{channel}"')
    return conn


def _notifications(conn: psycopg2.extensions.connection, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    while not conn.notifies:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        select.select([conn], [], [], left)
        conn.poll()
    got = list(conn.notifies)
    conn.notifies.clear()
    return got


def _idle_relay(database_url: str, outbox: Outbox) -> psycopg2.extensions.connection:
    """A session that listens and holds the wake lock, as an idle relay does."""
    conn = _listener(database_url, outbox.names.channel)
    with conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(%s)", (outbox.names.wake_lock,))
    return conn


def test_commit_notifies_an_idle_relay_and_rollback_does_not(
    engine: sa.Engine, database_url: str, outbox: Outbox
) -> None:
    channel = Outbox().names.channel
    assert channel == "outbox_kafka.public.outbox"
    listener = _idle_relay(database_url, outbox)
    try:
        with engine.connect() as conn:
            with conn.begin() as tx:
                outbox.enqueue(conn, **valid_event())
                tx.rollback()
            assert _notifications(listener, 0.5) == []

            with conn.begin():
                outbox.enqueue(conn, **valid_event())
                assert _notifications(listener, 0.2) == []  # not before commit
            got = _notifications(listener, 5)
        assert len(got) == 1
        assert got[0].channel == channel
    finally:
        listener.close()


def test_no_notify_while_no_relay_waits_idle(
    engine: sa.Engine, database_url: str, outbox: Outbox
) -> None:
    # Listening, as a busy relay does, but not holding the wake lock: NOTIFY, which
    # serialises the commits that send one, is left out.
    listener = _listener(database_url, outbox.names.channel)
    try:
        with engine.begin() as conn:
            outbox.enqueue(conn, **valid_event())
        with engine.begin() as conn:
            outbox.enqueue_many(conn, [Event(**valid_event()), Event(**valid_event(key="b"))])
        assert _notifications(listener, 0.5) == []
    finally:
        listener.close()
    assert len(stored_events(engine)) == 3


def test_notify_can_be_turned_off(engine: sa.Engine, database_url: str) -> None:
    quiet = Outbox(schema_dir=EVENT_SCHEMAS, routes={"order.*": "orders"}, notify=False)
    listener = _idle_relay(database_url, quiet)
    try:
        with engine.begin() as conn:
            quiet.enqueue(conn, **valid_event())
        assert _notifications(listener, 0.5) == []
    finally:
        listener.close()
    assert len(stored_events(engine)) == 1


# --- other outboxes ------------------------------------------------------------------------


def test_custom_table_and_schema(engine: sa.Engine) -> None:
    names = TableNames(table="orders_outbox", schema="app")
    migrate(engine, names)
    box = Outbox(table="orders_outbox", db_schema="app", routes={"*": "orders"})
    with engine.begin() as conn:
        event_id = box.enqueue(conn, type="x", key="K", data={"a": 1})
    assert [r["event_id"] for r in stored_events(engine, '"app"."orders_outbox"')] == [event_id]
    assert key_seqs(engine, '"app"."orders_outbox_key_seq"') == {"K": 1}
    assert list(queued_keys(engine, '"app"."orders_outbox_arrivals"')) == ["K"]
    assert count_all(engine) == (0, 0, 0)


@pytest.mark.parametrize("kind", ["table", "schema"])
def test_longest_accepted_names_work(engine: sa.Engine, kind: str) -> None:
    """TableNames accepts these names, so an outbox using them must work end to end."""
    longest = {"table": "t" * 47, "schema": "s" * 63}[kind]
    names = TableNames(**{kind: longest})
    with pytest.raises(InvalidIdentifier):
        TableNames(**{kind: longest + kind[0]})
    migrate(engine, names)
    box = Outbox(table=names.table, db_schema=names.schema, routes={"*": "orders"})
    with engine.begin() as conn:
        event_id = box.enqueue(conn, type="x", key="K", data={"a": 1})
    table = f'"{names.schema}"."{names.events}"'
    assert [r["event_id"] for r in stored_events(engine, table)] == [event_id]


def test_topic_of_249_characters_is_stored(engine: sa.Engine, outbox: Outbox) -> None:
    topic = "t" * 249
    with engine.begin() as conn:
        outbox.enqueue(conn, **valid_event(topic=topic))
    assert stored_events(engine)[0]["topic"] == topic


def test_key_at_the_byte_limit_is_stored(engine: sa.Engine, outbox: Outbox) -> None:
    key = "€" * 341 + "k"
    assert len(key.encode()) == 1024
    with engine.begin() as conn:
        outbox.enqueue(conn, **valid_event(key=key))
        with pytest.raises(InvalidKey):
            outbox.enqueue(conn, **valid_event(key=key + "k"))
    assert key_seqs(engine) == {key: 1}


# --- tables.py agrees with the migrations -------------------------------------------------


def _type_ddl(column_type: Any, dialect: sa.Dialect) -> str:
    return str(column_type.compile(dialect=dialect))


@pytest.mark.parametrize(
    "names", [TableNames(), TableNames(table="orders_outbox", schema="app")], ids=str
)
def test_tables_metadata_matches_the_database(engine: sa.Engine, names: TableNames) -> None:
    if names != TableNames():
        migrate(engine, names)
    described = build_tables(names)
    inspector = sa.inspect(engine)
    for table in (
        described.events,
        described.keys,
        described.seqs,
        described.arrivals,
        described.floors,
        described.versions,
    ):
        schema = table.schema
        reflected = inspector.get_columns(table.name, schema=schema)
        assert [(c["name"], c["nullable"]) for c in reflected] == [
            (c.name, c.nullable) for c in table.columns
        ], table.name
        assert [_type_ddl(c["type"], engine.dialect) for c in reflected] == [
            _type_ddl(c.type, engine.dialect) for c in table.columns
        ], table.name
        assert [c["name"] for c in reflected if c.get("default") is not None] == [
            c.name for c in table.columns if c.server_default is not None
        ], table.name

        indexes = {
            i["name"]
            for i in inspector.get_indexes(table.name, schema=schema)
            if not i.get("duplicates_constraint")
        }
        assert indexes == {i.name for i in table.indexes}, table.name

        pk = inspector.get_pk_constraint(table.name, schema=schema)
        assert pk["constrained_columns"] == [c.name for c in table.primary_key.columns]
        uniques = {
            u["name"]: u["column_names"]
            for u in inspector.get_unique_constraints(table.name, schema=schema)
        }
        assert uniques == {
            c.name: [col.name for col in c.columns]
            for c in table.constraints
            if isinstance(c, sa.UniqueConstraint) and not isinstance(c, sa.PrimaryKeyConstraint)
        }
        checks = {c["name"] for c in inspector.get_check_constraints(table.name, schema=schema)}
        assert checks == {c.name for c in table.constraints if isinstance(c, sa.CheckConstraint)}
