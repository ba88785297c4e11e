"""Operator actions on an outbox: stats, requeue, unpark, purge and set-up checks.

Each action runs in its own short transaction; the relay picks the result up
on its next claim. These are the functions behind ``outbox-kafka stats``,
``requeue``, ``unpark``, ``purge`` and ``check``; driver errors are translated
into :class:`~outbox_kafka.errors.StorageError`.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, Row
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from outbox_kafka.database import make_engine
from outbox_kafka.errors import ConfigurationError, InvalidSelection, OutboxError, StorageError
from outbox_kafka.naming import TableNames
from outbox_kafka.queries import pg_array, queries_for
from outbox_kafka.relay.retention import purge_old_events
from outbox_kafka.relay.settings import RelaySettings

DAY = 86400.0


def _relay_default(name: str) -> Any:
    return next(f.default for f in fields(RelaySettings) if f.name == name)


#: The relay's retention defaults, so ``purge`` and ``relay`` agree.
DEFAULT_RETAIN_DELIVERED_SECONDS: float = _relay_default("retain_delivered_seconds")
DEFAULT_RETAIN_DISCARDED_SECONDS: float = _relay_default("retain_discarded_seconds")
DEFAULT_PURGE_BATCH: int = _relay_default("purge_batch")
_UNDEFINED_TABLE = "42P01"


@contextlib.contextmanager
def _database(what: str) -> Iterator[None]:
    """Translate driver errors into StorageError, naming the action and the cause."""
    try:
        yield
    except DBAPIError as exc:
        cause = str(exc.orig).strip()
        if getattr(exc.orig, "pgcode", None) == _UNDEFINED_TABLE:
            cause += " (run outbox-kafka migrate first)"
        raise StorageError(f"{what} failed: {cause}") from None
    except SQLAlchemyError as exc:
        raise StorageError(f"{what} failed: {exc}") from None


def _utc(value: datetime | None) -> datetime | None:
    return value.astimezone(UTC) if value is not None else None


def _iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat() if value is not None else None


def _array(values: Sequence[str]) -> str | None:
    return pg_array(list(values)) if values else None


def short_command_engine(url: str, *, connect_timeout: float = 10.0) -> Engine:
    """An engine for one short command: no pool kept, a bounded connection wait."""
    # READ COMMITTED whatever the server's default: requeue and unpark lock
    # rows in one statement and read what they hold in the next.
    return make_engine(
        url,
        poolclass=NullPool,
        isolation_level="READ COMMITTED",
        connect_args={"connect_timeout": max(1, round(connect_timeout))},
    )


# --------------------------------------------------------------------------- selections


@dataclass(frozen=True)
class Selection:
    """Which events (or parked keys) an operator action applies to.

    Selectors combine with AND; repeated values of one selector with OR. A
    time range is ``since <= created_at < until``. An empty selection selects
    nothing and is refused; ``everything=True`` (``--all``) selects every
    event and cannot be combined with selectors.
    """

    event_ids: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    types: tuple[str, ...] = ()
    topics: tuple[str, ...] = ()
    since: datetime | None = None
    until: datetime | None = None
    everything: bool = False

    def __post_init__(self) -> None:
        ids = []
        for raw in self.event_ids:
            try:
                ids.append(str(uuid.UUID(str(raw))))
            except ValueError:
                raise InvalidSelection(f"event id {raw!r} is not a UUID") from None
        object.__setattr__(self, "event_ids", tuple(ids))
        for name in ("keys", "types", "topics"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and value.utcoffset() is None:
                raise InvalidSelection(f"{name} {value.isoformat()} has no time zone")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise InvalidSelection(
                f"empty time range: since ({self.since.isoformat()}) is not before "
                f"until ({self.until.isoformat()})"
            )
        if self.everything and not self.is_empty:
            raise InvalidSelection("--all (everything) cannot be combined with selectors")

    @property
    def is_empty(self) -> bool:
        """No selector given (``everything`` aside)."""
        return not (
            self.event_ids or self.keys or self.types or self.topics or self.since or self.until
        )

    def require(self, what: str) -> None:
        if self.is_empty and not self.everything:
            raise InvalidSelection(
                f"nothing selected: say which {what} (--event-id, --key, --type, --topic, "
                "--since, --until), or --all for every one of them"
            )

    def params(self) -> dict[str, Any]:
        return {
            "event_ids": _array(self.event_ids),
            "ordering_keys": _array(self.keys),
            "types": _array(self.types),
            "topics": _array(self.topics),
            "since": self.since,
            "until": self.until,
        }


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class DiscardedEvent:
    """A discarded event, as the operator commands show it."""

    event_id: str
    key: str
    seq: int
    topic: str
    type: str
    attempts: int
    last_error: str | None
    created_at: datetime

    @classmethod
    def from_row(cls, row: Row[Any]) -> DiscardedEvent:
        created = _utc(row.created_at)
        assert created is not None
        return cls(
            event_id=row.event_id,
            key=row.ordering_key,
            seq=int(row.seq),
            topic=row.topic,
            type=row.type,
            attempts=int(row.attempts),
            last_error=row.last_error,
            created_at=created,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "key": self.key,
            "seq": self.seq,
            "topic": self.topic,
            "type": self.type,
            "attempts": self.attempts,
            "last_error": self.last_error,
            "created_at": _iso(self.created_at),
        }


@dataclass(frozen=True)
class ParkedKey:
    """A parked key and the discarded event that parked it (None once purged)."""

    key: str
    next_seq: int
    parked_at: datetime
    event: DiscardedEvent | None

    @classmethod
    def from_row(cls, row: Row[Any]) -> ParkedKey:
        parked_at = _utc(row.parked_at)
        assert parked_at is not None
        event = None
        if row.event_id is not None:
            event = DiscardedEvent(
                event_id=row.event_id,
                key=row.ordering_key,
                seq=int(row.next_seq),
                topic=row.topic,
                type=row.type,
                attempts=int(row.attempts),
                last_error=row.last_error,
                created_at=_utc(row.created_at) or parked_at,
            )
        return cls(row.ordering_key, int(row.next_seq), parked_at, event)

    @property
    def reason(self) -> str | None:
        return self.event.last_error if self.event is not None else None

    def as_dict(self) -> dict[str, Any]:
        event = self.event
        return {
            "key": self.key,
            "next_seq": self.next_seq,
            "parked_at": _iso(self.parked_at),
            "event_id": event.event_id if event else None,
            "topic": event.topic if event else None,
            "type": event.type if event else None,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class TopicCounts:
    topic: str
    pending: int = 0
    delivered: int | None = 0  # None: not counted
    discarded: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "pending": self.pending,
            "delivered": self.delivered,
            "discarded": self.discarded,
        }


@dataclass(frozen=True)
class OutboxStats:
    """One consistent snapshot of an outbox (one REPEATABLE READ transaction)."""

    table: str
    topics: list[TopicCounts]
    oldest_pending_age_seconds: float | None
    keys_queued: int
    keys_leased: int
    parked_count: int
    parked_keys: list[ParkedKey]
    recent_discards: list[DiscardedEvent]
    delivered_counted: bool = True

    @property
    def totals(self) -> TopicCounts:
        return TopicCounts(
            topic="*",
            pending=sum(t.pending for t in self.topics),
            delivered=sum(t.delivered or 0 for t in self.topics)
            if self.delivered_counted
            else None,
            discarded=sum(t.discarded for t in self.topics),
        )

    def as_dict(self) -> dict[str, Any]:
        totals = self.totals.as_dict()
        del totals["topic"]
        return {
            "table": self.table,
            "totals": totals,
            "topics": [t.as_dict() for t in self.topics],
            "oldest_pending_age_seconds": self.oldest_pending_age_seconds,
            "keys": {"queued": self.keys_queued, "leased": self.keys_leased},
            "parked_keys": {
                "count": self.parked_count,
                "keys": [k.as_dict() for k in self.parked_keys],
            },
            "recent_discards": [e.as_dict() for e in self.recent_discards],
        }


@dataclass(frozen=True)
class RequeueResult:
    """What a requeue did, or with ``dry_run`` would do."""

    dry_run: bool
    events: list[DiscardedEvent]
    #: Keys that were (would be) parked and flow again.
    unparked_keys: list[str] = field(default_factory=list)
    #: Keys a relay held: its batch in flight for them is sent again after its lease.
    taken_keys: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.events)

    @property
    def keys(self) -> list[str]:
        return sorted({e.key for e in self.events})

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "count": self.count,
            "keys": self.keys,
            "unparked_keys": self.unparked_keys,
            "taken_from_relay_keys": self.taken_keys,
            "events": [e.as_dict() for e in self.events],
        }


@dataclass(frozen=True)
class UnparkResult:
    dry_run: bool
    keys: list[ParkedKey]

    @property
    def count(self) -> int:
        return len(self.keys)

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "count": self.count,
            "keys": [k.as_dict() for k in self.keys],
        }


@dataclass(frozen=True)
class PurgeResult:
    dry_run: bool
    delivered: int
    discarded: int
    retain_delivered_seconds: float
    retain_discarded_seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "delivered": self.delivered,
            "discarded": self.discarded,
            "retain_delivered_days": self.retain_delivered_seconds / DAY,
            "retain_discarded_days": self.retain_discarded_seconds / DAY,
        }


# --------------------------------------------------------------------------- stats


def outbox_stats(
    engine: Engine,
    names: TableNames | None = None,
    *,
    parked_limit: int = 10,
    discard_limit: int = 10,
    count_delivered: bool = True,
) -> OutboxStats:
    """Counts by topic and status, the backlog's age, parked keys and recent discards.

    Pending and discarded counts come from their partial indexes; counting
    delivered events scans the table (``count_delivered=False`` skips it).
    Everything is read from one snapshot.
    """
    names = names or TableNames()
    q = queries_for(names)
    with _database("reading outbox stats"), engine.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        with conn.begin():
            counts: dict[str, dict[str, int]] = {}
            for row in conn.execute(q["stats_topic_counts"], {"count_delivered": count_delivered}):
                counts.setdefault(row.topic, {})[row.status] = int(row.n)
            backlog = conn.execute(q["stats_backlog"]).one()
            age = conn.execute(q["oldest_pending_age"]).scalar_one()
            parked = [
                ParkedKey.from_row(r)
                for r in conn.execute(q["stats_parked_keys"], {"limit": max(0, parked_limit)})
            ]
            discards = [
                DiscardedEvent.from_row(r)
                for r in conn.execute(q["stats_recent_discards"], {"limit": max(0, discard_limit)})
            ]
    topics = [
        TopicCounts(
            topic=topic,
            pending=found.get("pending", 0),
            delivered=found.get("delivered", 0) if count_delivered else None,
            discarded=found.get("discarded", 0),
        )
        for topic, found in sorted(counts.items())
    ]
    return OutboxStats(
        table=names.qualified_events,
        topics=topics,
        oldest_pending_age_seconds=float(age) if age is not None else None,
        keys_queued=int(backlog.keys_queued),
        keys_leased=int(backlog.keys_leased),
        parked_count=int(backlog.keys_parked),
        parked_keys=parked,
        recent_discards=discards,
        delivered_counted=count_delivered,
    )


# --------------------------------------------------------------------------- requeue


def requeue(
    engine: Engine,
    selection: Selection,
    names: TableNames | None = None,
    *,
    dry_run: bool = False,
) -> RequeueResult:
    """Make the selected discarded events pending again, in key order.

    Each key resumes from its earliest requeued event, so per key the
    requeued events go out in sequence order, before any later event of the
    key that is still pending. A parked key is unparked, but only together
    with the event that parked it: a selection holding other events of a
    parked key and not that one is refused (:class:`InvalidSelection`), so a
    requeue never silently skips a parked event. A key a relay is working on
    is taken back from it; that relay's batch for the key is sent again once
    its lease ends (a duplicate the consumer removes by ``ce_id``). With
    ``dry_run`` nothing changes and the result says what would be done.
    """
    selection.require("discarded events")
    q = queries_for(names or TableNames())
    with _database("requeueing events"), engine.connect() as conn, conn.begin() as tx:
        events = [
            DiscardedEvent.from_row(r)
            for r in conn.execute(q["requeue_candidates"], selection.params())
        ]
        chosen = {e.event_id for e in events}
        keys = sorted({e.key for e in events})
        unparked: list[str] = []
        taken: list[str] = []
        blocked: list[str] = []
        if keys:
            # Lock first, then read: see lock_keys in queries.sql.
            conn.execute(q["requeue_queue_rows"], {"event_ids": pg_array(sorted(chosen))})
            conn.execute(q["lock_keys"], {"ordering_keys": pg_array(keys)})
            states = conn.execute(q["requeue_key_states"], {"ordering_keys": pg_array(keys)})
            for state in states:
                if state.leased:
                    taken.append(state.ordering_key)
                if state.parked_at is None:
                    continue
                if state.parked_by is not None and state.parked_by not in chosen:
                    blocked.append(f"{state.ordering_key!r} (parked by event {state.parked_by})")
                else:
                    unparked.append(state.ordering_key)
        if blocked:
            raise InvalidSelection(
                "the selection holds events of parked keys but not the event that parked "
                f"them: {', '.join(blocked)}; select that event too, or unpark the key "
                "first (outbox-kafka unpark) to go on without it"
            )
        if dry_run or not events:
            tx.rollback()
        else:
            done = conn.execute(q["requeue_events"], {"event_ids": pg_array(sorted(chosen))}).one()
            if int(done.requeued) != len(events):  # the candidates are locked: cannot happen
                raise StorageError(
                    f"requeue changed {done.requeued} events instead of {len(events)}; rolled back"
                )
    return RequeueResult(dry_run=dry_run, events=events, unparked_keys=unparked, taken_keys=taken)


def requeue_events(
    engine: Engine, event_ids: Iterable[uuid.UUID | str], names: TableNames | None = None
) -> int:
    """Make these discarded events pending again (see :func:`requeue`); return how many.

    Ids of events that are not discarded are ignored.
    """
    ids = tuple(str(i) for i in event_ids)
    if not ids:
        return 0
    return requeue(engine, Selection(event_ids=ids), names).count


# --------------------------------------------------------------------------- unpark


def unpark(
    engine: Engine,
    selection: Selection,
    names: TableNames | None = None,
    *,
    dry_run: bool = False,
) -> UnparkResult:
    """Let the selected parked keys continue with their later events.

    The event that parked each key stays discarded (it can still be
    requeued later, out of order). ``selection.keys`` matches the key; the
    other selectors match the event that parked it.
    """
    selection.require("parked keys")
    q = queries_for(names or TableNames())
    with _database("unparking keys"), engine.connect() as conn, conn.begin() as tx:
        # Lock first, then read (see lock_keys in queries.sql); only the keys locked.
        params = selection.params()
        locked = list(
            conn.execute(
                q["lock_parked_keys"], {"ordering_keys": params["ordering_keys"]}
            ).scalars()
        )
        parked: list[ParkedKey] = []
        if locked:
            read = {**params, "ordering_keys": pg_array(locked)}
            parked = [ParkedKey.from_row(r) for r in conn.execute(q["unpark_candidates"], read)]
        if dry_run or not parked:
            tx.rollback()
        else:
            conn.execute(q["unpark_keys"], {"ordering_keys": pg_array([k.key for k in parked])})
    return UnparkResult(dry_run=dry_run, keys=parked)


def unpark_keys(engine: Engine, keys: Iterable[str], names: TableNames | None = None) -> int:
    """Let parked keys continue with their later events, leaving the discarded ones as they are."""
    wanted = tuple(keys)
    if not wanted:
        return 0
    return unpark(engine, Selection(keys=wanted), names).count


# --------------------------------------------------------------------------- purge


def purge(
    engine: Engine,
    names: TableNames | None = None,
    *,
    retain_delivered_seconds: float = DEFAULT_RETAIN_DELIVERED_SECONDS,
    retain_discarded_seconds: float = DEFAULT_RETAIN_DISCARDED_SECONDS,
    batch: int = DEFAULT_PURGE_BATCH,
    dry_run: bool = False,
) -> PurgeResult:
    """Delete delivered and discarded events older than their retention, now.

    The same statements as the relay's retention, ``batch`` rows per
    transaction, so a large purge never holds long locks. Pending events are
    never touched. With ``dry_run`` only counts what would go.
    """
    for what, value in (
        ("retain_delivered_seconds", retain_delivered_seconds),
        ("retain_discarded_seconds", retain_discarded_seconds),
    ):
        if value < 0:
            raise ConfigurationError(f"{what} must not be negative, got {value}")
    if batch <= 0:
        raise ConfigurationError(f"batch must be positive, got {batch}")
    q = queries_for(names or TableNames())
    if dry_run:
        with _database("counting old events"), engine.connect() as conn:
            row = conn.execute(
                q["purge_counts"],
                {
                    "delivered_seconds": retain_delivered_seconds,
                    "discarded_seconds": retain_discarded_seconds,
                },
            ).one()
            conn.rollback()
        removed = {"purge_delivered": int(row.delivered), "purge_discarded": int(row.discarded)}
    else:
        with _database("purging old events"):
            delivered, discarded = purge_old_events(
                engine,
                q,
                delivered_seconds=retain_delivered_seconds,
                discarded_seconds=retain_discarded_seconds,
                batch=batch,
            )
        removed = {"purge_delivered": delivered, "purge_discarded": discarded}
    return PurgeResult(
        dry_run=dry_run,
        delivered=removed["purge_delivered"],
        discarded=removed["purge_discarded"],
        retain_delivered_seconds=retain_delivered_seconds,
        retain_discarded_seconds=retain_discarded_seconds,
    )


# --------------------------------------------------------------------------- check


@dataclass(frozen=True)
class CheckResult:
    """One line of ``outbox-kafka check``."""

    name: str
    ok: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


def _reason(exc: BaseException) -> str:
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
            version = conn.execute(q["server_version"]).scalar_one()
            migration = _check_migrations(conn, names)
            conn.rollback()
    except (SQLAlchemyError, OutboxError) as exc:
        return (
            CheckResult("database", False, f"cannot connect to {shown_url}: {_reason(exc)}"),
            CheckResult("migrations", False, "not checked: no database connection"),
        )
    return CheckResult("database", True, f"{shown_url} (PostgreSQL {version})"), migration


def _check_migrations(conn: Connection, names: TableNames) -> CheckResult:
    q = queries_for(names)
    known = {m.version: m.name for m in q.migrations()}
    present = conn.execute(
        q["table_exists"], {"qualified_name": f'"{names.schema}"."{names.versions}"'}
    ).scalar_one()
    applied = set(conn.execute(q["applied_versions"]).scalars()) if present else set()
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
        return CheckResult(
            "migrations",
            False,
            f"{where} {state}: {len(missing)} pending ({listed}); run outbox-kafka migrate",
        )
    return CheckResult("migrations", True, f"{where} is at version {max(known)} (current)")


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
) -> list[CheckResult]:
    """Broker metadata within ``timeout`` seconds; then whether ``topics`` exist, and
    (with ``message_max_bytes``, the relay's) whether broker and topics take as much.

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
            f"{len(metadata.topics)} topics",
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
                    "does not exist and topic creation is off (create it, or --create-topics N)",
                )
            )
    if message_max_bytes is not None:
        results.append(_check_message_limits(admin, metadata, message_max_bytes, timeout))
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


