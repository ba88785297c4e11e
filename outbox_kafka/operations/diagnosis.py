"""``outbox-kafka check``: the database, the migrations, the schemas and Kafka."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from outbox_kafka.database import storage_errors
from outbox_kafka.errors import OutboxError
from outbox_kafka.naming import TableNames
from outbox_kafka.schema.migrations import applied_versions
from outbox_kafka.schema.statements import queries_for


@dataclass(frozen=True)
class CheckResult:
    """One line of ``outbox-kafka check``."""

    name: str
    ok: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


def reason(exc: BaseException) -> str:
    """A driver's message (or the exception's) on one line, for a check's detail."""
    if isinstance(exc, DBAPIError):
        return str(exc.orig).strip().replace("\n", " ")
    return str(exc).strip().replace("\n", " ") or type(exc).__name__


def check_database(
    engine: Engine, names: TableNames, *, shown_url: str
) -> tuple[CheckResult, CheckResult]:
    """Connectivity, then whether this outbox's migrations are all applied."""
    q = queries_for(names)
    try:
        with engine.connect() as conn:
            version, role = conn.execute(q["server_version"]).one()
            try:
                migration = _check_migrations(conn, names)
            except (SQLAlchemyError, OutboxError) as exc:
                if isinstance(exc, DBAPIError) and exc.connection_invalidated:
                    raise  # the connection went away: the database line says so
                # Connected, but this role may not read the outbox's migrations.
                migration = CheckResult(
                    "migrations",
                    False,
                    f"cannot read the migrations of {names.qualified_events} "
                    f"as {role}: {reason(exc)}",
                )
            conn.rollback()
    except (SQLAlchemyError, OutboxError) as exc:
        return (
            CheckResult("database", False, f"cannot connect to {shown_url}: {reason(exc)}"),
            CheckResult("migrations", False, "not checked: no database connection"),
        )
    detail = f"{shown_url} (PostgreSQL {version}, connected as {role})"
    return CheckResult("database", True, detail), migration


def _check_migrations(conn: Connection, names: TableNames) -> CheckResult:
    known = {m.version: m.name for m in queries_for(names).migrations()}
    applied = applied_versions(conn, names)
    newer = sorted(v for v in applied if v not in known)
    missing = sorted(v for v in known if v not in applied)
    where = names.qualified_events
    if newer:
        return CheckResult(
            "migrations",
            False,
            f"{where} has migrations {newer} that this outbox-kafka does not know "
            f"(it knows up to {max(known)}): upgrade outbox-kafka",
        )
    if missing:
        listed = ", ".join(f"{v:04d}_{known[v]}" for v in missing)
        state = "is not migrated" if not applied else "is behind"
        remedy = "run outbox-kafka migrate"
        if not applied and _events_table_exists(conn, names):
            # Made without migrate: from outbox_kafka.schema.metadata, by Alembic say.
            state = "exists but was made without outbox-kafka migrate (no version recorded)"
            remedy = "run outbox-kafka migrate --adopt"
        return CheckResult(
            "migrations", False, f"{where} {state}: {len(missing)} pending ({listed}); {remedy}"
        )
    return CheckResult("migrations", True, f"{where} is at version {max(known)} (current)")


def _events_table_exists(conn: Connection, names: TableNames) -> bool:
    found = conn.execute(
        queries_for(names)["table_exists"],
        {"qualified_name": f'"{names.schema}"."{names.events}"'},
    ).scalar_one()
    return bool(found)


#: Pending events whose topics ``check`` reads at most, per outbox: the cost of
#: ``pending_topics`` is bounded by this, whatever the backlog.
PENDING_EVENTS_READ = 100_000
#: Topics of pending events ``check`` names at most, per outbox (most events first).
PENDING_TOPICS_SHOWN = 50


@dataclass(frozen=True)
class PendingTopics:
    """The topics an outbox's pending events wait for, as ``pending_topics`` read them."""

    #: Events per topic, most first; lower bounds unless ``complete``.
    counts: dict[str, int]
    #: Pending events read.
    read: int
    #: Every pending event was read: the counts are exact.
    complete: bool
    #: The outbox's name in ``--outboxes-file``; None for the single outbox.
    outbox: str | None = None
    #: Other topics may have fewer events: only the first few are named.
    more_topics: bool = False
    #: In what order the events were read, when not every one was.
    read_in: str = "by key"
    #: Why the pending events were not read at all (nothing to check), or None.
    unread: str | None = None


