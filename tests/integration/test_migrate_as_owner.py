"""`migrate` run by the owner of the tables, who is no superuser and may not create schemas."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox_kafka.database import make_engine
from outbox_kafka.schema.migrations import migrate


@pytest.fixture
def owner_url(server_url: str) -> Iterator[str]:
    """An empty database and a role that may create tables in its public schema, nothing more."""
    name, role = f"outbox_o_{uuid.uuid4().hex[:12]}", f"t_owner_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    database = make_url(server_url).set(database=name)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        conn.exec_driver_sql(f'CREATE ROLE "{role}" LOGIN')
    in_database = sa.create_engine(database, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with in_database.connect() as conn:
        conn.exec_driver_sql(f'GRANT CREATE, USAGE ON SCHEMA public TO "{role}"')
    in_database.dispose()
    try:
        yield database.set(username=role).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.exec_driver_sql(f'DROP ROLE IF EXISTS "{role}"')
        admin.dispose()


def test_an_owner_without_create_on_the_database_migrates_the_public_schema(
    owner_url: str,
) -> None:
    engine = make_engine(owner_url)
    try:
        result = migrate(engine)
        assert result.current == max(result.applied) > 0
        with engine.connect() as conn:
            owner = conn.exec_driver_sql(
                "SELECT tableowner FROM pg_tables"
                " WHERE schemaname = 'public' AND tablename = 'outbox'"
            ).scalar_one()
        assert owner == make_url(owner_url).username
    finally:
        engine.dispose()
