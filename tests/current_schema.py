"""The outbox's schema as the catalog has it, and ``outbox_kafka/schema/current.sql`` written
from it.

:func:`catalog` reads every object of one schema of a database, as PostgreSQL itself
describes it (columns with their types, nullability and defaults, constraints, indexes,
storage settings, functions with their whole definition and grants, triggers, types,
privileges on tables, and the migrations recorded), so that two databases can be compared
object by object rather than as text. ``tests/integration/test_current_schema.py``
compares a database migrated from nothing with one made from ``current.sql``.

Run as ``python -m tests.current_schema`` (``make schema``) to write ``current.sql`` anew,
after adding a migration: it migrates a scratch database (on ``OUTBOX_TEST_DATABASE_URL``'s
server when set, else on an embedded one), writes the file from its catalog, and drops
the database.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox_kafka import migrate
from outbox_kafka.database import make_engine, normalise_url
from outbox_kafka.naming import TableNames

CURRENT_SQL = Path(__file__).resolve().parent.parent / "outbox_kafka" / "schema" / "current.sql"

Catalog = dict[str, list[tuple[Any, ...]]]

# Each query reads one kind of object of the schema :schema; rows are sorted by name, so
# that two databases made in a different order still compare equal.
_CATALOG = {
    "relation": """
        SELECT c.relname, c.relkind, c.relpersistence, c.relrowsecurity,
               ARRAY(SELECT o FROM unnest(c.reloptions) AS o ORDER BY o) AS options,
               c.relacl::text AS acl
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = :schema AND c.relkind <> 'i'
        ORDER BY c.relname""",
    "column": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod) AS type,
               a.attnotnull, pg_get_expr(d.adbin, d.adrelid) AS default,
               a.attidentity, a.attgenerated,
               CASE WHEN a.attcollation <> t.typcollation THEN co.collname END AS collation
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        JOIN pg_type t ON t.oid = a.atttypid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        LEFT JOIN pg_collation co ON co.oid = a.attcollation
        WHERE n.nspname = :schema AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
          AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY c.relname, a.attnum""",
    "constraint": """
        SELECT c.relname, con.conname, con.contype, pg_get_constraintdef(con.oid) AS definition,
               con.condeferrable, con.condeferred
        FROM pg_constraint con
        JOIN pg_class c ON c.oid = con.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = :schema
        ORDER BY c.relname, con.conname""",
    "index": """
        SELECT c.relname, i.relname AS index, pg_get_indexdef(i.oid) AS definition,
               ARRAY(SELECT o FROM unnest(i.reloptions) AS o ORDER BY o) AS options
        FROM pg_index x
        JOIN pg_class i ON i.oid = x.indexrelid
        JOIN pg_class c ON c.oid = x.indrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = :schema
        ORDER BY c.relname, i.relname""",
    "function": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid) AS arguments,
               pg_get_functiondef(p.oid) AS definition, p.proacl::text AS acl
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = :schema
        ORDER BY p.proname, 2""",
    "trigger": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid) AS definition, t.tgenabled
        FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = :schema AND NOT t.tgisinternal
        ORDER BY c.relname, t.tgname""",
    "type": """
        SELECT t.typname, t.typtype, format_type(t.typbasetype, t.typtypmod) AS base,
               ARRAY(SELECT e.enumlabel::text FROM pg_enum e WHERE e.enumtypid = t.oid
                     ORDER BY e.enumsortorder) AS labels
        FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
        WHERE n.nspname = :schema
        ORDER BY t.typname""",
}


def catalog(conn: sa.Connection, names: TableNames | None = None) -> Catalog:
    """Every object of the outbox's schema, by kind, and the migrations recorded in it."""
    names = names or TableNames()
    found = {
        kind: [_hashable(row) for row in conn.execute(sa.text(sql), {"schema": names.schema})]
        for kind, sql in _CATALOG.items()
    }
    versions = sa.text(f"SELECT version, name FROM {names.placeholders()['versions']} ORDER BY 1")
    found["migration"] = [tuple(row) for row in conn.execute(versions)]
    return found


def _hashable(row: sa.Row[Any]) -> tuple[Any, ...]:
    return tuple(tuple(v) if isinstance(v, list) else v for v in row)


