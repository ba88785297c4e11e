"""The outbox's schema: its tables, its named statements and its migrations.

- :mod:`~outbox_kafka.schema.metadata`: the tables as SQLAlchemy ``Table`` objects.
- :mod:`~outbox_kafka.schema.statements`: the named statements of ``sql/queries.sql``
  and the versioned migrations of ``sql/migrations``, rendered per outbox.
- :mod:`~outbox_kafka.schema.migrations`: applies the migrations, once, under a lock.
- :mod:`~outbox_kafka.schema.adoption`: adopts tables made without the migrations.
- ``current.sql``: the whole schema the migrations leave for the default outbox, in
  one file to read (a test checks that migrating an empty database ends equal to it).
"""
