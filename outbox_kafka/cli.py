"""The ``outbox-kafka`` command: one flag per setting, each mirrored by an ``OUTBOX_*`` variable."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from outbox_kafka.database import make_engine
from outbox_kafka.errors import ConfigurationError, OutboxError
from outbox_kafka.limits import DEFAULT_MAX_CLAIM_BYTES
from outbox_kafka.logs import LOG_FORMATS, configure_logging, redact
from outbox_kafka.migrations import migrate, migration_script
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.settings import (
    COMPRESSIONS,
    RelaySettings,
    kafka_config_from_env,
    kafka_config_from_file,
    parse_kafka_pair,
)

from . import operations, reports

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from outbox_kafka.relay.http_server import ObservabilityServer
    from outbox_kafka.relay.loop import Relay

Handler = Callable[[argparse.Namespace], int]
#: Where ``relay`` serves /metrics, /healthz and /readyz unless told otherwise.
DEFAULT_METRICS_PORT = 9400
#: `relay --drain` ended with events still pending (the summary says why).
EXIT_WORK_LEFT = 3
DEFAULT_METRICS_HOST = "0.0.0.0"


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
        max_claim_bytes=args.max_claim_bytes,
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
        sample_interval=args.sample_interval,
    )


def _metrics_port(args: argparse.Namespace) -> int | None:
    """The port to serve /metrics, /healthz and /readyz on, or None for no server.

    ``relay`` serves on 9400 by default; ``relay --drain`` only when a port is
    given. Port 0 turns the server off.
    """
    port: int | None = args.metrics_port
    if port is None:
        port = None if args.drain else DEFAULT_METRICS_PORT
    if port is not None and not 0 <= port <= 65535:
        raise OutboxError(f"--metrics-port must be between 0 and 65535, got {port}")
    return port or None


def _start_server(relay: Relay, args: argparse.Namespace) -> ObservabilityServer | None:
    """Serve the relay's endpoints, if wanted.

    A port given explicitly must be free (else exit 2); the default port, when
    taken (several relays on one host), is skipped with a warning.
    """
    from outbox_kafka.relay.http_server import ObservabilityServer

    port = _metrics_port(args)
    if port is None:
        return None
    try:
        server = ObservabilityServer.for_relay(relay, host=args.metrics_host, port=port)
    except ConfigurationError as exc:
        if args.metrics_port is not None:
            raise
        logging.getLogger("outbox_kafka.cli").warning(
            "metrics and health endpoints not served: the default port is taken",
            extra={"action": "http_unavailable", "error": str(exc)},
        )
        return None
    return server.start()


def _cmd_relay(args: argparse.Namespace) -> int:
    from outbox_kafka.relay.loop import Relay

    settings = _relay_settings(args)
    configure_logging(args.log_format, args.log_level, secrets=settings.secret_values())
    _metrics_port(args)  # a bad port is refused before anything starts
    relay = Relay(settings)
    try:
        server = _start_server(relay, args)
    except BaseException:
        relay.close()
        raise
    try:
        return _run_relay(args, relay)
    finally:
        if server is not None:
            server.close()


def _run_relay(args: argparse.Namespace, relay: Relay) -> int:
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
            result = relay.drain_all(args.drain_timeout)
        finally:
            relay.close()
        print(result.summary())
        return 0 if result.complete else EXIT_WORK_LEFT
    relay.run()
    return 0


def _add_relay_parser(
    sub: Any, name: str = "relay", help: str = "publish committed outbox events to Kafka"
) -> argparse.ArgumentParser:
    """The relay's parser; ``check`` is built on it so it validates the same settings."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
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
        p,
        "--max-claim-bytes",
        type=int,
        default=DEFAULT_MAX_CLAIM_BYTES,
        help="bytes of event values and headers one claim reads at most (an event larger "
        "than this still goes, alone); bounds the relay's memory, see the README",
    )
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
    add_flag(
        p,
        "--drain",
        help="publish everything, waiting for what comes due within --drain-timeout "
        f"(other relays' leases, retries, delays); exit 0 when nothing is left pending, "
        f"{EXIT_WORK_LEFT} when something is (the summary says what and why)",
    )
    add_option(
        p,
        "--drain-timeout",
        type=float,
        default=120.0,
        help="with --drain: the longest wait for work to come due, seconds",
    )
    add_option(
        p,
        "--sample-interval",
        type=float,
        default=15.0,
        help="seconds between samples of the backlog gauges (pending, oldest age, parked keys)",
    )
    add_option(
        p,
        "--metrics-port",
        type=int,
        help="port for /metrics, /healthz and /readyz; 0 turns the server off "
        f"(default: {DEFAULT_METRICS_PORT}; with --drain: off unless given)",
    )
    add_option(
        p,
        "--metrics-host",
        default=DEFAULT_METRICS_HOST,
        help="address the metrics and health server listens on; 0.0.0.0 is every "
        "interface, 127.0.0.1 (or one interface's address) restricts it",
    )
    add_option(p, "--log-format", default="text", choices=LOG_FORMATS, help="log format")
    add_option(p, "--log-level", default="INFO", help="log level")
    p.set_defaults(handler=_cmd_relay)
    return p


