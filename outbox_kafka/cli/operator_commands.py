"""``outbox-kafka stats``, ``requeue``, ``unpark``, ``purge`` and ``check --consistency``.

Connection, table and limit options have ``OUTBOX_*`` variables like every
setting. What an action applies to (selectors, ``--all``, ``--dry-run``) is
taken from the command line only, so a leftover variable can never widen it.
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from outbox_kafka import operations
from outbox_kafka.database import redact_url, short_command_engine, url_secrets
from outbox_kafka.logs import register_secrets
from outbox_kafka.relay.config import SECONDS_PER_DAY

from . import output
from .options import (
    add_database_option,
    add_flag,
    add_option,
    add_output_flags,
    add_table_options,
    names_from,
)

if TYPE_CHECKING:
    from sqlalchemy import Engine

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


def _iso_time(value: str) -> datetime:
    """An ISO-8601 time or date for --since/--until; without an offset it is UTC."""
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an ISO-8601 time, e.g. 2026-03-01T12:00:00Z or 2026-03-01"
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def _add_selectors(p: argparse.ArgumentParser, everything: str) -> None:
    g = p.add_argument_group(
        "selection",
        "command line only; different selectors combine with AND, "
        "repeated ones with OR; times are ISO-8601, UTC unless they carry an offset",
    )
    g.add_argument("--event-id", action="append", default=[], metavar="UUID", help="repeatable")
    g.add_argument("--key", action="append", default=[], help="ordering key, repeatable")
    g.add_argument(
        "--type",
        action="append",
        default=[],
        dest="types",
        metavar="TYPE",
        help="event type, repeatable",
    )
    g.add_argument(
        "--topic",
        action="append",
        default=[],
        dest="topics",
        metavar="TOPIC",
        help="Kafka topic, repeatable",
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


def operator_engine(args: argparse.Namespace, *, connect_timeout: float = 10.0) -> Engine:
    """An engine for one short command; the URL's password is masked in whatever it prints."""
    url = args.database_url or ""
    register_secrets(url_secrets(url))
    return short_command_engine(url, connect_timeout=connect_timeout)


def _cmd_stats(args: argparse.Namespace) -> int:
    names = names_from(args)
    engine = operator_engine(args)
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
    output.emit(args, stats.as_dict(), output.stats_text(stats))
    return 0


def _cmd_requeue(args: argparse.Namespace) -> int:
    names = names_from(args)
    selection = _selection(args)
    selection.require("discarded events")
    engine = operator_engine(args)
    try:
        result = operations.requeue(engine, selection, names, dry_run=args.dry_run)
    finally:
        engine.dispose()
    output.emit(args, result.as_dict(), output.requeue_text(result, show=args.list_limit))
    return 0


def _cmd_unpark(args: argparse.Namespace) -> int:
    names = names_from(args)
    selection = _selection(args)
    selection.require("parked keys")
    engine = operator_engine(args)
    try:
        result = operations.unpark(engine, selection, names, dry_run=args.dry_run)
    finally:
        engine.dispose()
    output.emit(args, result.as_dict(), output.unpark_text(result))
    return 0


def _cmd_purge(args: argparse.Namespace) -> int:
    names = names_from(args)
    engine = operator_engine(args)
    try:
        result = operations.purge(
            engine,
            names,
            retain_delivered_seconds=args.retain_delivered_days * SECONDS_PER_DAY,
            retain_discarded_seconds=args.retain_discarded_days * SECONDS_PER_DAY,
            batch=args.purge_batch,
            dry_run=args.dry_run,
        )
    finally:
        engine.dispose()
    output.emit(args, result.as_dict(), output.purge_text(result))
    return 0


def cmd_check_consistency(args: argparse.Namespace) -> int:
    """``check --consistency``: the database, the migrations, then the outbox's invariants."""
    names = names_from(args)
    # Refuses a missing URL, and masks its password in whatever is printed.
    engine = operator_engine(args, connect_timeout=args.check_timeout)
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
    text = output.check_text(results, report)
    ok = report is not None and report.ok
    if report is not None:
        document["consistency"] = report.as_dict()
    document["ok"] = ok
    output.emit(args, document, text)
    return 0 if ok else 1


