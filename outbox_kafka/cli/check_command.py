"""``outbox-kafka check``: what a relay with these settings needs, one OK/FAIL line each."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from outbox_kafka import operations
from outbox_kafka.database import NO_DATABASE_URL, redact_url, short_command_engine, url_secrets
from outbox_kafka.errors import OutboxError
from outbox_kafka.logs import register_secrets
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.group import OutboxTarget

from . import output
from .operator_commands import cmd_check_consistency
from .options import add_option, add_output_flags, names_from
from .relay_command import (
    add_relay_parser,
    log_relay_settings,
    outbox_targets,
    relay_settings,
)

_CHECK_HELP = (
    "Check what a relay with these settings needs: the settings themselves (the same "
    "validation as relay; every relay flag and variable is accepted), the schemas, the "
    "database, the migrations, the Kafka brokers and the topics pending events wait for (a "
    "missing one holds their keys). One OK/FAIL line each; exit 0 only if all pass, 1 "
    "otherwise. With --consistency: the database, the migrations and the "
    "outbox's invariants (every pending event reachable by the key queue, counters ahead of "
    "every sequence number, queue rows and leases whole, discards with a reason), with each "
    "violation listed."
)


def _cmd_check(args: argparse.Namespace) -> int:
    if args.consistency:
        return cmd_check_consistency(args)
    check = operations.CheckResult
    results: list[operations.CheckResult] = []
    register_secrets(url_secrets(args.database_url or ""))
    settings: RelaySettings | None = None
    targets: list[OutboxTarget] | None = None
    try:
        if args.source == "log":
            settings = log_relay_settings(args)
        else:
            targets = outbox_targets(args)
            settings = relay_settings(args, targets)
    except OutboxError as exc:
        results.append(check("settings", False, str(exc)))
    else:
        register_secrets(settings.secret_values())
        timeout_ms = f"delivery timeout {settings.effective_delivery_timeout_ms} ms"
        detail = (
            f"valid: {_tables(settings, targets)}, {timeout_ms}"
            if args.source == "log"
            else f"valid: {_tables(settings, targets)}, lease {settings.lease_seconds:g} s, "
            f"{timeout_ms}, on exhausted: {settings.on_exhausted}"
        )
        results.append(check("settings", True, detail))
    results.append(operations.check_schemas(args.schema_dir))

    timeout: float = args.check_timeout
    pending: list[operations.PendingTopics] = []
    if targets is not None:
        for target in targets:
            results.extend(_check_outbox_database(target, timeout, pending, args.source))
    elif args.outboxes_file:
        results.append(check("database", False, "not checked: fix the outboxes file first"))
    elif not args.database_url:
        results.append(check("database", False, NO_DATABASE_URL))
        results.append(check("migrations", False, "not checked: no database URL"))
    else:
        try:
            names = names_from(args)
        except OutboxError as exc:
            results.append(check("database", False, str(exc)))
            results.append(check("migrations", False, "not checked: fix the settings first"))
        else:
            results.extend(_check_database(args.database_url, names, timeout, pending, args.source))

    if settings is None:
        results.append(check("kafka", False, "not checked: fix the settings first"))
    else:
        topics = _dead_letter_topics(settings, targets)
        results.extend(
            operations.check_kafka(
                settings.admin_config(),
                timeout=timeout,
                topics=topics,
                create_topics=settings.create_topics is not None,
                message_max_bytes=int(settings.producer_config()["message.max.bytes"]),
                pending=pending,
            )
        )
    ok = all(r.ok for r in results)
    document = {"ok": ok, "checks": [r.as_dict() for r in results]}
    output.emit(args, document, output.check_text(results))
    return 0 if ok else 1


def _dead_letter_topics(settings: RelaySettings, targets: list[OutboxTarget] | None) -> list[str]:
    """The dead-letter topics in use: the shared one, and each outbox's own."""
    topics = [settings.dead_letter_topic] if settings.dead_letter_topic else []
    for target in targets or []:
        topic = target.settings.get("dead_letter_topic", settings.dead_letter_topic)
        if topic and topic not in topics:
            topics.append(topic)
    return topics


def _tables(settings: RelaySettings, targets: list[OutboxTarget] | None) -> str:
    """The table, or each outbox's, as the settings line shows them."""
    if targets is None:
        return f"table {settings.names.qualified_events}"
    listed = ", ".join(f"{t.name}: {t.names.qualified_events}" for t in targets)
    return f"{len(targets)} outboxes ({listed})"


def _check_database(
    url: str,
    names: TableNames,
    timeout: float,
    pending: list[operations.PendingTopics],
    source: str,
    outbox: str | None = None,
) -> list[operations.CheckResult]:
    """The database and migration checks of the outbox ``names`` at ``url``, and the log
    mode's if ``source`` is the log; the topics its pending events wait for are added to
    ``pending`` (checked with Kafka's)."""
    register_secrets(url_secrets(url))
    try:
        engine = short_command_engine(url, connect_timeout=timeout)
    except OutboxError as exc:
        return [
            operations.CheckResult("database", False, str(exc)),
            operations.CheckResult("migrations", False, "not checked: fix the settings first"),
        ]
    try:
        results = list(operations.check_database(engine, names, shown_url=redact_url(url)))
        if not all(r.ok for r in results):
            return results
        if source == "log":
            results += operations.check_log_mode(engine, names)
        try:
            if source == "log":
                found = operations.log_pending_topics(engine, names, outbox=outbox, timeout=timeout)
            else:
                found = operations.pending_topics(engine, names, outbox=outbox)
            pending.append(found)
        except OutboxError as exc:
            results.append(operations.CheckResult("pending topics", False, str(exc)))
        return results
    finally:
        engine.dispose()


def _check_outbox_database(
    target: OutboxTarget, timeout: float, pending: list[operations.PendingTopics], source: str
) -> list[operations.CheckResult]:
    """The database and migration checks of one outbox of ``--outboxes-file``, named for it."""
    found = _check_database(
        target.database_url, target.names, timeout, pending, source, target.name
    )
    return [dataclasses.replace(r, name=f"{r.name} [{target.name}]") for r in found]


def add_check_parser(sub: Any) -> None:
    """``check``: the relay's parser, and the check's own options."""
    p = add_relay_parser(sub, "check", help="check settings, database, migrations and Kafka")
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
        help="with --consistency: violations listed per check (default: 100)",
    )
    add_output_flags(p)
    p.set_defaults(handler=_cmd_check)
