"""Apply this package's migrations from an Alembic revision, in Alembic's transaction.

In a revision of the project's own Alembic history::

    from alembic import op
    from outbox_kafka.contrib.alembic import upgrade_outbox

    def upgrade() -> None:
        upgrade_outbox(op)                      # or upgrade_outbox(op, TableNames(...))

The pending migrations of the outbox run on the revision's connection and
commit with it; a revision that fails takes them back with it. Running it
again, or ``outbox-kafka migrate`` before or after, applies each migration
once. A later release's migrations arrive by a new revision calling it again.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

from outbox_kafka.migrations import MigrationResult, apply_migrations
from outbox_kafka.naming import TableNames

__all__ = ["upgrade_outbox"]


def upgrade_outbox(op: Any, names: TableNames | None = None) -> MigrationResult:
    """Apply the outbox's pending migrations on ``op``'s connection, in its transaction.

    ``op`` is ``alembic.op`` (or anything with ``get_bind()``), or a SQLAlchemy
    ``Connection``. Needs no import of Alembic itself.
    """
    conn = op if isinstance(op, Connection) else op.get_bind()
    if not isinstance(conn, Connection):
        raise TypeError(f"upgrade_outbox needs alembic.op or a Connection, got {type(op).__name__}")
    return apply_migrations(conn, names)
