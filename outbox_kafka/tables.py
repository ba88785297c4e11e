"""Moved: the outbox's SQLAlchemy tables live in :mod:`outbox_kafka.schema.metadata`.

This path (``outbox_kafka.tables.metadata`` in an Alembic ``env.py``, say) keeps
working for one release as a plain re-export of the same objects.
"""

from __future__ import annotations

from outbox_kafka.schema.metadata import (
    OutboxTables,
    build_tables,
    metadata,
    outbox_arrivals,
    outbox_events,
    outbox_floors,
    outbox_key_seq,
    outbox_keys,
    outbox_migrations,
)

__all__ = [
    "OutboxTables",
    "build_tables",
    "metadata",
    "outbox_arrivals",
    "outbox_events",
    "outbox_floors",
    "outbox_key_seq",
    "outbox_keys",
    "outbox_migrations",
]
