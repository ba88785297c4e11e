"""The relay's database boundary: claim, finish, purge, wake-ups.

Every statement comes from ``sql/queries.sql``. Driver errors are translated
here into :class:`~outbox_kafka.errors.StorageError`, so the relay loop never
imports psycopg2. No method holds a transaction open after it returns.
"""

from __future__ import annotations

import contextlib
import select
import time
import uuid
from codecs import escape_decode
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import psycopg2
import psycopg2.errors
import psycopg2.extensions
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from outbox_kafka.database import make_engine, redact_url
from outbox_kafka.errors import StorageError
from outbox_kafka.limits import DEFAULT_MAX_CLAIM_BYTES
from outbox_kafka.naming import TableNames
from outbox_kafka.producer.envelope import headers_from_text
from outbox_kafka.queries import pg_array, pg_text_array, queries_for
from outbox_kafka.relay.retention import purge_old_events

#: A claim of up to N keys first moves producers' arrivals into the key queue,
#: this many times N keys per pass, for at most this many passes.
_ADMIT_PER_KEY = 2
_ADMIT_PASSES = 4


class ClaimedEvent(NamedTuple):
    event_id: str
    key: str
    seq: int
    topic: str
    type: str
    value: bytes
    headers: list[tuple[str, bytes]] | None  # None: the stored headers are malformed
    attempts: int
    due: bool
    wait_seconds: float
    #: ``value`` as text when it is ASCII (the common case), for the envelope check.
    text: str | None = None


@dataclass
class ClaimedKey:
    key: str
    next_seq: int
    events: list[ClaimedEvent] = field(default_factory=list)
    #: The last sequence number handed out for the key at claim time (None: unknown).
    last_seq: int | None = None
    #: Events of the key were left out of the claim to keep it within its byte budget.
    withheld: bool = False

    @property
    def waiting(self) -> int:
        """How many events the key had from ``next_seq`` on: at least those claimed."""
        return len(self.events) + self.waiting_beyond_claim

    @property
    def waiting_beyond_claim(self) -> int:
        """Sequence numbers handed out from ``next_seq`` on that the claim did not bring.

        Unknown (``last_seq`` None) counts as one. Sequence numbers of events
        that are not pending, or not committed yet, count too.
        """
        if self.last_seq is None:
            return 1
        return max(0, self.last_seq - self.next_seq + 1 - len(self.events))


@dataclass(frozen=True)
class Claim:
    token: uuid.UUID
    keys: list[ClaimedKey]
    per_key_limit: int

    @property
    def event_count(self) -> int:
        return sum(len(k.events) for k in self.keys)


class KeyOutcome(NamedTuple):
    key: str
    next_seq: int
    delay: float
    park: bool
    exhausted: bool


class EventOutcome(NamedTuple):
    event_id: str
    key: str
    status: str  # delivered / pending / discarded
    attempt: int
    delay: float
    partition: int | None
    offset: int | None
    error: str | None


@dataclass(frozen=True)
class Backlog:
    """One sample of the outbox's backlog."""

    pending: int
    oldest_age_seconds: float | None
    parked_keys: int


@dataclass(frozen=True)
class Remaining:
    """Pending events, by why they are not being sent right now."""

    pending: int
    #: On keys a relay holds a lease on.
    leased: int
    #: On parked keys.
    parked: int
    #: On keys waiting for a retry's backoff.
    retrying: int
    #: On keys waiting for a delayed event (``available_at``).
    delayed: int
    #: On keys due now.
    due: int
    #: Not reachable by the key queue: a consistency violation.
    unreachable: int
    #: Seconds until the first key that is not parked comes due; None: none will.
    next_due_seconds: float | None


@dataclass(frozen=True)
class FinishResult:
    keys_owned: int
    keys_removed: int
    delivered: int
    discarded: int
    retried: int
    latencies: list[float]


def _int_array(values: Sequence[int | None]) -> str:
    """A PostgreSQL array literal of integers (the relay's hot path; no quoting needed)."""
    return "{" + ",".join(["NULL" if v is None else str(v) for v in values]) + "}"


#: SQLSTATEs of convert_from on bytes that are not UTF-8 text: an invalid byte
#: sequence (a zero byte included), or a character the server encoding lacks.
_NOT_UTF8_TEXT = frozenset({"22021", "22P05"})


class _ValueNotText(Exception):
    """A claimed value could not be read as UTF-8 text."""


def _speaks_utf8(dbapi_connection: Any) -> bool:
    """Text from this connection is the stored UTF-8 bytes, decoded: no conversion between."""
    return bool(
        dbapi_connection.encoding == "UTF8"
        and dbapi_connection.get_parameter_status("server_encoding") == "UTF8"
    )


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    try:
        yield
    except DBAPIError as exc:
        raise StorageError(f"{what} failed: {exc.orig!s}".strip()) from exc
    except SQLAlchemyError as exc:
        raise StorageError(f"{what} failed: {exc}") from exc
    except psycopg2.Error as exc:
        raise StorageError(f"{what} failed: {exc}".strip()) from exc


