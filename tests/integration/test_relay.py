"""The relay against a real PostgreSQL and a real Kafka-protocol broker.

Every test reads back what the relay published with a plain confluent-kafka
consumer (all partitions, from the beginning) and checks it against what was
committed: nothing lost, per-key commit order, the right partition, and
duplicates only where a crash makes them unavoidable.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import psycopg2.extensions
import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from outbox_kafka import Event
from outbox_kafka.cli.relay_command import FORCED_EXIT_GRACE
from outbox_kafka.database import make_engine
from outbox_kafka.demo.embedded import EmbeddedBroker
from outbox_kafka.limits import DEFAULT_MAX_CLAIM_BYTES, DEFAULT_MAX_MESSAGE_BYTES
from outbox_kafka.naming import TableNames
from outbox_kafka.operations import requeue_events
from outbox_kafka.relay import CycleReport, Relay
from outbox_kafka.relay.batch import Claim, EventOutcome, EventStatus, KeyOutcome
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.observe import RelayObserver
from outbox_kafka.relay.store import Store
from outbox_kafka.schema.statements import pg_array, pg_int_array, pg_text_array, queries_for
from outbox_kafka.stored_headers import headers_from_json, message_size
from tests.relay_support import (
    Record,
    RelayThread,
    TcpProxy,
    claimed_count,
    consume_all,
    database_proxy,
    delivered_count,
    delivered_positions_problem,
    discarded_count,
    enqueue_bulk,
    kafka_partition,
    make_settings,
    missing_from_topic,
    murmur2,
    outbox_summary,
    per_key_order,
    rows,
    running_relay,
    scalar,
    seq_events,
    topic_outbox,
    wait_until,
)

REPO = Path(__file__).resolve().parent.parent.parent
NAMES = TableNames()


def drain(settings: RelaySettings) -> CycleReport:
    """One relay's ``drain()``, closed afterwards."""
    relay = Relay(settings)
    try:
        return relay.drain()
    finally:
        relay.close()


def ids_by_key(events: list[Event], ids: list[str]) -> dict[str, list[str]]:
    """Event ids per key in the order they were written (one writer: commit order)."""
    out: dict[str, list[str]] = defaultdict(list)
    for event, event_id in zip(events, ids, strict=True):
        out[event.key].append(event_id)
    return dict(out)


def assert_each_key_on_its_partition(records: list[Record], partitions: int) -> None:
    seen: dict[str, set[int]] = defaultdict(set)
    for r in records:
        assert r.key is not None
        seen[r.key].add(r.partition)
    for key, parts in seen.items():
        assert len(parts) == 1, f"key {key!r} is spread over partitions {sorted(parts)}"
        assert parts == {kafka_partition(key.encode(), partitions)}, key


def wait_for_batch_in_flight(engine: sa.Engine, *, after: int) -> None:
    """Wait until ``after`` events are delivered and the relay holds a claimed batch.

    "Delivered" only grows when a batch is recorded, so waiting for the count
    alone would fire just between two batches.
    """
    wait_until(
        lambda: delivered_count(engine) >= after and claimed_count(engine) > 0,
        60,
        interval=0.005,
        what=f"{after:,} delivered and a batch in flight",
    )


def create_topic(bootstrap: str, partitions: int) -> str:
    name = f"p-{uuid.uuid4().hex[:12]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        future.result(timeout=30)
    return name


def relay_command(database_url: str, bootstrap: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "outbox_kafka.cli",
        "relay",
        "--database-url",
        database_url,
        "--bootstrap-servers",
        bootstrap,
        "--poll-interval",
        "0.1",
        "--backoff-base",
        "0.05",
        "--backoff-cap",
        "0.5",
        *extra,
    ]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PYTHONPATH"] = str(REPO)
    return env


# --------------------------------------------------------------------------- 1. basic


