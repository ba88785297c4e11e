"""`check`'s database line names the role the session really is."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox_kafka.database import redact_url, short_command_engine
from outbox_kafka.naming import TableNames
from outbox_kafka.operations import check_database


@pytest.fixture
def other_role(server_url: str) -> Iterator[str]:
    role = f"t_check_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE ROLE "{role}" LOGIN')
    try:
        yield role
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP ROLE IF EXISTS "{role}"')
        admin.dispose()


def test_a_user_parameter_is_the_role_check_names(database_url: str, other_role: str) -> None:
    # The URL's user part says one role, its ?user= parameter another: libpq
    # connects as the parameter's, and so does every relay given this URL.
    url = make_url(database_url).update_query_dict({"user": other_role})
    text = url.render_as_string(hide_password=False)
    engine = short_command_engine(text)
    try:
        database, migrations = check_database(engine, TableNames(), shown_url=redact_url(text))
    finally:
        engine.dispose()
    assert database.ok, database.detail
    assert database.detail.endswith(f", connected as {other_role})"), database.detail
    # The role was granted nothing: connected, it may not read the migrations,
    # which is what the migrations line says (not "cannot connect").
    assert not migrations.ok
    assert migrations.detail.startswith(
        f"cannot read the migrations of public.outbox as {other_role}: "
    ), migrations.detail
    assert "permission denied" in migrations.detail