def _cmd_demo(args: argparse.Namespace) -> int:
    from outbox_kafka.demo.run import run_demo

    return run_demo(args)


# --------------------------------------------------------------------------- operator commands
# Connection, table and limit options have OUTBOX_* variables like every
# setting. What an action applies to (selectors, --all, --dry-run) is taken
# from the command line only, so a leftover variable can never widen it.

_STATS_HELP = (
    "Counts by topic and status, the age of the oldest pending event, the key queue, parked "
    "keys (with the error of the event that parked each) and the latest discards, from one "
    "snapshot. Pending and discarded events are counted through their partial indexes; "
    "counting delivered events scans the whole table (about a third of a second per million "
    "rows), which --no-delivered skips."
)
_REQUEUE_HELP = (
    "Make discarded events pending again. Per key they go out in sequence order, before the "
    "key's later pending events. A parked key is unparked when the event that parked it is "
    "requeued (a selection with other events of a parked key but not that one is refused). "
    "An empty selection is refused; --all selects every discarded event."
)
_UNPARK_HELP = (
    "Let parked keys continue with their later events, skipping the event that parked each "
    "(it stays discarded and can still be requeued). --key selects keys; the other selectors "
    "select the event that parked the key. An empty selection is refused; --all selects every "
    "parked key."
)
_PURGE_HELP = (
    "Delete delivered and discarded events past their retention now, in batches, as the "
    "relay does every --purge-interval. Pending events are never deleted."
)
_CHECK_HELP = (
    "Check what a relay with these settings needs: the settings themselves (the same "
    "validation as relay; every relay flag and variable is accepted), the schemas, the "
    "database, the migrations and the Kafka brokers. One OK/FAIL line each; exit 0 only if "
    "all pass, 1 otherwise. With --consistency: the database, the migrations and the "
    "outbox's invariants (every pending event reachable by the key queue, counters ahead of "
    "every sequence number, queue rows and leases whole, discards with a reason), with each "
    "violation listed."
)


def _iso_time(value: str) -> datetime:
    """An ISO-8601 time or date for --since/--until; without an offset it is UTC."""
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an ISO-8601 time, e.g. 2026-03-01T12:00:00Z or 2026-03-01"
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def _add_output_flags(p: argparse.ArgumentParser, *, dry_run: str | None = None) -> None:
    p.add_argument("--json", action="store_true", help="print JSON (keys as in the README)")
    if dry_run is not None:
        p.add_argument("--dry-run", action="store_true", help=dry_run)


def _add_selectors(p: argparse.ArgumentParser, everything: str) -> None:
    g = p.add_argument_group(
        "selection",
        "command line only; different selectors combine with AND, "
        "repeated ones with OR; times are ISO-8601, UTC unless they carry an offset",
    )
    g.add_argument("--event-id", action="append", default=[], metavar="UUID", help="repeatable")
    g.add_argument("--key", action="append", default=[], help="ordering key, repeatable")
    g.add_argument(
        "--type", action="append", default=[], dest="types", metavar="TYPE", help="event type"
    )
    g.add_argument(
        "--topic", action="append", default=[], dest="topics", metavar="TOPIC", help="Kafka topic"
    )
    g.add_argument("--since", type=_iso_time, metavar="TIME", help="created at or after TIME")
    g.add_argument("--until", type=_iso_time, metavar="TIME", help="created before TIME")
    g.add_argument("--all", action="store_true", dest="everything", help=everything)


def _selection(args: argparse.Namespace) -> operations.Selection:
    return operations.Selection(
        event_ids=tuple(args.event_id),
        keys=tuple(args.key),
        types=tuple(args.types),
        topics=tuple(args.topics),
        since=args.since,
        until=args.until,
        everything=args.everything,
    )