def differences(expected: Catalog, found: Catalog) -> list[str]:
    """One line per object that is in one catalog and not, or not so, in the other."""
    lines = []
    for kind in sorted(set(expected) | set(found)):
        want, have = set(expected.get(kind, [])), set(found.get(kind, []))
        lines += [f"missing {kind}: {row}" for row in sorted(want - have, key=repr)]
        lines += [f"unexpected {kind}: {row}" for row in sorted(have - want, key=repr)]
    return lines


# --- writing current.sql ------------------------------------------------------------------

HEADER = """\
-- The whole schema that `outbox-kafka migrate` leaves for the default outbox (table
-- outbox in schema public), in one file to read: its tables, indexes, storage settings,
-- functions and their grants, and the migrations it records as applied.
--
-- Written by `make schema` (python -m tests.current_schema) from the catalog of a
-- database migrated from nothing: run it after adding a migration, and do not edit this
-- file by hand. The migrations in sql/migrations are how a database gets here, and
-- why each part is as it is; tests/integration/test_current_schema.py checks that
-- migrating an empty database ends equal to this file, object by object."""


def _rows(conn: sa.Connection, sql: str, **params: object) -> list[sa.Row[Any]]:
    return list(conn.execute(sa.text(sql), params))


def _storage(options: list[str]) -> str:
    return ",\n".join(f"    {o.replace('=', ' = ', 1)}" for o in options)


def render_current(conn: sa.Connection, names: TableNames | None = None) -> str:
    """``current.sql`` for the outbox ``names`` of the database on ``conn``.

    Raises ``RuntimeError`` for an object this writer does not render (an identity
    column, a privilege on a table, ...), rather than leave it out of the file: the
    comparison test would fail on it anyway, and the writer is the place to extend.
    """
    names = names or TableNames()
    schema = names.schema
    parts = [HEADER]
    tables = _rows(
        conn,
        """SELECT c.oid, c.relname, c.relkind, c.relacl::text AS acl, c.relrowsecurity,
                  ARRAY(SELECT o FROM unnest(c.reloptions) AS o ORDER BY o) AS options
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE n.nspname = :schema AND c.relkind <> 'i' ORDER BY c.oid""",
        schema=schema,
    )
    foreign_keys = []
    for table in tables:
        if table.relkind != "r" or table.acl is not None or table.relrowsecurity:
            raise RuntimeError(f"cannot render {table.relname} (relkind {table.relkind})")
        qualified = f"{schema}.{table.relname}"
        lines = []
        for col in _rows(
            conn,
            """SELECT a.attname, format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull,
                      pg_get_expr(d.adbin, d.adrelid) AS default,
                      a.attidentity, a.attgenerated, a.attcollation <> t.typcollation AS collated
               FROM pg_attribute a
               JOIN pg_type t ON t.oid = a.atttypid
               LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
               WHERE a.attrelid = :oid AND a.attnum > 0 AND NOT a.attisdropped
               ORDER BY a.attnum""",
            oid=table.oid,
        ):
            if col.attidentity or col.attgenerated or col.collated:
                raise RuntimeError(f"cannot render column {table.relname}.{col.attname}")
            line = f"    {col.attname} {col.type}"
            line += " NOT NULL" if col.attnotnull else ""
            line += f" DEFAULT {col.default}" if col.default is not None else ""
            lines.append(line)
        for con in _rows(
            conn,
            # Not the NOT NULL constraints PostgreSQL 18 lists here: the columns say NOT
            # NULL, which makes the same constraints there and loads on older servers.
            """SELECT conname, contype, pg_get_constraintdef(oid) AS definition
               FROM pg_constraint WHERE conrelid = :oid AND contype <> 'n'
               ORDER BY contype DESC, conname""",
            oid=table.oid,
        ):
            clause = f"CONSTRAINT {con.conname} {con.definition}"
            if con.contype == "f":
                foreign_keys.append(f"ALTER TABLE {qualified} ADD {clause};")
            else:
                lines.append(f"    {clause}")
        parts.append(f"CREATE TABLE {qualified} (\n" + ",\n".join(lines) + "\n);")
        if table.options:
            parts.append(f"ALTER TABLE {qualified} SET (\n{_storage(table.options)}\n);")
    parts += foreign_keys
    indexes = _rows(
        conn,
        """SELECT pg_get_indexdef(i.oid) AS definition
           FROM pg_index x
           JOIN pg_class i ON i.oid = x.indexrelid
           JOIN pg_class c ON c.oid = x.indrelid
           JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE n.nspname = :schema
             AND NOT EXISTS (SELECT 1 FROM pg_constraint con WHERE con.conindid = i.oid)
           ORDER BY c.oid, i.relname""",
        schema=schema,
    )
    parts += [f"{index.definition};" for index in indexes]
    for fn in _rows(
        conn,
        """SELECT p.oid, p.proname, pg_get_function_identity_arguments(p.oid) AS arguments,
                  pg_get_functiondef(p.oid) AS definition, pg_get_userbyid(p.proowner) AS owner
           FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
           WHERE n.nspname = :schema ORDER BY p.oid""",
        schema=schema,
    ):
        parts.append(fn.definition.rstrip() + ";")
        parts += _function_grants(conn, fn.oid, f"{schema}.{fn.proname}({fn.arguments})", fn.owner)
    for trigger in _rows(
        conn,
        """SELECT pg_get_triggerdef(t.oid) AS definition
           FROM pg_trigger t
           JOIN pg_class c ON c.oid = t.tgrelid
           JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE n.nspname = :schema AND NOT t.tgisinternal ORDER BY c.oid, t.tgname""",
        schema=schema,
    ):
        parts.append(f"{trigger.definition};")
    recorded = catalog(conn, names)["migration"]
    values = ",\n".join(f"    ({version}, '{name}')" for version, name in recorded)
    parts.append(
        f"INSERT INTO {names.placeholders()['versions']} (version, name) VALUES\n{values};"
    )
    return "\n\n".join(parts) + "\n"