_LOG_SETUP_HELP = (
    "For the log mode (producers with Outbox(write_to='log'), relay --source log): make the "
    "outbox's publication and replication slot where missing, and revoke "
    "pg_logical_emit_message from PUBLIC so that no other role can put events into the log. "
    "Needs wal_level = logical, a role with REPLICATION for the slot, and a superuser for "
    "the revoke (else a warning). A lost slot is reported, never made again."
)


def _cmd_log_setup(args: argparse.Namespace) -> int:
    from outbox_kafka.operations.log_setup import set_up_log

    names = names_from(args)
    engine = operator_engine(args)
    try:
        done = set_up_log(engine, names, failover=args.failover)
    finally:
        engine.dispose()
    lines = [
        f"publication {done.publication}: {'created' if done.created_publication else 'exists'}",
        f"slot {done.slot}: {'created' if done.created_slot else 'exists'}",
        "pg_logical_emit_message: "
        + ("not executable by PUBLIC" if done.emit_revoked else "executable by PUBLIC"),
        *(f"WARNING: {w}" for w in done.warnings),
    ]
    output.emit(args, done.as_dict(), "\n".join(lines))
    return 0


def add_operator_parsers(sub: Any) -> None:
    """The parsers of ``stats``, ``requeue``, ``unpark`` and ``purge``."""
    p = sub.add_parser("log-setup", help="make what the log mode needs on the server")
    p.description = _LOG_SETUP_HELP
    add_database_option(p)
    add_table_options(p)
    add_flag(
        p,
        "--failover",
        help="make the slot one that follows a failover to a standby that syncs slots "
        "(PostgreSQL 17 and later; see docs/reference/cli.md)",
    )
    add_output_flags(p)
    p.set_defaults(handler=_cmd_log_setup)

    p = sub.add_parser("stats", help="what the outbox holds (scans to count delivered events)")
    p.description = _STATS_HELP
    add_database_option(p)
    add_table_options(p)
    add_option(p, "--parked-limit", type=int, default=10, help="parked keys to list")
    add_option(p, "--discard-limit", type=int, default=10, help="latest discards to list")
    add_flag(p, "--no-delivered", help="do not count delivered events (skips the table scan)")
    add_output_flags(p)
    p.set_defaults(handler=_cmd_stats)

    p = sub.add_parser("requeue", help="send discarded events again, in key order")
    p.description = _REQUEUE_HELP
    add_database_option(p)
    add_table_options(p)
    _add_selectors(p, "every discarded event (instead of selectors)")
    add_option(p, "--list-limit", type=int, default=50, help="events listed in the text output")
    add_output_flags(p, dry_run="show what would be requeued; change nothing")
    p.set_defaults(handler=_cmd_requeue)

    p = sub.add_parser("unpark", help="let parked keys continue past the event that parked them")
    p.description = _UNPARK_HELP
    add_database_option(p)
    add_table_options(p)
    _add_selectors(p, "every parked key (instead of selectors)")
    add_output_flags(p, dry_run="show what would be unparked; change nothing")
    p.set_defaults(handler=_cmd_unpark)

    p = sub.add_parser("purge", help="delete delivered and discarded events past retention")
    p.description = _PURGE_HELP
    add_database_option(p)
    add_table_options(p)
    add_option(
        p,
        "--retain-delivered-days",
        type=float,
        default=operations.DEFAULT_RETAIN_DELIVERED_SECONDS / SECONDS_PER_DAY,
        help="keep delivered events this long (as relay)",
    )
    add_option(
        p,
        "--retain-discarded-days",
        type=float,
        default=operations.DEFAULT_RETAIN_DISCARDED_SECONDS / SECONDS_PER_DAY,
        help="keep discarded events this long (as relay)",
    )
    add_option(
        p,
        "--purge-batch",
        type=int,
        default=operations.DEFAULT_PURGE_BATCH,
        help="events deleted per transaction",
    )
    add_output_flags(p, dry_run="count what would be deleted; delete nothing")
    p.set_defaults(handler=_cmd_purge)
