"""The ``outbox-kafka`` command: one flag per setting, each mirrored by an ``OUTBOX_*`` variable."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from outbox_kafka.errors import OutboxError
from outbox_kafka.logs import redact
from outbox_kafka.version import __version__

from .check_command import add_check_parser
from .demo_command import add_demo_parser
from .dev_command import add_dev_parser
from .migrate_command import add_migrate_parser
from .operator_commands import add_operator_parsers
from .options import Handler
from .relay_command import add_relay_parser

__all__ = ["CLOSED_PIPE_EXIT", "build_parser", "main"]

#: The exit status when the reader of the output went away (``outbox-kafka stats | head``):
#: 128 + SIGPIPE, what a shell reports for a tool the signal ended.
CLOSED_PIPE_EXIT = 141


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox-kafka",
        description="Transactional outbox for PostgreSQL and Apache Kafka.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_migrate_parser(sub)
    add_relay_parser(sub)
    add_demo_parser(sub)
    add_dev_parser(sub)
    add_operator_parsers(sub)
    add_check_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` names; its exit status."""
    try:
        try:
            return _run(argv)
        finally:
            # Written here, not at interpreter exit, so that a closed pipe is caught below.
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped reading: stop quietly, as tools ended by SIGPIPE do.
        _discard_stdout()
        return CLOSED_PIPE_EXIT


def _run(argv: Sequence[str] | None) -> int:
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


def _discard_stdout() -> None:
    """Point stdout at the null device: what is still buffered would otherwise
    fail again, with a message, when Python flushes it on exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass  # stdout is no file (a test's capture): nothing is flushed to a pipe at exit
