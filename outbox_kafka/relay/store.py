"""The relay's transactions on the outbox tables: claim a batch, record its outcome,
purge what retention lets go, and read what is left.

Every statement comes from ``sql/queries.sql``. Driver errors are translated
here into :class:`~outbox_kafka.errors.StorageError`, so the relay loop never
imports psycopg2. No method holds a transaction open after it returns.
"""

from __future__ import annotations

import contextlib
import uuid
from codecs import escape_decode
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg2
from sqlalchemy import Engine

from outbox_kafka.database import make_engine, redact_url, storage_errors, unchecked_when_fresh
from outbox_kafka.limits import DEFAULT_MAX_CLAIM_BYTES
from outbox_kafka.naming import TableNames
from outbox_kafka.purging import purge_old_events
from outbox_kafka.relay.batch import (
    Claim,
    ClaimedEvent,
    ClaimedKey,
    Doubts,
    EventOutcome,
    EventStatus,
    Floor,
    KeyOutcome,
    RecordResult,
    Remaining,
)
from outbox_kafka.relay.wake import Wakeups
from outbox_kafka.schema.statements import pg_array, pg_int_array, pg_text_array, queries_for
from outbox_kafka.stored_headers import headers_from_text

#: A claim of up to N keys first moves producers' arrivals into the key queue,
#: this many times N keys per pass, for at most this many passes.
_ADMIT_PER_KEY = 2
_ADMIT_PASSES = 4


#: A claim or a record takes a pooled connection used within this many seconds without
#: checking it first: a busy relay's claims and records go without a round trip each.
#: Every other statement of the store, and a connection idle longer, is checked.
PING_AFTER_IDLE_SECONDS = 1.0

#: SQLSTATEs of convert_from on bytes that are not UTF-8 text: an invalid byte
#: sequence (a zero byte included), or a character the server encoding lacks.
_NOT_UTF8_TEXT = frozenset({"22021", "22P05"})


def _in_doubt(sessions: Sequence[str] | None, unrecorded: str | None) -> tuple[str, ...]:
    """A claimed key's doubtful sessions: those it had, and the session of a claim of
    it that was never recorded (see doubt_keys in queries.sql)."""
    doubt = tuple(sessions or ())
    if unrecorded is not None and unrecorded not in doubt:
        doubt += (unrecorded,)
    return doubt


class _ValueNotText(Exception):
    """A claimed value could not be read as UTF-8 text."""


def _speaks_utf8(dbapi_connection: Any) -> bool:
    """Text from this connection is the stored UTF-8 bytes, decoded: no conversion between."""
    return bool(
        dbapi_connection.encoding == "UTF8"
        and dbapi_connection.get_parameter_status("server_encoding") == "UTF8"
    )


