"""The producer API: write events to the outbox inside the caller's transaction."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from outbox_kafka.errors import ConfigurationError, DuplicateEventId, EventError
from outbox_kafka.limits import DEFAULT_MAX_KEY_BYTES, DEFAULT_MAX_MESSAGE_BYTES
from outbox_kafka.naming import TableNames
from outbox_kafka.producer.content_modes import ContentMode, check_content_mode
from outbox_kafka.producer.data import JsonDefault
from outbox_kafka.producer.encoding import EventEncoder
from outbox_kafka.producer.envelope import EncodedEvent
from outbox_kafka.producer.event import Event as Event  # also importable from here
from outbox_kafka.producer.event import Route as Route
from outbox_kafka.producer.event import event_from_mapping, routes_from
from outbox_kafka.producer.event_checks import (
    HeadersInput,
    check_attribute,
    check_id_header,
)
from outbox_kafka.producer.extensions import ExtensionValue
from outbox_kafka.producer.instruments import (
    counts_async_enqueue_failures,
    counts_enqueue_failures,
    producer_metrics,
)
from outbox_kafka.producer.log_writing import WRITE_TO, LogWriter
from outbox_kafka.producer.writing import Connectable, OutboxWriter
from outbox_kafka.validation import EventSchemas, load_event_schemas

if TYPE_CHECKING:
    from outbox_kafka.producer.writing import AsyncConnectable


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
        registry: CollectorRegistry | None = None,
        json_default: JsonDefault | None = None,
        content_mode: ContentMode = "structured",
        id_header: str | None = None,
        writer: OutboxWriter | None = None,
        write_to: str = "table",
    ) -> None:
        if write_to not in WRITE_TO:
            raise ConfigurationError(
                f"write_to must be one of {', '.join(map(repr, WRITE_TO))}, got {write_to!r}"
            )
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
        route_list = routes_from(routes)
        schemas = load_event_schemas(str(Path(schema_dir).resolve())) if schema_dir else None
        self._names = TableNames(table=table, schema=db_schema)
        self._encoder = EventEncoder(
            source=source,
            routes=route_list,
            schemas=schemas,
            allow_unknown_types=allow_unknown_types,
            max_key_bytes=max_key_bytes,
            max_message_bytes=max_message_bytes,
            json_default=json_default,
            content_mode=check_content_mode(content_mode),
            id_header=check_id_header(id_header),
            holds=write_to != "log",
        )
        if writer is not None and writer.names != self._names:
            raise ConfigurationError(
                f"writer writes to {writer.names.qualified_events}, "
                f"not to this outbox's {self._names.qualified_events}"
            )
        if writer is not None and isinstance(writer, LogWriter) != (write_to == "log"):
            raise ConfigurationError(
                f"writer is a {type(writer).__name__}, which does not write to the "
                f"{write_to} (write_to={write_to!r})"
            )
        if writer is None:
            writer = (LogWriter if write_to == "log" else OutboxWriter)(self._names, notify=notify)
        self._writer = writer
        #: ``outbox_enqueue_failures_total`` lives here; ``registry`` defaults to the global one.
        self.producer_metrics = producer_metrics(registry)

    @property
    def names(self) -> TableNames:
        """The database objects this outbox writes to."""
        return self._names

    @property
    def writer(self) -> OutboxWriter:
        """What writes this outbox's encoded events: for adapters that execute on a driver's
        cursor (:mod:`outbox_kafka.contrib.django`)."""
        return self._writer

    @property
    def content_mode(self) -> ContentMode:
        """The CloudEvents Kafka content mode this outbox stores its events in."""
        return self._encoder.content_mode

    @property
    def id_header(self) -> str | None:
        """The header each event's id is also sent in, if any."""
        return self._encoder.id_header

    @property
    def schemas(self) -> EventSchemas | None:
        return self._encoder.schemas

    @property
    def limits(self) -> tuple[int, int]:
        """``(max_key_bytes, max_message_bytes)``."""
        return self._encoder.max_key_bytes, self._encoder.max_message_bytes

    def topic_for(self, event_type: str) -> str | None:
        """The topic the routing rules give ``event_type``, if any."""
        return self._encoder.topic_for(event_type)

    def encode(self, event: Event, *, index: int | None = None) -> EncodedEvent:
        """Validate and encode one event exactly as it will be sent; write nothing."""
        try:
            return self._encoder.encode(event)
        except EventError as exc:
            if index is None:
                raise
            raise type(exc)(exc.field, exc.reason, index=index) from exc

    @counts_enqueue_failures
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
        delay: timedelta | None = None,
        extensions: Mapping[str, ExtensionValue] | None = None,
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
            delay=delay,
            extensions=extensions,
        )
        return self._writer.write(conn, [self._encoder.encode(event)], event_id is not None)[0]

    @counts_async_enqueue_failures
    async def enqueue_async(
        self,
        conn: AsyncConnectable,
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
        delay: timedelta | None = None,
        extensions: Mapping[str, ExtensionValue] | None = None,
    ) -> uuid.UUID:
        """:meth:`enqueue` from async code, on an ``AsyncConnection`` or ``AsyncSession``.

        The same checks, statements and guarantees as :meth:`enqueue`, in the
        caller's transaction, on any async driver SQLAlchemy has (asyncpg,
        psycopg). Validation and encoding run before the first await.
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
            delay=delay,
            extensions=extensions,
        )
        encoded = [self._encoder.encode(event)]
        return (await self._writer.write_async(conn, encoded, event_id is not None))[0]

    @counts_enqueue_failures
    def enqueue_many(
        self, conn: Connectable, events: Iterable[Event | Mapping[str, Any]]
    ) -> list[uuid.UUID]:
        """Write a batch of events in one statement; ids in the order given.

        Events of the same key keep their order within the batch. Every event
        is validated first: if any is bad, nothing is written.
        """
        encoded, chosen_ids = self._encode_batch(events)
        if not encoded:
            return []
        return self._writer.write(conn, encoded, chosen_ids)

    @counts_async_enqueue_failures
    async def enqueue_many_async(
        self, conn: AsyncConnectable, events: Iterable[Event | Mapping[str, Any]]
    ) -> list[uuid.UUID]:
        """:meth:`enqueue_many` from async code: see :meth:`enqueue_async`."""
        encoded, chosen_ids = self._encode_batch(events)
        if not encoded:
            return []
        return await self._writer.write_async(conn, encoded, chosen_ids)

    def _encode_batch(
        self, events: Iterable[Event | Mapping[str, Any]]
    ) -> tuple[list[EncodedEvent], bool]:
        """Every event of a batch validated and encoded; whether the caller chose ids."""
        batch = [
            e if isinstance(e, Event) else event_from_mapping(e, i) for i, e in enumerate(events)
        ]
        if len(batch) == 1:
            encoded = [self._encoder.encode(batch[0])]
        else:
            encoded = [self.encode(e, index=i) for i, e in enumerate(batch)]
        chosen_ids = any(e.event_id is not None for e in batch)
        if chosen_ids:
            _refuse_repeated_ids(batch)
        return encoded, chosen_ids


def _refuse_repeated_ids(batch: list[Event]) -> None:
    """Refuse a batch that gives one event id twice (the ids are checked UUIDs by now)."""
    first_index: dict[object, int] = {}
    for index, event in enumerate(batch):
        if event.event_id is None:
            continue
        first = first_index.setdefault(event.event_id, index)
        if first != index:
            raise DuplicateEventId(
                "event_id",
                f"{event.event_id} is given twice in the batch (also event {first})",
                index=index,
            )


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
    delay: timedelta | None = None,
    extensions: Mapping[str, ExtensionValue] | None = None,
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
        delay=delay,
        extensions=extensions,
    )


def enqueue_many(conn: Connectable, events: Iterable[Event | Mapping[str, Any]]) -> list[uuid.UUID]:
    """:meth:`Outbox.enqueue_many` on the default outbox."""
    return default_outbox().enqueue_many(conn, events)


async def enqueue_async(
    conn: AsyncConnectable,
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
    delay: timedelta | None = None,
    extensions: Mapping[str, ExtensionValue] | None = None,
) -> uuid.UUID:
    """:meth:`Outbox.enqueue_async` on the default outbox."""
    return await default_outbox().enqueue_async(
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
        delay=delay,
        extensions=extensions,
    )


async def enqueue_many_async(
    conn: AsyncConnectable, events: Iterable[Event | Mapping[str, Any]]
) -> list[uuid.UUID]:
    """:meth:`Outbox.enqueue_many_async` on the default outbox."""
    return await default_outbox().enqueue_many_async(conn, events)
