"""The outbox in a project whose own schema is managed with Alembic.

Two pieces. In a revision of the project's own history, ``upgrade_outbox``
applies the outbox's migrations in Alembic's transaction::

    from alembic import op
    from outbox_kafka.contrib.alembic import upgrade_outbox

    def upgrade() -> None:
        upgrade_outbox(op)                      # or upgrade_outbox(op, TableNames(...))

The pending migrations of the outbox run on the revision's connection and
commit with it; a revision that fails takes them back with it. Running it
again, or ``outbox-kafka migrate`` before or after, applies each migration
once. A later release's migrations arrive by a new revision calling it again.

In ``env.py``, ``outbox_include_object`` keeps autogenerate from writing the
migrations' work into the project's own revisions::

    context.configure(
        connection=connection,
        target_metadata=[Base.metadata, outbox_kafka.schema.metadata.metadata],
        include_object=outbox_include_object(connection),
    )

Autogenerate then never creates or drops an outbox's table (the migrations
do), and compares the outbox's tables with the metadata only while the
database holds exactly this package's migrations, so drift in a migrated
outbox is still reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection

from outbox_kafka.naming import TableNames
from outbox_kafka.schema.migrations import MigrationResult, applied_versions, apply_migrations
from outbox_kafka.schema.statements import raw_migrations

__all__ = ["IncludeObject", "outbox_include_object", "upgrade_outbox"]

#: Alembic's ``include_object`` hook: ``(object, name, type_, reflected, compare_to) -> bool``.
IncludeObject = Callable[[Any, str | None, str, bool, Any], bool]


def upgrade_outbox(op: Any, names: TableNames | None = None) -> MigrationResult:
    """Apply the outbox's pending migrations on ``op``'s connection, in its transaction.

    ``op`` is ``alembic.op`` (or anything with ``get_bind()``), or a SQLAlchemy
    ``Connection``. Needs no import of Alembic itself.
    """
    conn = op if isinstance(op, Connection) else op.get_bind()
    if not isinstance(conn, Connection):
        raise TypeError(f"upgrade_outbox needs alembic.op or a Connection, got {type(op).__name__}")
    return apply_migrations(conn, names)


def outbox_include_object(
    connection: Connection,
    *outboxes: TableNames,
    include_object: IncludeObject | None = None,
) -> IncludeObject:
    """An ``include_object`` for ``context.configure`` that leaves the outbox to its migrations.

    ``connection`` is the one handed to ``context.configure``; ``outboxes``
    are the outboxes whose tables are in ``target_metadata`` (the default
    outbox, ``TableNames()``, when none is given); ``include_object`` is the
    project's own hook, asked about everything this one lets through.

    With it, autogenerate never proposes to create or drop an outbox's table,
    whatever the order of the project's revisions: ``upgrade_outbox`` or
    ``outbox-kafka migrate`` makes them. A table of the outbox that exists is
    compared with the metadata (columns, indexes, constraints) when the
    outbox's recorded migrations are exactly this package's, and left alone
    otherwise, since the differences are then the work of the migrations not
    yet applied (or of a newer release's). The database is read once, at the
    first comparison, inside the autogenerate run's own transaction.
    """
    if not isinstance(connection, Connection):
        raise TypeError(
            "outbox_include_object needs the SQLAlchemy Connection handed to "
            f"context.configure, got {type(connection).__name__}"
        )
    for names in outboxes:
        if not isinstance(names, TableNames):
            raise TypeError(
                "outbox_include_object takes the outboxes as TableNames(table=..., schema=...), "
                f"got {names!r}"
            )
    if include_object is not None and not callable(include_object):
        raise TypeError(
            f"include_object must be a function, as Alembic's is, got {include_object!r}"
        )
    owners: dict[tuple[str | None, str], TableNames] = {}
    for names in outboxes or (TableNames(),):
        for table in (
            names.events,
            names.keys,
            names.seqs,
            names.arrivals,
            names.floors,
            names.versions,
        ):
            owners[(names.schema, table)] = names
    released = {m.version for m in raw_migrations()}
    current: dict[TableNames, bool] = {}

    def is_current(names: TableNames) -> bool:
        if names not in current:
            current[names] = applied_versions(connection, names) == released
        return current[names]

    def include(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        if type_ == "table" and name is not None:
            # Alembic names a table of the connection's default schema without a schema.
            schema: str | None = obj.schema or connection.dialect.default_schema_name
            names = owners.get((schema, name))
            if names is not None and (compare_to is None or not is_current(names)):
                return False
        return include_object is None or include_object(obj, name, type_, reflected, compare_to)

    return include
