"""The exceptions outbox-kafka raises: one root, one subclass per reason.

Every error raised for bad input is raised before anything is written, so the
caller's transaction stays usable. Driver errors (psycopg2, confluent-kafka) are
translated at the storage and publishing boundaries; database errors that the
caller must handle themselves, such as serialization failures under
REPEATABLE READ, are deliberately left as SQLAlchemy raised them.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of every error outbox-kafka raises."""


class ConfigurationError(OutboxError):
    """A setting is missing, malformed or inconsistent with another setting."""


class InvalidIdentifier(ConfigurationError):
    """A table or schema name is not a plain SQL identifier."""


class SchemaError(ConfigurationError):
    """A JSON Schema file cannot be read or is not a valid schema."""


class InvalidSelection(ConfigurationError):
    """An operator command's selection is empty, malformed, or unsafe to act on."""


class EventError(OutboxError, ValueError):
    """An event handed to `enqueue` cannot be written.

    ``field`` names the offending argument and ``reason`` says what is wrong
    with it; ``str(error)`` contains both.
    """

    def __init__(self, field: str, reason: str, *, index: int | None = None) -> None:
        self.field = field
        self.reason = reason
        self.index = index
        where = f"event {index}: " if index is not None else ""
        super().__init__(f"{where}{field}: {reason}")


class InvalidData(EventError):
    """The payload cannot be encoded as JSON (not serializable, NaN, Infinity)."""


class DataSchemaViolation(EventError):
    """The payload does not satisfy the JSON Schema of its event type."""


class UnknownEventType(EventError):
    """No schema exists for the event type and unknown types are not allowed."""


class InvalidEventType(EventError):
    """The event type is empty or otherwise unusable."""


class InvalidKey(EventError):
    """The ordering key is empty, too long, or contains a NUL character."""


class InvalidTopic(EventError):
    """The topic is not a legal Kafka topic name."""


class MissingTopic(EventError):
    """No topic was given and no routing rule matches the event type."""


class MessageTooLarge(EventError):
    """The encoded message is larger than the configured maximum."""


class InvalidHeaders(EventError):
    """A header name or value has the wrong type, or uses a reserved name."""


class InvalidTimestamp(EventError):
    """``available_at`` is naive (has no time zone) or not a datetime."""


class InvalidAttribute(EventError):
    """A CloudEvents attribute (source, subject, traceparent, id) is malformed."""


class EnvelopeInvalid(EventError):
    """The CloudEvents envelope does not satisfy ``schemas/cloudevent.json``."""


class DuplicateEventId(EventError):
    """An event with this id is already in the outbox."""


class UnsafeConnection(OutboxError):
    """The connection cannot give the outbox's guarantees (for example AUTOCOMMIT)."""


class StorageError(OutboxError):
    """The database could not be reached or refused a statement (relay side)."""


class MigrationError(OutboxError):
    """The outbox schema could not be brought up to date."""
