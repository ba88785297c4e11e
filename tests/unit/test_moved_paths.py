"""The import paths of names that moved keep working for one release, as plain
re-exports of the same objects (docs/howto/upgrading.md, "Moved import paths")."""

from __future__ import annotations

import importlib

import pytest

MOVED = [
    ("outbox_kafka.settings", "RelaySettings", "outbox_kafka.relay.config"),
    ("outbox_kafka.settings", "kafka_config_from_env", "outbox_kafka.relay.config"),
    ("outbox_kafka.settings", "kafka_config_from_file", "outbox_kafka.relay.config"),
    ("outbox_kafka.http_server", "ObservabilityServer", "outbox_kafka.relay.serve"),
    ("outbox_kafka.http_server", "HttpLimits", "outbox_kafka.relay.serve"),
    ("outbox_kafka.relay", "RelaySettings", "outbox_kafka.relay.config"),
    ("outbox_kafka.producer.outbox", "Event", "outbox_kafka.producer.event"),
    ("outbox_kafka.producer.outbox", "Route", "outbox_kafka.producer.event"),
    ("outbox_kafka", "Event", "outbox_kafka.producer.event"),
    ("outbox_kafka", "Route", "outbox_kafka.producer.event"),
    ("outbox_kafka", "__version__", "outbox_kafka.version"),
    ("outbox_kafka.tables", "metadata", "outbox_kafka.schema.metadata"),
    ("outbox_kafka.tables", "build_tables", "outbox_kafka.schema.metadata"),
    ("outbox_kafka.tables", "outbox_migrations", "outbox_kafka.schema.metadata"),
    ("outbox_kafka.tables", "outbox_floors", "outbox_kafka.schema.metadata"),
]


@pytest.mark.parametrize(("old", "name", "home"), MOVED, ids=[f"{o}.{n}" for o, n, _ in MOVED])
def test_an_old_path_gives_the_object_where_it_lives(old: str, name: str, home: str) -> None:
    moved = getattr(importlib.import_module(old), name)
    assert moved is getattr(importlib.import_module(home), name)
