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
from outbox_kafka.adoption import adopt, describe
from outbox_kafka.database import make_engine
from outbox_kafka.naming import TableNames
from tests.acceptance.test_relay_cli import run_cli

ENV_PY = """
from alembic import context
from sqlalchemy import engine_from_config, pool

import outbox_kafka.tables

config = context.config
target_metadata = outbox_kafka.tables.metadata


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
    assert "adopted public.outbox: recorded migrations [1, 2, 3, 4, 5]" in adopted.stdout
    assert "OK   migrations" in _check(url, kafka_bootstrap)
    again = run_cli("migrate", "--database-url", url)
    assert "is up to date (version 5)" in again.stdout, again.stdout + again.stderr

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
        conn.execute(sa.text("DELETE FROM outbox_migrations WHERE version = 5"))
    with pytest.raises(MigrationError, match="at version 4 already: run outbox-kafka migrate"):
        adopt(engine)


def test_every_migration_that_makes_tables_has_an_adopt_file() -> None:
    from outbox_kafka.queries import raw_migrations

    for migration in raw_migrations():
        makes_tables = any(
            phrase in migration.sql.upper()
            for phrase in ("CREATE TABLE", "ADD COLUMN", "CREATE INDEX", "CREATE UNIQUE INDEX")
        )
        if makes_tables:
            assert migration.adopt_sql != migration.sql, textwrap.shorten(migration.name, 40)
