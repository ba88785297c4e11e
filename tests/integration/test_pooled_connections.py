"""The relay's pooled connections: checked before use only after sitting idle.

A check is a round trip before each transaction; the relay's claim and record loops
run short transactions back to back, so a connection handed back a moment ago goes
out again unchecked, and one that sat idle is checked and replaced if it died.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg2
import pytest
import sqlalchemy as sa

from outbox_kafka.database import make_engine


def _backend_pid(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        conn.rollback()
    return int(pid)


def _terminate(admin: sa.Engine, pid: int) -> None:
    with admin.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT pg_terminate_backend({pid}, 5000)").scalar_one()
        conn.commit()


def _pings(engine: sa.Engine) -> list[Any]:
    """Every check the engine's dialect makes, as it makes it."""
    seen: list[Any] = []
    ping = engine.dialect.do_ping

    def counted(dbapi_connection: Any) -> bool:
        seen.append(dbapi_connection)
        return bool(ping(dbapi_connection))

    engine.dialect.do_ping = counted  # type: ignore[method-assign]
    return seen


def test_a_connection_idle_past_the_threshold_is_checked_and_replaced_if_dead(
    database_url: str, engine: sa.Engine
) -> None:
    pooled = make_engine(database_url, ping_after_idle=0.2, pool_size=1, max_overflow=0)
    try:
        pings = _pings(pooled)
        first = _backend_pid(pooled)
        assert _backend_pid(pooled) == first
        assert pings == [], "a connection handed back a moment ago was checked"
        _terminate(engine, first)
        time.sleep(0.3)
        # Idle past the threshold: checked, found dead, replaced by a new connection.
        replaced = _backend_pid(pooled)
        assert len(pings) == 1
        assert replaced != first
    finally:
        pooled.dispose()


def test_a_connection_handed_back_a_moment_ago_goes_out_unchecked(
    database_url: str, engine: sa.Engine
) -> None:
    """The price of skipping the check: a connection that died within the threshold
    fails its next statement, as one that dies mid-use does (the relay retries)."""
    pooled = make_engine(database_url, ping_after_idle=60.0, pool_size=1, max_overflow=0)
    try:
        pings = _pings(pooled)
        first = _backend_pid(pooled)
        _terminate(engine, first)
        with pytest.raises(sa.exc.OperationalError) as failed:
            _backend_pid(pooled)
        assert isinstance(failed.value.orig, psycopg2.OperationalError)
        assert pings == []
        # The failure invalidated the dead connection: the next one is new.
        assert _backend_pid(pooled) != first
    finally:
        pooled.dispose()


def test_an_engine_without_a_threshold_checks_every_pooled_connection(database_url: str) -> None:
    pooled = make_engine(database_url, pool_size=1, max_overflow=0)
    try:
        pings = _pings(pooled)
        for _ in range(3):
            _backend_pid(pooled)
        assert len(pings) == 2  # a new connection is not checked; a pooled one always
    finally:
        pooled.dispose()
