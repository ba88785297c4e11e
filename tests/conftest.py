"""Fixtures shared by every tier: a real PostgreSQL and a real Kafka-protocol broker.

PostgreSQL: ``OUTBOX_TEST_DATABASE_URL`` when set, else an embedded server
started once per session. Each test gets a fresh database cloned from a
migrated template. Broker: ``OUTBOX_TEST_KAFKA_BOOTSTRAP`` when set, else the
embedded broker started once per session on a free loopback port.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic
from sqlalchemy.engine import make_url

from outbox_kafka import Outbox, migrate
from outbox_kafka.database import make_engine, normalise_url
from outbox_kafka.demo.embedded import (
    EmbeddedBroker,
    start_broker,
    start_postgres,
    start_postgres_on_port,
)

from .log_support import log_database
from .relay_support import TcpProxy

REPO = Path(__file__).resolve().parent.parent
EVENT_SCHEMAS = REPO / "schemas" / "events"


@pytest.fixture(scope="session")
def work_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="outbox-kafka-tests-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def server_url(work_dir: Path) -> Iterator[str]:
    """URL of a database on the server under test, used to create test databases."""
    given = os.environ.get("OUTBOX_TEST_DATABASE_URL")
    if given:
        yield normalise_url(given)
        return
    pg = start_postgres(work_dir)
    try:
        yield normalise_url(pg.url)
    finally:
        pg.stop()


@pytest.fixture(scope="session")
def logical_server_url(work_dir: Path) -> Iterator[str]:
    """URL of a database on an embedded server of this session's own with
    ``wal_level = logical``, for the log mode, wherever the suite runs."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pg = start_postgres_on_port(
        work_dir / "logical-pgdata",
        port,
        {
            "wal_level": "logical",
            "max_replication_slots": "20",
            "max_wal_senders": "20",
            # Small, so that a test transaction of a few hundred kB spills to disk.
            "logical_decoding_work_mem": "64kB",
        },
    )
    try:
        yield normalise_url(pg.url)
    finally:
        pg.stop()


@pytest.fixture
def log_url(logical_server_url: str) -> Iterator[str]:
    """A migrated database on the logical server, with the outbox's publication and slot."""
    with log_database(logical_server_url) as url:
        yield url


@pytest.fixture
def log_engine(log_url: str) -> Iterator[sa.Engine]:
    eng = make_engine(log_url)
    yield eng
    eng.dispose()


def _admin(server_url: str) -> sa.Engine:
    return sa.create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)


@pytest.fixture(scope="session")
def template_db(server_url: str) -> Iterator[str]:
    """A migrated database that every test database is cloned from."""
    name = f"outbox_tmpl_{uuid.uuid4().hex[:10]}"
    admin = _admin(server_url)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    engine = make_engine(make_url(server_url).set(database=name).render_as_string(False))
    migrate(engine)
    engine.dispose()
    yield name
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture
def database_url(server_url: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for this test; dropped afterwards."""
    name = f"outbox_t_{uuid.uuid4().hex[:12]}"
    admin = _admin(server_url)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    eng = make_engine(database_url)
    yield eng
    eng.dispose()


@pytest.fixture
def outbox() -> Outbox:
    """The default outbox, validating against the shipped orders schemas."""
    return Outbox(schema_dir=EVENT_SCHEMAS, routes={"order.*": "orders"})


@pytest.fixture(scope="session")
def kafka_bootstrap(work_dir: Path) -> Iterator[str]:
    given = os.environ.get("OUTBOX_TEST_KAFKA_BOOTSTRAP")
    if given:
        yield given
        return
    broker = start_broker(work_dir)
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture
def new_topic(kafka_bootstrap: str) -> Callable[..., str]:
    """Create a uniquely named topic: ``new_topic(partitions=4)``, with topic settings
    in ``config`` (``{"cleanup.policy": "compact"}``)."""
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})

    def create(partitions: int = 4, prefix: str = "t", config: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        futures = admin.create_topics([NewTopic(name, partitions, 1, config=config or {})])
        for future in futures.values():
            future.result(timeout=30)
        return name

    return create


@pytest.fixture(scope="module")
def module_engine(server_url: str, template_db: str) -> Iterator[sa.Engine]:
    """One fresh, migrated database shared by a module's tests (they clean up themselves)."""
    name = f"outbox_m_{uuid.uuid4().hex[:12]}"
    admin = _admin(server_url)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    eng = make_engine(make_url(server_url).set(database=name).render_as_string(False))
    yield eng
    eng.dispose()
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture
def empty_database(server_url: str) -> Iterator[Callable[[], str]]:
    """Create empty databases (plain CREATE DATABASE, not migrated): ``url = empty_database()``.

    Each call returns the SQLAlchemy URL of a new database; all are dropped afterwards.
    """
    admin = _admin(server_url)
    created: list[str] = []

    def create() -> str:
        name = f"outbox_e_{uuid.uuid4().hex[:12]}"
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        created.append(name)
        return make_url(server_url).set(database=name).render_as_string(hide_password=False)

    yield create
    with admin.connect() as conn:
        for name in created:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture
def proxied_broker(work_dir: Path) -> Iterator[tuple[TcpProxy, EmbeddedBroker]]:
    """A broker of its own that advertises a proxy's port, with the proxy in front."""
    proxy = TcpProxy(target_port=1)
    log_dir = work_dir / f"proxied-{uuid.uuid4().hex[:8]}"
    log_dir.mkdir()
    broker = start_broker(log_dir, advertised_port=proxy.port)
    proxy.set_target(broker.port)
    proxy.start()
    try:
        yield proxy, broker
    finally:
        proxy.close()
        broker.stop()


@pytest.fixture
def validating_broker(work_dir: Path) -> Iterator[tuple[EmbeddedBroker, Path]]:
    """A broker of its own that checks every record of a topic against ``<topic>.json``
    in its schema folder, refusing a whole record batch when one record fails."""
    log_dir = work_dir / f"validating-{uuid.uuid4().hex[:8]}"
    schemas = log_dir / "schemas"
    schemas.mkdir(parents=True)
    broker = start_broker(log_dir, schema_registry=schemas)
    try:
        yield broker, schemas
    finally:
        broker.stop()
