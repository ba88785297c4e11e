"""An Alembic project with the outbox: autogenerate, a revision that migrates, adoption."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from outbox_kafka import MigrationError, migrate
from outbox_kafka.contrib.alembic import outbox_include_object
from outbox_kafka.database import make_engine
from outbox_kafka.naming import TableNames
from outbox_kafka.schema.adoption import adopt, describe
from outbox_kafka.schema.migrations import applied_versions
from tests.acceptance.test_relay_cli import run_cli

ENV_PY = """
from alembic import context
from sqlalchemy import engine_from_config, pool

import outbox_kafka.schema.metadata

config = context.config
target_metadata = outbox_kafka.schema.metadata.metadata


def run_migrations_online() -> None:
    connectable = engine_from_config(
        config.get_section(config.config_ini_section), prefix="sqlalchemy.",
        poolclass=pool.NullPool,
    )
    with connectable.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()


run_migrations_online()
"""


# The page's env.py: the project's own tables and the outbox's in target_metadata,
# and outbox_include_object composed with the project's own include_object.
APP_ENV_PY = """
from alembic import context
from sqlalchemy import Column, Integer, MetaData, Table, Text, engine_from_config, pool

import outbox_kafka.schema.metadata
from outbox_kafka.contrib.alembic import outbox_include_object
from outbox_kafka.naming import TableNames

config = context.config
app = MetaData()
Table("orders", app, Column("id", Integer, primary_key=True), Column("note", Text))
Table("scratch", app, Column("id", Integer, primary_key=True))
OUTBOXES = [TableNames(), *{others!r}]
others = MetaData()
for names in OUTBOXES[1:]:
    outbox_kafka.schema.metadata.build_tables(names, others)
target_metadata = [app, outbox_kafka.schema.metadata.metadata, others]


def not_scratch(obj, name, type_, reflected, compare_to):
    return not (type_ == "table" and name == "scratch")


def run_migrations_online() -> None:
    connectable = engine_from_config(
        config.get_section(config.config_ini_section), prefix="sqlalchemy.",
        poolclass=pool.NullPool,
    )
    with connectable.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            include_schemas={include_schemas!r},
            include_object=outbox_include_object(
                connection, *OUTBOXES, include_object=not_scratch
            ),
        )
        with context.begin_transaction():
            context.run_migrations()


run_migrations_online()
"""

OPS_OUTBOX = TableNames(table="orders_outbox", schema="ops")


@pytest.fixture
def project(tmp_path: Path, empty_database: object) -> Iterator[tuple[Config, str]]:
    """A fresh Alembic project over an empty database, its env.py targeting the outbox tables."""
    url = empty_database()  # type: ignore[operator]
    folder = tmp_path / "alembic"
    config = Config(str(tmp_path / "alembic.ini"))
    command.init(config, str(folder))
    config = Config(str(tmp_path / "alembic.ini"))
    config.set_main_option("script_location", str(folder))
    driver_url = url.replace("postgresql://", "postgresql+psycopg2://")
    # The ini file's interpolation reads "%" (in a socket path, say) as its own.
    config.set_main_option("sqlalchemy.url", driver_url.replace("%", "%%"))
    (folder / "env.py").write_text(ENV_PY, encoding="utf-8")
    yield config, url


def _use_app_env(config: Config, *others: TableNames) -> None:
    """Give the project the page's env.py; outboxes besides the default one need include_schemas."""
    folder = Path(config.get_main_option("script_location") or "")
    env = APP_ENV_PY.format(others=list(others), include_schemas=bool(others))
    (folder / "env.py").write_text(env, encoding="utf-8")


def _outbox_revision(config: Config, *outboxes: TableNames) -> None:
    """A revision whose upgrade() calls upgrade_outbox(op) for each outbox, as the page shows."""
    revision, path = _revision_text(config)
    calls = "".join(f"    upgrade_outbox(op, {names!r})\n" for names in outboxes)
    path.write_text(
        revision.replace(
            "def upgrade() -> None:\n",
            "def upgrade() -> None:\n"
            "    from outbox_kafka.contrib.alembic import upgrade_outbox\n"
            "    from outbox_kafka.naming import TableNames\n" + calls,
        ),
        encoding="utf-8",
    )


def _revision_text(config: Config, **kwargs: object) -> tuple[str, Path]:
    script = command.revision(config, message="r", **kwargs)  # type: ignore[arg-type]
    assert script is not None and not isinstance(script, list)
    path = Path(script.path)
    return path.read_text(encoding="utf-8"), path


def _operations(revision: str) -> list[str]:
    """The ``op.`` lines of a generated revision's upgrade()."""
    upgrade = revision.split("def upgrade()", 1)[1].split("def downgrade()", 1)[0]
    return [line.strip() for line in upgrade.splitlines() if line.strip().startswith("op.")]


