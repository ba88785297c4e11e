"""The ``outbox-kafka`` command: one flag per setting, each mirrored by an ``OUTBOX_*`` variable."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from outbox_kafka.errors import OutboxError
from outbox_kafka.logs import redact

from .check_command import add_check_parser
from .demo_command import add_demo_parser
from .dev_command import add_dev_parser
from .migrate_command import add_migrate_parser
from .operator_commands import add_operator_parsers
from .options import Handler
from .relay_command import add_relay_parser

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox-kafka",
        description="Transactional outbox for PostgreSQL and Apache Kafka.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_migrate_parser(sub)
    add_relay_parser(sub)
    add_demo_parser(sub)
    add_dev_parser(sub)
    add_operator_parsers(sub)
    add_check_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except OutboxError as exc:
        print(redact(f"outbox-kafka {args.command}: error: {exc}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
