"""The producer API: write events to the outbox inside the caller's transaction."""

from __future__ import annotations

import fnmatch
import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from .envelope import (
    EncodedEvent,
    HeadersInput,
    build_envelope,
    check_attribute,
    check_available_at,
    check_event_id,
    check_headers,
    check_key,
    check_topic,
    check_traceparent,
    check_type,
    encode_data,
    headers_to_json,
    message_size,
    standard_headers,
    uuid7,
)
from .errors import (
    ConfigurationError,
    DataSchemaViolation,
    DuplicateEventId,
    EnvelopeInvalid,
    EventError,
    MessageTooLarge,
    MissingTopic,
    UnknownEventType,
    UnsafeConnection,
)
from .naming import TableNames
from .queries import Queries, pg_array, queries_for
from .validation import EventSchemas, envelope_schema, load_event_schemas

#: Kafka's default ``message.max.bytes`` is 1 MiB; keep 16 KiB for record overhead.
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024 - 16 * 1024
DEFAULT_MAX_KEY_BYTES = 1024


@dataclass(frozen=True)
class Event:
    """One event for :meth:`Outbox.enqueue_many`; fields as in :meth:`Outbox.enqueue`."""

    type: str
    key: str
    data: Any
    topic: str | None = None
    headers: HeadersInput | None = None
    available_at: datetime | None = None
    event_id: uuid.UUID | None = None
    source: str | None = None
    subject: str | None = None
    traceparent: str | None = None


@dataclass(frozen=True)
class Route:
    """Events whose type matches ``pattern`` (an fnmatch glob) go to ``topic``."""

    pattern: str
    topic: str


@dataclass
class _Limits:
    max_key_bytes: int = DEFAULT_MAX_KEY_BYTES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


@dataclass
class _Config:
    names: TableNames
    source: str
    routes: list[Route]
    schemas: EventSchemas | None
    allow_unknown_types: bool
    limits: _Limits = field(default_factory=_Limits)
    notify: bool = True


Connectable = Connection | Session


