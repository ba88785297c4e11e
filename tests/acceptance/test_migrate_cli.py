"""`outbox-kafka migrate` run as a separate process against real, empty databases."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox_kafka import TableNames
from outbox_kafka.database import make_engine
from tests.support import libpq_url

CLI = [sys.executable, "-m", "outbox_kafka.cli"]
TIMEOUT = 60


def cli_env(database_url: str | None = None, **extra: str) -> dict[str, str]:
    """The test's environment without OUTBOX_* settings, plus the ones given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    if database_url is not None:
        env["OUTBOX_DATABASE_URL"] = database_url
    env.update(extra)
    return env


def run_cli(
    *args: str, database_url: str | None = None, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        env=cli_env(database_url, **extra_env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def relations(url: str, schema: str = "public") -> list[str]:
    """Tables of ``schema``, sorted."""
    engine = make_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return list(
                conn.execute(
                    sa.text(
                        "SELECT tablename FROM pg_tables WHERE schemaname = :s ORDER BY tablename"
                    ),
                    {"s": schema},
                ).scalars()
            )
    finally:
        engine.dispose()


def applied_versions(url: str, names: TableNames | None = None) -> list[tuple[int, str]]:
    names = names or TableNames()
    engine = make_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    f'SELECT version, name FROM "{names.schema}"."{names.versions}" '
                    "ORDER BY version"
                )
            ).all()
            return [(v, n) for v, n in rows]
    finally:
        engine.dispose()


OUTBOX_TABLES = [
    "outbox",
    "outbox_arrivals",
    "outbox_floors",
    "outbox_key_seq",
    "outbox_keys",
    "outbox_migrations",
]
#: Every migration, as the versions table records it once all are applied.
MIGRATIONS = [
    (1, "initial"),
    (2, "arrivals"),
    (3, "enqueue_function"),
    (4, "drop_pending_index"),
    (5, "producer_functions"),
    (6, "exactly_once"),
    (7, "log_messages"),
    (8, "emit_slot_check"),
]


def test_migrate_fresh_database_then_up_to_date(empty_database: Callable[[], str]) -> None:
    url = libpq_url(empty_database())
    assert relations(url) == []

    first = run_cli("migrate", database_url=url)
    assert first.returncode == 0, first.stderr
    assert "applied migrations [1, 2, 3, 4, 5, 6, 7, 8]" in first.stdout
    assert "public.outbox" in first.stdout
    assert relations(url) == OUTBOX_TABLES

    second = run_cli("migrate", database_url=url)
    assert second.returncode == 0, second.stderr
    assert "up to date" in second.stdout
    assert "applied" not in second.stdout
    assert applied_versions(url) == MIGRATIONS


def test_database_url_flag(empty_database: Callable[[], str]) -> None:
    url = libpq_url(empty_database())
    result = run_cli("migrate", "--database-url", url)
    assert result.returncode == 0, result.stderr
    assert relations(url) == OUTBOX_TABLES


def test_flag_beats_environment(empty_database: Callable[[], str]) -> None:
    wanted, other = libpq_url(empty_database()), libpq_url(empty_database())
    result = run_cli("migrate", "--database-url", wanted, database_url=other)
    assert result.returncode == 0, result.stderr
    assert relations(wanted) == OUTBOX_TABLES
    assert relations(other) == []


