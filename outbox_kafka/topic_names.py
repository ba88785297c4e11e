"""What a Kafka topic name may be.

Producers check each event's topic before it is written, and the relay checks
it again before it sends (and the dead-letter topic of its settings), with the
same rule: ASCII letters, digits, ``.``, ``_`` and ``-``, 1 to 249 characters,
and neither ``.`` nor ``..``.
"""

from __future__ import annotations

import re

from outbox_kafka.errors import InvalidTopic

#: Kafka's longest topic name.
MAX_TOPIC_LENGTH = 249

_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")


def check_topic(topic: object) -> str:
    """Return ``topic`` if it is a legal Kafka topic name, else raise :class:`InvalidTopic`."""
    if not isinstance(topic, str):
        raise InvalidTopic("topic", f"must be a str, not {type(topic).__name__}")
    if topic in {".", ".."}:
        raise InvalidTopic("topic", f"{topic!r} is not allowed as a Kafka topic name")
    if not _TOPIC.fullmatch(topic):
        if len(topic) > MAX_TOPIC_LENGTH:
            raise InvalidTopic(
                "topic", f"is {len(topic)} characters, over Kafka's limit of {MAX_TOPIC_LENGTH}"
            )
        raise InvalidTopic(
            "topic",
            f"{topic!r} is not a legal Kafka topic name (use ASCII letters, digits, '.', '_', '-')",
        )
    return topic