class Store:
    """The relay's access to one outbox (see :class:`~outbox_kafka.relay.ports.ClaimStore`)."""

    def __init__(self, database_url: str, names: TableNames, *, engine: Engine | None = None):
        self.names = names
        self.url_for_logs = redact_url(database_url)
        self._database_url = database_url
        # Claims, records and retention each run on their own connection at once.
        # READ COMMITTED whatever the server's default: the claim and the record
        # rely on each statement seeing what committed before it began.
        self._engine = engine or make_engine(
            database_url,
            ping_after_idle=PING_AFTER_IDLE_SECONDS,
            pool_size=3,
            max_overflow=2,
            isolation_level="READ COMMITTED",
        )
        self._q = queries_for(names)
        #: Where the next admission pass starts (see admit_arrivals in queries.sql).
        self._admit_after = ""
        #: Whether the last claim left arrivals behind (its passes all came back full).
        self.arrivals_left = False

    @contextlib.contextmanager
    def _cursor(self, what: str, *, hot: bool = False) -> Iterator[Any]:
        """A raw cursor in its own transaction, committed on success.

        The relay's two hot statements bypass SQLAlchemy's result layer: at a
        thousand rows per batch, building Row objects costs more than the query.
        The claim's and the record's transactions (``hot``) plan by index (see
        index_plans in queries.sql), sent with their first statement in one round
        trip, and take a connection used within the last second unchecked (see
        :func:`~outbox_kafka.database.unchecked_when_fresh`): the loop retries them.
        """
        checks = unchecked_when_fresh() if hot else contextlib.nullcontext()
        with storage_errors(what), checks, self._engine.connect() as conn:
            dbapi: Any = conn.connection.dbapi_connection
            cur = dbapi.cursor()
            try:
                yield cur
                dbapi.commit()
            except BaseException:
                if dbapi.closed:
                    # It died under the statement: the pool must not hand it out again,
                    # and the error to report is the statement's, not the rollback's.
                    conn.invalidate()
                else:
                    dbapi.rollback()
                raise
            finally:
                cur.close()

    def claim(
        self,
        *,
        batch_size: int,
        lease_seconds: float,
        max_keys: int | None = None,
        max_bytes: int = DEFAULT_MAX_CLAIM_BYTES,
        session: uuid.UUID | None = None,
    ) -> Claim:
        """Lease up to ``max_keys`` keys (default ``batch_size``) and read their next events.

        At most ``batch_size`` events come back, shared evenly between the keys,
        and events whose values and headers start past ``max_bytes`` stay in
        the table (their keys marked ``withheld``); the first event always comes.
        ``session``: the relay session that will send the claim, written on its keys.
        """
        token = uuid.uuid4()
        params = {
            "token": str(token),
            "session": None if session is None else str(session),
            "max_keys": max_keys or batch_size,
            "batch_size": batch_size,
            "max_bytes": max_bytes,
            "lease_seconds": lease_seconds,
            "admit_limit": _ADMIT_PER_KEY * (max_keys or batch_size),
        }
        try:
            rows, as_text, per_key, leased = self._claim_rows(params, as_text=True)
        except _ValueNotText:
            # A value that is not UTF-8 (written behind the library's back) failed
            # the whole statement, which changed nothing: claim again with every
            # value in bytea's escape format. The relay discards that event as an
            # invalid envelope, and the claims after it are back on text.
            rows, as_text, per_key, leased = self._claim_rows(params, as_text=False)
        keys: dict[str, ClaimedKey] = {}
        claimed: ClaimedKey | None = None
        for (
            key,
            next_seq,
            event_id,
            seq,
            topic,
            event_type,
            value,
            stored_headers,
            attempts,
            wait_seconds,
            last_seq,
            withheld,
        ) in rows:
            # Rows come ordered by key: a key's rows are consecutive.
            if claimed is None or claimed.key != key:
                due_at, doubt = leased[key]
                claimed = keys[key] = ClaimedKey(
                    key, next_seq, last_seq=last_seq, due_at=due_at, doubt=doubt
                )
            if withheld:
                claimed.withheld = True
                continue
            if event_id is None:
                continue
            text: str | None = value
            if not as_text and "\\" in value:
                # bytea's escape format is ASCII: it doubles a backslash and writes a
                # zero byte or one with the high bit set as a backslash and three
                # octal digits. With no backslash in it, the text is the value.
                text = None
                data = escape_decode(value)[0]
            else:
                data = value.encode()
            claimed.events.append(
                ClaimedEvent(
                    event_id,
                    key,
                    seq,
                    topic,
                    event_type,
                    data,
                    headers_from_text(stored_headers),
                    attempts,
                    wait_seconds is None,
                    wait_seconds or 0.0,
                    text,
                )
            )
        return Claim(token=token, keys=list(keys.values()), per_key_limit=per_key, session=session)

    def _admit(self, cur: Any, limit: int) -> None:
        """Move producers' arrivals into the key queue, a few passes at most; the first
        pass is the claim's first statement, sent with index_plans."""
        for i in range(_ADMIT_PASSES):
            start = self._admit_after
            cur.execute(
                self._q.driver_batch("index_plans", "admit_arrivals")
                if i == 0
                else self._q.driver_sql("admit_arrivals"),
                {"after_key": start, "admit_limit": limit},
            )
            moved, last_key = cur.fetchone()
            if moved == limit:
                self._admit_after = last_key
                continue
            # The sweep reached the end: start over, at once if it began past the
            # first key (the keys before it may have arrivals too).
            self._admit_after = ""
            if start == "":
                self.arrivals_left = False
                return
        self.arrivals_left = True

    def _claim_rows(
        self, params: dict[str, Any], *, as_text: bool
    ) -> tuple[list[Any], bool, int, dict[str, tuple[float, tuple[str, ...]]]]:
        """Run the claim; its rows, whether their values came as text, each key's
        share of the batch (the most events read per key), and by key when it was
        due before the claim (seconds since the epoch) and its doubtful sessions."""
        with self._cursor("claiming events", hot=True) as cur:
            as_text = as_text and _speaks_utf8(cur.connection)
            # The keys that producers added since the last claim join the queue
            # first (admit_arrivals). Then two statements, so that the events are
            # read from a snapshot taken after the keys are locked: see
            # claim_keys in queries.sql.
            self._admit(cur, params["admit_limit"])
            cur.execute(self._q.driver_sql("claim_keys"), params)
            leased = cur.fetchall()
            if not leased:
                return [], as_text, params["batch_size"], {}
            key_names = pg_text_array([row[0] for row in leased])
            lease = {**params, "key_names": key_names}
            unrecorded = [(row[0], row[4]) for row in leased if row[4] is not None]
            if unrecorded:
                cur.execute(self._q.driver_sql("lease_keys"), lease)
                # Claimed before and never recorded: in doubt about that claim's session.
                cur.execute(
                    self._q.driver_sql("doubt_keys"),
                    {
                        "key_names": pg_text_array([key for key, _ in unrecorded]),
                        "key_sessions": pg_array([session for _, session in unrecorded]),
                    },
                )
            per_key = max(1, params["batch_size"] // len(leased))
            try:
                # Without keys in doubt, the lease and the read go in one round trip.
                cur.execute(
                    self._q.driver_sql("claim_events")
                    if unrecorded
                    else self._q.driver_batch("lease_keys", "claim_events"),
                    {
                        **lease,
                        "key_next_seqs": pg_int_array([row[1] for row in leased]),
                        # The keys' places in the queue: the budget goes in their order.
                        "key_due_ats": pg_array([row[2] for row in leased]),
                        "per_key_limit": per_key,
                        "max_bytes": params["max_bytes"],
                        "values_as_text": as_text,
                    },
                )
            except psycopg2.Error as exc:
                if as_text and exc.pgcode in _NOT_UTF8_TEXT:
                    raise _ValueNotText from exc
                raise
            by_key = {
                key: (due, _in_doubt(doubt, session)) for key, _, due, doubt, session in leased
            }
            return cur.fetchall(), as_text, per_key, by_key

    def record(
        self,
        token: uuid.UUID,
        keys: Sequence[KeyOutcome],
        events: Sequence[EventOutcome],
        doubts: Doubts | None = None,
    ) -> RecordResult:
        """Record a batch's outcome, fenced by ``token``, in one statement; with
        ``doubts``, also which keys are in doubt now and the session's raised floors."""
        delivered = [e for e in events if e.status == EventStatus.DELIVERED]
        others = [e for e in events if e.status != EventStatus.DELIVERED]
        doubtful = doubts.doubtful if doubts is not None else {}
        floors = list(doubts.floors.items()) if doubts is not None else []
        params: dict[str, Any] = {
            "token": str(token),
            "session": None if doubts is None else str(doubts.session),
            # A shorter array is padded with NULLs (no new doubt): the common batch,
            # with none, sends an empty one.
            "key_doubt_until": (
                pg_int_array([doubtful.get(k.key) for k in keys]) if doubtful else "{}"
            ),
            "floor_topics": pg_text_array([topic for (topic, _), _ in floors]),
            "floor_partitions": pg_int_array([partition for (_, partition), _ in floors]),
            "floor_offsets": pg_int_array([offset for _, offset in floors]),
            "key_names": pg_array([k.key for k in keys]),
            "key_next_seqs": pg_int_array([k.next_seq for k in keys]),
            "key_delays": pg_array([k.delay for k in keys]),
            "key_due_ats": pg_array([k.due_at for k in keys]),
            "key_parks": pg_array([k.park for k in keys]),
            "key_drained": pg_array([k.drained for k in keys]),
            # Event ids are canonical UUID text: no quoting needed.
            "delivered_ids": "{" + ",".join([e.event_id for e in delivered]) + "}",
            "delivered_partitions": pg_int_array([e.partition for e in delivered]),
            "delivered_offsets": pg_int_array([e.offset for e in delivered]),
            "event_ids": pg_array([e.event_id for e in others]),
            "event_statuses": pg_array([e.status for e in others]),
            "event_attempts": pg_array([e.attempts_added for e in others]),
            "event_delays": pg_array([e.delay for e in others]),
            "event_partitions": pg_array([e.partition for e in others]),
            "event_offsets": pg_array([e.offset for e in others]),
            "event_errors": pg_array([e.error for e in others]),
        }
        with self._cursor("recording delivered events", hot=True) as cur:
            cur.execute(self._q.driver_batch("index_plans", "record_batch"), params)
            keys_owned, keys_removed, delivered, discarded, retried, latencies = cur.fetchone()
        return RecordResult(
            keys_owned=keys_owned,
            keys_removed=keys_removed,
            delivered=delivered,
            discarded=discarded,
            retried=retried,
            latencies=list(latencies or ()),
        )

    # Floors: where each relay session's unrecorded messages may begin.

    def open_floors(self, session: uuid.UUID, floors: Sequence[Floor]) -> None:
        """Write ``session``'s floors on partitions it is about to produce to for the
        first time (a floor it has keeps its value); committed on return."""
        with self._cursor("opening floors") as cur:
            cur.execute(
                self._q.driver_sql("open_floors"),
                {
                    "session": str(session),
                    "topics": pg_text_array([f.topic for f in floors]),
                    "kafka_partitions": pg_int_array([f.partition for f in floors]),
                    "partition_counts": pg_int_array([f.partitions for f in floors]),
                    "floor_offsets": pg_int_array([f.offset for f in floors]),
                },
            )

    def read_floors(self, sessions: Sequence[str], topics: Sequence[str]) -> list[Floor]:
        """The floors of ``sessions`` on ``topics``."""
        with self._cursor("reading floors") as cur:
            cur.execute(
                self._q.driver_sql("read_floors"),
                {"sessions": pg_array(list(sessions)), "topics": pg_text_array(list(topics))},
            )
            return [Floor(*row) for row in cur.fetchall()]

    def forget_floors(self, older_seconds: float) -> None:
        """Delete the floors of sessions older than ``older_seconds`` that no key names."""
        with self._cursor("forgetting old floors") as cur:
            cur.execute(self._q.driver_sql("forget_floors"), {"older_seconds": older_seconds})

    def purge(self, *, delivered_seconds: float, discarded_seconds: float, batch: int) -> int:
        """Delete old delivered and discarded events, ``batch`` rows per transaction."""
        with storage_errors("purging old events"):
            delivered, discarded = purge_old_events(
                self._engine,
                self._q,
                delivered_seconds=delivered_seconds,
                discarded_seconds=discarded_seconds,
                batch=batch,
            )
        return delivered + discarded

    def remaining(self) -> Remaining:
        """What is left pending and why (one statement; reads every pending event)."""
        with storage_errors("reading the remaining work"), self._engine.connect() as conn:
            row = conn.execute(self._q["remaining_work"]).one()
            conn.rollback()
        return Remaining.from_row(row)

    # LISTEN/NOTIFY: a dedicated autocommit connection, outside the pool.

    def wakeups(self) -> Wakeups:
        """The LISTEN connection on this store's database (opened on first use)."""
        return Wakeups(self._engine, self.names)

    def close(self) -> None:
        self._engine.dispose()
