"""The ``outbox-kafka`` command: one flag per setting, each mirrored by an ``OUTBOX_*`` variable."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .database import make_engine
from .errors import OutboxError
from .logs import configure_logging
from .migrations import migrate, migration_script
from .naming import TableNames
from .settings import (
    COMPRESSIONS,
    RelaySettings,
    kafka_config_from_env,
    kafka_config_from_file,
    parse_kafka_pair,
)

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


def _relay_settings(args: argparse.Namespace) -> RelaySettings:
    kafka = kafka_config_from_env()
    if args.kafka_config_file:
        kafka.update(kafka_config_from_file(args.kafka_config_file))
    for pair in args.kafka_config or []:
        key, value = parse_kafka_pair(pair)
        kafka[key] = value
    return RelaySettings(
        database_url=args.database_url or "",
        bootstrap_servers=args.bootstrap_servers or "",
        table=args.table,
        db_schema=args.db_schema,
        kafka_config=kafka,
        batch_size=args.batch_size,
        poll_interval=args.poll_interval,
        lease_seconds=args.lease_seconds,
        delivery_timeout_ms=args.delivery_timeout_ms,
        backoff_base=args.backoff_base,
        backoff_cap=args.backoff_cap,
        max_attempts=args.max_attempts,
        compression=args.compression,
        dead_letter_topic=args.dead_letter_topic or None,
        on_exhausted=args.on_exhausted,
        create_topics=args.create_topics,
        listen=not args.no_listen,
        shutdown_timeout=args.shutdown_timeout,
        retain_delivered_seconds=args.retain_delivered_days * 86400,
        retain_discarded_seconds=args.retain_discarded_days * 86400,
        purge_interval=args.purge_interval,
    )


def _cmd_relay(args: argparse.Namespace) -> int:
    from .relay import Relay

    configure_logging(args.log_format, args.log_level)
    settings = _relay_settings(args)
    relay = Relay(settings)
    signals_seen = 0

    def on_signal(signum: int, frame: object) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            # Second signal: leave now; leases hand the in-flight keys to another relay.
            os._exit(128 + signum)
        relay.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.drain:
        try:
            report = relay.drain()
        finally:
            relay.close()
        print(
            f"drained: {report.delivered} delivered, {report.discarded} discarded, "
            f"{report.retried} to retry, {report.leases_lost} leases lost"
        )
        return 0
    relay.run()
    return 0


def _add_relay_parser(sub: Any) -> None:
    p = sub.add_parser("relay", help="publish committed outbox events to Kafka")
    add_database_option(p)
    add_option(
        p,
        "--bootstrap-servers",
        env="OUTBOX_KAFKA_BOOTSTRAP_SERVERS",
        help="Kafka bootstrap servers, host:port[,host:port]",
    )
    p.add_argument(
        "--kafka-config",
        action="append",
        metavar="KEY=VALUE",
        help="any librdkafka setting, repeatable; also OUTBOX_KAFKA_CONFIG_<NAME> "
        "with dots as underscores, e.g. OUTBOX_KAFKA_CONFIG_SECURITY_PROTOCOL=SSL",
    )
    add_option(p, "--kafka-config-file", help="file of librdkafka key=value lines")
    add_table_options(p)
    add_option(p, "--batch-size", type=int, default=1000, help="events claimed per cycle")
    add_option(
        p, "--poll-interval", type=float, default=0.5, help="seconds between polls when idle"
    )
    add_option(p, "--lease-seconds", type=float, default=30.0, help="per-key lease length")
    add_option(
        p,
        "--delivery-timeout-ms",
        type=int,
        default=10_000,
        help="Kafka delivery timeout; must be at most 80%% of the lease",
    )
    add_option(p, "--backoff-base", type=float, default=0.5, help="first retry delay, seconds")
    add_option(p, "--backoff-cap", type=float, default=60.0, help="largest retry delay, seconds")
    add_option(p, "--max-attempts", type=int, default=50, help="sends before an event is discarded")
    add_option(
        p, "--compression", default="none", choices=COMPRESSIONS, help="Kafka compression codec"
    )
    add_option(p, "--dead-letter-topic", help="copy discarded events to this topic")
    add_option(
        p,
        "--on-exhausted",
        default="continue",
        choices=("continue", "park"),
        help="after a discard: let the key continue, or park it until requeued",
    )
    add_option(
        p, "--create-topics", type=int, help="create missing topics with this many partitions"
    )
    add_flag(p, "--no-listen", help="poll only; do not LISTEN for enqueue notifications")
    add_option(
        p, "--shutdown-timeout", type=float, default=30.0, help="seconds to finish on SIGTERM"
    )
    add_option(p, "--retain-delivered-days", type=float, default=7.0, help="keep delivered events")
    add_option(p, "--retain-discarded-days", type=float, default=90.0, help="keep discarded events")
    add_option(
        p, "--purge-interval", type=float, default=300.0, help="seconds between retention runs"
    )
    add_flag(p, "--drain", help="publish everything due, then exit 0")
    add_option(p, "--log-format", default="text", choices=("text", "json"), help="log format")
    add_option(p, "--log-level", default="INFO", help="log level")
    p.set_defaults(handler=_cmd_relay)


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

    _add_relay_parser(sub)

    p = sub.add_parser("demo", help="run the orders demo end to end on embedded services")
    add_option(p, "--orders", type=int, default=400, help="orders to create, pay and ship")
    add_option(p, "--writers", type=int, default=4, help="concurrent order-service threads")
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
