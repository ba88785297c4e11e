"""outbox_kafka/schema/current.sql is the schema the migrations make: migrating an empty
database ends equal to it, object by object, as the catalog describes both."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from outbox_kafka import migrate
from outbox_kafka.database import make_engine
from tests.current_schema import CURRENT_SQL, Catalog, catalog, differences


def _load_current(engine: sa.Engine) -> None:
    """Run current.sql as one script, as psql -f would (the driver, not SQLAlchemy, parses it)."""
    raw = engine.raw_connection()
    try:
        with raw.cursor() as cursor:
            cursor.execute(CURRENT_SQL.read_text(encoding="utf-8"))
        raw.commit()
    finally:
        raw.close()


@pytest.fixture
def from_current(empty_database: Callable[[], str]) -> Iterator[sa.Engine]:
    """An empty database given current.sql."""
    engine = make_engine(empty_database())
    _load_current(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def migrated_catalog(empty_database: Callable[[], str]) -> Catalog:
    """The catalog of an empty database brought up to date by migrate."""
    engine = make_engine(empty_database())
    try:
        migrate(engine)
        with engine.connect() as conn:
            return catalog(conn)
    finally:
        engine.dispose()


def test_migrating_an_empty_database_ends_equal_to_current_sql(
    from_current: sa.Engine, migrated_catalog: Catalog
) -> None:
    with from_current.connect() as conn:
        found = catalog(conn)
    drift = "\n".join(differences(migrated_catalog, found))
    assert not drift, f"current.sql is not what the migrations make (make schema):\n{drift}"
    # Not vacuous: the five tables, the migrations' own, their indexes and the three functions.
    assert len(found["relation"]) == 6
    assert len(found["index"]) == 10
    assert [row[0] for row in found["function"]] == [
        "outbox_emit",
        "outbox_enqueue_many",
        "outbox_enqueue_one",
    ]
    assert [row[0] for row in found["migration"]] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_a_database_made_from_current_sql_is_up_to_date(from_current: sa.Engine) -> None:
    assert migrate(from_current).applied == []


# One change of each kind that the comparison must see; each runs in a transaction that
# is rolled back, on the database made from current.sql.
DRIFTS = {
    "a default": "ALTER TABLE outbox ALTER COLUMN attempts SET DEFAULT 1",
    "a column's type": "ALTER TABLE outbox ALTER COLUMN kafka_partition TYPE bigint",
    "nullability": "ALTER TABLE outbox_keys ALTER COLUMN claim_token SET NOT NULL",
    "a column": "ALTER TABLE outbox_arrivals ADD COLUMN note text",
    "a check": "ALTER TABLE outbox DROP CONSTRAINT outbox_attempts_check",
    "an index's predicate": "DROP INDEX outbox_keys_due_idx; "
    "CREATE INDEX outbox_keys_due_idx ON outbox_keys (due_at) WHERE parked_at IS NOT NULL",
    "a storage setting": "ALTER TABLE outbox_keys SET (fillfactor = 60)",
    "an array's element type": "ALTER TABLE outbox_keys ALTER COLUMN doubt_sessions TYPE text[]",
    "a primary key": "ALTER TABLE outbox_floors DROP CONSTRAINT outbox_floors_pkey; "
    "ALTER TABLE outbox_floors ADD PRIMARY KEY (session, kafka_partition, topic)",
    "a function's rights": "ALTER FUNCTION outbox_enqueue_many SECURITY INVOKER",
    "a function's body": "CREATE OR REPLACE FUNCTION outbox_enqueue_one(p_event_id uuid, "
    "p_ordering_key text, p_topic text, p_type text, p_value bytea, p_headers jsonb, "
    "p_available_at timestamptz, p_delay_seconds double precision, p_notify boolean) "
    "RETURNS boolean LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp "
    "AS 'SELECT false'",
    "a function's grants": "GRANT EXECUTE ON FUNCTION outbox_enqueue_one TO PUBLIC",
    "a trigger": "CREATE FUNCTION outbox_touch() RETURNS trigger LANGUAGE plpgsql "
    "AS 'BEGIN RETURN NEW; END'; CREATE TRIGGER outbox_touch BEFORE UPDATE ON outbox_keys "
    "FOR EACH ROW EXECUTE FUNCTION outbox_touch()",
    "a migration recorded": "DELETE FROM outbox_migrations WHERE version = 6",
}


@pytest.mark.parametrize("change", DRIFTS.values(), ids=DRIFTS.keys())
def test_the_comparison_sees_each_kind_of_drift(
    from_current: sa.Engine, migrated_catalog: Catalog, change: str
) -> None:
    with from_current.connect() as conn:
        assert differences(migrated_catalog, catalog(conn)) == []
        conn.exec_driver_sql(change)
        assert differences(migrated_catalog, catalog(conn)) != []
        conn.rollback()