def _function_grants(conn: sa.Connection, oid: int, signature: str, owner: str) -> list[str]:
    """The statements that give a function its privileges; none for the default (PUBLIC)."""
    acl = _rows(
        conn,
        """SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                       ELSE quote_ident(pg_get_userbyid(a.grantee)) END AS grantee,
                  a.privilege_type, a.is_grantable
           FROM pg_proc p, aclexplode(p.proacl) AS a
           WHERE p.oid = :oid ORDER BY 1""",
        oid=oid,
    )
    if not acl:
        return []
    statements = [f"REVOKE ALL ON FUNCTION {signature} FROM PUBLIC;"]
    for item in acl:
        if item.grantee == owner and not item.is_grantable:
            continue
        option = " WITH GRANT OPTION" if item.is_grantable else ""
        statements.append(
            f"GRANT {item.privilege_type} ON FUNCTION {signature} TO {item.grantee}{option};"
        )
    return statements


@contextmanager
def scratch_database(server_url: str) -> Iterator[str]:
    """A new, empty database on the server of ``server_url``, dropped afterwards."""
    name = f"outbox_current_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def write_current(server_url: str, path: Path = CURRENT_SQL) -> None:
    """Migrate a scratch database on ``server_url``'s server and write ``path`` from it."""
    with scratch_database(server_url) as url:
        engine = make_engine(url)
        try:
            migrate(engine)
            with engine.connect() as conn:
                path.write_text(render_current(conn), encoding="utf-8")
        finally:
            engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.current_schema", description=__doc__)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("OUTBOX_TEST_DATABASE_URL"),
        help="a database on the server to use (default: OUTBOX_TEST_DATABASE_URL, "
        "else an embedded PostgreSQL)",
    )
    parser.add_argument("--output", type=Path, default=CURRENT_SQL)
    args = parser.parse_args(argv)
    if args.database_url:
        write_current(normalise_url(args.database_url), args.output)
    else:
        from outbox_kafka.demo.embedded import start_postgres

        with tempfile.TemporaryDirectory(prefix="outbox-current-") as folder:
            pg = start_postgres(Path(folder))
            try:
                write_current(normalise_url(pg.url), args.output)
            finally:
                pg.stop()
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