def _operator_engine(args: argparse.Namespace, *, connect_timeout: float = 10.0) -> Engine:
    """An engine for one short command; the URL's password is masked in whatever it prints."""
    from outbox_kafka.database import url_secrets
    from outbox_kafka.logs import register_secrets

    url = args.database_url or ""
    register_secrets(url_secrets(url))
    return operations.short_command_engine(url, connect_timeout=connect_timeout)


def _emit(args: argparse.Namespace, document: dict[str, Any], text: str) -> None:
    out = json.dumps(document, indent=2, ensure_ascii=False) if args.json else text
    print(redact(out))


def _cmd_stats(args: argparse.Namespace) -> int:
    names = names_from(args)
    engine = _operator_engine(args)
    try:
        stats = operations.outbox_stats(
            engine,
            names,
            parked_limit=args.parked_limit,
            discard_limit=args.discard_limit,
            count_delivered=not args.no_delivered,
        )
    finally:
        engine.dispose()
    _emit(args, stats.as_dict(), reports.stats_text(stats))
    return 0


def _cmd_requeue(args: argparse.Namespace) -> int:
    names = names_from(args)
    selection = _selection(args)
    selection.require("discarded events")
    engine = _operator_engine(args)
    try:
        result = operations.requeue(engine, selection, names, dry_run=args.dry_run)
    finally:
        engine.dispose()
    _emit(args, result.as_dict(), reports.requeue_text(result, show=args.list_limit))
    return 0


def _cmd_unpark(args: argparse.Namespace) -> int:
    names = names_from(args)
    selection = _selection(args)
    selection.require("parked keys")
    engine = _operator_engine(args)
    try:
        result = operations.unpark(engine, selection, names, dry_run=args.dry_run)
    finally:
        engine.dispose()
    _emit(args, result.as_dict(), reports.unpark_text(result))
    return 0


def _cmd_purge(args: argparse.Namespace) -> int:
    names = names_from(args)
    engine = _operator_engine(args)
    try:
        result = operations.purge(
            engine,
            names,
            retain_delivered_seconds=args.retain_delivered_days * operations.DAY,
            retain_discarded_seconds=args.retain_discarded_days * operations.DAY,
            batch=args.purge_batch,
            dry_run=args.dry_run,
        )
    finally:
        engine.dispose()
    _emit(args, result.as_dict(), reports.purge_text(result))
    return 0


def _cmd_check_consistency(args: argparse.Namespace) -> int:
    from outbox_kafka.database import redact_url

    names = names_from(args)
    # Refuses a missing URL, and masks its password in whatever is printed.
    engine = _operator_engine(args, connect_timeout=args.check_timeout)
    try:
        results = list(
            operations.check_database(engine, names, shown_url=redact_url(args.database_url))
        )
        report = None
        if all(r.ok for r in results):
            report = operations.check_consistency(engine, names, limit=args.violation_limit)
    finally:
        engine.dispose()
    document: dict[str, Any] = {"checks": [r.as_dict() for r in results]}
    text = reports.check_text(results)
    ok = report is not None and report.ok
    if report is not None:
        document["consistency"] = report.as_dict()
        text += "\n" + reports.consistency_text(report)
    document["ok"] = ok
    _emit(args, document, text)
    return 0 if ok else 1


