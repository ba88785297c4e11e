"""The producer API: write events to the outbox inside the caller's transaction."""

from __future__ import annotations

import fnmatch
import uuid
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import accumulate
from pathlib import Path
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from outbox_kafka.errors import (
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
from outbox_kafka.limits import DEFAULT_MAX_KEY_BYTES, DEFAULT_MAX_MESSAGE_BYTES
from outbox_kafka.naming import TableNames
from outbox_kafka.producer.envelope import (
    EncodedEvent,
    EnvelopeTemplate,
    HeadersInput,
    check_attribute,
    check_available_at,
    check_delay,
    check_event_id,
    check_headers,
    check_key,
    check_topic,
    check_traceparent,
    check_type,
    encode_data,
    uuid7,
)
from outbox_kafka.queries import Queries, pg_array, pg_int_array, pg_text_array, queries_for
from outbox_kafka.relay.metrics import counts_enqueue_failures, producer_metrics
from outbox_kafka.validation import (
    CompiledSchema,
    EventSchemas,
    envelope_schema,
    load_event_schemas,
)


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
    delay: timedelta | None = None


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


class _EventKind:
    """What every event of one type from one source shares, worked out once."""

    __slots__ = ("schema", "template", "topic", "unknown")

    def __init__(
        self,
        template: EnvelopeTemplate,
        topic: str | None,
        schema: CompiledSchema | None,
        unknown: bool,
    ) -> None:
        self.template = template
        #: The routed topic, checked; None when no rule matches.
        self.topic = topic
        self.schema = schema
        #: A schema directory is configured, has no schema for the type, and
        #: unknown types are not allowed.
        self.unknown = unknown


#: Event kinds an ``Outbox`` keeps; past that (many distinct sources) it starts over.
_MAX_KINDS = 1024

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
        registry: CollectorRegistry | None = None,
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
        #: The wake-up parameters of every enqueue: notify on this channel while a
        #: relay holds this lock (see enqueue in queries.sql; the single-event
        #: function has both built in).
        self._wake: dict[str, Any] = {
            "notify": notify,
            "channel": self._config.names.channel,
            "wake_lock": self._config.names.wake_lock,
        }
        self._kinds: dict[tuple[str, str | None], _EventKind] = {}
        #: Engines on which a session could call both enqueue functions.
        self._functions_callable_on: weakref.WeakSet[Engine] = weakref.WeakSet()
        #: ``outbox_enqueue_failures_total`` lives here; ``registry`` defaults to the global one.
        self.producer_metrics = producer_metrics(registry)

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

    def _kind(self, event_type: object, source: object) -> _EventKind:
        """The checked, cached :class:`_EventKind` of ``event_type`` from ``source``."""
        # Only exact str keys: a subclass could hash or compare in its own way.
        key: tuple[str, str | None] | None = None
        if type(event_type) is str and (source is None or type(source) is str):
            key = (event_type, source)
            found = self._kinds.get(key)
            if found is not None:
                return found
        cfg = self._config
        checked_type = check_type(event_type)
        checked_source = cfg.source if source is None else check_attribute("source", source)
        routed = self.topic_for(checked_type)
        schema = None if cfg.schemas is None else cfg.schemas.get(checked_type)
        kind = _EventKind(
            EnvelopeTemplate(
                checked_type, checked_source, None if schema is None else schema.schema_id
            ),
            topic=None if routed is None else check_topic(routed),
            schema=schema,
            unknown=cfg.schemas is not None and schema is None and not cfg.allow_unknown_types,
        )
        if key is not None:
            if len(self._kinds) >= _MAX_KINDS:
                self._kinds.clear()
            self._kinds[key] = kind
        return kind

    def _encode(self, event: Event) -> EncodedEvent:
        cfg = self._config
        kind = self._kind(event.type, event.source)
        event_type = kind.template.event_type
        key_bytes = check_key(event.key, cfg.limits.max_key_bytes)
        if event.topic is not None:
            topic = check_topic(event.topic)
        elif kind.topic is not None:
            topic = kind.topic
        else:
            raise MissingTopic(
                "topic", f"no topic given and no routing rule matches type {event_type!r}"
            )
        if event.event_id is None:
            event_id, id_text = uuid7.with_text()
        else:
            event_id = check_event_id(event.event_id)
            id_text = str(event_id)
        subject = None if event.subject is None else check_attribute("subject", event.subject)
        traceparent = None if event.traceparent is None else check_traceparent(event.traceparent)
        available_at = (
            None if event.available_at is None else check_available_at(event.available_at)
        )
        delay = None if event.delay is None else check_delay(event.delay, available_at)
        own_headers = check_headers(event.headers)

        data_json = encode_data(event.data)
        if kind.unknown and cfg.schemas is not None:
            raise UnknownEventType(
                "type",
                f"no schema {event_type}.json in {cfg.schemas.directory} "
                "(pass allow_unknown_types=True to accept it)",
            )
        envelope, value = kind.template.envelope(
            id_text, event.key, data_json, subject, traceparent
        )
        if kind.schema is not None:
            problem = kind.schema.payload_problem(event.data, data_json)
            if problem is not None:
                raise DataSchemaViolation("data", f"does not match {event_type}.json {problem}")
        # The attributes are plain strings, so the dict is exactly what was encoded.
        problem = envelope_schema().problem({**envelope, "data": None})
        if problem is not None:
            raise EnvelopeInvalid("envelope", problem)
        headers, stored_headers, header_bytes = kind.template.headers(
            id_text, traceparent, own_headers
        )
        size = len(key_bytes) + len(value) + header_bytes
        if size > cfg.limits.max_message_bytes:
            raise MessageTooLarge(
                "data",
                f"the encoded message is {size} bytes, over the maximum of "
                f"{cfg.limits.max_message_bytes}",
            )
        return EncodedEvent(
            event_id,
            event.key,
            topic,
            event_type,
            value,
            headers,
            available_at,
            envelope,
            stored_headers,
            delay,
        )

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
        )
        return self._write(conn, [self._encode(event)], event_id is not None)[0]

    @counts_enqueue_failures
    def enqueue_many(
        self, conn: Connectable, events: Iterable[Event | Mapping[str, Any]]
    ) -> list[uuid.UUID]:
        """Write a batch of events in one statement; ids in the order given.

        Events of the same key keep their order within the batch. Every event
        is validated first: if any is bad, nothing is written.
        """
        batch = [
            e if isinstance(e, Event) else _event_from_mapping(e, i) for i, e in enumerate(events)
        ]
        if not batch:
            return []
        if len(batch) == 1:
            encoded = [self._encode(batch[0])]
        else:
            encoded = [self.encode(e, index=i) for i, e in enumerate(batch)]
        return self._write(conn, encoded, any(e.event_id is not None for e in batch))

    def _write(
        self, conn: Connectable, encoded: list[EncodedEvent], chosen_ids: bool
    ) -> list[uuid.UUID]:
        """Write ``encoded`` in one statement; ``chosen_ids``: the caller gave event ids.

        The first write on a connection may cost one more round trip: the
        question :meth:`_functions` asks.
        """
        connection = _connection_of(conn)
        functions = self._functions(connection)
        if len(encoded) == 1 and functions.one:
            name, params = "enqueue_one", _enqueue_one_params(encoded[0])
        else:
            name = "enqueue_many_call" if functions.many else "enqueue"
            params = _enqueue_params(encoded)
        params.update(self._wake)

        def execute() -> None:
            if connection.dialect.driver == "psycopg2":
                # Compiled once for the driver: SQLAlchemy's handling of a text()
                # construct on every call costs more than encoding the event.
                connection.exec_driver_sql(self._queries.driver_sql(name), params)
            else:
                connection.execute(self._queries[name], params)

        if not chosen_ids:
            execute()
            return [e.event_id for e in encoded]
        # Caller-chosen ids may collide; a savepoint keeps a collision from
        # spoiling the caller's transaction.
        try:
            with connection.begin_nested():
                execute()
        except IntegrityError as exc:
            diag = getattr(exc.orig, "diag", None)
            if getattr(diag, "constraint_name", None) == f"{self._config.names.table}_pkey":
                raise DuplicateEventId(
                    "event_id", "an event with this id is already in the outbox"
                ) from None
            raise
        return [e.event_id for e in encoded]

    def _functions(self, connection: Connection) -> _Functions:
        """Which enqueue functions this session may call (migrations 0003 and 0005).

        Asked once per driver connection, at most: an answer of both holds for
        the whole engine (kept in a weak set, so short-lived connections such
        as NullPool's do not ask again); any other is kept in the connection's
        ``info``, which lives as long as the pooled connection. Where a function
        is missing (tables made from :mod:`outbox_kafka.tables`, a database not
        migrated that far) or the role lacks EXECUTE, enqueue writes with the
        batch statement instead, which needs the table grants of schema version
        4. The answer assumes that the engine's role keeps its EXECUTE and that
        the functions stay (``SET ROLE`` to a role without it, or dropping
        them, makes the call fail until the process restarts).
        """
        engine = connection.engine
        if engine in self._functions_callable_on:
            return _BOTH
        names = self._config.names
        key = ("outbox_kafka.enqueue functions", names.enqueue_one_signature)
        known = connection.info.get(key)
        if isinstance(known, _Functions):
            return known
        row = connection.execute(
            self._queries["enqueue_function_callable"],
            {
                "signature": names.enqueue_one_signature,
                "batch_signature": names.enqueue_many_signature,
            },
        ).one()
        found = _Functions(bool(row.callable), bool(row.batch_callable))
        if found == _BOTH:
            # For the engine's other connections too, however short-lived (NullPool).
            self._functions_callable_on.add(engine)
        else:
            connection.info[key] = found
        return found


