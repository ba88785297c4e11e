"""The size limits the producer library and the relay share, defined once.

The relay's producer is configured with ``message.max.bytes`` =
:data:`KAFKA_MESSAGE_MAX_BYTES` (1 MiB, below the 1,048,588 bytes a Kafka
broker and its topics accept by default), and checks every event against it
before handing it over. ``enqueue`` refuses, by default, events over
:data:`DEFAULT_MAX_MESSAGE_BYTES`: the same 1 MiB less
:data:`RECORD_FRAMING_BYTES` for what Kafka adds around a record, so that
whatever ``enqueue`` accepts, the relay sends. Sizes are key + value +
header names and values (:func:`outbox_kafka.stored_headers.message_size`).
"""

from __future__ import annotations

#: The relay producer's ``message.max.bytes`` unless ``--kafka-config`` sets it.
KAFKA_MESSAGE_MAX_BYTES = 1024 * 1024
#: Room kept below ``message.max.bytes`` for Kafka's record and batch framing.
RECORD_FRAMING_BYTES = 16 * 1024
#: ``enqueue``'s default limit on key + value + headers.
DEFAULT_MAX_MESSAGE_BYTES = KAFKA_MESSAGE_MAX_BYTES - RECORD_FRAMING_BYTES
#: ``enqueue``'s default limit on the ordering key's UTF-8 bytes.
DEFAULT_MAX_KEY_BYTES = 1024
#: The partitioners that send a key where a Java client sends it (murmur2);
#: for keyed messages the two behave the same.
KEY_PARTITIONERS = ("murmur2_random", "murmur2")
#: The relay's claim budget: values and headers one claim reads at most (plus
#: the event that crosses it). See docs/explanation/design.md (Memory) for what it bounds.
DEFAULT_MAX_CLAIM_BYTES = 32 * 1024 * 1024


def enqueue_limit_for(message_max_bytes: int) -> int:
    """The ``max_message_bytes`` producers should use with a relay's ``message.max.bytes``:
    :data:`RECORD_FRAMING_BYTES` below it, or half of it for a limit under twice that."""
    return message_max_bytes - min(RECORD_FRAMING_BYTES, message_max_bytes // 2)
