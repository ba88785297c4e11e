"""An outbox an older release left, brought up to date while it is in use: what a migration
does to the rows already there, and whom it makes wait."""

from __future__ import annotations

import uuid

import sqlalchemy as sa

from outbox_kafka import Event, Outbox
from outbox_kafka.naming import TableNames
from outbox_kafka.schema.migrations import apply_migrations
from tests.relay_support import admit_arrivals, migrate_to, rows, scalar

NAMES = TableNames(table="before_floors")


def _file_node(engine: sa.Engine, table: str) -> int:
    """The table's file on disk: a rewrite (a volatile default, a type change) makes a new one."""
    return int(scalar(engine, "SELECT pg_relation_filenode(CAST(:t AS regclass))", t=table))


def test_version_6_adds_its_columns_and_floors_without_rewriting_the_key_queue(
    engine: sa.Engine,
) -> None:
    outbox = Outbox(allow_unknown_types=True, table=NAMES.table)
    migrate_to(engine, NAMES, 5)
    with engine.begin() as conn:
        outbox.enqueue_many(conn, [Event(type="t", key=k, data=0, topic="t") for k in "abc"])
    admit_arrivals(engine, NAMES)
    token = str(uuid.uuid4())
    with engine.begin() as conn:
        # A claim a relay of version 5 made and never recorded.
        conn.execute(
            sa.text(
                "UPDATE before_floors_keys SET claim_token = :token, "
                "lease_expires_at = now() + interval '1 minute' WHERE ordering_key = 'a'"
            ),
            {"token": token},
        )
    keys_node = _file_node(engine, "before_floors_keys")
    before = rows(engine, "SELECT * FROM before_floors_keys ORDER BY ordering_key")

    with engine.connect() as migrating, migrating.begin():
        assert apply_migrations(migrating, NAMES).applied == [6, 7, 8]
        # Uncommitted, it holds the key queue; a producer writes all the same.
        with engine.begin() as producing:
            producing.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
            outbox.enqueue_many(producing, [Event(type="t", key="d", data=0, topic="t")])

    assert _file_node(engine, "before_floors_keys") == keys_node
    after = rows(engine, "SELECT * FROM before_floors_keys ORDER BY ordering_key")
    assert [tuple(r)[:-3] for r in after] == [tuple(r) for r in before]
    assert [tuple(r)[-3:] for r in after] == [(None, None, None)] * 3
    assert scalar(engine, "SELECT count(*) FROM before_floors_keys WHERE claim_token = :t", t=token)
    assert scalar(engine, "SELECT count(*) FROM before_floors_floors") == 0
    assert scalar(engine, "SELECT count(*) FROM before_floors WHERE ordering_key = 'd'") == 1
    options = scalar(
        engine,
        "SELECT ARRAY(SELECT o FROM unnest(reloptions) o ORDER BY o) FROM pg_class "
        "WHERE oid = CAST('before_floors_floors' AS regclass)",
    )
    assert options == [
        "autovacuum_vacuum_cost_delay=0",
        "autovacuum_vacuum_scale_factor=0",
        "autovacuum_vacuum_threshold=2000",
        "fillfactor=70",
    ]
