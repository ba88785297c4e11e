"""Writing encoded events to the outbox table, in the caller's transaction.

One event goes through the ``enqueue_one`` function where the session may call
it; a batch through the ``enqueue_many`` function, or else the ``enqueue``
statement. Nothing here commits, rolls back or begins a transaction.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Sequence
from datetime import UTC, datetime
from itertools import accumulate
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, scoped_session

from outbox_kafka.errors import DuplicateEventId, UnsafeConnection
from outbox_kafka.naming import TableNames
from outbox_kafka.producer.envelope import EncodedEvent
from outbox_kafka.schema.statements import (
    Queries,
    pg_array,
    pg_int_array,
    pg_text_array,
    queries_for,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session

    #: What enqueue_async writes through: an AsyncConnection, an AsyncSession, or
    #: an ``async_scoped_session``, on an async driver SQLAlchemy has (asyncpg,
    #: psycopg). Defined for type checkers only: the asyncio extension needs greenlet.
    AsyncConnectable: TypeAlias = AsyncConnection | AsyncSession | async_scoped_session[Any]

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

    @property
    def names(self) -> TableNames:
        """The tables (and functions) this writer writes to."""
        return self._names

    def write(
        self, conn: Connectable, encoded: list[EncodedEvent], chosen_ids: bool
    ) -> list[uuid.UUID]:
        """Write ``encoded`` in one statement; ``chosen_ids``: the caller gave event ids.

        The first write on a connection may cost one more round trip: the
        question :meth:`functions` asks.
        """
        connection = connection_of(conn)
        psycopg2 = connection.dialect.driver == "psycopg2"
        name, params = self.statement(encoded, self.functions(connection), literals=psycopg2)

        def execute() -> None:
            if psycopg2:
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
            if self.is_duplicate_id(exc.orig):
                raise duplicate_id_error() from None
            raise
        return [e.event_id for e in encoded]

    async def write_async(
        self, conn: AsyncConnectable, encoded: list[EncodedEvent], chosen_ids: bool
    ) -> list[uuid.UUID]:
        """:meth:`write` through an async connection: the same statements and checks.

        The synchronous write runs on the async connection's own driver
        connection (SQLAlchemy's ``run_sync``), so every guarantee of
        :meth:`write` holds as is; no statement blocks the event loop.
        """
        connection = await _async_connection_of(conn)
        return await connection.run_sync(self.write, encoded, chosen_ids)

    def statement(
        self, encoded: list[EncodedEvent], functions: EnqueueFunctions, *, literals: bool
    ) -> tuple[str, dict[str, Any]]:
        """The name of the statement that writes ``encoded``, and its parameters.

        ``literals``: bind arrays as array literals (psycopg2's fast path; see
        :func:`_enqueue_params`). For callers that execute on a driver's own
        cursor, with :meth:`driver_sql`.
        """
        if len(encoded) == 1 and functions.one:
            name, params = "enqueue_one", _enqueue_one_params(encoded[0])
        else:
            name = "enqueue_many_call" if functions.many else "enqueue"
            params = _enqueue_params(encoded, literals=literals)
        params.update(self._wake)
        return name, params

    def driver_sql(self, name: str) -> str:
        """Statement ``name`` in the ``%(name)s`` parameter style of psycopg2 and psycopg."""
        return self._queries.driver_sql(name)

    def is_duplicate_id(self, driver_error: BaseException | None) -> bool:
        """Whether a driver's unique violation is an event id already in the outbox.

        psycopg2 and psycopg give the constraint in ``diag``; asyncpg, as an
        attribute of the error that SQLAlchemy's adapter error was raised from.
        """
        wanted = f"{self._names.table}_pkey"
        for error in (driver_error, getattr(driver_error, "__cause__", None)):
            diag = getattr(error, "diag", None)
            found = getattr(diag, "constraint_name", None) or getattr(
                error, "constraint_name", None
            )
            if found is not None:
                return bool(found == wanted)
        return False

    def functions(self, connection: Connection) -> EnqueueFunctions:
        """Which enqueue functions this session may call (migrations 0003 and 0005).

        Asked once per driver connection, at most: an answer of both holds for
        the whole engine (kept in a weak set, so short-lived connections such
        as NullPool's do not ask again); any other is kept in the connection's
        ``info``, which lives as long as the pooled connection. Where a function
        is missing (tables made from :mod:`outbox_kafka.schema.metadata`, a database not
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
            self._queries["enqueue_function_callable"], self.functions_params()
        ).one()
        found = self.functions_from_row(row)
        if found == _BOTH:
            # For the engine's other connections too, however short-lived (NullPool).
            self._functions_callable_on.add(engine)
        else:
            connection.info[key] = found
        return found

    def functions_params(self) -> dict[str, str]:
        """The parameters of ``enqueue_function_callable``, the question :meth:`functions` asks."""
        names = self._names
        return {
            "signature": names.enqueue_one_signature,
            "batch_signature": names.enqueue_many_signature,
        }

    @staticmethod
    def functions_from_row(row: Sequence[Any]) -> EnqueueFunctions:
        """The answer of ``enqueue_function_callable``, from its one row (in column order)."""
        return EnqueueFunctions(bool(row[0]), bool(row[1]))


def duplicate_id_error() -> DuplicateEventId:
    return DuplicateEventId("event_id", "an event with this id is already in the outbox")


async def _async_connection_of(conn: object) -> AsyncConnection:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session

    if isinstance(conn, async_scoped_session):
        conn = conn()
    if isinstance(conn, AsyncSession):
        return await conn.connection()
    if isinstance(conn, AsyncConnection):
        return conn
    if isinstance(conn, Connection | Session | scoped_session):
        raise UnsafeConnection(
            f"{type(conn).__name__} given: enqueue_async and enqueue_many_async take an "
            "AsyncConnection or AsyncSession; with a synchronous Connection or Session, use "
            "enqueue(...) or enqueue_many(...)"
        )
    raise _not_sqlalchemy(
        conn, "expected a SQLAlchemy AsyncConnection, AsyncSession or async_scoped_session"
    )


def _not_sqlalchemy(conn: object, expected: str) -> UnsafeConnection:
    """The error for ``conn``, none of the SQLAlchemy objects ``expected`` names.

    Django's connections, cursors and their proxies (found by module, so that
    Django is never imported here) get a message that names the Django adapter.
    """
    kind = type(conn)
    if kind.__module__.partition(".")[0] == "django":
        return UnsafeConnection(
            f"{expected}, got {kind.__name__}, one of Django's database objects: with Django, "
            "call outbox_kafka.contrib.django.enqueue(...) or enqueue_many(...) inside "
            "transaction.atomic(); they write on Django's own connection, in its transaction"
        )
    return UnsafeConnection(f"{expected}, got {kind.__name__}")


def connection_of(conn: Connectable) -> Connection:
    if isinstance(conn, scoped_session):
        conn = conn()
    if isinstance(conn, Session):
        connection = conn.connection()
    elif isinstance(conn, Connection):
        connection = conn
    elif type(conn).__module__.startswith("sqlalchemy.ext.asyncio"):
        # By module: importing SQLAlchemy's asyncio extension needs greenlet.
        raise UnsafeConnection(
            f"{type(conn).__name__} given: enqueue and enqueue_many take a synchronous "
            "Connection or Session; with an AsyncConnection or AsyncSession, use "
            "await enqueue_async(...) or await enqueue_many_async(...)"
        )
    else:
        raise _not_sqlalchemy(conn, "expected a SQLAlchemy Connection, Session or scoped_session")
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


def _enqueue_params(encoded: list[EncodedEvent], *, literals: bool) -> dict[str, Any]:
    """The ``enqueue`` statement's parameters: per event, and per distinct key.

    ``literals``: arrays as PostgreSQL array literals (one string each, for
    psycopg2, see :func:`pg_array`); else as lists, which every driver binds
    as arrays (asyncpg accepts nothing else), with times as datetimes.
    """
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
    starts = list(accumulate(lengths[:-1], initial=1))
    key_times = [first[k].available_at for k in per_key] if delayed else None
    event_times = [e.available_at for e in encoded] if delayed else None
    key_delays = [first[k].delay_seconds for k in per_key] if deferred else None
    event_delays = [e.delay_seconds for e in encoded] if deferred else None
    # The envelope's "id" is the id's text.
    texts = {
        "key_names": list(per_key),
        "event_ids": [e.envelope["id"] for e in encoded],
        "ordering_keys": [e.key for e in encoded],
        "topics": [e.topic for e in encoded],
        "types": [e.type for e in encoded],
    }
    integers = {
        "key_counts": list(per_key.values()),
        "behind": behind,
        "value_starts": starts,
        "value_lengths": lengths,
    }
    params: dict[str, Any] = {
        "event_values": b"".join(values),
        "event_headers": "[" + ",".join([e.stored_headers for e in encoded]) + "]",
    }
    if not literals:
        params.update(texts)
        params.update(integers)
        params.update(
            key_available_ats=key_times,
            available_ats=event_times,
            key_delays=key_delays,
            delays=event_delays,
        )
        return params
    # Keys and types hold no NUL (checked), nor do ids (hex digits and dashes)
    # and topics (checked): the one-pass text arrays fit them all.
    params.update({name: pg_text_array(v) for name, v in texts.items()})
    params.update({name: pg_int_array(v) for name, v in integers.items()})
    params.update(
        key_available_ats=None if key_times is None else pg_array(list(map(_utc_text, key_times))),
        available_ats=None if event_times is None else pg_array(list(map(_utc_text, event_times))),
        key_delays=None if key_delays is None else pg_array(key_delays),
        delays=None if event_delays is None else pg_array(event_delays),
    )
    return params


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
