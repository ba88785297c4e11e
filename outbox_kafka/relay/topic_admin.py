"""What the relay asks of the broker about topics, through its admin client.

- Each topic's largest message: the topic's ``max.message.bytes``
  (DescribeConfigs), which may be below the producer's ``message.max.bytes``. A
  message over it is refused by the broker, in a delivery report that names its
  whole record batch; found before producing, it is refused alone.
- Creating a topic that is missing, under ``--create-topics``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from outbox_kafka.relay.batch import Problem, Verdict

log = logging.getLogger("outbox_kafka.publisher")

#: How long a topic's max.message.bytes, as the broker told it, is trusted: read
#: again after that, so that a limit an operator raises takes effect.
TOPIC_LIMIT_SECONDS = 60.0

#: librdkafka's names of the producer's compression setting.
_COMPRESSION_KEYS = ("compression.type", "compression.codec")


class TopicLimits:
    """``limits(topic)``: the largest message ``topic`` takes, or None where the broker
    does not tell it or the producer compresses (a compressed batch may fit a limit its
    messages exceed). Threads may share it: at worst two of them ask the broker at once."""

    def __init__(
        self,
        producer_config: dict[str, Any],
        admin_client: Callable[[], AdminClient],
        timeout: float,
    ) -> None:
        self._compressed = any(producer_config.get(k, "none") != "none" for k in _COMPRESSION_KEYS)
        self._admin_client = admin_client
        self._timeout = timeout
        #: By topic: (its max.message.bytes or None where not told, when it was read).
        self._limits: dict[str, tuple[int | None, float]] = {}

    def __call__(self, topic: str) -> int | None:
        if self._compressed:
            return None
        now = time.monotonic()
        cached = self._limits.get(topic)
        if cached is not None and now - cached[1] < TOPIC_LIMIT_SECONDS:
            return cached[0]
        limit: int | None = None
        try:
            resource = ConfigResource(ResourceType.TOPIC, topic)
            futures = self._admin_client().describe_configs(
                [resource], request_timeout=self._timeout
            )
            entry = futures[resource].result(self._timeout + 1).get("max.message.bytes")
            limit = int(entry.value)
        except Exception:
            limit = None  # the broker's answer to the send decides
        self._limits[topic] = (limit, now)
        return limit


def create_topic(admin: AdminClient, topic: str, partitions: int) -> Problem | None:
    """Create ``topic`` with ``partitions`` partitions (the broker's replication factor);
    None once it exists (made here, or by another process first), else why not: its
    events wait (HELD)."""
    futures = admin.create_topics([NewTopic(topic, partitions, -1)], request_timeout=10)
    try:
        futures[topic].result(timeout=15)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if not (isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
            return (
                Verdict.HELD,
                f"CREATE_TOPIC_FAILED: cannot create topic {topic!r}: {exc} (its events wait)",
            )
        # Another process created it first: it is there, and that one logged it.
        log.debug("topic already exists", extra={"action": "topic_exists", "topic": topic})
    else:
        log.info(
            "created topic",
            extra={"action": "create_topic", "topic": topic, "partitions": partitions},
        )
    return None
