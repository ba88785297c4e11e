"""One migrated outbox database for the relay benches: fills, resets, counts, a start gate.

Two ways to fill a table:

* :meth:`Table.fill` writes events through ``Outbox.enqueue_many``, as an
  application would;
* :meth:`Table.fill_server_side` writes rows with one ``INSERT ... SELECT``
  on the server, for backlogs too large to write through the producer API in
  a bench's time. The rows are what ``enqueue_many`` would write for the
  same events: the same columns, value and header bytes built from one
  ``Outbox.encode`` template with each row's own event id and key, so the
  relay sends them as it would any event (valid envelopes); time-ordered
  version-7 ids; per-key sequence numbers from 1; the counter and key-queue
  rows to match. What differs: every row carries the same ``data``, and the
  rows are backdated by a microsecond each instead of being written one
  transaction at a time.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, text

from outbox_kafka import Event, Outbox, migrate

from .common import BenchContext
from .producer import EVENT_TYPE
from .workload import DEFAULT_SIZE, HOT_KEY, chunks, key_name, payload

#: Fills write ``enqueue_many`` calls of this many events, CALLS_PER_TRANSACTION per transaction.
FILL_BATCH = 1_000
CALLS_PER_TRANSACTION = 10

#: The template's key: replaced by each row's own key (as a JSON string) in the envelope.
_TEMPLATE_KEY = key_name(0)

#: Every statement the relay benches run themselves (the outbox's own are in
#: outbox_kafka/sql). ``{events}``, ``{keys}`` and ``{seqs}`` are the outbox's
#: quoted table names. The naive loop's statements are in psycopg2's ``%(name)s``
#: style: it runs them on a raw driver cursor, as the relay runs its own, so
#: neither pays for SQLAlchemy rows; the others are SQLAlchemy ``:name`` text.
SQL: dict[str, str] = {
    "truncate": "TRUNCATE {events}, {keys}, {seqs}, {arrivals}, {floors}",
    "analyze": "ANALYZE {events}, {keys}, {seqs}",
    "vacuum_events": "VACUUM (ANALYZE) {events}",
    "vacuum_keys": "VACUUM (ANALYZE) {keys}",
    "vacuum_seqs": "VACUUM (ANALYZE) {seqs}",
    "pending": "SELECT count(*) FROM {events} WHERE status = 'pending'",
    "delivered": "SELECT count(*) FROM {events} WHERE status = 'delivered'",
    "discarded": "SELECT count(*) FROM {events} WHERE status = 'discarded'",
    "delivered_of_key": """
        SELECT count(*) FROM {events} WHERE status = 'delivered' AND ordering_key = :key
    """,
    "naive_select": """
        SELECT CAST(event_id AS text), ordering_key, topic, value, headers
        FROM {events}
        WHERE status = 'pending'
        ORDER BY created_at
        LIMIT %(limit)s
    """,
    "naive_mark": """
        UPDATE {events}
        SET status = 'delivered', delivered_at = now()
        WHERE event_id = ANY(CAST(%(ids)s AS uuid[]))
    """,
    # Undo a claim without recording anything: the keys become due again in
    # their original order (the hot key, queued first, stays at the front).
    "release_keys": """
        UPDATE {keys}
        SET claim_token = NULL, lease_expires_at = NULL, due_at = created_at
        WHERE claim_token IS NOT NULL
    """,
    "latency": """
        SELECT count(*),
               percentile_cont(0.5) WITHIN GROUP (ORDER BY s),
               percentile_cont(0.9) WITHIN GROUP (ORDER BY s),
               percentile_cont(0.99) WITHIN GROUP (ORDER BY s),
               max(s)
        FROM (
            SELECT EXTRACT(EPOCH FROM delivered_at - created_at) AS s
            FROM {events}
            WHERE status = 'delivered' AND topic = :topic
        ) AS d
    """,
    # Events 1 .. :hot on the hot key, then :others spread over :keys keys
    # (event i on key (i - :hot - 1) mod :keys), created a microsecond apart
    # in that order, so the hot key heads the queue.
    "fill_events": """
        INSERT INTO {events} (event_id, ordering_key, seq, topic, type, value, headers,
                              available_at, created_at)
        SELECT g.id, g.k, g.seq, :topic, :event_type,
               convert_to(replace(replace(:value_template, :id_marker, CAST(g.id AS text)),
                                  :key_marker, '"partitionkey":' || CAST(to_json(g.k) AS text)),
                          'UTF8'),
               CAST(replace(:headers_template, :id_marker, CAST(g.id AS text)) AS jsonb),
               g.at, g.at
        FROM (
            SELECT CAST(:id_prefix || lpad(to_hex(i), 15, '0') AS uuid) AS id,
                   CASE WHEN i <= :hot THEN :hot_key
                        ELSE 'customer-' || lpad(CAST((i - :hot - 1) % :keys AS text), 5, '0')
                   END AS k,
                   CASE WHEN i <= :hot THEN i ELSE (i - :hot - 1) / :keys + 1 END AS seq,
                   now() - make_interval(secs => (:hot + :others - i) * 0.000001) AS at
            FROM generate_series(1, :hot + :others) AS i
        ) AS g
    """,
    "fill_seqs": """
        INSERT INTO {seqs} (ordering_key, last_seq)
        SELECT ordering_key, max(seq) FROM {events} GROUP BY ordering_key
    """,
    # The key queue as enqueue leaves it: one row per key with pending events,
    # due from its first event, queued in the order of first writes.
    "fill_keys": """
        INSERT INTO {keys} (ordering_key, next_seq, due_at, created_at)
        SELECT ordering_key, min(seq), min(available_at), min(created_at)
        FROM {events}
        WHERE status = 'pending'
        GROUP BY ordering_key
    """,
    "clear_keys": "DELETE FROM {keys}",
    "reset_delivered": """
        UPDATE {events}
        SET status = 'pending', delivered_at = NULL, claim_token = NULL,
            kafka_partition = NULL, kafka_offset = NULL
        WHERE status = 'delivered'
    """,
    "lock_keys": "LOCK TABLE {keys} IN ACCESS EXCLUSIVE MODE",
    # Relay claims (the only statement that locks keys SKIP LOCKED before any
    # work) waiting for the lock: other sessions of the relay, such as its
    # backlog sampler, may wait on the same lock and are not counted.
    "claims_waiting": """
        SELECT count(*) FROM pg_stat_activity
        WHERE datname = current_database()
          AND pid <> pg_backend_pid()
          AND wait_event_type = 'Lock'
          AND query LIKE '%SKIP LOCKED%'
    """,
    "any_pending": """
        SELECT CAST(EXISTS (SELECT 1 FROM {events} WHERE status = 'pending') AS integer)
    """,
}


@dataclass(frozen=True)
class ServerFill:
    """A server-side fill: ``hot`` events on the hot key, then ``others`` over ``keys`` keys."""

    topic: str
    others: int
    keys: int
    hot: int = 0
    size: int = DEFAULT_SIZE

    @property
    def count(self) -> int:
        return self.hot + self.others

    def describe(self) -> str:
        spread = f"{self.others:,} over {self.keys:,} keys"
        if not self.others:
            return f"{self.hot:,} on one key"
        return f"{self.hot:,} on one key + {spread}" if self.hot else spread


class Table:
    """One migrated database: fill, reset, truncate, count, read latencies."""

    def __init__(self, ctx: BenchContext, url: str, outbox: Outbox, connections: int = 2) -> None:
        self.ctx = ctx
        self.url = url
        self.outbox = outbox
        self.engine: Engine = ctx.engine_factory(url, pool_size=connections)
        migrate(self.engine)
        placeholders = outbox.names.placeholders()
        self.sql = {name: sql.format_map(placeholders) for name, sql in SQL.items()}

    def close(self) -> None:
        self.engine.dispose()

    def scalar(self, name: str, **params: Any) -> int:
        with self.engine.begin() as conn:
            return int(conn.execute(text(self.sql[name]), params).scalar_one())

    def statement(self, name: str, **params: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(self.sql[name]), params)

    def vacuum(self) -> None:
        """VACUUM (ANALYZE) the three tables, as autovacuum would have by now."""
        with self.engine.connect() as conn:
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            for name in ("vacuum_events", "vacuum_keys", "vacuum_seqs"):
                auto.execute(text(self.sql[name]))

    def fill(self, events: Iterable[Event]) -> tuple[int, float]:
        """Enqueue ``events`` (truncating first), ``FILL_BATCH`` per call; (count, seconds)."""
        self.statement("truncate")
        count = 0
        start = time.perf_counter()
        calls = chunks(events, FILL_BATCH)
        while True:
            with self.engine.begin() as conn:
                written = 0
                for batch in calls:
                    self.outbox.enqueue_many(conn, batch)
                    count += len(batch)
                    written += 1
                    if written == CALLS_PER_TRANSACTION:
                        break
            if written < CALLS_PER_TRANSACTION:
                break
        seconds = time.perf_counter() - start
        self.statement("analyze")
        return count, seconds

    def fill_server_side(self, fill: ServerFill) -> float:
        """Truncate, write ``fill`` with one INSERT ... SELECT, VACUUM ANALYZE; seconds."""
        if fill.keys > 100_000:
            raise ValueError("server-side fills name at most 100,000 keys (5 digits)")
        rng = random.Random(fill.count)
        sample = self.outbox.encode(
            Event(
                type=EVENT_TYPE,
                key=_TEMPLATE_KEY,
                data=payload(rng, 0, fill.size),
                topic=fill.topic,
            )
        )
        value_template = sample.value.decode()
        key_marker = '"partitionkey":' + f'"{_TEMPLATE_KEY}"'
        if value_template.count(key_marker) != 1 or value_template.count(str(sample.event_id)) != 1:
            raise RuntimeError("the envelope template does not hold its id and key once each")
        # 48 bits of milliseconds, version 7, 12 random bits, the variant, then the row number.
        id_prefix = f"{time.time_ns() // 1_000_000:012x}7{rng.getrandbits(12):03x}8"
        params = {
            "topic": fill.topic,
            "event_type": sample.type,
            "value_template": value_template,
            "headers_template": sample.stored_headers,
            "id_marker": str(sample.event_id),
            "key_marker": key_marker,
            "id_prefix": id_prefix,
            "hot": fill.hot,
            "hot_key": HOT_KEY,
            "others": fill.others,
            "keys": max(1, fill.keys),
        }
        self.statement("truncate")
        start = time.perf_counter()
        with self.engine.begin() as conn:
            conn.execute(text(self.sql["fill_events"]), params)
            conn.execute(text(self.sql["fill_seqs"]))
            conn.execute(text(self.sql["fill_keys"]))
        self.vacuum()
        return time.perf_counter() - start

    def reset_delivered(self) -> None:
        """Make every delivered event pending again and rebuild the key queue to match.

        After a measurement has sent part of a server-side fill, this puts
        the table back as it was filled (same topic), cheaper than a refill.
        """
        with self.engine.begin() as conn:
            conn.execute(text(self.sql["reset_delivered"]))
            conn.execute(text(self.sql["clear_keys"]))
            conn.execute(text(self.sql["fill_keys"]))
        self.vacuum()

    def expect_drained(self, count: int, what: str) -> None:
        pending = self.scalar("pending")
        delivered = self.scalar("delivered")
        if pending or delivered != count:
            raise RuntimeError(
                f"{what}: {delivered:,} of {count:,} events delivered, {pending:,} still pending"
            )

    def latencies(self, topic: str) -> tuple[int, float, float, float, float]:
        """(delivered, p50, p90, p99, max) of commit-to-ack seconds for ``topic``."""
        with self.engine.connect() as conn:
            count, p50, p90, p99, top = conn.execute(
                text(self.sql["latency"]), {"topic": topic}
            ).one()
        return int(count), float(p50 or 0), float(p90 or 0), float(p99 or 0), float(top or 0)

    @contextlib.contextmanager
    def start_gate(self) -> Iterator[Gate]:
        """Hold the key queue locked, so relays started now wait at their first claim."""
        with self.engine.connect() as conn:
            transaction = conn.begin()
            try:
                conn.execute(text(self.sql["lock_keys"]))
                yield Gate(self, conn, transaction.commit)
            finally:
                if transaction.is_active:
                    transaction.rollback()


class Gate:
    """The start line of a throughput measurement (see :meth:`Table.start_gate`).

    Relays started behind the gate open their connections and their Kafka
    producer (connection, producer id) and then block on their first claim;
    :meth:`open` releases them all at once, so start-up is not timed.
    """

    def __init__(self, table: Table, conn: Connection, release: Callable[[], None]) -> None:
        self._table = table
        self._conn = conn
        self._release = release

    def wait_for(
        self, waiters: int, alive: Callable[[], bool] = lambda: True, timeout: float = 60.0
    ) -> None:
        """Wait until ``waiters`` relay claims wait on the key queue."""
        deadline = time.monotonic() + timeout
        # Another connection: this one holds the lock and must not see its own snapshot.
        with self._table.engine.connect() as probe:
            while True:
                found = probe.execute(text(self._table.sql["claims_waiting"])).scalar_one()
                probe.rollback()
                if found >= waiters:
                    return
                if not alive():
                    raise RuntimeError("a relay exited before its first claim")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{found} of {waiters} relays reached their first claim")
                time.sleep(0.02)

    def open(self) -> None:
        self._release()
