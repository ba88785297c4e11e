"""The broker side of the relay benches: fresh topics, warm producers, relay settings."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from outbox_kafka.relay.config import RelaySettings

#: Partitions of every measured topic.
PARTITIONS = 6


class Kafka:
    """One broker: topics created per measurement and deleted after it."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        # Kept for the life of the bench: its futures resolve only while it exists.
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        #: Where warm-up messages go, so the measured topics hold only measured ones.
        self.warm_up_topic = self.new_topic("bench-warm-up", partitions=1)

    def new_topic(self, prefix: str = "bench-relay", partitions: int = PARTITIONS) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        futures = self.admin.create_topics([NewTopic(name, partitions, 1)], request_timeout=30)
        for future in futures.values():
            future.result(timeout=60)
        return name

    def delete_topic(self, name: str) -> None:
        """Delete a measured topic (best effort): an in-memory broker keeps every message."""
        with contextlib.suppress(Exception):
            for future in self.admin.delete_topics([name], operation_timeout=30).values():
                future.result(timeout=60)

    @contextlib.contextmanager
    def topic(self, prefix: str = "bench-relay") -> Iterator[str]:
        name = self.new_topic(prefix)
        try:
            yield name
        finally:
            self.delete_topic(name)

    def settings(self, database_url: str, **overrides: Any) -> RelaySettings:
        return RelaySettings(
            database_url=database_url, bootstrap_servers=self.bootstrap, **overrides
        )

    def producer(self) -> Any:
        """A producer with the relay's configuration that has delivered one message.

        A new idempotent producer's first delivery takes ~0.5 s longer on the
        embedded broker (connection, producer id); none of that is timed.
        """
        producer = Producer(self.settings("postgresql://unused/unused").producer_config())
        producer.produce(self.warm_up_topic, b"warm-up", b"warm-up")
        if producer.flush(30) != 0:
            raise RuntimeError("the warm-up message was not delivered")
        return producer