def test_drain_publishes_every_event_once_with_its_envelope_and_headers(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(4)
    outbox = topic_outbox(source="urn:test:relay")
    keys = [f"clé-{i}" for i in range(10)]
    events = [
        Event(
            type="order.created",
            key=keys[i % 10],
            data={"n": i},
            topic=topic,
            headers=[("x-tenant", "acme"), ("x-bytes", b"\x00\xff"), ("x-tenant", "again")],
        )
        for i in range(100)
    ]
    ids = enqueue_bulk(engine, outbox, events, chunk=7)

    report = drain(make_settings(database_url, kafka_bootstrap))
    assert report.delivered == 100
    assert report.discarded == 0

    records = consume_all(kafka_bootstrap, topic, 100)
    assert len(records) == 100
    assert Counter(r.event_id for r in records) == Counter(ids)

    stored = {
        str(row.event_id): row
        for row in rows(
            engine,
            "SELECT event_id, ordering_key, status, value, kafka_partition, kafka_offset, "
            "delivered_at FROM outbox",
        )
    }
    for r in records:
        row = stored[r.event_id]
        assert r.raw == bytes(row.value)
        assert r.key_bytes == row.ordering_key.encode("utf-8")
        assert r.header_list == [
            ("content-type", b"application/cloudevents+json"),
            ("x-tenant", b"acme"),
            ("x-bytes", b"\x00\xff"),
            ("x-tenant", b"again"),
        ]
        assert r.value["id"] == r.event_id
        assert r.value["partitionkey"] == row.ordering_key
        assert row.status == "delivered"
        assert row.delivered_at is not None
        assert (row.kafka_partition, row.kafka_offset) == (r.partition, r.offset)

    order = per_key_order(records)
    assert order == ids_by_key(events, ids)
    assert_each_key_on_its_partition(records, 4)
    assert scalar(engine, "SELECT count(*) FROM outbox_keys") == 0


def test_murmur2_matches_kafka_reference_vectors() -> None:
    # org.apache.kafka.common.utils.UtilsTest#testMurmur2
    vectors = {
        b"21": -973932308,
        b"foobar": -790332482,
        b"a-little-bit-long-string": -985981536,
        b"a-little-bit-longer-string": -1486304829,
        b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
        b"abc": 479470107,
    }
    for data, expected in vectors.items():
        assert murmur2(data) == expected, data
    assert kafka_partition(b"21", 6) == (-973932308 & 0x7FFFFFFF) % 6


# --------------------------------------------------------------------------- 2. concurrency


@pytest.mark.slow
def test_concurrent_producers_and_relay_keep_per_key_commit_order(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(6)
    outbox = topic_outbox()
    keys = [f"key-{i}" for i in range(200)]
    total = 20_000
    writers = 8
    committed: dict[str, list[str]] = defaultdict(list)
    lock = threading.Lock()
    budget = [total]
    open_now, open_max = [0], [0]
    errors: list[BaseException] = []
    producer_engine = sa.create_engine(
        engine.url.render_as_string(hide_password=False), pool_size=writers
    )

    def produce(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while True:
                with lock:
                    n = min(rng.randint(1, 5), budget[0])
                    budget[0] -= n
                if n == 0:
                    return
                batch = [
                    Event(type="t.e", key=rng.choice(keys), data={"w": seed}, topic=topic)
                    for _ in range(n)
                ]
                conn = producer_engine.connect()
                try:
                    tx = conn.begin()
                    ids = outbox.enqueue_many(conn, batch)
                    with lock:
                        open_now[0] += 1
                        open_max[0] = max(open_max[0], open_now[0])
                    # The commit and its record happen under one lock, so the record is in
                    # commit order even when a thread is descheduled right after commit()
                    # returns. A commit never waits for a row lock: no deadlock, and the
                    # transactions themselves still interleave and wait on each other.
                    with lock:
                        tx.commit()
                        open_now[0] -= 1
                        for event, event_id in zip(batch, ids, strict=True):
                            committed[event.key].append(str(event_id))
                finally:
                    conn.close()
        except BaseException as exc:
            errors.append(exc)

    relay = Relay(make_settings(database_url, kafka_bootstrap, batch_size=500))
    with running_relay(relay) as thread:
        producers = [threading.Thread(target=produce, args=(s,)) for s in range(writers)]
        for p in producers:
            p.start()
        for p in producers:
            p.join(180)
        assert not errors, errors
        assert sum(len(v) for v in committed.values()) == total
        assert open_max[0] >= 2, "the writers never overlapped"
        wait_until(lambda: delivered_count(engine) == total, 90, what="all delivered")
        assert thread.is_alive() and thread.error is None
    producer_engine.dispose()

    records = consume_all(kafka_bootstrap, topic, total, timeout=60)
    counts = Counter(r.event_id for r in records)
    assert len(counts) == total
    assert max(counts.values()) == 1, "an event was published twice"
    assert per_key_order(records) == dict(committed)
    assert_each_key_on_its_partition(records, 6)
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status <> 'delivered'") == 0


# --------------------------------------------------------------------------- 3. one key


def test_single_key_backlog_is_delivered_in_order_many_per_batch(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(3)
    events = seq_events(topic, ["only"], 20_000)
    ids = enqueue_bulk(engine, topic_outbox(), events)

    relay = Relay(make_settings(database_url, kafka_bootstrap, batch_size=1000))
    try:
        report = relay.drain()
        cycles = _histogram_count(relay)
    finally:
        relay.close()
    assert report.delivered == 20_000
    assert cycles < 200, f"{cycles} cycles for 20,000 events of one key"

    records = consume_all(kafka_bootstrap, topic, 20_000)
    assert len(records) == 20_000
    assert per_key_order(records) == {"only": ids}
    assert {r.partition for r in records} == {kafka_partition(b"only", 3)}
    assert [r.value["data"]["n"] for r in sorted(records, key=lambda r: r.offset)] == list(
        range(20_000)
    )


def _histogram_count(relay: Relay) -> int:
    for metric in relay.metrics.registry.collect():
        if metric.name == "outbox_claim_duration_seconds":
            for sample in metric.samples:
                if sample.name.endswith("_count"):
                    return int(sample.value)
    raise AssertionError("no claim histogram")


# --------------------------------------------------------------------------- 4. claim cost


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def _rows_read(node: dict[str, Any]) -> float:
    """The rows a plan node went through: those it returned and those its filters
    dropped, over all its loops (EXPLAIN reports both per loop)."""
    removed = sum(
        node.get(f"Rows Removed by {what}", 0)
        for what in ("Filter", "Join Filter", "Index Recheck")
    )
    return (node["Actual Rows"] + removed) * node["Actual Loops"]


def _explain_claim(engine: sa.Engine, batch_size: int) -> dict[str, Any]:
    """EXPLAIN ANALYZE the claim's statement that reads events, then roll the claim back."""
    queries = queries_for(NAMES)
    with engine.connect() as conn:
        dbapi: Any = conn.connection.dbapi_connection
        cur = dbapi.cursor()
        try:
            cur.execute(queries.driver_sql("index_plans"))  # as the relay's claim does
            cur.execute(
                queries.driver_sql("claim_keys"),
                {
                    "token": str(uuid.uuid4()),
                    "session": None,
                    "max_keys": batch_size,
                    "lease_seconds": 30.0,
                },
            )
            leased = cur.fetchall()
            params = {
                "key_names": pg_text_array([row[0] for row in leased]),
                "key_next_seqs": pg_int_array([row[1] for row in leased]),
                "key_due_ats": pg_array([row[2] for row in leased]),
                "per_key_limit": max(1, batch_size // max(1, len(leased))),
                "max_bytes": DEFAULT_MAX_CLAIM_BYTES,
                "values_as_text": True,
            }
            sql = queries.driver_sql("claim_events")
            cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
            plan: dict[str, Any] = cur.fetchone()[0][0]["Plan"]
        finally:
            dbapi.rollback()
            cur.close()
    return plan


def _assert_bounded_plan(plan: dict[str, Any], batch_size: int) -> None:
    nodes = list(_plan_nodes(plan))
    claim_scans = [n for n in nodes if n.get("Index Name") == "outbox_claim_idx"]
    assert claim_scans, f"the claim does not read outbox_claim_idx: {json.dumps(plan)[:3000]}"
    for scan in claim_scans:
        assert scan["Actual Rows"] * scan["Actual Loops"] <= batch_size
    assert any(n["Node Type"] == "Limit" for n in nodes)
    assert not any(
        n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "outbox" for n in nodes
    )
    for n in nodes:
        read = _rows_read(n)
        assert read <= 2 * batch_size + 10, (
            f"{n['Node Type']} on {n.get('Relation Name') or n.get('Index Name')} reads "
            f"{read} rows for a batch of {batch_size}"
        )


class _ExplainingCursor(psycopg2.extensions.cursor):
    """A cursor that EXPLAIN ANALYZEs the claim's and the record's key statements just
    before running them, in their own transaction (a savepoint rolls the explained run
    back), and keeps the plans in :attr:`plans`."""

    plans: ClassVar[dict[str, dict[str, Any]]] = {}
    watched: ClassVar[dict[str, str]] = {}

    def execute(self, query: Any, vars: Any = None) -> None:
        statements = query.split(";\n") if isinstance(query, str) else [query]
        for i, statement in enumerate(statements):
            name = self.watched.get(statement)
            if name is None:
                continue
            # With the statements the store sends before it in the same string
            # (Queries.driver_batch), run as the server runs them: index_plans then
            # steers the plan of the statement after it in the same round trip.
            before = "".join(f"{earlier};\n" for earlier in statements[:i])
            super().execute("SAVEPOINT explained")
            super().execute(before + "EXPLAIN (ANALYZE, FORMAT JSON) " + statement, vars)
            row = self.fetchone()
            assert row is not None
            self.plans[name] = row[0][0]["Plan"]
            super().execute("ROLLBACK TO SAVEPOINT explained")
        super().execute(query, vars)


def _explaining_store(database_url: str, watched: tuple[str, ...]) -> Store:
    """A store whose cursors EXPLAIN the ``watched`` statements (fresh plans)."""
    queries = queries_for(NAMES)
    _ExplainingCursor.watched = {queries.driver_sql(name): name for name in watched}
    _ExplainingCursor.plans = {}
    return Store(
        database_url,
        NAMES,
        engine=make_engine(database_url, connect_args={"cursor_factory": _ExplainingCursor}),
    )


def test_claim_and_record_stay_within_the_batch_when_the_queue_statistics_are_stale(
    engine: sa.Engine, database_url: str
) -> None:
    """Statistics taken while the queue was empty (autovacuum off, or not there yet) do
    not turn the claim's or the record's key statements into whole-table reads: with
    such statistics the planner sorted every due key to claim the first few, and
    scanned every key's counter to record a batch."""
    queue = ("outbox_keys", "outbox_key_seq", "outbox_arrivals")
    with engine.connect() as conn:
        for table in queue:
            # Autovacuum would analyze them again once the keys are written.
            conn.exec_driver_sql(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
            conn.exec_driver_sql(f"ANALYZE {table}")
        conn.commit()
    keys = [f"k{i:05d}" for i in range(4000)]
    enqueue_bulk(engine, topic_outbox(), seq_events("stale-topic", keys, len(keys)))
    watched = ("admit_arrivals", "claim_keys", "lease_keys", "claim_events", "record_batch")
    store = _explaining_store(database_url, watched)
    try:
        # The first claims move the writers' arrivals into the key queue; then one
        # claims 100 of the 4,000 due keys, and its record removes them.
        for _ in range(10):
            claim = store.claim(batch_size=100, lease_seconds=30.0, max_keys=100)
            store.record(claim.token, [KeyOutcome.unchanged(k) for k in claim.keys], [])
        claim = store.claim(batch_size=100, lease_seconds=30.0, max_keys=100)
        assert len(claim.keys) == 100
        outcomes = [
            EventOutcome(e.event_id, e.key, EventStatus.DELIVERED, 0, 0.0, 0, i, None)
            for i, e in enumerate(e for k in claim.keys for e in k.events)
        ]
        next_seqs = [KeyOutcome(k.key, k.events[-1].seq + 1, 0.0, False, True) for k in claim.keys]
        assert store.record(claim.token, next_seqs, outcomes).keys_removed == 100
    finally:
        store.close()
    for name in watched:
        for node in _plan_nodes(_ExplainingCursor.plans[name]):
            read = _rows_read(node)
            assert read <= 2 * 100 + 10, (
                f"{name}: {node['Node Type']} on "
                f"{node.get('Relation Name') or node.get('Index Name')} reads {read} rows "
                f"for 100 keys of 4,000: {json.dumps(_ExplainingCursor.plans[name])[:2000]}"
            )


def test_record_reads_its_batch_not_the_backlog_of_its_keys(
    engine: sa.Engine, database_url: str
) -> None:
    """A record marks its events through their ids: with a few keys each holding a
    deep backlog, the planner read every pending event of the batch's keys (15 keys
    of 500: 7,500 rows to mark 990) and hashed them to find the batch's."""
    keys = [f"deep-{i:02d}" for i in range(15)]
    enqueue_bulk(engine, topic_outbox(), seq_events("deep-topic", keys, 15 * 500))
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE")
        conn.commit()
    store = _explaining_store(database_url, ("record_batch",))
    try:
        claim = store.claim(batch_size=1000, lease_seconds=30.0, max_keys=15)
        assert claim.event_count == 990
        outcomes = [
            EventOutcome(e.event_id, e.key, EventStatus.DELIVERED, 0, 0.0, 0, i, None)
            for i, e in enumerate(e for k in claim.keys for e in k.events)
        ]
        next_seqs = [KeyOutcome(k.key, k.events[-1].seq + 1, 0.0, False, False) for k in claim.keys]
        assert store.record(claim.token, next_seqs, outcomes).delivered == 990
    finally:
        store.close()
    for node in _plan_nodes(_ExplainingCursor.plans["record_batch"]):
        read = _rows_read(node)
        assert read <= 2 * 990 + 10, (
            f"record_batch: {node['Node Type']} on "
            f"{node.get('Relation Name') or node.get('Index Name')} reads {read} rows "
            f"to mark 990 events: {json.dumps(_ExplainingCursor.plans['record_batch'])[:2000]}"
        )


@pytest.mark.slow
def test_claim_cost_is_bounded_by_the_batch_not_by_a_hot_key_backlog(
    engine: sa.Engine, database_url: str
) -> None:
    outbox = topic_outbox()
    hot = 100_000
    enqueue_bulk(engine, outbox, seq_events("hot-topic", ["hot"], hot))
    others = [f"cold-{i:04d}" for i in range(1000)]
    enqueue_bulk(engine, outbox, seq_events("cold-topic", others, 1000))
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE outbox")
        conn.exec_driver_sql("ANALYZE outbox_keys")
        conn.commit()

    # The plans: index-driven, limited, reading O(batch) rows, never the 100,000-event
    # backlog. (With statistics, the planner may hash-join the whole 1,001-row keys table
    # in the claim's UPDATE: a small-table choice, inside 2 x batch for batch >= 500.)
    _assert_bounded_plan(_explain_claim(engine, 500), 500)
    _assert_bounded_plan(_explain_claim(engine, 1000), 1000)

    store = Store(database_url, NAMES)
    timings: list[float] = []
    try:
        started = time.perf_counter()
        first = store.claim(batch_size=500, lease_seconds=30)
        timings.append(time.perf_counter() - started)
        claimed = {k.key: k for k in first.keys}
        # The hot key is the oldest, so it is claimed, but it does not crowd out the others.
        assert "hot" in claimed
        assert len(first.keys) == 500
        assert len(claimed["hot"].events) == first.per_key_limit == 1
        assert first.event_count == 500
        assert [e.seq for e in claimed["hot"].events] == [1]

        # Claim the remaining cold keys, then let only the hot key be due.
        while True:
            started = time.perf_counter()
            more = store.claim(batch_size=500, lease_seconds=30)
            timings.append(time.perf_counter() - started)
            if not more.keys:
                break
            assert "hot" not in {k.key for k in more.keys}, "a leased key was claimed again"
            assert all(len(k.events) == 1 for k in more.keys)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "UPDATE outbox_keys SET due_at = now(), claim_token = NULL "
                "WHERE ordering_key = 'hot'"
            )
        _assert_bounded_plan(_explain_claim(engine, 1000), 1000)
        started = time.perf_counter()
        alone = store.claim(batch_size=1000, lease_seconds=30)
        timings.append(time.perf_counter() - started)
        assert [k.key for k in alone.keys] == ["hot"]
        assert alone.per_key_limit == 1000
        assert [e.seq for e in alone.keys[0].events] == list(range(1, 1001))
    finally:
        store.close()
    print("claim timings (s):", [round(t, 4) for t in timings])


# --------------------------------------------------------------------------- 5. broker cut


@pytest.mark.slow
def test_broker_cut_mid_run_loses_nothing_and_keeps_order(
    engine: sa.Engine,
    database_url: str,
    proxied_broker: tuple[TcpProxy, EmbeddedBroker],
) -> None:
    proxy, broker = proxied_broker
    bootstrap = broker.bootstrap  # the proxy's address
    topic = create_topic(bootstrap, 4)
    keys = [f"k{i:02d}" for i in range(50)]
    events = seq_events(topic, keys, 5000)
    ids = enqueue_bulk(engine, topic_outbox(), events)
    expected = ids_by_key(events, ids)

    relay = Relay(make_settings(database_url, bootstrap, batch_size=100))
    with running_relay(relay) as thread:
        wait_until(lambda: delivered_count(engine) >= 1000, 60, interval=0.02, what="1,000")
        proxy.cut()
        cut_at = delivered_count(engine)
        time.sleep(10)
        during = delivered_count(engine)
        assert thread.is_alive(), thread.error
        proxy.restore()
        wait_until(
            lambda: delivered_count(engine) == 5000 or discarded_count(engine) > 0,
            60,
            what="all delivered after the broker came back",
            explain=lambda: outbox_summary(engine),
        )
        assert discarded_count(engine) == 0, (
            f"events were discarded after a 10 s outage:\n{outbox_summary(engine)}"
        )
        assert thread.is_alive() and thread.error is None
    assert cut_at < 5000 and during < 5000, "the cut came too late to test anything"

    records = consume_all(bootstrap, topic, 5000)
    assert {r.event_id for r in records} == set(ids)
    assert per_key_order(records) == expected
    # By position in each partition: the first occurrences of a key's events are in seq order.
    for key, got in per_key_order(records).items():
        seqs = [events[ids.index(i)].data["n"] for i in got]
        assert seqs == sorted(seqs), key
    attempts = scalar(engine, "SELECT coalesce(sum(attempts), 0) FROM outbox")
    assert thread.total("retried") > 0 or attempts > 0


# --------------------------------------------------------------------------- 6. poison events


def _poison_setup(
    engine: sa.Engine, topic: str, poison: str
) -> tuple[dict[str, list[str]], str, bytes]:
    """Key P: ok, POISON, ok, ok; keys a and b: 3 events each. Returns ids, poison id, value."""
    big = topic_outbox(max_message_bytes=5_000_000)
    written: dict[str, list[str]] = defaultdict(list)
    poison_id = ""
    for step in range(4):
        with engine.begin() as conn:
            for key in ("a", "b"):
                if step < 3:
                    written[key].extend(
                        str(i)
                        for i in big.enqueue_many(
                            conn, [Event(type="t.e", key=key, data={"n": step}, topic=topic)]
                        )
                    )
            data: Any = {"n": step}
            if step == 1 and poison == "large":
                data = {"n": step, "pad": "x" * 1_500_000}
            [event_id] = big.enqueue_many(
                conn, [Event(type="t.e", key="P", data=data, topic=topic)]
            )
            written["P"].append(str(event_id))
            if step == 1:
                poison_id = str(event_id)
    original = bytes(scalar(engine, "SELECT value FROM outbox WHERE event_id = :id", id=poison_id))
    corruption = {
        "corrupt": "UPDATE outbox SET value = 'not json'::bytea WHERE event_id = :id",
        "headers": 'UPDATE outbox SET headers = \'{"not": "a list"}\'::jsonb WHERE event_id = :id',
    }
    if poison in corruption:
        with engine.begin() as conn:
            conn.execute(sa.text(corruption[poison]), {"id": poison_id})
    return dict(written), poison_id, original


def test_claims_keep_to_their_byte_budget_and_every_event_still_goes_in_key_order(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """With a 25 kB claim budget, events of 10 kB come a few per claim (keys past the
    budget are handed back untouched), one of 60 kB comes alone, and every event
    of every key is delivered, in its key's order."""
    topic = new_topic(2)
    outbox = topic_outbox()
    events = [
        Event(type="t.e", key=key, data={"n": n, "pad": "x" * size}, topic=topic)
        for n in range(8)
        for key in ("a", "b", "c")
        for size in [60_000 if (key, n) == ("b", 3) else 10_000]
    ]
    ids = enqueue_bulk(engine, outbox, events)
    budget = 25_000
    relay = Relay(make_settings(database_url, kafka_bootstrap, max_claim_bytes=budget))
    claimed_bytes: list[int] = []
    withheld_keys: list[int] = []
    claim = relay.store.claim

    def measured_claim(**kwargs: Any) -> Any:
        result = claim(**kwargs)
        claimed_bytes.append(sum(len(e.value) for k in result.keys for e in k.events))
        withheld_keys.append(sum(k.withheld for k in result.keys))
        return result

    relay.store.claim = measured_claim  # type: ignore[method-assign]
    try:
        report = relay.drain()
    finally:
        relay.close()
    assert (report.delivered, report.discarded) == (len(events), 0)
    records = consume_all(kafka_bootstrap, topic, len(events))
    assert per_key_order(records) == ids_by_key(events, [str(i) for i in ids])
    largest = max(
        len(bytes(v))
        for (v,) in rows(engine, "SELECT value FROM outbox WHERE status = 'delivered'")
    )
    assert largest > budget
    assert max(claimed_bytes) <= budget + largest
    assert sum(withheld_keys) > 0, "no claim reached the budget"
    assert len([b for b in claimed_bytes if b > 0]) >= sum(len(e.data["pad"]) for e in events) // (
        budget + largest
    )


def test_the_claim_budget_goes_round_robin_over_the_keys(
    engine: sa.Engine, database_url: str
) -> None:
    """Four keys with three events of 10 kB each and a 25 kB budget: the first
    events of three keys come (not all of the first key's), and every key keeps
    the rest for later, marked withheld."""
    outbox = topic_outbox()
    keys = ["a", "b", "c", "d"]
    enqueue_bulk(
        engine,
        outbox,
        [
            Event(type="t.e", key=k, data={"n": n, "pad": "x" * 10_000}, topic="t")
            for n in range(3)
            for k in keys
        ],
    )
    store = Store(database_url, NAMES)
    try:
        claim = store.claim(batch_size=1000, lease_seconds=30, max_bytes=25_000)
    finally:
        store.close()
    claimed = {k.key: ([e.seq for e in k.events], k.withheld) for k in claim.keys}
    assert claimed == {
        "a": ([1], True),
        "b": ([1], True),
        "c": ([1], True),
        "d": ([], True),
    }


def test_an_event_enqueue_accepts_near_its_size_limit_is_delivered(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """Enqueue and the relay share one limit: an event of about 1,015,000 bytes, above
    librdkafka's default message.max.bytes (1,000,000) and within enqueue's default
    limit, goes out (it used to be committed, then discarded as MSG_SIZE_TOO_LARGE)."""
    topic = new_topic(1)
    outbox = topic_outbox()
    with engine.begin() as conn:
        [event_id] = outbox.enqueue_many(
            conn, [Event(type="t.e", key="big", data={"pad": "x" * 1_015_000}, topic=topic)]
        )
    value, headers = rows(
        engine,
        "SELECT value, headers FROM outbox WHERE event_id = :id",
        id=str(event_id),
    )[0]
    sent_headers = headers_from_json(headers)
    assert sent_headers is not None
    size = message_size(b"big", bytes(value), sent_headers)
    assert 1_000_000 < size <= DEFAULT_MAX_MESSAGE_BYTES

    report = drain(make_settings(database_url, kafka_bootstrap))
    assert (report.delivered, report.discarded) == (1, 0)
    [record] = consume_all(kafka_bootstrap, topic, 1)
    assert record.event_id == str(event_id)
    assert record.raw == bytes(value)


@pytest.mark.parametrize(
    ("poison", "reason"),
    [
        ("large", "MSG_SIZE_TOO_LARGE"),
        ("corrupt", "INVALID_ENVELOPE"),
        ("headers", "INVALID_HEADERS"),
    ],
)
def test_poison_event_is_discarded_and_its_key_continues(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    poison: str,
    reason: str,
) -> None:
    topic = new_topic(2)
    written, poison_id, _ = _poison_setup(engine, topic, poison)

    report = drain(make_settings(database_url, kafka_bootstrap))
    assert report.discarded == 1
    assert report.delivered == 9

    status, error = rows(
        engine, "SELECT status, last_error FROM outbox WHERE event_id = :id", id=poison_id
    )[0]
    assert status == "discarded"
    assert reason in error
    if poison == "corrupt":
        assert "not JSON" in error

    records = consume_all(kafka_bootstrap, topic, 9)
    expected = {k: [i for i in v if i != poison_id] for k, v in written.items()}
    assert per_key_order(records) == expected
    assert len(records) == 9
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'") == 0


def test_parked_key_holds_later_events_of_the_same_batch(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """With on_exhausted=park, nothing after the discarded event may reach Kafka."""
    topic = new_topic(2)
    written, poison_id, _ = _poison_setup(engine, topic, "corrupt")

    drain(make_settings(database_url, kafka_bootstrap, on_exhausted="park"))

    statuses = dict(
        rows(
            engine,
            "SELECT CAST(event_id AS text), status FROM outbox WHERE ordering_key = 'P'",
        )
    )
    p = written["P"]
    assert statuses[p[0]] == "delivered"
    assert statuses[poison_id] == "discarded"
    assert scalar(engine, "SELECT parked_at IS NOT NULL FROM outbox_keys WHERE ordering_key='P'")
    assert [statuses[i] for i in p[2:]] == ["pending", "pending"], (
        "events after the parked event were published past it"
    )
    records = consume_all(kafka_bootstrap, topic, 7)
    assert per_key_order(records)["P"] == [p[0]]


def test_parked_key_waits_until_requeued_then_flows_in_order(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(2)
    outbox = topic_outbox()
    settings = make_settings(database_url, kafka_bootstrap, on_exhausted="park")
    first = enqueue_bulk(engine, outbox, seq_events(topic, ["P", "other"], 4))
    p_ids = first[0::2]
    poison_id = p_ids[-1]  # the last event of P is the poison: nothing behind it in this batch
    original = bytes(scalar(engine, "SELECT value FROM outbox WHERE event_id = :id", id=poison_id))
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET value = 'not json'::bytea WHERE event_id = :id"),
            {"id": poison_id},
        )
    report = drain(settings)
    assert (report.delivered, report.discarded) == (3, 1)
    assert scalar(engine, "SELECT parked_at IS NOT NULL FROM outbox_keys WHERE ordering_key='P'")

    later = enqueue_bulk(engine, outbox, seq_events(topic, ["P", "other"], 6))
    p_later = later[0::2]
    report = drain(settings)
    assert report.delivered == 3  # only "other"
    pending = rows(
        engine,
        "SELECT CAST(event_id AS text) FROM outbox WHERE status = 'pending' ORDER BY seq",
    )
    assert [r[0] for r in pending] == p_later
    assert scalar(engine, "SELECT parked_at IS NOT NULL FROM outbox_keys WHERE ordering_key='P'")

    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET value = :v WHERE event_id = :id"),
            {"v": original, "id": poison_id},
        )
    assert requeue_events(engine, [poison_id]) == 1
    assert requeue_events(engine, [poison_id]) == 0  # no longer discarded
    report = drain(settings)
    assert (report.delivered, report.discarded) == (4, 0)

    records = consume_all(kafka_bootstrap, topic, 10)
    order = per_key_order(records)
    assert order["P"] == [*p_ids, *p_later]
    assert order["other"] == first[1::2] + later[1::2]
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status <> 'delivered'") == 0
    assert scalar(engine, "SELECT count(*) FROM outbox_keys") == 0


def test_discarded_event_is_copied_to_the_dead_letter_topic(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(2)
    dlt = new_topic(1, prefix="dlt")
    written, poison_id, _ = _poison_setup(engine, topic, "corrupt")

    report = drain(make_settings(database_url, kafka_bootstrap, dead_letter_topic=dlt))
    assert (report.delivered, report.discarded) == (9, 1)

    [copy] = consume_all(kafka_bootstrap, dlt, 1)
    assert copy.headers["outbox_event_id"] == poison_id.encode()
    assert copy.key == "P"
    assert copy.raw == b"not json"
    assert b"INVALID_ENVELOPE" in copy.headers["outbox_error"]
    assert copy.headers["outbox_original_topic"] == topic.encode()
    error = scalar(engine, "SELECT last_error FROM outbox WHERE event_id = :id", id=poison_id)
    assert "INVALID_ENVELOPE" in error
    records = consume_all(kafka_bootstrap, topic, 9)
    assert per_key_order(records)["P"] == [i for i in written["P"] if i != poison_id]


def test_oversized_event_with_a_dead_letter_topic_does_not_block_its_key(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """An event too large for Kafka is too large for the dead-letter topic too.

    Its dead-letter copy can never succeed, so it must end (discarded, or given
    up after max_attempts) instead of holding its key forever.
    """
    topic = new_topic(2)
    dlt = new_topic(1, prefix="dlt")
    _, poison_id, _ = _poison_setup(engine, topic, "large")
    settings = make_settings(database_url, kafka_bootstrap, dead_letter_topic=dlt, max_attempts=3)
    relay = Relay(settings)
    try:
        relay.drain()
        [later] = enqueue_bulk(engine, topic_outbox(), seq_events(topic, ["P"], 1))
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            relay.drain()
            if not scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'"):
                break
            time.sleep(0.2)
    finally:
        relay.close()
    status, attempts = rows(
        engine, "SELECT status, attempts FROM outbox WHERE event_id = :id", id=poison_id
    )[0]
    later_status = scalar(engine, "SELECT status FROM outbox WHERE event_id = :id", id=later)
    assert (status, later_status) == ("discarded", "delivered"), (
        f"the oversized event is still {status} after {attempts} attempts "
        f"(max_attempts=3) and the next event of its key is {later_status}"
    )


# --------------------------------------------------------------------------- 7. kill -9


def _spawn_relay(
    database_url: str, bootstrap: str, log: Path, *extra: str
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        relay_command(database_url, bootstrap, *extra),
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=clean_env(),
    )


@pytest.mark.slow
def test_relay_killed_with_sigkill_is_taken_over_without_loss(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    topic = new_topic(4)
    keys = [f"k{i:03d}" for i in range(100)]
    events = seq_events(topic, keys, 20_000)
    ids = enqueue_bulk(engine, topic_outbox(), events)
    expected = ids_by_key(events, ids)
    batch = 500

    proc = _spawn_relay(
        database_url,
        kafka_bootstrap,
        tmp_path / "relay1.log",
        "--lease-seconds",
        "4",
        "--delivery-timeout-ms",
        "2000",
        "--batch-size",
        str(batch),
    )
    try:
        wait_for_batch_in_flight(engine, after=3000)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    at_kill = delivered_count(engine)
    assert at_kill < 20_000, "the relay finished before it could be killed"
    assert claimed_count(engine) > 0, "the relay was not killed mid-batch"

    relay = Relay(
        make_settings(
            database_url,
            kafka_bootstrap,
            lease_seconds=4,
            batch_size=batch,
            delivery_timeout_ms=2000,
        )
    )
    with running_relay(relay):
        wait_until(lambda: delivered_count(engine) == 20_000, 90, what="all delivered")

    records = consume_all(kafka_bootstrap, topic, 20_000)
    assert {r.event_id for r in records} == set(ids)
    assert per_key_order(records) == expected
    duplicates = len(records) - len({r.event_id for r in records})
    assert duplicates <= batch, f"{duplicates} duplicates, more than one batch ({batch})"
    # A duplicate is the same event again: same event id, same bytes, for the same (key, n).
    by_position: dict[tuple[str | None, int], set[tuple[str, bytes]]] = defaultdict(set)
    for r in records:
        by_position[(r.key, r.value["data"]["n"])].add((r.event_id, r.raw))
    assert all(len(v) == 1 for v in by_position.values())


# --------------------------------------------------------------------------- 8. three relays


def test_three_relays_share_one_outbox_without_loss_reordering_or_duplicates(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(6)
    keys = [f"k{i:03d}" for i in range(300)]
    events = seq_events(topic, keys, 10_000)
    ids = enqueue_bulk(engine, topic_outbox(), events)

    threads = [
        RelayThread(
            Relay(make_settings(database_url, kafka_bootstrap, batch_size=200, relay_id=f"r{i}")),
            name=f"relay-{i}",
        ).start()
        for i in range(3)
    ]
    try:
        wait_until(lambda: delivered_count(engine) == 10_000, 90, what="all delivered")
    finally:
        for t in threads:
            t.stop()
    for t in threads:
        assert t.error is None
        assert t.total("leases_lost") == 0
    assert sum(1 for t in threads if t.total("delivered") > 0) >= 2, "one relay did everything"

    records = consume_all(kafka_bootstrap, topic, 10_000)
    assert len(records) == 10_000, missing_from_topic(engine, records)
    assert len({r.event_id for r in records}) == 10_000
    assert delivered_positions_problem(engine) is None
    assert per_key_order(records) == ids_by_key(events, ids)
    assert_each_key_on_its_partition(records, 6)


# --------------------------------------------------------------------------- 9. SIGTERM


def test_sigterm_finishes_the_batch_and_exits_zero(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    topic = new_topic(3)
    events = seq_events(topic, [f"k{i}" for i in range(50)], 10_000)
    ids = enqueue_bulk(engine, topic_outbox(), events)
    log = tmp_path / "relay.log"
    command = relay_command(
        database_url, kafka_bootstrap, "--batch-size", "200", "--shutdown-timeout", "10"
    )
    command[0:3] = [str(Path(sys.executable).with_name("outbox-kafka"))]
    proc = subprocess.Popen(
        command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=clean_env()
    )
    try:
        wait_for_batch_in_flight(engine, after=1000)
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = proc.wait(15)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()
    assert took < 10
    assert claimed_count(engine) == 0
    left = 10_000 - delivered_count(engine)
    assert left > 0, "the relay finished before SIGTERM"

    report = drain(make_settings(database_url, kafka_bootstrap))
    assert report.delivered == left
    records = consume_all(kafka_bootstrap, topic, 10_000)
    assert {r.event_id for r in records} == set(ids)
    assert per_key_order(records) == ids_by_key(events, ids)


def test_sigterm_while_the_relay_starts_stops_it_and_exits_zero(
    database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A signal that comes while the relay is still starting stops it like any other,
    rather than ending the process as an unhandled SIGTERM does (exit -15)."""
    # The relay reads its Kafka settings from a FIFO: it waits there until a writer
    # comes, which holds it in its start-up for as long as the test needs.
    fifo = tmp_path / "kafka.conf"
    os.mkfifo(fifo)
    log = tmp_path / "relay.log"
    command = relay_command(database_url, kafka_bootstrap, "--kafka-config-file", str(fifo))
    proc = subprocess.Popen(
        command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=clean_env()
    )
    try:
        writer = None
        deadline = time.monotonic() + 60
        while writer is None:
            try:
                # Succeeds once the relay has the FIFO open for reading.
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the relay never opened its config file"
                time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # the signal is handled before the file's end arrives
        with contextlib.suppress(BrokenPipeError):  # the relay is gone: its exit code says why
            os.write(writer, b"linger.ms=5\n")
        os.close(writer)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()
    assert "relay stopped" in log.read_text()


def test_sigterm_exits_by_its_deadline_while_the_database_does_not_answer(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    """A database that stops answering without closing its connections (a frozen host,
    a network dropping packets) holds the relay in a call that does not return; SIGTERM
    still ends the process within --shutdown-timeout plus FORCED_EXIT_GRACE, it says why,
    and another relay then delivers everything, once."""
    topic = new_topic(2)
    first = seq_events(topic, ["a", "b", "c"], 30)
    ids = enqueue_bulk(engine, topic_outbox(), first)
    proxy, through = database_proxy(database_url)
    log = tmp_path / "relay.log"
    command = relay_command(through, kafka_bootstrap, "--shutdown-timeout", "1")
    proc = subprocess.Popen(
        command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=clean_env()
    )
    try:
        wait_until(lambda: delivered_count(engine) == 30, 60, what="the first events delivered")
        proxy.hang()
        ids += enqueue_bulk(engine, topic_outbox(), seq_events(topic, ["a", "d"], 10))
        # The relay's next look at the database (within its 0.1 s poll) waits for an answer.
        wait_until(lambda: proxy.stalled > 0, 30, what="the relay waiting on the database")
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = proc.wait(1 + FORCED_EXIT_GRACE + 30)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proxy.close()
    text = log.read_text()
    assert code == 0, text
    assert 1 + FORCED_EXIT_GRACE - 1 < took < 1 + FORCED_EXIT_GRACE + 10, text
    assert "forced_exit" in text, text
    # drain_all: a request the proxy passed on just before it hung may still hold its
    # rows' locks until the server notices its client has gone.
    relay = Relay(make_settings(database_url, kafka_bootstrap))
    try:
        drained = relay.drain_all(60)
    finally:
        relay.close()
    assert drained.complete, drained
    assert drained.report.delivered == 10
    records = consume_all(kafka_bootstrap, topic, 40)
    assert sorted(r.event_id for r in records) == sorted(ids)


def test_drain_and_stop_give_back_the_claim_read_ahead(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """The next claim is read while a batch is in flight; stopping must not strand its keys."""
    topic = new_topic(2)
    # More keys than one claim takes, so the claim read ahead has keys of its own.
    keys = [f"k{i}" for i in range(500)]
    first = seq_events(topic, keys, 2_000)
    ids = enqueue_bulk(engine, topic_outbox(), first)
    settings = make_settings(database_url, kafka_bootstrap, batch_size=100)
    relay = Relay(settings)
    try:
        assert relay.drain().delivered == 2_000
        assert claimed_count(engine) == 0
    finally:
        relay.close()

    second = seq_events(topic, keys, 20_000)
    ids += enqueue_bulk(engine, topic_outbox(), second)
    relay = Relay(settings)
    send = relay.publisher.send
    sends = 0

    def send_then_stop(*args: Any, **kwargs: Any) -> Any:
        # Stop while a batch is being sent: the next claim is being read ahead then.
        nonlocal sends
        sends += 1
        if sends == 20:
            relay.stop()
        return send(*args, **kwargs)

    relay.publisher.send = send_then_stop  # type: ignore[method-assign]
    with running_relay(relay) as thread:
        wait_until(lambda: not thread.is_alive(), timeout=60)
    assert claimed_count(engine) == 0
    assert delivered_count(engine) < 22_000, "the relay finished before it was stopped"

    drain(settings)
    records = consume_all(kafka_bootstrap, topic, 22_000)
    assert {r.event_id for r in records} == set(ids)
    assert per_key_order(records) == ids_by_key(first + second, ids)


class ReleaseCounter(RelayObserver):
    """Counts the claims read ahead that a relay released unsent, too old to use."""

    def __init__(self) -> None:
        self.claims = 0

    def read_ahead_released(self, keys: int) -> None:
        self.claims += 1


def test_a_claim_read_ahead_behind_a_slow_send_is_claimed_afresh_not_sent_late(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """A claim read during a 2 s send has 1 s of its 3 s lease left: too little for its own send."""
    topic = new_topic(2)
    events = seq_events(topic, [f"k{i}" for i in range(150)], 300)
    ids = enqueue_bulk(engine, topic_outbox(), events)
    relay = Relay(
        make_settings(
            database_url, kafka_bootstrap, batch_size=50, lease_seconds=3, delivery_timeout_ms=2400
        )
    )
    send = relay.publisher.send
    released = ReleaseCounter()
    relay.observer.observers.append(released)

    def slow_send(*args: Any, **kwargs: Any) -> Any:
        time.sleep(2.0)  # a broker that answers late, within the delivery timeout
        return send(*args, **kwargs)

    relay.publisher.send = slow_send  # type: ignore[method-assign]
    try:
        report = relay.drain()
    finally:
        relay.close()
    assert released.claims > 0, "no claim was read ahead behind a slow send"
    assert report.leases_lost == 0
    assert report.delivered == 300
    records = consume_all(kafka_bootstrap, topic, 300)
    assert sorted(r.event_id for r in records) == sorted(str(i) for i in ids)  # once each
    assert per_key_order(records) == ids_by_key(events, ids)


def test_a_batch_is_sent_while_the_one_before_it_is_recorded_and_no_further_ahead(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """A batch's record runs while the next batch is sent, and no batch is sent while
    two before it are unrecorded: at most two are ever sent and unrecorded, what a
    kill -9 can leave to the read-back of the keys' next holder.

    Each record is slowed to 0.2 s, far longer than a send, so a loop that did not
    wait for a record before handing over the next one would get further ahead.
    """
    topic = new_topic(2)
    events = seq_events(topic, [f"k{i}" for i in range(400)], 2_000)
    ids = enqueue_bulk(engine, topic_outbox(), events)
    lock = threading.Lock()
    sent: list[str] = []  # claim tokens, in the order their batches were sent
    recorded: set[str] = set()
    unrecorded_at_send: list[int] = []  # batches before it unrecorded as each send ends

    class Watch(RelayObserver):
        def sent(self, claim: Claim, seconds: float) -> None:
            with lock:
                unrecorded_at_send.append(sum(1 for t in sent if t not in recorded))
                sent.append(str(claim.token))

    relay = Relay(make_settings(database_url, kafka_bootstrap, batch_size=200), observers=[Watch()])
    record = relay.store.record

    def slow_record(token: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.2)
        result = record(token, *args, **kwargs)
        with lock:
            recorded.add(str(token))
        return result

    relay.store.record = slow_record  # type: ignore[method-assign]
    try:
        report = relay.drain()
    finally:
        relay.close()
    assert report.delivered == 2_000
    assert len(sent) >= 10, f"only {len(sent)} batches"
    assert max(unrecorded_at_send) == 1, unrecorded_at_send  # overlapped, never further
    records = consume_all(kafka_bootstrap, topic, 2_000)
    assert sorted(r.event_id for r in records) == sorted(str(i) for i in ids)
    assert per_key_order(records) == ids_by_key(events, ids)


# --------------------------------------------------------------------------- 10. topics, fencing


def test_missing_topic_holds_its_key_unless_topics_are_created(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    existing = new_topic(2)
    missing = f"missing-{uuid.uuid4().hex[:10]}"
    outbox = topic_outbox()
    with engine.begin() as conn:
        [held] = outbox.enqueue_many(conn, [Event(type="t.e", key="K", data={}, topic=missing)])
        behind, fine = outbox.enqueue_many(
            conn,
            [
                Event(type="t.e", key="K", data={"n": 1}, topic=existing),
                Event(type="t.e", key="L", data={"n": 1}, topic=existing),
            ],
        )
    report = drain(make_settings(database_url, kafka_bootstrap))
    assert (report.delivered, report.discarded) == (1, 0)
    status, attempts, error = rows(
        engine, "SELECT status, attempts, last_error FROM outbox WHERE event_id = :id", id=str(held)
    )[0]
    assert (status, attempts) == ("pending", 0)
    assert "--create-topics" in error and missing in error
    assert [r.event_id for r in consume_all(kafka_bootstrap, existing, 1)] == [str(fine)]

    # With topic creation on, the held key goes on in order once it is due again.
    relay = Relay(make_settings(database_url, kafka_bootstrap, create_topics=3))
    try:
        relay.drain_all(timeout=10)
    finally:
        relay.close()
    assert [r.event_id for r in consume_all(kafka_bootstrap, missing, 1)] == [str(held)]
    ids = [r.event_id for r in consume_all(kafka_bootstrap, existing, 2)]
    assert ids == [str(fine), str(behind)]

    created = f"created-{uuid.uuid4().hex[:10]}"
    with engine.begin() as conn:
        [made] = outbox.enqueue_many(conn, [Event(type="t.e", key="M", data={}, topic=created)])
    report = drain(make_settings(database_url, kafka_bootstrap, create_topics=3))
    assert report.delivered == 1
    [record] = consume_all(kafka_bootstrap, created, 1)
    assert record.event_id == str(made)
    meta = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(created, timeout=10)
    assert len(meta.topics[created].partitions) == 3
    assert record.partition == kafka_partition(b"M", 3)


def test_finish_is_fenced_by_the_claim_token(engine: sa.Engine, database_url: str) -> None:
    outbox = topic_outbox()
    enqueue_bulk(engine, outbox, seq_events("fenced", ["a", "b"], 4))
    store = Store(database_url, NAMES)
    try:
        claim = store.claim(batch_size=10, lease_seconds=30)
        assert {k.key for k in claim.keys} == {"a", "b"}
        with engine.begin() as conn:
            conn.exec_driver_sql("UPDATE outbox_keys SET claim_token = gen_random_uuid()")
        keys = [KeyOutcome(k.key, k.events[-1].seq + 1, 0.0, False, True) for k in claim.keys]
        outcomes = [
            EventOutcome(e.event_id, k.key, "delivered", 0, 0.0, 0, n, None)
            for k in claim.keys
            for n, e in enumerate(k.events)
        ]
        result = store.record(claim.token, keys, outcomes)
    finally:
        store.close()
    assert result.keys_owned == 0
    assert (result.delivered, result.discarded, result.retried) == (0, 0, 0)
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'") == 4
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE kafka_offset IS NOT NULL") == 0
    remaining = rows(engine, "SELECT ordering_key, next_seq, claim_token FROM outbox_keys")
    assert sorted((r[0], r[1]) for r in remaining) == [("a", 1), ("b", 1)]
    assert all(r[2] is not None and r[2] != claim.token for r in remaining)


# --------------------------------------------------------------------------- 11. backoff


def test_unreachable_broker_backs_off_without_losing_or_discarding(
    engine: sa.Engine,
    database_url: str,
    proxied_broker: tuple[TcpProxy, EmbeddedBroker],
) -> None:
    proxy, broker = proxied_broker
    topic = create_topic(broker.bootstrap, 2)
    outbox = topic_outbox()
    enqueue_bulk(engine, outbox, seq_events(topic, ["warm"], 1))
    settings = make_settings(
        database_url, broker.bootstrap, delivery_timeout_ms=1000, backoff_base=1, backoff_cap=4
    )
    relay = Relay(settings)
    with running_relay(relay) as thread:
        wait_until(lambda: delivered_count(engine) == 1, 30, what="warm-up")
        proxy.cut()
        ids = enqueue_bulk(engine, outbox, seq_events(topic, ["a", "b"], 6))
        # From the third retry on, the backoff is in [2, 4] s: a head spends most of
        # its time not due, and so does its key. The two keys drift apart (one may
        # be in a send while the other backs off), so wait for a moment when both
        # are backed off, read in one snapshot.
        backed_off = (
            "SELECT (SELECT count(DISTINCT ordering_key) FROM outbox "
            "        WHERE status = 'pending' AND attempts >= 3), "
            "       (SELECT count(*) FROM outbox WHERE status = 'pending' AND attempts >= 3 "
            "        AND available_at > now() + interval '0.5 seconds'), "
            "       (SELECT count(*) FROM outbox_keys WHERE due_at > now() + interval '0.5 s')"
        )
        wait_until(
            lambda: tuple(rows(engine, backed_off)[0]) == (2, 2, 2),
            30,
            what="both keys' heads retried three times and backed off together",
        )
        heads = rows(
            engine,
            "SELECT ordering_key, attempts, last_error FROM outbox WHERE status = 'pending' "
            "AND attempts > 0",
        )
        assert thread.is_alive()
        # Only a key's head is retried; the events behind it wait untouched.
        assert sorted(h[0] for h in heads) == ["a", "b"]
        assert all(h[2] for h in heads)
        assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'discarded'") == 0
        proxy.restore()
        wait_until(lambda: delivered_count(engine) == 7, 60, what="all delivered")
    records = consume_all(broker.bootstrap, topic, 7)
    assert {r.event_id for r in records} >= set(ids)
    order = per_key_order(records)
    assert order["a"] == ids[0::2] and order["b"] == ids[1::2]


def test_cycle_with_broker_unreachable_from_the_start_stays_within_the_lease(
    engine: sa.Engine,
    database_url: str,
    proxied_broker: tuple[TcpProxy, EmbeddedBroker],
) -> None:
    """Metadata failures must not cost seconds per claimed event."""
    proxy, broker = proxied_broker
    topic = create_topic(broker.bootstrap, 2)
    enqueue_bulk(engine, topic_outbox(), seq_events(topic, ["a", "b", "c"], 3))
    proxy.cut()
    settings = make_settings(database_url, broker.bootstrap)
    relay = Relay(settings)
    try:
        started = time.monotonic()
        report = relay.cycle()
        took = time.monotonic() - started
    finally:
        relay.close()
    assert report.delivered == 0 and report.discarded == 0
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'") == 3
    assert took < settings.lease_seconds, (
        f"one cycle over 3 events took {took:.1f} s, longer than the "
        f"{settings.lease_seconds} s lease"
    )
