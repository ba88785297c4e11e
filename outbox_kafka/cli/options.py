"""Command-line options, each mirrored by an ``OUTBOX_*`` variable."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

from outbox_kafka.naming import TableNames
from outbox_kafka.relay.config import RelaySettings

#: What a command's handler is: the parsed arguments in, the exit status out.
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
    # argparse converts (and reports errors in) string defaults like command-line values.
    value = raw if raw not in (None, "") else default
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
    add_option(parser, "--table", help="outbox table name", default=RelaySettings.table)
    add_option(
        parser,
        "--db-schema",
        help="PostgreSQL schema of the outbox",
        default=RelaySettings.db_schema,
    )


def add_database_option(parser: argparse.ArgumentParser) -> None:
    add_option(
        parser,
        "--database-url",
        help="PostgreSQL URL, e.g. postgresql://user:pass@host/db; an application's "
        "postgresql+<driver>:// URL (+psycopg, +asyncpg, ...) works too: every command "
        "and the relay connect with psycopg2, so query parameters must be libpq's",
        secret=True,
    )


def add_output_flags(p: argparse.ArgumentParser, *, dry_run: str | None = None) -> None:
    p.add_argument(
        "--json", action="store_true", help="print JSON (keys as in docs/reference/cli.md)"
    )
    if dry_run is not None:
        p.add_argument("--dry-run", action="store_true", help=dry_run)


def names_from(args: argparse.Namespace) -> TableNames:
    return TableNames(table=args.table, schema=args.db_schema)