class Outbox:
    """Configuration of one outbox, and the producer API that writes to it.

    ``Outbox`` is cheap to keep for the life of a process and safe to share
    between threads. Its methods take the caller's SQLAlchemy ``Connection``
    or ``Session`` and write in the caller's transaction: they never commit,
    roll back or begin a transaction of their own, so the event exists exactly
    when the caller's transaction commits.
    """

    def __init__(
        self,
        *,
        table: str = "outbox",
        db_schema: str = "public",
        schema_dir: str | Path | None = None,
        allow_unknown_types: bool = False,
        source: str = "outbox-kafka",
        routes: Mapping[str, str] | Iterable[Route] | None = None,
        max_key_bytes: int = DEFAULT_MAX_KEY_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        notify: bool = True,
    ) -> None:
        if max_key_bytes < 1:
            raise ConfigurationError(f"max_key_bytes must be at least 1, got {max_key_bytes}")
        if max_message_bytes < 1024:
            raise ConfigurationError(
                f"max_message_bytes must be at least 1024, got {max_message_bytes}"
            )
        try:
            check_attribute("source", source)
        except EventError as exc:
            raise ConfigurationError(f"default source: {exc.reason}") from None
        route_list = _routes(routes)
        schemas = load_event_schemas(str(Path(schema_dir).resolve())) if schema_dir else None
        self._config = _Config(
            names=TableNames(table=table, schema=db_schema),
            source=source,
            routes=route_list,
            schemas=schemas,
            allow_unknown_types=allow_unknown_types,
            limits=_Limits(max_key_bytes=max_key_bytes, max_message_bytes=max_message_bytes),
            notify=notify,
        )
        self._queries: Queries = queries_for(self._config.names)

    @property
    def names(self) -> TableNames:
        """The database objects this outbox writes to."""
        return self._config.names

    @property
    def schemas(self) -> EventSchemas | None:
        return self._config.schemas

    @property
    def limits(self) -> tuple[int, int]:
        """``(max_key_bytes, max_message_bytes)``."""
        return self._config.limits.max_key_bytes, self._config.limits.max_message_bytes

    def topic_for(self, event_type: str) -> str | None:
        """The topic the routing rules give ``event_type``, if any."""
        for route in self._config.routes:
            if route.pattern == event_type:
                return route.topic
        for route in self._config.routes:
            if fnmatch.fnmatchcase(event_type, route.pattern):
                return route.topic
        return None

    def encode(self, event: Event, *, index: int | None = None) -> EncodedEvent:
        """Validate and encode one event exactly as it will be sent; write nothing."""
        try:
            return self._encode(event)
        except EventError as exc:
            if index is None:
                raise
            raise type(exc)(exc.field, exc.reason, index=index) from exc

    def _encode(self, event: Event) -> EncodedEvent:
        cfg = self._config
        event_type = check_type(event.type)
        key_bytes = check_key(event.key, cfg.limits.max_key_bytes)
        if event.topic is not None:
            topic = check_topic(event.topic)
        else:
            routed = self.topic_for(event_type)
            if routed is None:
                raise MissingTopic(
                    "topic", f"no topic given and no routing rule matches type {event_type!r}"
                )
            topic = check_topic(routed)
        event_id = uuid7() if event.event_id is None else check_event_id(event.event_id)
        source = cfg.source if event.source is None else check_attribute("source", event.source)
        subject = None if event.subject is None else check_attribute("subject", event.subject)
        traceparent = None if event.traceparent is None else check_traceparent(event.traceparent)
        available_at = (
            None if event.available_at is None else check_available_at(event.available_at)
        )
        own_headers = check_headers(event.headers)

        data_json = encode_data(event.data)
        schema = None
        if cfg.schemas is not None:
            schema = cfg.schemas.get(event_type)
            if schema is None and not cfg.allow_unknown_types:
                raise UnknownEventType(
                    "type",
                    f"no schema {event_type}.json in {cfg.schemas.directory} "
                    "(pass allow_unknown_types=True to accept it)",
                )
        envelope, value = build_envelope(
            event_id=event_id,
            source=source,
            event_type=event_type,
            key=event.key,
            data_json=data_json,
            subject=subject,
            dataschema=None if schema is None else schema.schema_id,
            traceparent=traceparent,
        )
        if schema is not None:
            # Validate what consumers will see: the payload after JSON encoding.
            problem = schema.first_error(json.loads(data_json))
            if problem is not None:
                raise DataSchemaViolation("data", f"does not match {event_type}.json {problem}")
        # The attributes are plain strings, so the dict is exactly what was encoded.
        problem = envelope_schema().first_error({**envelope, "data": None})
        if problem is not None:
            raise EnvelopeInvalid("envelope", problem)
        headers = standard_headers(event_id, event_type, source, traceparent) + own_headers
        size = message_size(key_bytes, value, headers)
        if size > cfg.limits.max_message_bytes:
            raise MessageTooLarge(
                "data",
                f"the encoded message is {size} bytes, over the maximum of "
                f"{cfg.limits.max_message_bytes}",
            )
        return EncodedEvent(
            event_id=event_id,
            key=event.key,
            topic=topic,
            type=event_type,
            value=value,
            headers=headers,
            available_at=available_at,
            envelope=envelope,
        )

    def enqueue(
        self,
        conn: Connectable,
        *,
        type: str,
        key: str,
        data: Any,
        topic: str | None = None,
        headers: HeadersInput | None = None,
        available_at: datetime | None = None,
        event_id: uuid.UUID | None = None,
        source: str | None = None,
        subject: str | None = None,
        traceparent: str | None = None,
    ) -> uuid.UUID:
        """Write one event in the caller's transaction and return its id.

        Guarantees: the event is validated and encoded before anything is
        written (bad input raises an :class:`~outbox_kafka.OutboxError`
        subclass and leaves the transaction usable); it becomes visible to
        the relay only when the caller commits; events of one ``key`` are
        published in the commit order of their transactions. Writers of the
        same key wait for each other until commit. Under REPEATABLE READ or
        SERIALIZABLE, a concurrent enqueue for the same key raises the
        database's serialization error, to be retried by the caller.
        """
        event = Event(
            type=type,
            key=key,
            data=data,
            topic=topic,
            headers=headers,
            available_at=available_at,
            event_id=event_id,
            source=source,
            subject=subject,
            traceparent=traceparent,
        )
        return self.enqueue_many(conn, [event])[0]

    def enqueue_many(
        self, conn: Connectable, events: Iterable[Event | Mapping[str, Any]]
    ) -> list[uuid.UUID]:
        """Write a batch of events in one round trip; ids in the order given.

        Events of the same key keep their order within the batch. Every event
        is validated first: if any is bad, nothing is written.
        """
        batch = [
            e if isinstance(e, Event) else _event_from_mapping(e, i) for i, e in enumerate(events)
        ]
        if not batch:
            return []
        encoded = [self.encode(e, index=i if len(batch) > 1 else None) for i, e in enumerate(batch)]
        connection = _connection_of(conn)
        params = _enqueue_params(encoded, self._config.names.channel, self._config.notify)
        statement = self._queries["enqueue"]
        if any(e.event_id is not None for e in batch):
            # Caller-chosen ids may collide; a savepoint keeps a collision from
            # spoiling the caller's transaction.
            try:
                with connection.begin_nested():
                    connection.execute(statement, params)
            except IntegrityError as exc:
                diag = getattr(exc.orig, "diag", None)
                if getattr(diag, "constraint_name", None) == f"{self._config.names.table}_pkey":
                    raise DuplicateEventId(
                        "event_id", "an event with this id is already in the outbox"
                    ) from None
                raise
        else:
            connection.execute(statement, params)
        return [e.event_id for e in encoded]


