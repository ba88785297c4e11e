"""The ``outbox-kafka`` command: one flag per setting, each mirrored by an ``OUTBOX_*`` variable."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .database import make_engine
from .errors import OutboxError
from .migrations import migrate, migration_script
from .naming import TableNames

Handler = Callable[[argparse.Namespace], int]


def env_name(flag: str) -> str:
    """``--database-url`` -> ``OUTBOX_DATABASE_URL``."""
    return "OUTBOX_" + flag.lstrip("-").replace("-", "_").upper()


def add_option(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    help: str,
    env: str | None = None,
    default: Any = None,
    type: Callable[[str], Any] = str,
    secret: bool = False,
    choices: Sequence[str] | None = None,
) -> None:
    """Add ``flag``, defaulting to its environment variable, and say so in ``--help``.

    Values from the environment never appear in ``--help``; defaults of secret
    options are not shown at all.
    """
    variable = env or env_name(flag)
    raw = os.environ.get(variable)
    value = type(raw) if raw not in (None, "") else default
    shown = "" if secret or default is None else f" (default: {default})"
    parser.add_argument(
        flag,
        default=value,
        type=type,
        choices=choices,
        help=f"{help}{shown} [env {variable}]",
        dest=flag.lstrip("-").replace("-", "_"),
    )


def add_flag(parser: argparse.ArgumentParser, flag: str, *, help: str) -> None:
    """A boolean switch, also set by its variable being ``1``/``true``/``yes``."""
    variable = env_name(flag)
    on = os.environ.get(variable, "").strip().lower() in {"1", "true", "yes", "on"}
    parser.add_argument(
        flag,
        action="store_true",
        default=on,
        help=f"{help} [env {variable}]",
        dest=flag.lstrip("-").replace("-", "_"),
    )


def add_table_options(parser: argparse.ArgumentParser) -> None:
    add_option(parser, "--table", help="outbox table name", default="outbox")
    add_option(parser, "--db-schema", help="PostgreSQL schema of the outbox", default="public")


def add_database_option(parser: argparse.ArgumentParser) -> None:
    add_option(
        parser,
        "--database-url",
        help="PostgreSQL URL, e.g. postgresql://user:pass@host/db",
        secret=True,
    )


def names_from(args: argparse.Namespace) -> TableNames:
    return TableNames(table=args.table, schema=args.db_schema)


def _cmd_migrate(args: argparse.Namespace) -> int:
    names = names_from(args)
    if args.print_sql:
        sys.stdout.write(migration_script(names))
        return 0
    if not args.database_url:
        raise OutboxError("no database URL given (--database-url or OUTBOX_DATABASE_URL)")
    engine = make_engine(args.database_url)
    try:
        result = migrate(engine, names)
    finally:
        engine.dispose()
    if result.applied:
        print(f"applied migrations {result.applied} to {names.qualified_events}")
    else:
        print(f"{names.qualified_events} is up to date (version {result.current})")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox-kafka",
        description="Transactional outbox for PostgreSQL and Apache Kafka.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("migrate", help="create or update the outbox tables")
    add_database_option(p)
    add_table_options(p)
    p.add_argument(
        "--print-sql",
        action="store_true",
        help="print the migration SQL for a DBA instead of running it",
    )
    p.set_defaults(handler=_cmd_migrate)

    p = sub.add_parser("demo", help="run the orders demo end to end on embedded services")
    p.set_defaults(handler=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except OutboxError as exc:
        print(f"outbox-kafka {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
