"""The relay's pooled connections: its claims and records take a connection used a
moment ago without checking it; everything else checks, as ``pool_pre_ping`` does.

A check is a round trip before each transaction, and the relay's claim and record
loops run short transactions back to back and retry a statement that fails.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_kafka.database import make_engine, unchecked_when_fresh
from outbox_kafka.errors import StorageError
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.store import Store

#: Long enough that two checkouts in a row are always within it, even on a loaded machine.
FRESH = 2.0


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


@pytest.fixture
def pooled(database_url: str) -> Any:
    engine = make_engine(database_url, ping_after_idle=FRESH, pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


def test_a_fresh_connection_goes_out_unchecked_only_where_asked(pooled: sa.Engine) -> None:
    pings = _pings(pooled)
    first = _backend_pid(pooled)
    with unchecked_when_fresh():
        assert _backend_pid(pooled) == first
    assert pings == [], "a connection handed back a moment ago was checked"
    assert _backend_pid(pooled) == first
    assert len(pings) == 1, "outside unchecked_when_fresh, a pooled connection is checked"


def test_an_idle_connection_is_checked_and_replaced_if_dead(
    pooled: sa.Engine, engine: sa.Engine
) -> None:
    pings = _pings(pooled)
    first = _backend_pid(pooled)
    _terminate(engine, first)
    time.sleep(FRESH + 0.2)
    with unchecked_when_fresh():
        replaced = _backend_pid(pooled)
    assert len(pings) == 1
    assert replaced != first


def test_a_fresh_connection_that_died_fails_its_statement_then_is_replaced(
    pooled: sa.Engine, engine: sa.Engine
) -> None:
    """The price of skipping the check: a connection that died within the threshold
    fails its next statement, as one that dies mid-use does (the relay retries)."""
    pings = _pings(pooled)
    first = _backend_pid(pooled)
    _terminate(engine, first)
    with unchecked_when_fresh(), pytest.raises(sa.exc.OperationalError):
        _backend_pid(pooled)
    assert pings == []
    with unchecked_when_fresh():
        assert _backend_pid(pooled) != first


def test_a_claim_on_a_connection_that_died_fails_with_its_own_error_then_claims_again(
    database_url: str, engine: sa.Engine
) -> None:
    """The store's raw cursor: the claim reports why its statement failed (not that
    the rollback after it could not run), and the dead connection is not used again."""
    store = Store(database_url, TableNames())
    try:
        store.claim(batch_size=10, lease_seconds=30.0)
        with engine.connect() as conn:
            pids = conn.exec_driver_sql(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            ).scalars()
            for pid in list(pids):
                conn.exec_driver_sql(f"SELECT pg_terminate_backend({pid}, 5000)")
            conn.commit()
        with pytest.raises(StorageError) as failed:
            store.claim(batch_size=10, lease_seconds=30.0)
        assert "already closed" not in str(failed.value)
        assert "terminat" in str(failed.value) or "closed the connection" in str(failed.value)
        assert store.claim(batch_size=10, lease_seconds=30.0).keys == []
    finally:
        store.close()
