"""The local stack the documentation pages run against, and the run and skip counts."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox_kafka.database import normalise_url
from outbox_kafka.demo.local_stack import StackSettings, start_local_stack


@dataclass(frozen=True)
class DocsStack:
    """Where pages get their databases (``admin_url``) and their broker."""

    admin_url: str
    bootstrap: str


@dataclass
class PageCounts:
    page: str
    ran: int = 0
    written: int = 0
    shown: int = 0
    skipped: list[str] = field(default_factory=list)


COUNTS: list[PageCounts] = []

#: Pages that run on a server with ``wal_level = logical`` (``outbox-kafka dev --log-mode``).
LOG_MODE_PAGES = {"log-mode"}


@pytest.fixture(scope="session")
def docs_stack(request: pytest.FixtureRequest) -> Iterator[DocsStack]:
    """The tests' PostgreSQL and broker with OUTBOX_TEST_DATABASE_URL, else `outbox-kafka dev`'s."""
    if os.environ.get("OUTBOX_TEST_DATABASE_URL"):
        yield DocsStack(
            admin_url=request.getfixturevalue("server_url"),
            bootstrap=request.getfixturevalue("kafka_bootstrap"),
        )
        return
    # Not under pytest's numbered temporary directories: another pytest run of the
    # same user may clean those up while the server still uses them.
    data_dir = Path(tempfile.mkdtemp(prefix="outbox-kafka-docs-"))
    stack = start_local_stack(StackSettings(data_dir=data_dir, postgres_port=0, kafka_port=0))
    try:
        yield DocsStack(
            admin_url=normalise_url(stack.environment["OUTBOX_DATABASE_URL"]),
            bootstrap=stack.environment["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"],
        )
    finally:
        stack.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
def page_database(docs_stack: DocsStack, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, empty database for one page (libpq URL, as `outbox-kafka dev` prints),
    on a server with ``wal_level = logical`` for the log mode's pages.

    Databases the page creates beside it, named after it (``<name>_tenants``), are
    dropped with it, and replication slots left in them first.
    """
    page = getattr(request.node, "callspec", None)
    stem = page.params["page"].stem if page is not None and "page" in page.params else ""
    admin_url = (
        request.getfixturevalue("logical_server_url")
        if stem in LOG_MODE_PAGES
        else docs_stack.admin_url
    )
    name = f"docs_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = make_url(admin_url).set(drivername="postgresql", database=name)
    yield url.render_as_string(hide_password=False)
    with admin.connect() as conn:
        beside = conn.execute(
            sa.text("SELECT datname FROM pg_database WHERE starts_with(datname, :prefix)"),
            {"prefix": f"{name}_"},
        ).scalars()
        for database in [name, *beside]:
            conn.exec_driver_sql(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                "WHERE database = %(database)s AND NOT active",
                {"database": database},
            )
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture
def checkout_files(tmp_path: Path) -> None:
    """The page's project directory holds a copy of the repository's ``deploy/``.

    A page runs as from a checkout, where ``psql -f deploy/sql/roles.sql`` finds
    the script; a copy, so that nothing a page does can change the repository.
    """
    shutil.copytree(repo_root() / "deploy", tmp_path / "deploy")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not COUNTS:
        return
    terminalreporter.section("documentation pages")
    for counts in COUNTS:
        terminalreporter.write_line(
            f"{counts.page}: {counts.ran} blocks run, {counts.written} files written, "
            f"{len(counts.skipped)} not run, {counts.shown} shown"
        )
        for reason in counts.skipped:
            terminalreporter.write_line(f"    not run: {reason}")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]
