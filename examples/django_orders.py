"""Enqueue from Django: an order and its event in one ``transaction.atomic()`` block.

Against a database the outbox is migrated in (``outbox-kafka migrate --database-url
"$DATABASE_URL"``)::

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test python examples/django_orders.py

Configures Django from ``DATABASE_URL``, creates a ``django_example_orders`` table, writes
an order and its event in one atomic block, shows that an event outside
``transaction.atomic()`` is refused, and prints what was stored.
"""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any
from urllib.parse import unquote, urlsplit

import django
from django.conf import settings
from django.db import connection, transaction

import outbox_kafka
from outbox_kafka.contrib import django as outbox


def database_settings(url: str) -> dict[str, Any]:
    """Django's ``DATABASES`` entry for a ``postgresql://user:password@host:port/name`` URL."""
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }


def place_order(order_id: str, total_cents: int) -> uuid.UUID:
    """The order row and its event: both committed at the end of the block, or neither."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO django_example_orders (id, total_cents) VALUES (%s, %s)",
                [order_id, total_cents],
            )
        return outbox.enqueue(
            type="order.created",
            key=order_id,
            data={"order_id": order_id, "total_cents": total_cents},
        )


def main() -> None:
    url = os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("set DATABASE_URL, e.g. postgresql://postgres@127.0.0.1:5432/test")
    settings.configure(
        DATABASES={"default": database_settings(url)}, INSTALLED_APPS=[], USE_TZ=True
    )
    django.setup()
    outbox_kafka.configure(
        outbox_kafka.Outbox(source="//shop/django-orders", routes={"order.*": "orders"})
    )
    with connection.cursor() as cursor:  # autocommit: the table is there for good
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS django_example_orders "
            "(id text PRIMARY KEY, total_cents integer NOT NULL)"
        )

    order_id = f"o-{uuid.uuid4().hex[:8]}"
    event_id = place_order(order_id, 1250)
    print(f"order {order_id} committed with event {event_id}")

    try:
        outbox.enqueue(type="order.paid", key=order_id, data={"order_id": order_id})
    except outbox_kafka.UnsafeConnection as exc:
        print(f"refused: {exc}")

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT event_id, ordering_key, seq, topic, type, status FROM outbox "
            "WHERE ordering_key = %s ORDER BY seq",
            [order_id],
        )
        for row in cursor.fetchall():
            print("stored:", dict(zip([c.name for c in cursor.description], row, strict=True)))
    connection.close()


if __name__ == "__main__":
    main()
