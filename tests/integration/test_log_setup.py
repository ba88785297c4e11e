"""``log-setup``: the publication, the slot and the revoke the log mode needs, made once,
and what it refuses."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from outbox_kafka.database import make_engine
from outbox_kafka.errors import ConfigurationError
from outbox_kafka.operations.log_setup import set_up_log

from ..log_support import NAMES, emit, keys_and_ns, log_database, log_outbox, read_log


@pytest.fixture
def bare_log_engine(logical_server_url: str) -> Iterator[tuple[sa.Engine, str]]:
    """A migrated database on the logical server, without the publication and slot."""
    with log_database(logical_server_url, set_up=False) as url:
        engine = make_engine(url)
        yield engine, url
        engine.dispose()


def test_it_makes_what_is_missing_once(bare_log_engine: tuple[sa.Engine, str]) -> None:
    engine, url = bare_log_engine
    first = set_up_log(engine, NAMES)
    assert (first.created_publication, first.created_slot, first.emit_revoked) == (
        True,
        True,
        True,
    )
    assert first.warnings == []
    again = set_up_log(engine, NAMES)
    assert (again.created_publication, again.created_slot, again.emit_revoked) == (
        False,
        False,
        True,
    )
    with engine.begin() as conn:
        emit(log_outbox(), conn, "k", 1)
    transactions, _ = read_log(url)
    assert keys_and_ns(transactions) == [[("k", 1)]]


def test_after_it_only_the_emit_function_can_put_events_into_the_log(
    bare_log_engine: tuple[sa.Engine, str],
) -> None:
    engine, url = bare_log_engine
    role = f"producer_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE ROLE "{role}"')
        conn.exec_driver_sql(f'GRANT USAGE ON SCHEMA public TO "{role}"')
        conn.exec_driver_sql(f'GRANT EXECUTE ON FUNCTION outbox_emit(bytea) TO "{role}"')
    try:
        # Before: any role may emit a message with the outbox's prefix.
        with engine.begin() as conn:
            conn.exec_driver_sql(f'SET LOCAL ROLE "{role}"')
            conn.exec_driver_sql(
                "SELECT pg_logical_emit_message(true, %(p)s, 'x')", {"p": NAMES.log_prefix}
            )
        set_up_log(engine, NAMES)
        with engine.begin() as conn:
            conn.exec_driver_sql(f'SET LOCAL ROLE "{role}"')
            with pytest.raises(sa.exc.DBAPIError, match="permission denied for function"):
                conn.exec_driver_sql(
                    "SELECT pg_logical_emit_message(true, %(p)s, 'x')", {"p": NAMES.log_prefix}
                )
        # The producer role still writes, through the emit function.
        with engine.begin() as conn:
            conn.exec_driver_sql(f'SET LOCAL ROLE "{role}"')
            emit(log_outbox(), conn, "k", 1)
        transactions, _ = read_log(url)
        assert keys_and_ns(transactions) == [[("k", 1)]]
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP OWNED BY "{role}"')
            conn.exec_driver_sql(f'DROP ROLE "{role}"')


def test_it_refuses_below_wal_level_logical(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        level = conn.exec_driver_sql("SHOW wal_level").scalar_one()
    if level == "logical":
        pytest.skip("the server under test runs with wal_level = logical")
    with pytest.raises(ConfigurationError, match=f"wal_level is {level}, not logical"):
        set_up_log(engine, NAMES)


def test_failover_needs_postgresql_17(bare_log_engine: tuple[sa.Engine, str]) -> None:
    engine, _ = bare_log_engine
    with engine.connect() as conn:
        major = int(conn.exec_driver_sql("SHOW server_version_num").scalar_one()) // 10000
    if major >= 17:
        done = set_up_log(engine, NAMES, failover=True)
        assert done.created_slot
        with engine.connect() as conn:
            failover = conn.exec_driver_sql(
                "SELECT failover FROM pg_replication_slots WHERE slot_name = %(s)s",
                {"s": NAMES.log_slot},
            ).scalar_one()
        assert failover is True
    else:
        with pytest.raises(ConfigurationError, match="--failover needs PostgreSQL 17"):
            set_up_log(engine, NAMES, failover=True)