@pytest.mark.parametrize("round_", range(3))
def test_concurrent_migrations_apply_once(empty_database: Callable[[], str], round_: int) -> None:
    url = libpq_url(empty_database())
    procs = [
        subprocess.Popen(
            [*CLI, "migrate"],
            env=cli_env(url),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=TIMEOUT) for p in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    stdouts = sorted(out for out, _ in outputs)
    applied = "applied migrations [1, 2, 3, 4, 5, 6, 7, 8]"
    assert sum(applied in out for out in stdouts) == 1, stdouts
    assert sum("up to date" in out for out in stdouts) == 1, stdouts
    assert applied_versions(url) == MIGRATIONS
    assert relations(url) == OUTBOX_TABLES


def test_missing_database_url_is_an_error() -> None:
    result = run_cli("migrate")
    assert result.returncode != 0
    assert "OUTBOX_DATABASE_URL" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_database_is_a_clean_error(empty_database: Callable[[], str]) -> None:
    existing = make_url(empty_database())
    missing = existing.set(database="no_such_database_here", password="s3cr3t-pw")
    result = run_cli("migrate", database_url=libpq_url(missing.render_as_string(False)))
    assert result.returncode == 2
    assert "no_such_database_here" in result.stderr
    assert "s3cr3t-pw" not in result.stderr
    assert "Traceback" not in result.stderr


# --- --print-sql ------------------------------------------------------------------------


def test_print_sql_needs_no_database() -> None:
    result = run_cli("migrate", "--print-sql")
    assert result.returncode == 0, result.stderr
    assert "CREATE TABLE" in result.stdout
    assert '"public"."outbox"' in result.stdout
    assert result.stdout.lstrip().startswith("--")
    assert "BEGIN;" in result.stdout and result.stdout.rstrip().endswith("COMMIT;")


def _psql(url: str, script: str) -> subprocess.CompletedProcess[str]:
    psql = shutil.which("psql") or "/usr/bin/psql"
    if not Path(psql).exists():
        pytest.skip("psql is not installed")
    return subprocess.run(
        [psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", url, "-f", "-"],
        input=script,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        env=cli_env(),
    )


def test_print_sql_runs_in_psql_and_is_idempotent(empty_database: Callable[[], str]) -> None:
    url = libpq_url(empty_database())
    script = run_cli("migrate", "--print-sql").stdout

    first = _psql(url, script)
    assert first.returncode == 0, first.stderr
    assert "ERROR" not in first.stderr
    assert relations(url) == OUTBOX_TABLES
    assert applied_versions(url) == MIGRATIONS

    second = _psql(url, script)
    assert second.returncode == 0, second.stderr
    assert applied_versions(url) == MIGRATIONS

    # The CLI agrees the database is up to date.
    result = run_cli("migrate", database_url=url)
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout


def test_print_sql_after_cli_migrate_is_a_no_op(empty_database: Callable[[], str]) -> None:
    url = libpq_url(empty_database())
    assert run_cli("migrate", database_url=url).returncode == 0
    result = _psql(url, run_cli("migrate", "--print-sql").stdout)
    assert result.returncode == 0, result.stderr
    assert applied_versions(url) == MIGRATIONS


def test_print_sql_schema_matches_cli_migrate(empty_database: Callable[[], str]) -> None:
    """The DBA script and `migrate` create the same columns, indexes and constraints."""
    by_cli, by_script = libpq_url(empty_database()), libpq_url(empty_database())
    assert run_cli("migrate", database_url=by_cli).returncode == 0
    assert _psql(by_script, run_cli("migrate", "--print-sql").stdout).returncode == 0

    def describe(url: str) -> list[tuple[str, ...]]:
        engine = make_engine(url, poolclass=sa.NullPool)
        try:
            with engine.connect() as conn:
                columns = conn.execute(
                    sa.text(
                        "SELECT table_name, column_name, data_type, is_nullable, "
                        "coalesce(column_default, '') FROM information_schema.columns "
                        "WHERE table_schema = 'public' ORDER BY 1, ordinal_position"
                    )
                ).all()
                indexes = conn.execute(
                    sa.text(
                        "SELECT tablename, indexname, indexdef FROM pg_indexes "
                        "WHERE schemaname = 'public' ORDER BY 1, 2"
                    )
                ).all()
                constraints = conn.execute(
                    sa.text(
                        "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) "
                        "FROM pg_constraint WHERE connamespace = 'public'::regnamespace "
                        "ORDER BY 1, 2"
                    )
                ).all()
            return [tuple(map(str, r)) for r in [*columns, *indexes, *constraints]]
        finally:
            engine.dispose()

    assert describe(by_script) == describe(by_cli)


# --- custom names -----------------------------------------------------------------------


@pytest.mark.parametrize("via", ["flags", "environment"])
def test_custom_table_and_schema(empty_database: Callable[[], str], via: str) -> None:
    url = libpq_url(empty_database())
    if via == "flags":
        result = run_cli(
            "migrate", "--table", "orders_outbox", "--db-schema", "app", database_url=url
        )
    else:
        result = run_cli(
            "migrate", database_url=url, OUTBOX_TABLE="orders_outbox", OUTBOX_DB_SCHEMA="app"
        )
    assert result.returncode == 0, result.stderr
    assert "app.orders_outbox" in result.stdout
    assert relations(url, "app") == [
        "orders_outbox",
        "orders_outbox_arrivals",
        "orders_outbox_floors",
        "orders_outbox_key_seq",
        "orders_outbox_keys",
        "orders_outbox_migrations",
    ]
    assert relations(url, "public") == []
    names = TableNames(table="orders_outbox", schema="app")
    assert applied_versions(url, names) == MIGRATIONS

    again = run_cli("migrate", "--table", "orders_outbox", "--db-schema", "app", database_url=url)
    assert again.returncode == 0, again.stderr
    assert "up to date" in again.stdout
    # The default outbox is a separate outbox in the same database.
    default = run_cli("migrate", database_url=url)
    assert "applied migrations [1, 2, 3, 4, 5, 6, 7, 8]" in default.stdout
    assert relations(url, "public") == OUTBOX_TABLES


def test_custom_names_in_print_sql() -> None:
    result = run_cli("migrate", "--print-sql", "--table", "orders_outbox", "--db-schema", "app")
    assert result.returncode == 0, result.stderr
    assert '"app"."orders_outbox_key_seq"' in result.stdout
    assert '"public"' not in result.stdout


@pytest.mark.parametrize(
    "flag, value", [("--table", "x;drop"), ("--db-schema", "x;drop"), ("--table", "Outbox")]
)
def test_bad_identifier_is_rejected(
    empty_database: Callable[[], str], flag: str, value: str
) -> None:
    url = libpq_url(empty_database())
    for extra in ([], ["--print-sql"]):
        result = run_cli("migrate", flag, value, *extra, database_url=url)
        assert result.returncode != 0
        assert repr(value) in result.stderr
        assert "not a valid identifier" in result.stderr
        assert "Traceback" not in result.stderr
        assert result.stdout == ""
    assert relations(url) == []


# --- help -------------------------------------------------------------------------------


def test_migrate_help_names_the_environment_variables() -> None:
    result = run_cli("migrate", "--help")
    assert result.returncode == 0
    for variable in ("OUTBOX_DATABASE_URL", "OUTBOX_TABLE", "OUTBOX_DB_SCHEMA"):
        assert variable in result.stdout
    assert "--print-sql" in result.stdout


def test_help_never_shows_values_from_the_environment() -> None:
    secret_url = "postgresql://app:s3cr3t-pw@db.internal/app"
    result = run_cli("migrate", "--help", database_url=secret_url, OUTBOX_TABLE="custom_tbl")
    assert result.returncode == 0
    assert "s3cr3t-pw" not in result.stdout
    assert "db.internal" not in result.stdout
    assert "custom_tbl" not in result.stdout


def test_console_script_help() -> None:
    script = Path(sys.executable).with_name("outbox-kafka")
    if not script.exists():
        pytest.skip("the outbox-kafka console script is not installed next to this Python")
    result = subprocess.run(
        [str(script), "migrate", "--help"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        env=cli_env(),
    )
    assert result.returncode == 0
    assert "OUTBOX_DATABASE_URL" in result.stdout
    top = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert top.returncode == 0
    assert "migrate" in top.stdout
