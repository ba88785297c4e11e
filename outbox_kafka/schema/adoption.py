"""Adopting outbox tables made without ``outbox-kafka migrate`` (from ``schema.metadata``).

A project that let Alembic's autogenerate create the outbox tables has their
shape but not the migrations' record, storage settings or functions, so no
later migration of this package could ever apply. :func:`adopt` checks the
tables against the shape the migrations make (built for comparison in a
scratch schema, in the same transaction, and dropped), and when they match
records every migration as applied after running what each adds beyond the
shape (``Migration.adopt_sql``). When they do not match, nothing changes and
the differences are listed.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from sqlalchemy import Connection, Engine, text

from outbox_kafka.database import storage_errors
from outbox_kafka.errors import MigrationError
from outbox_kafka.naming import TableNames
from outbox_kafka.schema.migrations import MigrationResult, applied_versions
from outbox_kafka.schema.statements import queries_for

#: The parts of the shape compared before adopting; storage settings and
#: functions are what adopting adds.
_SHAPE = ("column", "constraint", "index")

Description = dict[tuple[str, str, str], str]


def describe(conn: Connection, names: TableNames) -> Description:
    """The outbox's columns, constraints, indexes, storage settings and functions.

    Keyed by (kind, table, name), with the outbox's own table name standing
    for its prefix, so that outboxes of other names compare too.
    """
    tables = [names.events, names.keys, names.seqs, names.arrivals, names.floors]
    rows = conn.execute(
        queries_for(names)["describe_outbox"],
        {
            "schema": names.schema,
            "tables": tables,
            "functions": [names.enqueue_one, names.enqueue_many],
        },
    ).all()
    return {(r.kind, r.table_name, r.name): r.definition for r in rows}


def shape_differences(conn: Connection, names: TableNames) -> list[str]:
    """How the outbox's tables differ from what the migrations make; empty when they match.

    The reference is built by the migrations themselves in a scratch schema
    and dropped again, inside the caller's transaction.
    """
    scratch = TableNames(table=names.table, schema=f"outbox_adopt_{uuid.uuid4().hex[:12]}")
    q = queries_for(scratch)
    conn.execute(q["create_schema"])
    for migration in q.migrations():
        conn.execute(text(migration.sql))
    expected = describe(conn, scratch)
    conn.execute(q["drop_schema"])
    found = describe(conn, names)
    return _differences(expected, found, names)


def _differences(expected: Description, found: Description, names: TableNames) -> list[str]:
    listed = []
    if not any(kind == "column" for kind, _, _ in found):
        return [f"no outbox tables in schema {names.schema!r} (table {names.table!r})"]
    for key in sorted(set(expected) | set(found)):
        kind, table, name = key
        if kind not in _SHAPE:
            continue
        where = f"{kind} {table}.{name}" if kind == "column" else f"{kind} {name} on {table}"
        if key not in found:
            listed.append(f"missing {where}: {expected[key]}")
        elif key not in expected:
            listed.append(f"unexpected {where}: {found[key]}")
        elif expected[key] != found[key]:
            listed.append(f"{where}: expected {expected[key]}, found {found[key]}")
    return listed


def adopt(engine: Engine, names: TableNames | None = None) -> MigrationResult:
    """Record existing tables of the current shape as migrated, adding what they lack.

    One transaction under the migration lock, like :func:`~outbox_kafka.migrate`.
    Tables already migrated are left as they are (nothing to adopt). Raises
    :class:`~outbox_kafka.MigrationError` listing every difference when the
    tables do not have the shape of the current version.
    """
    names = names or TableNames()
    q = queries_for(names)
    with (
        storage_errors(f"adopting {names.qualified_events}", error=MigrationError),
        engine.begin() as conn,
    ):
        conn.execute(q["migration_lock"], {"lock_id": names.lock_id("migrate")})
        conn.execute(q["create_versions_table"])
        migrations = q.migrations()
        applied = applied_versions(conn, names)
        if applied:
            current = max(applied)
            if applied == {m.version for m in migrations}:
                return MigrationResult(applied=[], current=current)
            raise MigrationError(
                f"{names.qualified_events} is at version {current} already: "
                "run outbox-kafka migrate to bring it up to date (adopting is for tables "
                "made without it)"
            )
        differences = shape_differences(conn, names)
        if differences:
            raise MigrationError(_refusal(names, differences))
        for migration in migrations:
            conn.execute(text(migration.adopt_sql))
            conn.execute(
                q["record_version"], {"version": migration.version, "name": migration.name}
            )
    return MigrationResult(applied=[m.version for m in migrations], current=migrations[-1].version)


def _refusal(names: TableNames, differences: Sequence[str]) -> str:
    lines = "\n".join(f"  - {d}" for d in differences)
    return (
        f"{names.qualified_events} does not have the shape outbox-kafka migrate makes, "
        f"so it cannot be adopted; nothing was changed. Differences:\n{lines}"
    )
