"""outbox-kafka: the transactional outbox for PostgreSQL and Apache Kafka.

Producers call :func:`enqueue` (or :meth:`Outbox.enqueue`) inside their own
SQLAlchemy transaction; the relay (``outbox-kafka relay``) publishes committed
events to Kafka in per-key commit order.
"""

from __future__ import annotations

from outbox_kafka.errors import (
    ConfigurationError,
    DataSchemaViolation,
    DuplicateEventId,
    EnvelopeInvalid,
    EventError,
    InvalidAttribute,
    InvalidData,
    InvalidEventType,
    InvalidHeaders,
    InvalidIdentifier,
    InvalidKey,
    InvalidTimestamp,
    InvalidTopic,
    MessageTooLarge,
    MigrationError,
    MissingTopic,
    OutboxError,
    SchemaError,
    StorageError,
    UnknownEventType,
    UnsafeConnection,
)
from outbox_kafka.naming import TableNames
from outbox_kafka.producer.event import Event, Route
from outbox_kafka.producer.outbox import (
    Outbox,
    configure,
    default_outbox,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
)
from outbox_kafka.schema.migrations import migrate, migration_script
from outbox_kafka.version import __version__

__all__ = [
    "ConfigurationError",
    "DataSchemaViolation",
    "DuplicateEventId",
    "EnvelopeInvalid",
    "Event",
    "EventError",
    "InvalidAttribute",
    "InvalidData",
    "InvalidEventType",
    "InvalidHeaders",
    "InvalidIdentifier",
    "InvalidKey",
    "InvalidTimestamp",
    "InvalidTopic",
    "MessageTooLarge",
    "MigrationError",
    "MissingTopic",
    "Outbox",
    "OutboxError",
    "Route",
    "SchemaError",
    "StorageError",
    "TableNames",
    "UnknownEventType",
    "UnsafeConnection",
    "__version__",
    "configure",
    "default_outbox",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "migrate",
    "migration_script",
]
