"""The log mode in tests: a database on the logical server with the outbox's
publication and slot, an outbox that writes to the log, and a reading of the slot."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox_kafka import Outbox, migrate
from outbox_kafka.database import make_engine
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.log_reader import LogReader, LogTransaction, Strays

NAMES = TableNames()

#: The lines ``check --source log`` adds, in order.
LOG_CHECK_LINES = [
    "wal_level",
    "replication role",
    "publication",
    "replication slot",
    "slot WAL limit",
    "slot failover",
    "emit privilege",
]


def _admin(url: str) -> sa.Engine:
    return sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)


@contextlib.contextmanager
def log_database(server_url: str, *, set_up: bool = True) -> Iterator[str]:
    """A migrated database on ``server_url`` with the outbox's publication and slot
    (without, if not ``set_up``); both dropped with it."""
    name = f"outbox_log_{uuid.uuid4().hex[:12]}"
    admin = _admin(server_url)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = make_url(server_url).set(database=name).render_as_string(False)
    engine = make_engine(url)
    try:
        migrate(engine)
        if set_up:
            _publication_and_slot(engine)
    finally:
        engine.dispose()
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                "WHERE database = %(db)s AND NOT active",
                {"db": name},
            )
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def _publication_and_slot(engine: sa.Engine) -> None:
    """As ``log-setup`` makes them, without its revoke (which the tests of it check)."""
    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE PUBLICATION "{NAMES.log_publication}"')
    # Not in a transaction that has written anything.
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "SELECT pg_create_logical_replication_slot(%(slot)s, 'pgoutput')",
            {"slot": NAMES.log_slot},
        )


def log_outbox() -> Outbox:
    return Outbox(allow_unknown_types=True, write_to="log")


def emit(outbox: Outbox, conn: sa.Connection, key: str, n: int, **kwargs: Any) -> uuid.UUID:
    """Enqueue event ``n`` of ``key`` (its data is ``{"n": n}``)."""
    return outbox.enqueue(
        conn, type="log.test", key=key, data={"n": n}, topic="log-topic", **kwargs
    )


def read_log(url: str, idle: float = 1.0) -> tuple[list[LogTransaction], Strays]:
    """Every transaction the slot holds now, acknowledging none; and the strays."""
    reader = LogReader(url, NAMES)
    reader.open()
    try:
        found: list[LogTransaction] = []
        while batch := reader.read(idle):
            found += batch
        return found, reader.strays
    finally:
        reader.close()


def keys_and_ns(transactions: list[LogTransaction]) -> list[list[tuple[str, int]]]:
    """Each transaction's events as (key, n)."""
    return [
        [(e.key, int(json.loads(e.value)["data"]["n"])) for e in t.events] for t in transactions
    ]