# --------------------------------------------------------------------------- consistency

#: The invariant checks of :func:`check_consistency`, by name, each with its statement.
CONSISTENCY_CHECKS: dict[str, str] = {
    "unqueued_pending": "consistency_unqueued_pending",
    "passed_pending": "consistency_passed_pending",
    "counter_behind": "consistency_counter_behind",
    "queue_rows": "consistency_queue_rows",
    "discarded_without_reason": "consistency_discarded_without_reason",
}


@dataclass(frozen=True)
class Violation:
    """One broken invariant: which check, on which key and event, and how."""

    check: str
    key: str
    event_id: str | None
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "key": self.key,
            "event_id": self.event_id,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class ConsistencyReport:
    """What :func:`check_consistency` found, read from one snapshot."""

    table: str
    violations: list[Violation]
    #: Per check: whether it found more than the limit it listed.
    truncated: dict[str, bool]

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "ok": self.ok,
            "checks": list(CONSISTENCY_CHECKS),
            "violations": [v.as_dict() for v in self.violations],
            "truncated": sorted(name for name, more in self.truncated.items() if more),
        }


def check_consistency(
    engine: Engine, names: TableNames | None = None, *, limit: int = 100
) -> ConsistencyReport:
    """Check the invariants the relay relies on, on a live outbox, from one snapshot.

    Every pending event is reachable by the key queue (its key has a queue
    row whose ``next_seq`` is at or below it); every key's counter is at or
    above the sequence number of each of its pending and discarded events;
    every queue row has a counter, a ``next_seq`` at most one past it, a
    lease that is either wholly set or wholly clear, and, when parked, a next
    event that is not pending; every discarded event has a reason. Each check
    lists at most ``limit`` violations. Reads only; safe while relays,
    writers and operators work (it reads pending and discarded events through
    their partial indexes, and the whole key queue).
    """
    if limit <= 0:
        raise ConfigurationError(f"limit must be positive, got {limit}")
    names = names or TableNames()
    q = queries_for(names)
    violations: list[Violation] = []
    truncated: dict[str, bool] = {}
    with _database("checking consistency"), engine.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        with conn.begin():
            for check, statement in CONSISTENCY_CHECKS.items():
                found = conn.execute(q[statement], {"limit": limit + 1}).all()
                truncated[check] = len(found) > limit
                violations.extend(
                    Violation(check, row.ordering_key, row.event_id, row.detail)
                    for row in found[:limit]
                )
    return ConsistencyReport(names.qualified_events, violations, truncated)
