"""Applies the versioned migrations in ``sql/migrations``, once, under a lock."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, Engine, text

from outbox_kafka.database import storage_errors
from outbox_kafka.errors import MigrationError
from outbox_kafka.naming import TableNames
from outbox_kafka.schema.statements import Migration, queries_for


@dataclass(frozen=True)
class MigrationResult:
    applied: list[int]
    current: int


def applied_versions(conn: Connection, names: TableNames) -> set[int]:
    """The migration versions recorded for this outbox (none before its first migration)."""
    q = queries_for(names)
    present = conn.execute(
        q["table_exists"], {"qualified_name": f'"{names.schema}"."{names.versions}"'}
    ).scalar_one()
    return set(conn.execute(q["applied_versions"]).scalars()) if present else set()


def pending_migrations(conn: Connection, names: TableNames) -> list[Migration]:
    """Migrations not yet applied to this outbox (all of them on a fresh database)."""
    applied = applied_versions(conn, names)
    return [m for m in queries_for(names).migrations() if m.version not in applied]


def migrate(engine: Engine, names: TableNames | None = None) -> MigrationResult:
    """Bring the outbox schema up to date; safe to run from several pods at once.

    Everything happens in one transaction under a transaction-scoped advisory
    lock, so concurrent runs apply each migration exactly once and a failed
    migration leaves nothing behind.
    """
    names = names or TableNames()
    with (
        storage_errors(f"migrating {names.qualified_events}", error=MigrationError),
        engine.begin() as conn,
    ):
        return apply_migrations(conn, names)


def apply_migrations(conn: Connection, names: TableNames | None = None) -> MigrationResult:
    """:func:`migrate` in the caller's transaction on ``conn`` (an Alembic revision's, say).

    Begins, commits and rolls back nothing: the migrations apply when the
    caller commits. The advisory lock is the transaction's, as in :func:`migrate`.
    """
    names = names or TableNames()
    q = queries_for(names)
    conn.execute(q["migration_lock"], {"lock_id": names.lock_id("migrate")})
    conn.execute(q["create_schema"])
    conn.execute(q["create_versions_table"])
    todo = pending_migrations(conn, names)
    for migration in todo:
        conn.execute(text(migration.sql))
        conn.execute(q["record_version"], {"version": migration.version, "name": migration.name})
    current = max(conn.execute(q["applied_versions"]).scalars(), default=0)
    return MigrationResult(applied=[m.version for m in todo], current=current)


def migration_script(names: TableNames | None = None) -> str:
    """The whole migration as one SQL script, for a DBA to review and run.

    The script is idempotent: it takes the same advisory lock as
    ``outbox-kafka migrate`` and skips versions already recorded.
    """
    names = names or TableNames()
    q = queries_for(names)
    lines = [
        f"-- outbox-kafka schema for {names.qualified_events}",
        "BEGIN;",
        q.sql["migration_lock"].replace(":lock_id", str(names.lock_id("migrate"))),
        q.sql["create_schema"],
        q.sql["create_versions_table"],
    ]
    for migration in q.migrations():
        record = (
            q.sql["record_version"]
            .replace(":version", str(migration.version))
            .replace(":name", f"'{migration.name}'")
        )
        lines += [
            f"-- migration {migration.version:04d}_{migration.name}",
            "DO $outbox_migration$",
            "BEGIN",
            f"IF NOT EXISTS (SELECT 1 FROM {names.placeholders()['versions']} "
            f"WHERE version = {migration.version}) THEN",
            migration.sql.strip(),
            record.rstrip(";") + ";",
            "END IF;",
            "END",
            "$outbox_migration$;",
        ]
    lines.append("COMMIT;")
    return "\n".join(lines) + "\n"