def pending_topics(
    engine: Engine,
    names: TableNames,
    *,
    outbox: str | None = None,
    scan_limit: int = PENDING_EVENTS_READ,
    topic_limit: int = PENDING_TOPICS_SHOWN,
) -> PendingTopics:
    """The topics of at most ``scan_limit`` pending events (by key), with their counts."""
    with storage_errors("reading the topics of pending events"), engine.connect() as conn:
        rows = conn.execute(
            queries_for(names)["pending_topics"],
            {"scan_limit": scan_limit, "topic_limit": topic_limit},
        ).all()
        conn.rollback()
    read = int(rows[0].scanned) if rows else 0
    return PendingTopics(
        counts={str(r.topic): int(r.events) for r in rows},
        read=read,
        complete=read < scan_limit,
        outbox=outbox,
        more_topics=len(rows) >= topic_limit,
    )


def check_schemas(schema_dir: str | Path | None) -> CheckResult:
    """The shipped envelope schema and, if given, every payload schema of ``schema_dir``."""
    from outbox_kafka.validation import EventSchemas, envelope_schema, shipped_schema_dir

    try:
        envelope_schema()
        detail = f"envelope schema {shipped_schema_dir() / 'cloudevent.json'}"
        if schema_dir:
            schemas = EventSchemas(schema_dir)
            detail += f"; {len(schemas.types)} event types in {schema_dir}"
    except OutboxError as exc:
        return CheckResult("schemas", False, str(exc))
    return CheckResult("schemas", True, f"compiled: {detail}")