def _check(url: str, bootstrap: str) -> str:
    checked = run_cli("check", "--database-url", url, "--bootstrap-servers", bootstrap)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    return checked.stdout


def test_after_migrate_autogenerate_proposes_nothing(project: tuple[Config, str]) -> None:
    config, url = project
    engine = make_engine(url)
    migrate(engine)
    engine.dispose()
    revision, _ = _revision_text(config, autogenerate=True)
    assert _operations(revision) == [], revision


def test_a_revision_calling_upgrade_outbox_migrates_in_alembics_transaction(
    project: tuple[Config, str], kafka_bootstrap: str
) -> None:
    config, url = project
    revision, path = _revision_text(config)
    path.write_text(
        revision.replace(
            "def upgrade() -> None:\n",
            "def upgrade() -> None:\n"
            "    from outbox_kafka.contrib.alembic import upgrade_outbox\n"
            "    upgrade_outbox(op)\n",
        ),
        encoding="utf-8",
    )
    command.upgrade(config, "head")
    assert "OK   migrations" in _check(url, kafka_bootstrap)
    again, _ = _revision_text(config, autogenerate=True)
    assert _operations(again) == [], again


def test_a_failing_revision_takes_the_outbox_migrations_back_with_it(
    project: tuple[Config, str],
) -> None:
    config, url = project
    revision, path = _revision_text(config)
    path.write_text(
        revision.replace(
            "def upgrade() -> None:\n",
            "def upgrade() -> None:\n"
            "    from outbox_kafka.contrib.alembic import upgrade_outbox\n"
            "    upgrade_outbox(op)\n"
            "    op.execute('SELECT 1/0')\n",
        ),
        encoding="utf-8",
    )
    with pytest.raises(sa.exc.DataError):
        command.upgrade(config, "head")
    engine = make_engine(url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT to_regclass('public.outbox')")).scalar() is None
    engine.dispose()


def test_tables_alembic_created_are_adopted_and_then_match_a_migrated_outbox(
    project: tuple[Config, str], kafka_bootstrap: str, empty_database: object
) -> None:
    config, url = project
    revision, _ = _revision_text(config, autogenerate=True)
    assert "op.create_table('outbox'" in revision
    command.upgrade(config, "head")
    checked = run_cli("check", "--database-url", url, "--bootstrap-servers", kafka_bootstrap)
    assert checked.returncode == 1 and "FAIL migrations" in checked.stdout, checked.stdout
    assert "made without outbox-kafka migrate" in checked.stdout
    assert "run outbox-kafka migrate --adopt" in checked.stdout

    adopted = run_cli("migrate", "--adopt", "--database-url", url)
    assert adopted.returncode == 0, adopted.stdout + adopted.stderr
    assert "adopted public.outbox: recorded migrations [1, 2, 3, 4, 5, 6, 7, 8]" in adopted.stdout
    assert "OK   migrations" in _check(url, kafka_bootstrap)
    again = run_cli("migrate", "--database-url", url)
    assert "is up to date (version 8)" in again.stdout, again.stdout + again.stderr

    # Storage settings and functions included: the same as an outbox migrate made.
    reference_url = empty_database()  # type: ignore[operator]
    adopted_engine, reference = make_engine(url), make_engine(reference_url)
    migrate(reference)
    try:
        with adopted_engine.connect() as a, reference.connect() as b:
            assert describe(a, TableNames()) == describe(b, TableNames())
    finally:
        adopted_engine.dispose()
        reference.dispose()


def test_a_doctored_table_is_refused_with_its_differences_and_nothing_changes(
    project: tuple[Config, str],
) -> None:
    config, url = project
    _revision_text(config, autogenerate=True)
    command.upgrade(config, "head")
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox ALTER COLUMN topic DROP NOT NULL"))
        conn.execute(sa.text("DROP INDEX outbox_claim_idx"))
        conn.execute(sa.text("ALTER TABLE outbox_keys ADD COLUMN note text"))
    refused = run_cli("migrate", "--adopt", "--database-url", url)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "cannot be adopted; nothing was changed" in refused.stderr
    for difference in (
        "column outbox.topic: expected text NOT NULL, found text",
        "missing index outbox_claim_idx on outbox",
        "unexpected column outbox_keys.note: text",
    ):
        assert difference in refused.stderr, refused.stderr
    with engine.connect() as conn:
        recorded = conn.execute(sa.text("SELECT count(*) FROM outbox_migrations")).scalar()
        scratch = conn.execute(
            sa.text("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'outbox_adopt_%'")
        ).scalar()
    engine.dispose()
    assert (recorded, scratch) == (0, 0)


def test_adopting_a_migrated_outbox_changes_nothing_and_a_partial_one_is_refused(
    engine: sa.Engine,
) -> None:
    assert adopt(engine).applied == []
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_migrations WHERE version >= 7"))
    with pytest.raises(MigrationError, match="at version 6 already: run outbox-kafka migrate"):
        adopt(engine)


def test_every_migration_that_makes_tables_has_an_adopt_file() -> None:
    from outbox_kafka.schema.statements import raw_migrations

    for migration in raw_migrations():
        makes_tables = any(
            phrase in migration.sql.upper()
            for phrase in ("CREATE TABLE", "ADD COLUMN", "CREATE INDEX", "CREATE UNIQUE INDEX")
        )
        if makes_tables:
            assert migration.adopt_sql != migration.sql, textwrap.shorten(migration.name, 40)


def _released() -> set[int]:
    from outbox_kafka.schema.statements import raw_migrations

    return {m.version for m in raw_migrations()}


def _creates(operations: list[str]) -> list[str]:
    return [line for line in operations if line.startswith("op.create_table(")]


@pytest.mark.parametrize("others", [(), (OPS_OUTBOX,)], ids=["default", "second-in-ops"])
def test_the_apps_autogenerate_first_then_the_outbox_revision_upgrades_and_matches(
    project: tuple[Config, str], others: tuple[TableNames, ...]
) -> None:
    config, url = project
    _use_app_env(config, *others)
    # The project's first autogenerate, before any revision of the outbox: its
    # own tables (but "scratch", which its own include_object leaves out), and
    # none of the outbox's.
    first, _ = _revision_text(config, autogenerate=True)
    assert _creates(_operations(first)) == ["op.create_table('orders',"], first
    assert "outbox" not in first.split("def downgrade()", 1)[1], first

    _outbox_revision(config, TableNames(), *others)
    command.upgrade(config, "head")
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            for names in (TableNames(), *others):
                assert applied_versions(conn, names) == _released(), names
    finally:
        engine.dispose()

    # Now the outbox's tables exist and are migrated: compared, and equal.
    again, _ = _revision_text(config, autogenerate=True)
    assert _operations(again) == [], again


def test_drift_in_a_migrated_outbox_is_still_reported(project: tuple[Config, str]) -> None:
    config, url = project
    _use_app_env(config, OPS_OUTBOX)
    engine = make_engine(url)
    try:
        migrate(engine)
        migrate(engine, OPS_OUTBOX)
        with engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE outbox ALTER COLUMN topic DROP NOT NULL"))
            conn.execute(sa.text("DROP INDEX ops.orders_outbox_keys_due_idx"))
    finally:
        engine.dispose()
    revision, _ = _revision_text(config, autogenerate=True)
    operations = _operations(revision)
    assert any(line.startswith("op.alter_column('outbox', 'topic',") for line in operations)
    due_idx = "op.create_index('orders_outbox_keys_due_idx', 'orders_outbox_keys', ['due_at'],"
    assert any(line.startswith(due_idx) and "schema='ops'" in line for line in operations)
    assert _creates(operations) == ["op.create_table('orders',"], revision


def test_an_outbox_behind_the_package_is_left_to_its_revision(
    project: tuple[Config, str],
) -> None:
    config, url = project
    _use_app_env(config)
    # An outbox that has not applied migration 4, next to a release that has
    # it: the migration drops this index, so autogenerate must not drop it first.
    engine = make_engine(url)
    migrate(engine)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE INDEX outbox_pending_idx ON outbox (created_at) WHERE status = 'pending'"
            )
        )
        conn.execute(sa.text("DELETE FROM outbox_migrations WHERE version = 4"))
    first, _ = _revision_text(config, autogenerate=True)
    assert _creates(_operations(first)) == ["op.create_table('orders',"], first
    assert not [line for line in _operations(first) if "outbox" in line], first

    _outbox_revision(config, TableNames())
    command.upgrade(config, "head")
    try:
        with engine.connect() as conn:
            assert applied_versions(conn, TableNames()) == _released()
            index = conn.execute(sa.text("SELECT to_regclass('public.outbox_pending_idx')"))
            assert index.scalar() is None
    finally:
        engine.dispose()
    again, _ = _revision_text(config, autogenerate=True)
    assert _operations(again) == [], again


def test_outbox_include_object_refuses_what_is_not_a_connection_or_names(
    engine: sa.Engine,
) -> None:
    with pytest.raises(TypeError, match="needs the SQLAlchemy Connection"):
        outbox_include_object("postgresql://db/app")  # type: ignore[arg-type]
    with engine.connect() as conn:
        with pytest.raises(TypeError, match=r"as TableNames\(table=\.\.\., schema=\.\.\.\)"):
            outbox_include_object(conn, "outbox")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="include_object must be a function"):
            outbox_include_object(conn, include_object=True)  # type: ignore[arg-type]
