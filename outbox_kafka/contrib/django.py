"""Enqueue on Django's own database connection, in the transaction of ``transaction.atomic()``.

Django hands out no SQLAlchemy connection, and ``outbox_kafka.enqueue`` refuses Django's.
This module writes the same statements, with the events encoded by the same
:class:`~outbox_kafka.Outbox`, through a cursor of ``django.db.connections[using]``::

    from django.db import transaction
    from outbox_kafka.contrib import django as outbox

    with transaction.atomic():
        order = Order.objects.create(id="o-1", total_cents=1250)
        outbox.enqueue(type="order.created", key=order.id, data={"order_id": order.id})
    # committed: the order and its event; an exception in the block: neither

It never commits, rolls back or closes anything of Django's: the event commits or rolls
back with the atomic block around it. Importing this module imports Django; nothing else
in :mod:`outbox_kafka` does.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, IntegrityError, connections, transaction

from outbox_kafka.errors import UnsafeConnection
from outbox_kafka.producer.envelope import EncodedEvent
from outbox_kafka.producer.event import Event
from outbox_kafka.producer.event_checks import HeadersInput
from outbox_kafka.producer.extensions import ExtensionValue
from outbox_kafka.producer.outbox import Outbox, default_outbox
from outbox_kafka.producer.writing import EnqueueFunctions, duplicate_id_error

__all__ = ["enqueue", "enqueue_many"]


def enqueue(
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
    using: str = "default",
    outbox: Outbox | None = None,
) -> uuid.UUID:
    """Write one event in the transaction of Django's connection ``using``; return its id.

    The arguments and guarantees of :meth:`outbox_kafka.Outbox.enqueue`, on ``outbox``
    (default: :func:`outbox_kafka.default_outbox`). The connection must be inside
    ``transaction.atomic()`` (or a view under ``ATOMIC_REQUESTS``): else the event would
    be committed on its own, and :class:`~outbox_kafka.UnsafeConnection` is raised.
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
    return _enqueue(default_outbox() if outbox is None else outbox, [event], using)[0]


def enqueue_many(
    events: Iterable[Event | Mapping[str, Any]],
    *,
    using: str = "default",
    outbox: Outbox | None = None,
) -> list[uuid.UUID]:
    """Write a batch of events in one statement, as :meth:`outbox_kafka.Outbox.enqueue_many`,
    in the transaction of Django's connection ``using``; ids in the order given."""
    return _enqueue(default_outbox() if outbox is None else outbox, events, using)


def _enqueue(
    outbox: Outbox, events: Iterable[Event | Mapping[str, Any]], using: str
) -> list[uuid.UUID]:
    """Validate and encode every event, then write them; count a failure as the core API does."""
    try:
        encoded, chosen_ids = outbox._encode_batch(events)
        if not encoded:
            return []
        return _write(outbox, _atomic_connection(using), encoded, chosen_ids, using)
    except DatabaseError as exc:
        outbox.producer_metrics.enqueue_failed(exc, "database")
        raise
    except Exception as exc:
        outbox.producer_metrics.enqueue_failed(exc)
        raise


def _atomic_connection(using: str) -> Any:
    """Django's connection ``using``, refused unless it is PostgreSQL inside an atomic block."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        raise UnsafeConnection(
            f"the Django database {using!r} is {connection.vendor}: the outbox is a set of "
            "PostgreSQL tables, written on a PostgreSQL connection only"
        )
    if not connection.in_atomic_block:
        raise UnsafeConnection(
            f"the Django connection {using!r} is not inside transaction.atomic(): in autocommit "
            "mode the event would be committed on its own, whatever becomes of the rest of the "
            f"work; enqueue inside `with transaction.atomic(using={using!r}):` (or a view under "
            "ATOMIC_REQUESTS)"
        )
    return connection


def _write(
    outbox: Outbox, connection: Any, encoded: list[EncodedEvent], chosen_ids: bool, using: str
) -> list[uuid.UUID]:
    """Write ``encoded`` in one statement on a cursor of ``connection``, in its transaction."""
    writer = outbox.writer
    with connection.cursor() as cursor:
        functions = _functions(outbox, connection, cursor)
        # Array literals: one string each, which both of Django's PostgreSQL drivers bind
        # as they are (psycopg 3 binds on the client by default in Django).
        name, params = writer.statement(encoded, functions, literals=True)
        sql = writer.driver_sql(name)
        if not chosen_ids:
            cursor.execute(sql, params)
            return [e.event_id for e in encoded]
        # Caller-chosen ids may collide; a savepoint keeps a collision from spoiling the
        # caller's transaction (Django marks an atomic block whose statement failed).
        try:
            with transaction.atomic(using=using):
                cursor.execute(sql, params)
        except IntegrityError as exc:
            # Django raises its IntegrityError from the driver's.
            if writer.is_duplicate_id(exc.__cause__):
                raise duplicate_id_error() from None
            raise
    return [e.event_id for e in encoded]


_answers_lock = threading.Lock()
#: Per Django connection object (one alias in one thread; it outlives reconnects): the
#: outboxes, by function signature, whose functions both were callable, as
#: :meth:`OutboxWriter.functions` keeps that answer for a whole engine.
_both_callable: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
#: Per DB-API connection: any other answer, asked again after a reconnect (the database
#: may have been migrated since).
_other_answers: weakref.WeakKeyDictionary[Any, dict[str, EnqueueFunctions]] = (
    weakref.WeakKeyDictionary()
)


def _functions(outbox: Outbox, connection: Any, cursor: Any) -> EnqueueFunctions:
    """Which enqueue functions this session may call: the question of
    :meth:`OutboxWriter.functions`, asked on Django's cursor."""
    signature = outbox.names.enqueue_one_signature
    driver_connection = connection.connection
    with _answers_lock:
        if signature in _both_callable.get(connection, ()):
            return EnqueueFunctions(True, True)
        known = _other_answers.get(driver_connection, {}).get(signature)
    if known is not None:
        return known
    writer = outbox.writer
    cursor.execute(writer.driver_sql("enqueue_function_callable"), writer.functions_params())
    found = writer.functions_from_row(cursor.fetchone())
    with _answers_lock:
        if all(found):
            _both_callable.setdefault(connection, set()).add(signature)
        else:
            _other_answers.setdefault(driver_connection, {})[signature] = found
    return found