def _cmd_check(args: argparse.Namespace) -> int:
    from outbox_kafka.database import redact_url, url_secrets
    from outbox_kafka.logs import register_secrets

    if args.consistency:
        return _cmd_check_consistency(args)
    check = operations.CheckResult
    results: list[operations.CheckResult] = []
    register_secrets(url_secrets(args.database_url or ""))
    settings: RelaySettings | None = None
    try:
        settings = _relay_settings(args)
    except OutboxError as exc:
        results.append(check("settings", False, str(exc)))
    else:
        register_secrets(settings.secret_values())
        results.append(
            check(
                "settings",
                True,
                f"valid: table {settings.names.qualified_events}, lease "
                f"{settings.lease_seconds:g} s, delivery timeout "
                f"{settings.effective_delivery_timeout_ms} ms, on exhausted: "
                f"{settings.on_exhausted}",
            )
        )
    results.append(operations.check_schemas(args.schema_dir))

    timeout: float = args.check_timeout
    if not args.database_url:
        missing = "no database URL given (--database-url or OUTBOX_DATABASE_URL)"
        results.append(check("database", False, missing))
        results.append(check("migrations", False, "not checked: no database URL"))
    else:
        try:
            names = names_from(args)
            engine = _operator_engine(args, connect_timeout=timeout)
        except OutboxError as exc:
            results.append(check("database", False, str(exc)))
            results.append(check("migrations", False, "not checked: fix the settings first"))
        else:
            try:
                results.extend(
                    operations.check_database(
                        engine, names, shown_url=redact_url(args.database_url)
                    )
                )
            finally:
                engine.dispose()

    if settings is None:
        results.append(check("kafka", False, "not checked: fix the settings first"))
    else:
        topics = [settings.dead_letter_topic] if settings.dead_letter_topic else []
        results.extend(
            operations.check_kafka(
                settings.admin_config(),
                timeout=timeout,
                topics=topics,
                create_topics=settings.create_topics is not None,
                message_max_bytes=int(settings.producer_config()["message.max.bytes"]),
            )
        )
    ok = all(r.ok for r in results)
    document = {"ok": ok, "checks": [r.as_dict() for r in results]}
    _emit(args, document, reports.check_text(results))
    return 0 if ok else 1


def _add_operator_parsers(sub: Any) -> None:
    p = sub.add_parser("stats", help="what the outbox holds (scans to count delivered events)")
    p.description = _STATS_HELP
    add_database_option(p)
    add_table_options(p)
    add_option(p, "--parked-limit", type=int, default=10, help="parked keys to list")
    add_option(p, "--discard-limit", type=int, default=10, help="latest discards to list")
    add_flag(p, "--no-delivered", help="do not count delivered events (skips the table scan)")
    _add_output_flags(p)
    p.set_defaults(handler=_cmd_stats)

    p = sub.add_parser("requeue", help="send discarded events again, in key order")
    p.description = _REQUEUE_HELP
    add_database_option(p)
    add_table_options(p)
    _add_selectors(p, "every discarded event (instead of selectors)")
    add_option(p, "--list-limit", type=int, default=50, help="events listed in the text output")
    _add_output_flags(p, dry_run="show what would be requeued; change nothing")
    p.set_defaults(handler=_cmd_requeue)

    p = sub.add_parser("unpark", help="let parked keys continue past the event that parked them")
    p.description = _UNPARK_HELP
    add_database_option(p)
    add_table_options(p)
    _add_selectors(p, "every parked key (instead of selectors)")
    _add_output_flags(p, dry_run="show what would be unparked; change nothing")
    p.set_defaults(handler=_cmd_unpark)

    p = sub.add_parser("purge", help="delete delivered and discarded events past retention")
    p.description = _PURGE_HELP
    add_database_option(p)
    add_table_options(p)
    add_option(
        p,
        "--retain-delivered-days",
        type=float,
        default=operations.DEFAULT_RETAIN_DELIVERED_SECONDS / operations.DAY,
        help="keep delivered events this long (as relay)",
    )
    add_option(
        p,
        "--retain-discarded-days",
        type=float,
        default=operations.DEFAULT_RETAIN_DISCARDED_SECONDS / operations.DAY,
        help="keep discarded events this long (as relay)",
    )
    add_option(
        p,
        "--purge-batch",
        type=int,
        default=operations.DEFAULT_PURGE_BATCH,
        help="events deleted per transaction",
    )
    _add_output_flags(p, dry_run="count what would be deleted; delete nothing")
    p.set_defaults(handler=_cmd_purge)

    p = _add_relay_parser(sub, "check", help="check settings, database, migrations and Kafka")
    p.description = _CHECK_HELP
    add_option(
        p,
        "--schema-dir",
        help="also compile the payload schemas (<type>.json) of this directory",
    )
    add_option(
        p,
        "--check-timeout",
        type=float,
        default=10.0,
        help="seconds to wait for the database and for Kafka metadata",
    )
    p.add_argument(
        "--consistency",
        action="store_true",
        help="check the outbox's own invariants instead (database only: no relay settings "
        "or Kafka needed); lists every violation with its key and event; exit 1 on any",
    )
    p.add_argument(
        "--violation-limit",
        type=int,
        default=100,
        help="with --consistency: violations listed per check",
    )
    _add_output_flags(p)
    p.set_defaults(handler=_cmd_check)


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

    _add_operator_parsers(sub)
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


if __name__ == "__main__":
    raise SystemExit(main())