def check_kafka(
    config: Mapping[str, str],
    *,
    timeout: float,
    topics: Sequence[str] = (),
    create_topics: bool = False,
    message_max_bytes: int | None = None,
    pending: Sequence[PendingTopics] = (),
) -> list[CheckResult]:
    """Broker metadata within ``timeout`` seconds; then whether ``topics`` exist,
    whether the topics ``pending`` events wait for exist (the relay holds their keys
    until they do), and (with ``message_max_bytes``, the relay's) whether broker
    and topics take as much.

    ``config`` holds the connection settings (security included); librdkafka's
    own log lines are kept out of the command's output.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    servers = config.get("bootstrap.servers", "")
    if not servers:
        return [CheckResult("kafka", False, "no bootstrap servers given")]
    quiet = logging.getLogger("outbox_kafka.check.librdkafka")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    try:
        client_config: dict[str, Any] = {**config, "logger": quiet}
        admin = AdminClient(client_config)
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        return [
            CheckResult("kafka", False, f"no metadata from {servers} within {timeout:g} s: {exc}")
        ]
    except (ValueError, TypeError) as exc:
        return [CheckResult("kafka", False, f"invalid Kafka configuration: {exc}")]
    brokers = len(metadata.brokers)
    results = [
        CheckResult(
            "kafka",
            True,
            f"{servers}: {brokers} broker{'s' if brokers != 1 else ''}, "
            f"{len(metadata.topics)} topic{'s' if len(metadata.topics) != 1 else ''}",
        )
    ]
    for topic in topics:
        meta = metadata.topics.get(topic)
        if meta is not None and meta.error is None:
            results.append(CheckResult(f"topic {topic}", True, "exists"))
        elif create_topics:
            results.append(CheckResult(f"topic {topic}", True, "missing; the relay creates it"))
        else:
            results.append(
                CheckResult(
                    f"topic {topic}",
                    False,
                    "does not exist and topic creation is off "
                    "(create it, or --create-topics <partitions>)",
                )
            )
    shown = {r.name for r in results}
    for found in pending:
        for result in _check_pending_topics(metadata, found, create_topics):
            if result.name not in shown:
                shown.add(result.name)
                results.append(result)
    if message_max_bytes is not None:
        results.append(_check_message_limits(admin, metadata, message_max_bytes, timeout))
    return results


def _check_pending_topics(
    metadata: Any, pending: PendingTopics, create_topics: bool
) -> list[CheckResult]:
    """A line per topic that pending events wait for, as the relay will find it."""
    from confluent_kafka import KafkaError

    where = f" [{pending.outbox}]" if pending.outbox else ""
    results: list[CheckResult] = []
    limits = []
    if pending.unread is not None:
        limits.append(f"not read: {pending.unread}")
    elif not pending.complete:
        limits.append(
            f"{pending.read} or more events pending: the topics of the first {pending.read} "
            f"({pending.read_in}) are checked, their counts are lower bounds"
        )
    if pending.more_topics:
        limits.append(f"the {len(pending.counts)} topics with the most events are checked")
    if limits:
        results.append(CheckResult(f"pending topics{where}", True, "; ".join(limits)))
    for topic, count in sorted(pending.counts.items()):
        events = f"{'' if pending.complete else 'at least '}{count} pending event" + (
            "s" if count != 1 else ""
        )
        wait = f"{events} wait{'s' if count == 1 else ''} for it"
        meta = metadata.topics.get(topic)
        error = None if meta is None else meta.error
        name = f"topic {topic}{where}"
        if meta is not None and error is None:
            results.append(CheckResult(name, True, f"exists; {events}"))
        elif error is not None and error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
            # Listed, but these credentials may not see or write it.
            results.append(
                CheckResult(
                    name,
                    False,
                    f"{error.name()}: {error.str()}; {wait} (grant the relay's credentials "
                    "Describe and Write on it)",
                )
            )
        elif create_topics:
            results.append(CheckResult(name, True, f"missing; the relay creates it ({events})"))
        else:
            results.append(
                CheckResult(
                    name,
                    False,
                    f"missing; {wait} (create it, or let the relay create it: "
                    "--create-topics <partitions>)",
                )
            )
    return results


#: Topics whose size limit ``check`` reads at most (in name order).
_TOPICS_DESCRIBED = 500


def _check_message_limits(
    admin: Any, metadata: Any, relay_limit: int, timeout: float
) -> CheckResult:
    """Whether the broker and the cluster's topics accept messages of ``relay_limit``
    bytes, where the broker tells (DescribeConfigs): a smaller limit refuses events
    that enqueue and the relay accept, and the relay discards them."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import ConfigResource, ResourceType  # type: ignore[attr-defined]

    names = sorted(t for t in metadata.topics if not t.startswith("__"))[:_TOPICS_DESCRIBED]
    resources = [ConfigResource(ResourceType.TOPIC, t) for t in names]
    if metadata.brokers:
        resources.append(ConfigResource(ResourceType.BROKER, str(min(metadata.brokers))))
    try:
        futures = admin.describe_configs(resources, request_timeout=timeout)
    except (KafkaException, ValueError) as exc:
        return CheckResult("message size", True, f"limits not told by the broker: {exc}")
    lower: list[str] = []
    told = 0
    for resource, future in futures.items():
        broker = resource.restype == ResourceType.BROKER
        key = "message.max.bytes" if broker else "max.message.bytes"
        try:
            entry = future.result(timeout).get(key)
            limit = int(entry.value)
        except (KafkaException, AttributeError, TypeError, ValueError):
            continue  # not told, or not a number
        told += 1
        if limit < relay_limit:
            lower.append(f"{'the broker' if broker else 'topic ' + resource.name} ({key} {limit})")
    if lower:
        shown = ", ".join(lower[:10]) + (f" and {len(lower) - 10} more" if len(lower) > 10 else "")
        return CheckResult(
            "message size",
            False,
            f"{shown} accept less than the relay's message.max.bytes ({relay_limit}): events "
            "between the two are committed, then refused by the broker and discarded. Lower "
            "the relay's message.max.bytes to the smallest, and producers' max_message_bytes "
            "16 KiB below it",
        )
    if not told:
        return CheckResult("message size", True, "limits not told by the broker")
    return CheckResult(
        "message size",
        True,
        f"broker and {len(names)} topics accept the relay's message.max.bytes ({relay_limit})"
        if told > len(names)
        else f"{told} topics accept the relay's message.max.bytes ({relay_limit}); "
        "the broker does not tell its own limit",
    )
