"""``outbox-kafka migrate``: create or update the outbox tables, or print their SQL."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from outbox_kafka.database import NO_DATABASE_URL, make_engine
from outbox_kafka.errors import OutboxError
from outbox_kafka.schema.adoption import adopt
from outbox_kafka.schema.migrations import migrate, migration_script

from .options import add_database_option, add_table_options, names_from


def _cmd_migrate(args: argparse.Namespace) -> int:
    names = names_from(args)
    if args.print_sql:
        sys.stdout.write(migration_script(names))
        return 0
    if not args.database_url:
        raise OutboxError(NO_DATABASE_URL)
    engine = make_engine(args.database_url)
    try:
        result = adopt(engine, names) if args.adopt else migrate(engine, names)
    finally:
        engine.dispose()
    if result.applied and args.adopt:
        print(f"adopted {names.qualified_events}: recorded migrations {result.applied}")
    elif result.applied:
        print(f"applied migrations {result.applied} to {names.qualified_events}")
    else:
        print(f"{names.qualified_events} is up to date (version {result.current})")
    return 0


def add_migrate_parser(sub: Any) -> None:
    p = sub.add_parser("migrate", help="create or update the outbox tables")
    add_database_option(p)
    add_table_options(p)
    p.add_argument(
        "--print-sql",
        action="store_true",
        help="print the migration SQL for a DBA instead of running it",
    )
    p.add_argument(
        "--adopt",
        action="store_true",
        help="adopt tables made without migrate (from outbox_kafka.schema.metadata, by "
        "Alembic say): check they have the current shape, add the storage settings and "
        "functions, record the migrations; refused, listing the differences, otherwise",
    )
    p.set_defaults(handler=_cmd_migrate)
