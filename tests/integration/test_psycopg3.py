"""Producers on psycopg 3's synchronous driver (``postgresql+psycopg://``): the same rows,
order and errors as on psycopg2, through the enqueue functions and through the batch
statement, with arrays bound as lists."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from outbox_kafka import DuplicateEventId, Event, Outbox, UnsafeConnection
from tests.integration.test_enqueue import count_all, key_seqs, queued_keys, stored_events
from tests.support import ORDER_CREATED, valid_event


@pytest.fixture
def psycopg_engine(database_url: str) -> Iterator[sa.Engine]:
    eng = sa.create_engine(make_url(database_url).set(drivername="postgresql+psycopg"))
    assert eng.dialect.driver == "psycopg"
    yield eng
    eng.dispose()


@pytest.fixture(params=["functions", "statement"])
def path(request: pytest.FixtureRequest, engine: sa.Engine, outbox: Outbox) -> str:
    """Which way events are written: the enqueue functions, or the batch statement where
    they cannot be called (dropped here, as on tables made from outbox_kafka.schema.metadata)."""
    if request.param == "statement":
        with engine.begin() as conn:
            conn.exec_driver_sql(
                f"DROP FUNCTION {outbox.names.enqueue_one_signature}, "
                f"{outbox.names.enqueue_many_signature}"
            )
    return str(request.param)


@pytest.fixture
def statements(psycopg_engine: sa.Engine) -> Iterator[list[tuple[str, Any]]]:
    """The event-writing statements psycopg_engine sends, with their parameters."""
    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, *rest: Any) -> None:
        if "outbox_enqueue_" in statement or "batch_keys" in statement:
            seen.append((statement, parameters))

    sa.event.listen(psycopg_engine, "before_cursor_execute", record)
    yield seen
    sa.event.remove(psycopg_engine, "before_cursor_execute", record)


def test_enqueue_and_enqueue_many_store_their_events(
    engine: sa.Engine,
    psycopg_engine: sa.Engine,
    outbox: Outbox,
    path: str,
    statements: list[tuple[str, Any]],
) -> None:
    later = datetime(2040, 1, 1, tzinfo=UTC)
    with psycopg_engine.begin() as conn:
        one = outbox.enqueue(conn, **valid_event(headers={"x-tenant": "acme"}))
        many = outbox.enqueue_many(
            conn,
            [
                Event(**valid_event(key="b", delay=timedelta(minutes=5))),
                valid_event(key="order-1", available_at=later),
                Event(**valid_event(key="b")),
            ],
        )
        now = conn.execute(sa.text("SELECT now()")).scalar_one()
    rows = {r["event_id"]: r for r in stored_events(engine)}
    assert set(rows) == {one, *many}
    assert json.loads(rows[one]["value"])["data"] == ORDER_CREATED
    assert json.loads(rows[one]["value"])["id"] == str(one)
    assert rows[one]["topic"] == "orders"
    assert rows[one]["header_names"][-1] == "x-tenant"
    assert rows[one]["header_values"][-1] == b"acme"
    assert [(rows[i]["ordering_key"], rows[i]["seq"], rows[i]["available_at"]) for i in many] == [
        ("b", 1, now + timedelta(minutes=5)),
        ("order-1", 2, later),
        ("b", 2, now),
    ]
    assert key_seqs(engine) == {"order-1": 2, "b": 2}
    assert queued_keys(engine)["b"]["due_at"] == now + timedelta(minutes=5)

    assert len(statements) == 2
    if path == "functions":
        assert '"outbox_enqueue_one"(' in statements[0][0]
        assert '"outbox_enqueue_many"(' in statements[1][0]
    else:
        assert all(s.lstrip().startswith("WITH batch_keys") for s, _ in statements)
    # Arrays as lists, which psycopg adapts itself (array literals are for psycopg2).
    assert isinstance(statements[1][1]["event_ids"], list)


def test_a_rolled_back_transaction_leaves_nothing(
    engine: sa.Engine, psycopg_engine: sa.Engine, outbox: Outbox, path: str
) -> None:
    with psycopg_engine.connect() as conn, conn.begin() as tx:
        outbox.enqueue(conn, **valid_event())
        outbox.enqueue_many(conn, [valid_event(key="b"), valid_event(key="c")])
        tx.rollback()
    with pytest.raises(RuntimeError), Session(psycopg_engine) as session, session.begin():
        outbox.enqueue(session, **valid_event())
        raise RuntimeError("roll back")
    assert count_all(engine) == (0, 0, 0)


def test_a_duplicate_event_id_leaves_the_transaction_usable(
    engine: sa.Engine, psycopg_engine: sa.Engine, outbox: Outbox, path: str
) -> None:
    taken = uuid.uuid4()
    with psycopg_engine.begin() as conn:
        outbox.enqueue(conn, **valid_event(key="K", event_id=taken))
    with Session(psycopg_engine) as session, session.begin():
        with pytest.raises(DuplicateEventId):
            outbox.enqueue(session, **valid_event(key="K", event_id=taken))
        with pytest.raises(DuplicateEventId):
            outbox.enqueue_many(session, [valid_event(key="L"), valid_event(event_id=taken)])
        assert session.execute(sa.text("SELECT 1")).scalar_one() == 1
        after = outbox.enqueue(session, **valid_event(key="K"))
        [other] = outbox.enqueue_many(session, [valid_event(key="L")])
    assert [(r["ordering_key"], r["seq"], r["event_id"]) for r in stored_events(engine)] == [
        ("K", 1, taken),
        ("K", 2, after),
        ("L", 1, other),
    ]


def test_a_batch_keeps_the_order_given_per_key(
    engine: sa.Engine, psycopg_engine: sa.Engine, outbox: Outbox, path: str
) -> None:
    keys = ["x", "y", "x", "z", "y", "x", 'we"ird\\', "z", 'we"ird\\']
    with psycopg_engine.begin() as conn:
        outbox.enqueue(conn, **valid_event(key="y"))
    with psycopg_engine.begin() as conn:
        ids = outbox.enqueue_many(
            conn,
            [
                Event(**valid_event(key=k, data={**ORDER_CREATED, "order_id": f"o-{n}"}))
                for n, k in enumerate(keys)
            ],
        )
    rows = {r["event_id"]: r for r in stored_events(engine)}
    for n, event_id in enumerate(ids):
        assert json.loads(rows[event_id]["value"])["data"]["order_id"] == f"o-{n}"
    for key in set(keys):
        given = [event_id for event_id, k in zip(ids, keys, strict=True) if k == key]
        first = 2 if key == "y" else 1
        assert [rows[e]["seq"] for e in given] == list(range(first, first + len(given))), key
    assert key_seqs(engine) == {"x": 3, "y": 3, "z": 2, 'we"ird\\': 2}


def test_autocommit_is_refused(database_url: str, engine: sa.Engine, outbox: Outbox) -> None:
    autocommit = sa.create_engine(
        make_url(database_url).set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT"
    )
    try:
        with autocommit.connect() as conn:
            assert isinstance(conn.connection.dbapi_connection, psycopg.Connection)
            with pytest.raises(UnsafeConnection, match="AUTOCOMMIT"):
                outbox.enqueue(conn, **valid_event())
    finally:
        autocommit.dispose()
    assert count_all(engine) == (0, 0, 0)
