"""Writing encoded events to the outbox table, in the caller's transaction.

One event goes through the ``enqueue_one`` function where the session may call
it; a batch through the ``enqueue_many`` function, or else the ``enqueue``
statement. Nothing here commits, rolls back or begins a transaction.
"""

from __future__ import annotations

import uuid
import weakref
from datetime import UTC, datetime
from itertools import accumulate
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, scoped_session

from outbox_kafka.errors import DuplicateEventId, UnsafeConnection
from outbox_kafka.naming import TableNames
from outbox_kafka.producer.envelope import EncodedEvent
from outbox_kafka.queries import Queries, pg_array, pg_int_array, pg_text_array, queries_for

#: What enqueue writes through: a Connection, a Session, or a ``scoped_session``
#: (Flask-SQLAlchemy's ``db.session``), whose current session is used.
Connectable = Connection | Session | scoped_session[Any]


class EnqueueFunctions(NamedTuple):
    """Which of the enqueue functions a session may call."""

    one: bool
    many: bool


_BOTH = EnqueueFunctions(True, True)


class OutboxWriter:
    """Writes the encoded events of one outbox; safe to share between threads."""

    def __init__(self, names: TableNames, *, notify: bool) -> None:
        self._names = names
        self._queries: Queries = queries_for(names)
        #: The wake-up parameters of every enqueue: notify on this channel while a
        #: relay holds this lock (see enqueue in queries.sql; the single-event
        #: function has both built in).
        self._wake: dict[str, Any] = {
            "notify": notify,
            "channel": names.channel,
            "wake_lock": names.wake_lock,
        }
        #: Engines on which a session could call both enqueue functions.
        self._functions_callable_on: weakref.WeakSet[Engine] = weakref.WeakSet()

    def write(
        self, conn: Connectable, encoded: list[EncodedEvent], chosen_ids: bool
    ) -> list[uuid.UUID]:
        """Write ``encoded`` in one statement; ``chosen_ids``: the caller gave event ids.

        The first write on a connection may cost one more round trip: the
        question :meth:`functions` asks.
        """
        connection = _connection_of(conn)
        functions = self.functions(connection)
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
            if getattr(diag, "constraint_name", None) == f"{self._names.table}_pkey":
                raise DuplicateEventId(
                    "event_id", "an event with this id is already in the outbox"
                ) from None
            raise
        return [e.event_id for e in encoded]

    def functions(self, connection: Connection) -> EnqueueFunctions:
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
        names = self._names
        key = ("outbox_kafka.enqueue functions", names.enqueue_one_signature)
        known = connection.info.get(key)
        if isinstance(known, EnqueueFunctions):
            return known
        row = connection.execute(
            self._queries["enqueue_function_callable"],
            {
                "signature": names.enqueue_one_signature,
                "batch_signature": names.enqueue_many_signature,
            },
        ).one()
        found = EnqueueFunctions(bool(row.callable), bool(row.batch_callable))
        if found == _BOTH:
            # For the engine's other connections too, however short-lived (NullPool).
            self._functions_callable_on.add(engine)
        else:
            connection.info[key] = found
        return found


def _connection_of(conn: Connectable) -> Connection:
    if isinstance(conn, scoped_session):
        conn = conn()
    if isinstance(conn, Session):
        connection = conn.connection()
    elif isinstance(conn, Connection):
        connection = conn
    elif type(conn).__module__.startswith("sqlalchemy.ext.asyncio"):
        # By module: importing SQLAlchemy's asyncio extension needs greenlet.
        raise UnsafeConnection(
            f"{type(conn).__name__} given: enqueue takes a synchronous Connection or "
            "Session; from async code, call it through run_sync, e.g. "
            "await session.run_sync(lambda s: outbox.enqueue(s, ...))"
        )
    else:
        raise UnsafeConnection(
            f"expected a SQLAlchemy Connection, Session or scoped_session, "
            f"got {type(conn).__name__}"
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
    # Keys and types hold no NUL (checked), nor do ids (hex digits and dashes)
    # and topics (checked): the one-pass text arrays fit them all. The
    # envelope's "id" is the id's text.
    return {
        "key_names": pg_text_array(list(per_key)),
        "key_counts": pg_int_array(per_key.values()),
        "key_available_ats": pg_array([_utc_text(first[k].available_at) for k in per_key])
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
        "available_ats": pg_array([_utc_text(e.available_at) for e in encoded])
        if delayed
        else None,
        "delays": pg_array([e.delay_seconds for e in encoded]) if deferred else None,
    }


def _utc_text(value: datetime | None) -> str | None:
    """``value`` as ISO 8601 text in UTC, an element for :func:`pg_array`.

    In UTC: PostgreSQL refuses some offsets Python allows (see ``check_available_at``).
    """
    return None if value is None else value.astimezone(UTC).isoformat()


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