class _Functions(NamedTuple):
    """Which of the enqueue functions a session may call."""

    one: bool
    many: bool


_BOTH = _Functions(True, True)


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


def _enqueue_params(encoded: list[EncodedEvent]) -> dict[str, Any]:
    """The ``enqueue`` statement's parameters: per event, and per distinct key."""
    # Walking the batch backwards: how many later events of the same key each
    # event has, how many events each key has, and each key's first event.
    behind = [0] * len(encoded)
    per_key: dict[str, int] = {}
    first: dict[str, EncodedEvent] = {}
    for index in range(len(encoded) - 1, -1, -1):
        event = encoded[index]
        later = per_key.get(event.key, 0)
        behind[index] = later
        per_key[event.key] = later + 1
        first[event.key] = event
    delayed = any(e.available_at is not None for e in encoded)
    deferred = any(e.delay_seconds is not None for e in encoded)
    values = [e.value for e in encoded]
    lengths = [len(v) for v in values]
    # Keys and types hold no NUL (checked); ids and topics are ASCII: the
    # one-pass text arrays fit them all. The envelope's "id" is the id's text.
    return {
        "key_names": pg_text_array(list(per_key)),
        "key_counts": pg_int_array(per_key.values()),
        "key_available_ats": _timestamps([first[k].available_at for k in per_key])
        if delayed
        else None,
        "key_delays": pg_array([first[k].delay_seconds for k in per_key]) if deferred else None,
        "event_ids": pg_text_array([e.envelope["id"] for e in encoded]),
        "ordering_keys": pg_text_array([e.key for e in encoded]),
        "behind": pg_int_array(behind),
        "topics": pg_text_array([e.topic for e in encoded]),
        "types": pg_text_array([e.type for e in encoded]),
        "event_values": b"".join(values),
        "value_starts": pg_int_array(accumulate(lengths[:-1], initial=1)),
        "value_lengths": pg_int_array(lengths),
        "event_headers": "[" + ",".join([e.stored_headers for e in encoded]) + "]",
        "available_ats": _timestamps([e.available_at for e in encoded]) if delayed else None,
        "delays": pg_array([e.delay_seconds for e in encoded]) if deferred else None,
    }


def _timestamps(values: list[datetime | None]) -> str:
    # In UTC: PostgreSQL refuses some offsets Python allows (check_available_at).
    return pg_array([None if v is None else v.astimezone(UTC).isoformat() for v in values])


def _enqueue_one_params(event: EncodedEvent) -> dict[str, Any]:
    """The ``enqueue_one`` statement's parameters."""
    return {
        "event_id": event.envelope["id"],
        "ordering_key": event.key,
        "topic": event.topic,
        "type": event.type,
        "value": event.value,
        "headers": event.stored_headers,
        "available_at": None if event.available_at is None else event.available_at.astimezone(UTC),
        "delay_seconds": event.delay_seconds,
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
    delay: timedelta | None = None,
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
    )


def enqueue_many(conn: Connectable, events: Iterable[Event | Mapping[str, Any]]) -> list[uuid.UUID]:
    """:meth:`Outbox.enqueue_many` on the default outbox."""
    return default_outbox().enqueue_many(conn, events)
