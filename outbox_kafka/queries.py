"""Moved to :mod:`outbox_kafka.schema.statements`; re-exported here until the relay imports
it from there."""

from __future__ import annotations

from outbox_kafka.schema.statements import (
    Migration,
    Queries,
    millis,
    pg_array,
    pg_int_array,
    pg_text_array,
    queries_for,
    raw_migrations,
    raw_queries,
    render,
)

__all__ = [
    "Migration",
    "Queries",
    "millis",
    "pg_array",
    "pg_int_array",
    "pg_text_array",
    "queries_for",
    "raw_migrations",
    "raw_queries",
    "render",
]