class Store:
    """Relay-side access to one outbox."""

    def __init__(self, database_url: str, names: TableNames, *, engine: Engine | None = None):
        self.names = names
        self.url_for_logs = redact_url(database_url)
        self._database_url = database_url
        # Claims, records and retention each run on their own connection at once.
        # READ COMMITTED whatever the server's default: the claim and the record
        # rely on each statement seeing what committed before it began.
        self._engine = engine or make_engine(
            database_url, pool_size=3, max_overflow=2, isolation_level="READ COMMITTED"
        )
        self._q = queries_for(names)
        #: Where the next admission pass starts (see admit_arrivals in queries.sql).
        self._admit_after = ""
        #: Whether the last claim left arrivals behind (its passes all came back full).
        self.arrivals_left = False
        self._listener: psycopg2.extensions.connection | None = None
        self._idle = False
        self._wake_lock = {"wake_lock": names.wake_lock}

    @contextlib.contextmanager
    def _cursor(self, what: str) -> Iterator[Any]:
        """A raw cursor in its own transaction, committed on success.

        The relay's two hot statements bypass SQLAlchemy's result layer: at a
        thousand rows per batch, building Row objects costs more than the query.
        """
        with _translated(what), self._engine.connect() as conn:
            dbapi: Any = conn.connection.dbapi_connection
            cur = dbapi.cursor()
            try:
                yield cur
                dbapi.commit()
            except BaseException:
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
    ) -> Claim:
        """Lease up to ``max_keys`` keys (default ``batch_size``) and read their next events.

        At most ``batch_size`` events come back, shared evenly between the keys,
        and events whose values and headers start past ``max_bytes`` stay in
        the table (their keys marked ``withheld``); the first event always comes.
        """
        token = uuid.uuid4()
        params = {
            "token": str(token),
            "max_keys": max_keys or batch_size,
            "batch_size": batch_size,
            "max_bytes": max_bytes,
            "lease_seconds": lease_seconds,
            "admit_limit": _ADMIT_PER_KEY * (max_keys or batch_size),
        }
        try:
            rows, as_text = self._claim_rows(params, as_text=True)
        except _ValueNotText:
            # A value that is not UTF-8 (written behind the library's back) failed
            # the whole statement, which changed nothing: claim again with every
            # value in bytea's escape format. The relay discards that event as an
            # invalid envelope, and the claims after it are back on text.
            rows, as_text = self._claim_rows(params, as_text=False)
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
                claimed = keys[key] = ClaimedKey(key, next_seq, last_seq=last_seq)
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
        per_key = max(1, batch_size // max(1, len(keys)))
        return Claim(token=token, keys=list(keys.values()), per_key_limit=per_key)

    def _admit(self, cur: Any, limit: int) -> None:
        """Move producers' arrivals into the key queue, a few passes at most."""
        for _ in range(_ADMIT_PASSES):
            start = self._admit_after
            cur.execute(
                self._q.driver_sql("admit_arrivals"), {"after_key": start, "admit_limit": limit}
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

    def _claim_rows(self, params: dict[str, Any], *, as_text: bool) -> tuple[list[Any], bool]:
        """Run the claim; its rows, and whether their values came as text."""
        with self._cursor("claiming events") as cur:
            as_text = as_text and _speaks_utf8(cur.connection)
            # The keys that producers added since the last claim join the queue
            # first (admit_arrivals). Then two statements, so that the events are
            # read from a snapshot taken after the keys are locked: see
            # claim_keys in queries.sql.
            self._admit(cur, params["admit_limit"])
            cur.execute(self._q.driver_sql("claim_keys"), params)
            leased = cur.fetchall()
            if not leased:
                return [], as_text
            try:
                cur.execute(
                    self._q.driver_sql("claim_events"),
                    {
                        "key_names": pg_text_array([key for key, _ in leased]),
                        "key_next_seqs": _int_array([next_seq for _, next_seq in leased]),
                        "batch_size": params["batch_size"],
                        "max_bytes": params["max_bytes"],
                        "values_as_text": as_text,
                    },
                )
            except psycopg2.Error as exc:
                if as_text and exc.pgcode in _NOT_UTF8_TEXT:
                    raise _ValueNotText from exc
                raise
            return cur.fetchall(), as_text

    def finish(
        self, token: uuid.UUID, keys: Sequence[KeyOutcome], events: Sequence[EventOutcome]
    ) -> FinishResult:
        """Record a batch's outcome, fenced by ``token``, in one statement."""
        delivered = [e for e in events if e.status == "delivered"]
        others = [e for e in events if e.status != "delivered"]
        params: dict[str, Any] = {
            "token": str(token),
            "key_names": pg_array([k.key for k in keys]),
            "key_next_seqs": _int_array([k.next_seq for k in keys]),
            "key_delays": pg_array([k.delay for k in keys]),
            "key_parks": pg_array([k.park for k in keys]),
            "key_exhausted": pg_array([k.exhausted for k in keys]),
            # Event ids are canonical UUID text: no quoting needed.
            "delivered_ids": "{" + ",".join([e.event_id for e in delivered]) + "}",
            "delivered_partitions": _int_array([e.partition for e in delivered]),
            "delivered_offsets": _int_array([e.offset for e in delivered]),
            "event_ids": pg_array([e.event_id for e in others]),
            "event_statuses": pg_array([e.status for e in others]),
            "event_attempts": pg_array([e.attempt for e in others]),
            "event_delays": pg_array([e.delay for e in others]),
            "event_partitions": pg_array([e.partition for e in others]),
            "event_offsets": pg_array([e.offset for e in others]),
            "event_errors": pg_array([e.error for e in others]),
        }
        with self._cursor("recording delivered events") as cur:
            cur.execute(self._q.driver_sql("finish_batch"), params)
            keys_owned, keys_removed, delivered, discarded, retried, latencies = cur.fetchone()
        return FinishResult(
            keys_owned=keys_owned,
            keys_removed=keys_removed,
            delivered=delivered,
            discarded=discarded,
            retried=retried,
            latencies=[float(x) for x in (latencies or [])],
        )

    def purge(self, *, delivered_seconds: float, discarded_seconds: float, batch: int) -> int:
        """Delete old delivered and discarded events, ``batch`` rows per transaction."""
        with _translated("purging old events"):
            delivered, discarded = purge_old_events(
                self._engine,
                self._q,
                delivered_seconds=delivered_seconds,
                discarded_seconds=discarded_seconds,
                batch=batch,
            )
        return delivered + discarded

    # Monitoring: cheap statements for the backlog sampler and readiness probes.

    @classmethod
    def for_monitoring(
        cls, database_url: str, names: TableNames, *, connect_timeout: float = 2.0
    ) -> Store:
        """A store of its own (one pooled connection, short connect timeout) for probes."""
        engine = make_engine(
            database_url,
            pool_size=1,
            max_overflow=1,
            connect_args={"connect_timeout": max(1, round(connect_timeout))},
        )
        return cls(database_url, names, engine=engine)

    def ping(self, timeout: float) -> None:
        """Run ``SELECT 1`` within ``timeout`` seconds; raise StorageError otherwise."""
        with _translated("checking the database"), self._engine.begin() as conn:
            conn.execute(self._q["statement_timeout"], {"milliseconds": _millis(timeout)})
            conn.execute(self._q["ping"])

    def backlog(self, timeout: float) -> Backlog:
        """Pending events, the oldest one's age and parked keys, in one snapshot.

        Reads the key queue, the key counters and each queued key's first
        pending event, never the rest of the event rows, so a sample costs
        one probe per key with work at any backlog.
        """
        with _translated("sampling the backlog"), self._engine.connect() as conn:
            snapshot = conn.execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            )
            with snapshot.begin():
                snapshot.execute(self._q["statement_timeout"], {"milliseconds": _millis(timeout)})
                pending = snapshot.execute(self._q["pending_events_estimate"]).scalar_one()
                age = snapshot.execute(self._q["oldest_pending_age"]).scalar_one()
                parked = snapshot.execute(self._q["parked_key_count"]).scalar_one()
        return Backlog(
            pending=int(pending),
            oldest_age_seconds=None if age is None else max(0.0, float(age)),
            parked_keys=int(parked),
        )

    def consistency_violations(self, timeout: float) -> int:
        """Keys whose pending events no relay will reach, plus broken queue rows.

        One statement: a probe of the claim index per key with pending events
        and a pass over the key queue, so its cost grows with the keys that
        have work, not with the events; 0 in a consistent outbox.
        """
        with _translated("counting consistency violations"), self._engine.begin() as conn:
            conn.execute(self._q["statement_timeout"], {"milliseconds": _millis(timeout)})
            return int(conn.execute(self._q["consistency_violation_count"]).scalar_one())

    def remaining(self) -> Remaining:
        """What is left pending and why (one statement; reads every pending event)."""
        with _translated("reading the remaining work"), self._engine.connect() as conn:
            row = conn.execute(self._q["remaining_work"]).one()
            conn.rollback()
        return Remaining(
            pending=int(row.pending),
            leased=int(row.leased),
            parked=int(row.parked),
            retrying=int(row.retrying),
            delayed=int(row.delayed),
            due=int(row.due),
            unreachable=int(row.unreachable),
            next_due_seconds=None if row.next_due_seconds is None else float(row.next_due_seconds),
        )

    # LISTEN/NOTIFY: a dedicated autocommit connection, outside the pool.

    def _listen(self) -> psycopg2.extensions.connection:
        if self._listener is None or self._listener.closed:
            raw = self._engine.raw_connection()
            try:
                dbapi = raw.driver_connection
                assert isinstance(dbapi, psycopg2.extensions.connection)
                # Detach from the pool: this connection lives as long as the relay.
                raw.detach()
                dbapi.autocommit = True
                with dbapi.cursor() as cur:
                    cur.execute(f"LISTEN {self.names.placeholders()['channel']}")
            except BaseException:
                raw.close()
                raise
            self._listener = dbapi
        return self._listener

    @contextlib.contextmanager
    def _on_listener(self, what: str) -> Iterator[psycopg2.extensions.connection]:
        """The LISTEN connection (opened if need be) for one step.

        A step that fails drops the connection, and with it the wake lock it
        may hold: the next step starts on a new session.
        """
        try:
            with _translated(what):
                yield self._listen()
        except (StorageError, OSError):
            self._drop_listener()
            raise

    def wait_for_wakeup(self, timeout: float) -> bool:
        """Block until an enqueue commits (True) or ``timeout`` seconds pass (False)."""
        with self._on_listener("listening for new events") as conn:
            if conn.notifies:
                conn.notifies.clear()
                return True
            ready, _, _ = select.select([conn], [], [], timeout)
            if ready:
                conn.poll()
                woke = bool(conn.notifies)
                conn.notifies.clear()
                return woke
            return False

    def drop_wakeups(self) -> None:
        """Read and forget the notifications that have arrived, without waiting.

        A listening session that is not read holds the server's notification
        queue (shared by the whole cluster) at its position: the relay calls
        this in every busy cycle. Nothing to do before the first LISTEN.
        """
        if self._listener is None or self._listener.closed:
            return
        with self._on_listener("reading notifications") as conn:
            # Whatever the socket holds now, read in a few gulps at most.
            deadline = time.monotonic() + 0.05
            while True:
                conn.poll()
                conn.notifies.clear()
                ready, _, _ = select.select([conn], [], [], 0)
                if not ready or time.monotonic() > deadline:
                    break

    # The wake lock: held while this relay waits idle, so that producers notify.

    @property
    def idle_announced(self) -> bool:
        """Whether this relay holds the wake lock (producers notify it)."""
        return self._idle and self._listener is not None and not self._listener.closed

    def announce_idle(self, wait: float) -> bool:
        """Take the wake lock, waiting up to ``wait`` seconds; whether it is held now.

        Producers that committed meanwhile without a notify held the lock
        shared, so once this returns True every event they wrote is visible:
        look for work once more before waiting for a notification. False when
        another relay holds the lock or a producer's transaction outlasted
        ``wait``; producers then notify only if another relay holds it.
        """
        if self.idle_announced:
            return True
        with self._on_listener("announcing an idle relay") as conn, conn.cursor() as cur:
            cur.execute(self._q.driver_sql("wake_lock_timeout"), {"milliseconds": _millis(wait)})
            try:
                cur.execute(self._q.driver_sql("announce_idle"), self._wake_lock)
            except psycopg2.errors.LockNotAvailable:
                return False
        self._idle = True
        return True

    def announce_busy(self) -> None:
        """Let go of the wake lock, if held: producers stop notifying."""
        if not self.idle_announced:
            self._idle = False
            return
        with self._on_listener("announcing a busy relay") as conn, conn.cursor() as cur:
            cur.execute(self._q.driver_sql("announce_busy"), self._wake_lock)
        self._idle = False

    def another_relay_idle(self) -> bool:
        """Whether another relay holds the wake lock (and so producers notify)."""
        lock_id = self._wake_lock["wake_lock"]
        params = {"lock_high": (lock_id >> 32) & 0xFFFFFFFF, "lock_low": lock_id & 0xFFFFFFFF}
        with self._on_listener("looking for an idle relay") as conn, conn.cursor() as cur:
            cur.execute(self._q.driver_sql("wake_lock_held_by_relay"), params)
            row = cur.fetchone()
        return bool(row and row[0])

    def _drop_listener(self) -> None:
        self._idle = False  # the lock goes with the session
        if self._listener is not None:
            with contextlib.suppress(Exception):
                self._listener.close()
            self._listener = None

    def close(self) -> None:
        self._drop_listener()
        self._engine.dispose()


def _millis(seconds: float) -> str:
    return str(max(1, round(seconds * 1000)))