def _routes(routes: Mapping[str, str] | Iterable[Route] | None) -> list[Route]:
    if routes is None:
        return []
    pairs = (
        [Route(p, t) for p, t in routes.items()] if isinstance(routes, Mapping) else list(routes)
    )
    for route in pairs:
        if not isinstance(route, Route) or not isinstance(route.pattern, str) or not route.pattern:
            raise ConfigurationError(f"routing rule {route!r} needs a non-empty type pattern")
        try:
            check_topic(route.topic)
        except EventError as exc:
            raise ConfigurationError(f"routing rule for {route.pattern!r}: {exc.reason}") from None
    return pairs


_EVENT_FIELDS = frozenset(Event.__dataclass_fields__)


def _event_from_mapping(item: Mapping[str, Any], index: int) -> Event:
    if not isinstance(item, Mapping):
        raise EventError(
            "events", f"must hold Event objects or mappings, not {type(item).__name__}", index=index
        )
    unknown = set(item) - _EVENT_FIELDS
    if unknown:
        raise EventError("events", f"unknown field(s) {sorted(unknown)}", index=index)
    missing = {"type", "key", "data"} - set(item)
    if missing:
        raise EventError("events", f"missing field(s) {sorted(missing)}", index=index)
    return Event(**item)


def _connection_of(conn: Connectable) -> Connection:
    if isinstance(conn, Session):
        connection = conn.connection()
    elif isinstance(conn, Connection):
        connection = conn
    else:
        raise UnsafeConnection(
            f"expected a SQLAlchemy Connection or Session, got {type(conn).__name__}"
        )
    level = connection.get_execution_options().get("isolation_level") or (
        connection.engine.get_execution_options().get("isolation_level")
    )
    # The engine-wide setting lives on the driver connection itself.
    driver_autocommit = bool(getattr(connection.connection.dbapi_connection, "autocommit", False))
    if level == "AUTOCOMMIT" or driver_autocommit:
        raise UnsafeConnection(
            "the connection is in AUTOCOMMIT mode: the event would not share the caller's "
            "transaction; enqueue inside a transaction instead"
        )
    return connection


def _enqueue_params(encoded: list[EncodedEvent], channel: str, notify: bool) -> dict[str, Any]:
    return {
        "event_ids": pg_array([str(e.event_id) for e in encoded]),
        "ordering_keys": pg_array([e.key for e in encoded]),
        "topics": pg_array([e.topic for e in encoded]),
        "types": pg_array([e.type for e in encoded]),
        "event_values": pg_array([e.value for e in encoded]),
        "available_ats": pg_array(
            [None if e.available_at is None else e.available_at.isoformat() for e in encoded]
        ),
        "event_headers": pg_array([headers_to_json(e.headers) for e in encoded]),
        "notify": notify,
        "channel": channel,
    }


_default_outbox: Outbox | None = None


def default_outbox() -> Outbox:
    """The ``Outbox`` used by the module-level functions (table ``outbox``)."""
    global _default_outbox
    if _default_outbox is None:
        _default_outbox = Outbox()
    return _default_outbox


def configure(outbox: Outbox) -> None:
    """Make ``outbox`` the one the module-level ``enqueue`` functions use."""
    global _default_outbox
    if not isinstance(outbox, Outbox):
        raise ConfigurationError(f"configure() takes an Outbox, not {type(outbox).__name__}")
    _default_outbox = outbox


def enqueue(
    conn: Connectable,
    *,
    type: str,
    key: str,
    data: Any,
    topic: str | None = None,
    headers: HeadersInput | None = None,
    available_at: datetime | None = None,
    event_id: uuid.UUID | None = None,
    source: str | None = None,
    subject: str | None = None,
    traceparent: str | None = None,
) -> uuid.UUID:
    """:meth:`Outbox.enqueue` on the default outbox."""
    return default_outbox().enqueue(
        conn,
        type=type,
        key=key,
        data=data,
        topic=topic,
        headers=headers,
        available_at=available_at,
        event_id=event_id,
        source=source,
        subject=subject,
        traceparent=traceparent,
    )


def enqueue_many(conn: Connectable, events: Iterable[Event | Mapping[str, Any]]) -> list[uuid.UUID]:
    """:meth:`Outbox.enqueue_many` on the default outbox."""
    return default_outbox().enqueue_many(conn, events)
