"""``outbox_kafka.contrib.django``: events written on Django's own connection, in the
transaction of ``transaction.atomic()``, against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import django
import pytest
import sqlalchemy as sa
from django.conf import settings
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from prometheus_client import REGISTRY
from sqlalchemy.engine import make_url

from outbox_kafka import (
    DuplicateEventId,
    Event,
    InvalidKey,
    Outbox,
    TableNames,
    UnknownEventType,
    UnsafeConnection,
    migrate,
)
from outbox_kafka.contrib import django as django_outbox
from tests.integration.test_enqueue import stored_events
from tests.log_support import keys_and_ns, log_outbox, read_log
from tests.relay_support import migrate_to
from tests.support import ORDER_CREATED, REPO, valid_event


def _django_database(url: str, **options: Any) -> dict[str, Any]:
    """Django's settings for the database at SQLAlchemy URL ``url``.

    A server on a Unix socket (embedded PostgreSQL) is named by the query's
    ``host`` (the socket's directory) and ``port``.
    """
    parsed = make_url(url)
    query_host = parsed.query.get("host")
    query_port = parsed.query.get("port")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parsed.database,
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": parsed.host or (str(query_host) if query_host else ""),
        "PORT": str(parsed.port or query_port or ""),
        "OPTIONS": options,
    }


@pytest.fixture
def django_db(database_url: str) -> Iterator[None]:
    with _django_on(database_url):
        yield


@pytest.fixture
def django_log_db(log_url: str) -> Iterator[None]:
    """:func:`django_db` on a database of the logical server, with the outbox's slot."""
    with _django_on(log_url):
        yield


@contextlib.contextmanager
def _django_on(database_url: str) -> Iterator[None]:
    """Django's ``default`` connection on ``database_url``, with a ``django_orders``
    table (and a SQLite database as ``lite``); every connection closed at the end, so
    that the database can be dropped.

    Django's settings are the process's: configured by the first test, and pointed at
    each test's database after that.
    """
    databases = {
        "default": _django_database(database_url),
        "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    }
    if not settings.configured:
        settings.configure(DATABASES=databases, INSTALLED_APPS=[], USE_TZ=True)
        django.setup()
    settings.DATABASES = databases
    connections.settings = connections.configure_settings(databases)
    try:
        with connection.cursor() as cursor:
            cursor.execute("CREATE TABLE django_orders (id text PRIMARY KEY)")
        yield
    finally:
        connections.close_all()
        for alias in databases:
            with contextlib.suppress(AttributeError):
                del connections[alias]


def _create_order(order_id: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO django_orders (id) VALUES (%s)", [order_id])


def _orders(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT id FROM django_orders ORDER BY id")).scalars())


def _keys(engine: sa.Engine, table: str = '"outbox"') -> list[str]:
    return [e["ordering_key"] for e in stored_events(engine, table)]


def _failures(reason: str) -> float:
    found = REGISTRY.get_sample_value("outbox_enqueue_failures_total", {"reason": reason})
    return found or 0.0


def _order_event(key: str, order_id: str, **overrides: Any) -> dict[str, Any]:
    return valid_event(key=key, data={**ORDER_CREATED, "order_id": order_id}, **overrides)


def test_an_order_and_its_event_commit_together_at_the_end_of_atomic(
    django_db: None, engine: sa.Engine, outbox: Outbox
) -> None:
    with transaction.atomic():
        _create_order("o-1")
        event_id = django_outbox.enqueue(**valid_event(key="o-1"), outbox=outbox)
        # Not committed yet: another session sees neither.
        assert _orders(engine) == []
        assert stored_events(engine) == []
    assert _orders(engine) == ["o-1"]
    [event] = stored_events(engine)
    assert (str(event["event_id"]), event["ordering_key"], event["topic"]) == (
        str(event_id),
        "o-1",
        "orders",
    )
    assert json.loads(event["value"])["data"] == ORDER_CREATED
    # Django's connection was left open and usable, out of any transaction.
    assert connection.connection is not None
    assert not connection.in_atomic_block
    assert connection.is_usable()


def test_extension_attributes_are_passed_on(
    django_db: None, engine: sa.Engine, outbox: Outbox
) -> None:
    with transaction.atomic():
        django_outbox.enqueue(
            **valid_event(key="o-1"), extensions={"tenant": "acme"}, outbox=outbox
        )
    [event] = stored_events(engine)
    assert json.loads(event["value"])["tenant"] == "acme"


def test_an_exception_in_the_atomic_block_leaves_neither_order_nor_event(
    django_db: None, engine: sa.Engine, outbox: Outbox
) -> None:
    with pytest.raises(RuntimeError, match="the view failed"), transaction.atomic():
        _create_order("o-1")
        django_outbox.enqueue(**valid_event(key="o-1"), outbox=outbox)
        django_outbox.enqueue_many([_order_event("o-1", "o-1")], outbox=outbox)
        raise RuntimeError("the view failed after enqueue")
    assert _orders(engine) == []
    assert stored_events(engine) == []


def test_an_inner_atomic_rolled_back_takes_its_events_and_the_outer_commits_its_own(
    django_db: None, engine: sa.Engine, outbox: Outbox
) -> None:
    with transaction.atomic():
        _create_order("o-1")
        kept = django_outbox.enqueue(**_order_event("a", "a-1"), outbox=outbox)
        with pytest.raises(RuntimeError), transaction.atomic():
            django_outbox.enqueue(**_order_event("b", "b-1"), outbox=outbox)
            django_outbox.enqueue(**_order_event("a", "a-dropped"), outbox=outbox)
            raise RuntimeError("the inner block failed")
        later = django_outbox.enqueue(**_order_event("a", "a-2"), outbox=outbox)
    assert _orders(engine) == ["o-1"]
    events = stored_events(engine)
    assert [(str(e["event_id"]), e["ordering_key"]) for e in events] == [
        (str(kept), "a"),
        (str(later), "a"),
    ]
    assert [json.loads(e["value"])["data"]["order_id"] for e in events] == ["a-1", "a-2"]
    assert events[0]["seq"] < events[1]["seq"]


def test_enqueue_many_keeps_the_order_of_each_key(
    django_db: None, engine: sa.Engine, outbox: Outbox
) -> None:
    given = [("k1", 0), ("k2", 0), ("k1", 1), ("k3", 0), ("k2", 1), ("k1", 2), ("k1", 3)]
    with transaction.atomic():
        ids = django_outbox.enqueue_many(
            [Event(**_order_event(key, f"{key}-{n}")) for key, n in given[:4]]
            + [_order_event(key, f"{key}-{n}") for key, n in given[4:]],
            outbox=outbox,
        )
    assert len(set(ids)) == len(given)
    events = stored_events(engine)  # by key, then seq
    assert sorted(str(e["event_id"]) for e in events) == sorted(map(str, ids))
    by_key: dict[str, list[tuple[int, str]]] = {}
    for event in events:
        order_id = json.loads(event["value"])["data"]["order_id"]
        by_key.setdefault(event["ordering_key"], []).append((event["seq"], order_id))
    for key, stored in by_key.items():
        seqs = [seq for seq, _ in stored]
        assert seqs == sorted(set(seqs)), key
        assert [order_id for _, order_id in stored] == [f"{k}-{n}" for k, n in given if k == key]
    assert sorted(by_key) == ["k1", "k2", "k3"]
    # The ids come back in the order given.
    id_of = {json.loads(e["value"])["data"]["order_id"]: str(e["event_id"]) for e in events}
    assert [str(i) for i in ids] == [id_of[f"{k}-{n}"] for k, n in given]


def test_outside_an_atomic_block_enqueue_is_refused_naming_transaction_atomic(
    django_db: None, engine: sa.Engine, outbox: Outbox
) -> None:
    counted = _failures("unsafe_connection")
    assert connection.get_autocommit()
    with pytest.raises(UnsafeConnection, match=r"not inside transaction\.atomic\(\)"):
        django_outbox.enqueue(**valid_event(), outbox=outbox)
    with pytest.raises(UnsafeConnection, match=r"transaction\.atomic\(using='default'\)"):
        django_outbox.enqueue_many([valid_event(key="k1"), valid_event(key="k2")], outbox=outbox)
    assert stored_events(engine) == []
    assert _failures("unsafe_connection") == counted + 2


def test_a_database_that_is_not_postgresql_is_refused(django_db: None, outbox: Outbox) -> None:
    with (
        pytest.raises(UnsafeConnection, match="'lite' is sqlite"),
        transaction.atomic(using="lite"),
    ):
        django_outbox.enqueue(**valid_event(), using="lite", outbox=outbox)


@pytest.mark.parametrize("given", ["connection", "wrapper", "cursor"])
def test_the_core_api_given_a_django_connection_names_the_django_adapter(
    django_db: None, engine: sa.Engine, outbox: Outbox, given: str
) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        django_object = {
            "connection": connection,  # django.db.connection, a ConnectionProxy
            "wrapper": connections["default"],
            "cursor": cursor,
        }[given]
        with pytest.raises(UnsafeConnection) as raised:
            outbox.enqueue(django_object, **valid_event())
        with pytest.raises(UnsafeConnection) as raised_async:
            asyncio.run(outbox.enqueue_async(django_object, **valid_event()))
    for error in (raised.value, raised_async.value):
        assert "outbox_kafka.contrib.django.enqueue(" in str(error)
        assert "transaction.atomic()" in str(error)
        assert type(django_object).__name__ in str(error)
    assert stored_events(engine) == []


def test_a_duplicate_chosen_id_raises_and_the_outer_transaction_still_commits(
    django_db: None, engine: sa.Engine, outbox: Outbox
) -> None:
    chosen = uuid.uuid4()
    counted = _failures("duplicate_event_id")
    with transaction.atomic():
        _create_order("o-1")
        assert django_outbox.enqueue(**valid_event(key="o-1", event_id=chosen), outbox=outbox) == (
            chosen
        )
        with pytest.raises(DuplicateEventId, match="already in the outbox"):
            django_outbox.enqueue(**valid_event(key="o-2", event_id=chosen), outbox=outbox)
        with pytest.raises(DuplicateEventId, match="already in the outbox"):
            django_outbox.enqueue_many(
                [valid_event(key="o-3"), valid_event(key="o-3", event_id=chosen)], outbox=outbox
            )
        _create_order("o-2")
        other = django_outbox.enqueue(**valid_event(key="o-2"), outbox=outbox)
    assert _orders(engine) == ["o-1", "o-2"]
    assert [(str(e["event_id"]), e["ordering_key"]) for e in stored_events(engine)] == [
        (str(chosen), "o-1"),
        (str(other), "o-2"),
    ]
    assert _failures("duplicate_event_id") == counted + 2


@pytest.mark.parametrize(
    ("overrides", "error"),
    [({"type": "order.refunded"}, UnknownEventType), ({"key": ""}, InvalidKey)],
    ids=["unknown-type", "empty-key"],
)
def test_an_invalid_event_raises_before_anything_is_written(
    django_db: None,
    engine: sa.Engine,
    outbox: Outbox,
    overrides: dict[str, Any],
    error: type[Exception],
) -> None:
    counted = _failures("validation")
    with transaction.atomic():
        _create_order("o-1")
        with CaptureQueriesContext(connection) as queries, pytest.raises(error):
            django_outbox.enqueue(**valid_event(**overrides), outbox=outbox)
        with CaptureQueriesContext(connection) as batch_queries, pytest.raises(error) as caught:
            django_outbox.enqueue_many(
                [valid_event(key="fine"), valid_event(**overrides)], outbox=outbox
            )
        assert str(caught.value).startswith("event 1:")
        assert list(queries) == list(batch_queries) == []
    assert _orders(engine) == ["o-1"]  # the transaction stayed usable
    assert stored_events(engine) == []
    assert _failures("validation") == counted + 2


def test_the_functions_are_asked_about_once_and_again_on_a_new_connection_until_callable(
    django_db: None, engine: sa.Engine
) -> None:
    """An outbox at schema version 2 has no functions: Django's connection writes with the
    batch statement and keeps that answer for its session only; after the migration a new
    session calls the functions, and that answer holds across reconnects."""
    names = TableNames(table="behind")
    outbox = Outbox(allow_unknown_types=True, table="behind", routes={"*": "t"})
    migrate_to(engine, names, 2)
    # Per turn: how many times the functions are asked about, and whether they are called.
    expected = [(1, False), (1, True), (0, True)]
    for turn, (asks, calls_functions) in enumerate(expected):
        with CaptureQueriesContext(connection) as queries, transaction.atomic():
            django_outbox.enqueue(type="t", key="a", data=turn, outbox=outbox)
            django_outbox.enqueue_many(
                [Event("t", "a", data=turn), Event("t", "b", data=turn)], outbox=outbox
            )
            django_outbox.enqueue(type="t", key="b", data=turn, outbox=outbox)
        sent = [q["sql"] for q in queries.captured_queries]
        assert sum("has_function_privilege" in sql for sql in sent) == asks, turn
        writes = [sql for sql in sent if "has_function_privilege" not in sql]
        assert any('"behind_enqueue_' in sql for sql in writes) == calls_functions, turn
        connection.close()  # the next turn: a new session, on the same Django connection
        if turn == 0:
            assert migrate(engine, names).applied == [3, 4, 5, 6, 7, 8]
    stored = stored_events(engine, '"behind"')
    assert [(e["ordering_key"], json.loads(e["value"])["data"]) for e in stored] == [
        (key, turn) for key in "ab" for turn in range(3) for _ in range(2)
    ]


_OTHER_DRIVER_SCRIPT = """
import json, sys, uuid
from datetime import UTC, datetime

config = json.loads(sys.argv[1])
if config["hide_psycopg"]:
    sys.modules["psycopg"] = None  # Django falls back to psycopg2
import django
from django.conf import settings

settings.configure(DATABASES={"default": config["database"]}, INSTALLED_APPS=[], USE_TZ=True)
django.setup()
from django.db import connection, transaction
from django.db.backends.postgresql.psycopg_any import is_psycopg3

from outbox_kafka import DuplicateEventId, Event, Outbox
from outbox_kafka.contrib import django as django_outbox

outbox = Outbox(allow_unknown_types=True, routes={"*": "t"})
chosen = uuid.UUID(config["chosen"])
now = datetime.now(UTC)
with transaction.atomic():
    ids = [django_outbox.enqueue(type="t", key="a", data=0, available_at=now, outbox=outbox)]
    ids += django_outbox.enqueue_many(
        [Event("t", "a", 1, event_id=chosen), Event("t", "b", 2), Event("t", "a", 3)],
        outbox=outbox,
    )
    try:
        django_outbox.enqueue(type="t", key="b", data=-1, event_id=chosen, outbox=outbox)
        duplicate = False
    except DuplicateEventId:
        duplicate = True
    ids.append(django_outbox.enqueue(type="t", key="b", data=4, outbox=outbox))
connection.close()
print(json.dumps({"psycopg3": is_psycopg3, "duplicate": duplicate, "ids": list(map(str, ids))}))
"""


@pytest.mark.parametrize(
    ("hide_psycopg", "options", "psycopg3"),
    [(True, {}, False), (False, {"server_side_binding": True}, True)],
    ids=["psycopg2", "psycopg-server-side-binding"],
)
def test_the_other_drivers_of_django_write_the_same_events(
    database_url: str,
    engine: sa.Engine,
    hide_psycopg: bool,
    options: dict[str, Any],
    psycopg3: bool,
) -> None:
    """Django picks psycopg 3 where it is installed, binding on the client; the tests above
    run on that. Here, in a process of their own: psycopg2, and psycopg 3 binding on the
    server."""
    chosen = uuid.uuid4()
    config = {
        "hide_psycopg": hide_psycopg,
        "database": _django_database(database_url, **options),
        "chosen": str(chosen),
    }
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_DRIVER_SCRIPT, json.dumps(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["psycopg3"], report["duplicate"]) == (psycopg3, True)
    stored = stored_events(engine)
    assert [(e["ordering_key"], json.loads(e["value"])["data"]) for e in stored] == [
        ("a", 0),
        ("a", 1),
        ("a", 3),
        ("b", 2),
        ("b", 4),
    ]
    assert sorted(str(e["event_id"]) for e in stored) == sorted(report["ids"])
    assert str(chosen) in report["ids"]


def test_importing_outbox_kafka_does_not_import_django() -> None:
    check = (
        "import sys, outbox_kafka, outbox_kafka.contrib; "
        "print([m for m in sys.modules if m.split('.')[0] == 'django'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


def test_an_outbox_that_writes_to_the_log_writes_in_the_atomic_blocks_transaction(
    django_log_db: None, log_url: str
) -> None:
    """``write_to="log"`` through Django's connection: the events of an atomic block
    reach the log when it commits, those of a rolled-back inner block or a failed
    outer one never, and the business row commits with its events."""
    outbox = log_outbox()

    def one(key: str, n: int) -> dict[str, Any]:
        return {"type": "log.test", "key": key, "data": {"n": n}, "topic": "log-topic"}

    with transaction.atomic():
        _create_order("o-1")
        django_outbox.enqueue(**one("a", 1), outbox=outbox)
        with contextlib.suppress(RuntimeError), transaction.atomic():
            django_outbox.enqueue(**one("a", 2), outbox=outbox)
            raise RuntimeError("the inner block fails")
        django_outbox.enqueue_many([one("b", 3), one("a", 4)], outbox=outbox)
    with pytest.raises(RuntimeError), transaction.atomic():
        _create_order("o-2")
        django_outbox.enqueue(**one("a", 5), outbox=outbox)
        raise RuntimeError("the outer block fails")
    with transaction.atomic():
        django_outbox.enqueue(**one("c", 6), outbox=outbox)

    transactions, strays = read_log(log_url)
    assert (strays.non_transactional, strays.foreign, strays.malformed) == (0, 0, 0)
    assert keys_and_ns(transactions) == [[("a", 1), ("b", 3), ("a", 4)], [("c", 6)]]
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM django_orders")
        assert cursor.fetchall() == [("o-1",)]
