"""SQLAlchemy ``Table`` objects for the outbox, for Alembic autogenerate.

The migrations in ``sql/migrations`` are the source of truth; these objects
describe the same schema (a test checks that both agree) so projects managing
their schema with Alembic can include ``outbox_kafka.schema.metadata.metadata``
(or ``outbox_kafka.tables.metadata``, its older path) in their ``target_metadata``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    Text,
    Uuid,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from outbox_kafka.naming import TableNames


@dataclass(frozen=True)
class OutboxTables:
    """The tables of one outbox, on one ``MetaData``: its five, and its migrations table."""

    metadata: MetaData
    events: Table
    keys: Table
    seqs: Table
    arrivals: Table
    floors: Table
    versions: Table


def build_tables(names: TableNames | None = None, metadata: MetaData | None = None) -> OutboxTables:
    """Describe an outbox's tables on ``metadata`` (a new one by default)."""
    names = names or TableNames()
    md = metadata if metadata is not None else MetaData()
    schema = names.schema
    now = func.now()
    events = Table(
        names.events,
        md,
        Column("event_id", Uuid, primary_key=True),
        Column("ordering_key", Text, nullable=False),
        Column("seq", BigInteger, nullable=False),
        Column("topic", Text, nullable=False),
        Column("type", Text, nullable=False),
        Column("value", LargeBinary, nullable=False),
        Column("headers", JSONB, nullable=False, server_default=text("'[]'")),
        Column("status", Text, nullable=False, server_default=text("'pending'")),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("available_at", DateTime(timezone=True), nullable=False, server_default=now),
        Column("claim_token", Uuid),
        Column("delivered_at", DateTime(timezone=True)),
        Column("kafka_partition", Integer),
        Column("kafka_offset", BigInteger),
        Column("last_error", Text),
        Column(
            "created_at",
            DateTime(timezone=True),
            nullable=False,
            server_default=func.clock_timestamp(),
        ),
        CheckConstraint(
            "status IN ('pending', 'delivered', 'discarded')", name=f"{names.table}_status_check"
        ),
        CheckConstraint("attempts >= 0", name=f"{names.table}_attempts_check"),
        Index(
            f"{names.table}_claim_idx",
            "ordering_key",
            "seq",
            unique=True,
            postgresql_where=text("status = 'pending'"),
        ),
        Index(
            f"{names.table}_delivered_idx",
            "delivered_at",
            postgresql_where=text("status = 'delivered'"),
        ),
        Index(
            f"{names.table}_discarded_idx",
            "created_at",
            postgresql_where=text("status = 'discarded'"),
        ),
        schema=schema,
    )
    seqs = Table(
        names.seqs,
        md,
        Column("ordering_key", Text, primary_key=True),
        Column("last_seq", BigInteger, nullable=False),
        schema=schema,
    )
    keys = Table(
        names.keys,
        md,
        Column("ordering_key", Text, primary_key=True),
        Column("next_seq", BigInteger, nullable=False),
        Column("due_at", DateTime(timezone=True), nullable=False, server_default=now),
        Column("claim_token", Uuid),
        Column("lease_expires_at", DateTime(timezone=True)),
        Column("parked_at", DateTime(timezone=True)),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=now),
        Column("claim_session", Uuid),
        Column("doubt_sessions", ARRAY(Uuid)),
        Column("doubt_until_seq", BigInteger),
        Index(f"{names.keys}_due_idx", "due_at", postgresql_where=text("parked_at IS NULL")),
        schema=schema,
    )
    arrivals = Table(
        names.arrivals,
        md,
        Column("ordering_key", Text, primary_key=True),
        Column("first_seq", BigInteger, nullable=False),
        Column("due_at", DateTime(timezone=True), nullable=False, server_default=now),
        schema=schema,
    )
    floors = Table(
        names.floors,
        md,
        Column("session", Uuid, primary_key=True),
        Column("topic", Text, primary_key=True),
        Column("kafka_partition", Integer, primary_key=True, autoincrement=False),
        Column("partitions", Integer, nullable=False),
        Column("floor_offset", BigInteger, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=now),
        schema=schema,
    )
    # The migrations applied (``outbox-kafka migrate``): here so that Alembic's
    # autogenerate, with this metadata as its target, does not propose dropping it.
    versions = Table(
        names.versions,
        md,
        Column("version", Integer, primary_key=True, autoincrement=False),
        Column("name", Text, nullable=False),
        Column("applied_at", DateTime(timezone=True), nullable=False, server_default=now),
        schema=schema,
    )
    return OutboxTables(
        metadata=md,
        events=events,
        keys=keys,
        seqs=seqs,
        arrivals=arrivals,
        floors=floors,
        versions=versions,
    )


_default = build_tables()
#: MetaData holding the default outbox (table ``outbox`` in schema ``public``).
metadata = _default.metadata
outbox_events = _default.events
outbox_keys = _default.keys
outbox_key_seq = _default.seqs
outbox_arrivals = _default.arrivals
outbox_floors = _default.floors
outbox_migrations = _default.versions
