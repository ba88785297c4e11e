"""The fixtures themselves: a migrated database per test and a working broker."""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from confluent_kafka.admin import AdminClient


def test_database_is_migrated(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 0
        versions = conn.execute(sa.text("SELECT version FROM outbox_migrations")).scalars().all()
    assert versions == [1, 2, 3, 4, 5, 6, 7, 8]


def test_each_test_gets_its_own_database(engine: sa.Engine, database_url: str) -> None:
    with engine.connect() as conn:
        name = conn.execute(sa.text("SELECT current_database()")).scalar_one()
    assert name == sa.engine.make_url(database_url).database
    assert name.startswith("outbox_t_")


def test_broker_answers(new_topic: Callable[..., str], kafka_bootstrap: str) -> None:
    name = new_topic(2)
    assert name.startswith("t-")
    metadata = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10)
    assert name in metadata.topics
    assert len(metadata.topics[name].partitions) == 2
