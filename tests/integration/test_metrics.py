"""Every metric moves when its event happens, against a real PostgreSQL and a real broker.

Each relay gets a registry of its own (``RelayMetrics()``), so the values read
here are exactly what that relay did.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY, CollectorRegistry

import outbox_kafka
from outbox_kafka import Event, Outbox
from outbox_kafka.naming import TableNames
from outbox_kafka.operations import unpark_keys
from outbox_kafka.relay import Relay
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.metrics import SLICE_PAUSE, BacklogSampler, Monitor, RelayMetrics
from outbox_kafka.relay.observe import LogObserver, Observers
from outbox_kafka.schema.statements import queries_for
from tests.outage_support import DatabaseSwitch
from tests.relay_support import (
    admit_arrivals,
    delivered_count,
    enqueue_bulk,
    make_settings,
    running_relay,
    scalar,
    seq_events,
    topic_outbox,
    wait_until,
)
from tests.support import LogRecords

#: Nothing listens on port 1: every metadata request fails at once.
DEAD_BROKER = "127.0.0.1:1"
NAMES = TableNames()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def pending_count(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'"))


@pytest.fixture
def relay_for(database_url: str) -> Iterator[Callable[..., Relay]]:
    """``relay_for(bootstrap, **settings)``: a relay with its own registry, closed afterwards."""
    made: list[Relay] = []

    def make(bootstrap: str, **overrides: Any) -> Relay:
        relay = Relay(make_settings(database_url, bootstrap, **overrides), metrics=RelayMetrics())
        made.append(relay)
        return relay

    yield make
    for relay in made:
        relay.close()


@pytest.fixture
def database_switch(server_url: str, database_url: str) -> Iterator[DatabaseSwitch]:
    switch = DatabaseSwitch(server_url, database_url)
    try:
        yield switch
    finally:
        switch.close()


# --------------------------------------------------------------------------- relay counters


def test_a_drain_counts_published_events_durations_and_the_last_cycle(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_for: Callable[..., Relay],
) -> None:
    topic, other = new_topic(2), new_topic(1)
    enqueue_bulk(engine, topic_outbox(), seq_events(topic, ["a", "b", "c"], 30))
    enqueue_bulk(engine, topic_outbox(), seq_events(other, ["d"], 4))
    relay = relay_for(kafka_bootstrap)
    r = relay.metrics.registry
    assert value(r, "outbox_relay_last_cycle_timestamp_seconds") == 0.0
    before = time.time()

    report = relay.drain()

    assert report.delivered == 34
    assert value(r, "outbox_events_published_total", topic=topic) == 30
    assert value(r, "outbox_events_published_total", topic=other) == 4
    for histogram in (
        "outbox_claim_duration_seconds",
        "outbox_publish_duration_seconds",
        "outbox_mark_duration_seconds",
    ):
        assert value(r, f"{histogram}_count") >= 1, histogram
        assert value(r, f"{histogram}_sum") > 0, histogram
    # One latency per delivered event, measured on the database clock.
    assert value(r, "outbox_commit_to_ack_seconds_count") == 34
    assert value(r, "outbox_commit_to_ack_seconds_sum") > 0
    last = value(r, "outbox_relay_last_cycle_timestamp_seconds")
    assert before - 1 <= last <= time.time() + 1
    assert value(r, "outbox_events_retried_total", topic=topic, reason="NO_REPORT") == 0
    info = {
        "version": outbox_kafka.__version__,
        "settings_digest": relay.settings.digest(),
        "table": relay.settings.names.qualified_events,
        "on_exhausted": "continue",
    }
    assert value(r, "outbox_relay_info", **info) == 1


def test_a_failed_send_counts_a_retry_by_topic_and_reason(
    engine: sa.Engine, relay_for: Callable[..., Relay]
) -> None:
    enqueue_bulk(engine, topic_outbox(), seq_events("orders", ["a", "b", "c"], 6))
    relay = relay_for(DEAD_BROKER)

    report = relay.cycle()

    assert report.retried == 3  # each key's head; the events behind it wait
    r = relay.metrics.registry
    assert (
        value(r, "outbox_events_retried_total", topic="orders", reason="METADATA_UNAVAILABLE") == 3
    )
    assert value(r, "outbox_events_published_total", topic="orders") == 0
    assert pending_count(engine) == 6


def test_a_discarded_event_is_counted_by_topic_and_reason(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_for: Callable[..., Relay],
) -> None:
    topic = new_topic(1)
    ids = enqueue_bulk(engine, topic_outbox(), seq_events(topic, ["a", "b"], 6))
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET value = 'not json'::bytea WHERE event_id = :id"),
            {"id": ids[2]},
        )
    relay = relay_for(kafka_bootstrap)

    relay.drain()

    r = relay.metrics.registry
    assert value(r, "outbox_events_discarded_total", topic=topic, reason="INVALID_ENVELOPE") == 1
    assert value(r, "outbox_events_published_total", topic=topic) == 5


def test_a_lease_taken_over_mid_flight_is_counted(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_for: Callable[..., Relay],
) -> None:
    topic = new_topic(1)
    enqueue_bulk(engine, topic_outbox(), seq_events(topic, ["a", "b"], 4))
    relay = relay_for(kafka_bootstrap)
    send = relay.publisher.send

    def send_then_lose_key_a(*args: Any, **kwargs: Any) -> Any:
        deliveries = send(*args, **kwargs)
        # Another relay takes key "a" over while this batch is in flight.
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE outbox_keys SET claim_token = gen_random_uuid() "
                    "WHERE ordering_key = 'a'"
                )
            )
        return deliveries

    relay.publisher.send = send_then_lose_key_a  # type: ignore[method-assign]
    report = relay.cycle()

    assert report.leases_lost == 1
    assert value(relay.metrics.registry, "outbox_leases_lost_total") == 1
    # Kafka acknowledged all four; only the key still owned was recorded as delivered.
    assert value(relay.metrics.registry, "outbox_events_published_total", topic=topic) == 4
    assert delivered_count(engine) == 2


def test_database_errors_are_counted_and_the_relay_recovers(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_for: Callable[..., Relay],
    database_switch: DatabaseSwitch,
) -> None:
    topic = new_topic(1)
    outbox = topic_outbox()
    enqueue_bulk(engine, outbox, seq_events(topic, ["a"], 2))
    relay = relay_for(kafka_bootstrap, sample_interval=0.2)
    r = relay.metrics.registry
    with running_relay(relay) as thread:
        wait_until(lambda: delivered_count(engine) == 2, 30, what="the first events")
        database_switch.down()
        wait_until(
            lambda: value(r, "outbox_database_errors_total") >= 3,
            30,
            what="database errors to be counted",
        )
        database_switch.up()
        enqueue_bulk(engine, outbox, seq_events(topic, ["a", "b"], 4))
        wait_until(lambda: delivered_count(engine) == 6, 60, what="delivery after the outage")
        assert thread.is_alive() and thread.error is None
    assert value(r, "outbox_events_published_total", topic=topic) == 6


def test_purged_events_are_counted(
    engine: sa.Engine, kafka_bootstrap: str, relay_for: Callable[..., Relay]
) -> None:
    ids = enqueue_bulk(engine, topic_outbox(), seq_events("orders", ["a"], 5))
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox SET status = 'delivered', delivered_at = now() - interval '8 days' "
                "WHERE event_id = ANY(CAST(:ids AS uuid[]))"
            ),
            {"ids": ids[:3]},
        )
    relay = relay_for(kafka_bootstrap)
    relay.purge_once()
    assert value(relay.metrics.registry, "outbox_events_purged_total") == 3


# --------------------------------------------------------------------------- producer side


def failures(registry: CollectorRegistry, reason: str) -> float:
    return value(registry, "outbox_enqueue_failures_total", reason=reason)


def test_enqueue_failures_are_counted_once_each_by_reason(engine: sa.Engine) -> None:
    registry = CollectorRegistry()
    outbox = Outbox(allow_unknown_types=True, registry=registry)
    reasons = ("validation", "duplicate_event_id", "unsafe_connection", "database", "other")
    assert {reason: failures(registry, reason) for reason in reasons} == dict.fromkeys(reasons, 0)

    with engine.begin() as conn:
        outbox.enqueue(conn, type="t", key="k", data={}, topic="orders")
        outbox.enqueue_many(conn, [Event(type="t", key="k", data={}, topic="orders")] * 3)
    assert sum(failures(registry, reason) for reason in reasons) == 0

    with engine.begin() as conn, pytest.raises(outbox_kafka.InvalidKey):
        outbox.enqueue(conn, type="t", key="", data={}, topic="orders")
    with engine.begin() as conn, pytest.raises(outbox_kafka.InvalidData):
        outbox.enqueue_many(
            conn,
            [
                Event(type="t", key="k", data={}, topic="orders"),
                Event(type="t", key="k", data={"x": float("nan")}, topic="orders"),
            ],
        )
    assert failures(registry, "validation") == 2

    event_id = uuid.uuid4()
    with engine.begin() as conn:
        outbox.enqueue(conn, type="t", key="k", data={}, topic="orders", event_id=event_id)
    with engine.begin() as conn, pytest.raises(outbox_kafka.DuplicateEventId):
        outbox.enqueue(conn, type="t", key="k", data={}, topic="orders", event_id=event_id)
    assert failures(registry, "duplicate_event_id") == 1

    with engine.connect() as raw:
        auto = raw.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(outbox_kafka.UnsafeConnection):
            outbox.enqueue(auto, type="t", key="k", data={}, topic="orders")
    assert failures(registry, "unsafe_connection") == 1

    missing = Outbox(table="no_such_table", allow_unknown_types=True, registry=registry)
    with engine.begin() as conn, pytest.raises(sa.exc.ProgrammingError):
        missing.enqueue(conn, type="t", key="k", data={}, topic="orders")
    assert failures(registry, "database") == 1
    assert failures(registry, "validation") == 2
    assert scalar(engine, "SELECT count(*) FROM outbox") == 5


def test_the_module_level_enqueue_counts_on_the_global_registry(engine: sa.Engine) -> None:
    before = failures(REGISTRY, "validation")
    with engine.begin() as conn, pytest.raises(outbox_kafka.InvalidKey):
        outbox_kafka.enqueue(conn, type="t", key="", data={}, topic="orders")
    assert failures(REGISTRY, "validation") == before + 1


# --------------------------------------------------------------------------- backlog gauges


def test_backlog_gauges_follow_pending_events_their_age_and_parked_keys(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_for: Callable[..., Relay],
) -> None:
    topic = new_topic(1)
    outbox = topic_outbox()
    ids = enqueue_bulk(engine, outbox, seq_events(topic, ["a", "b"], 8))
    parked_ids = enqueue_bulk(engine, outbox, seq_events(topic, ["p"], 3))
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET created_at = now() - interval '120 s' WHERE event_id = :id"),
            {"id": ids[0]},
        )
        conn.execute(
            sa.text("UPDATE outbox SET value = 'not json'::bytea WHERE event_id = :id"),
            {"id": parked_ids[0]},
        )
    settings = make_settings(database_url, kafka_bootstrap, on_exhausted="park")
    metrics = RelayMetrics()
    sampler = BacklogSampler(settings, metrics)
    r = metrics.registry
    try:
        assert sampler.sample_once() is not None
        assert value(r, "outbox_pending_events") == 11 == pending_count(engine)
        assert value(r, "outbox_oldest_pending_age_seconds") >= 120
        assert value(r, "outbox_parked_keys") == 0

        relay_for(kafka_bootstrap, on_exhausted="park").drain()
        sampler.sample_once()
        # Key p is parked behind its discarded head; its two later events wait.
        assert value(r, "outbox_parked_keys") == 1
        assert value(r, "outbox_pending_events") == 2 == pending_count(engine)
        assert 0 < value(r, "outbox_oldest_pending_age_seconds") < 120

        unpark_keys(engine, ["p"])
        relay_for(kafka_bootstrap).drain()
        sampler.sample_once()
        assert value(r, "outbox_parked_keys") == 0
        assert value(r, "outbox_pending_events") == 0 == pending_count(engine)
        assert value(r, "outbox_oldest_pending_age_seconds") == 0
        assert value(r, "outbox_consistency_violations") == 0

        # A pending event whose key left the queue: no relay would ever reach it.
        enqueue_bulk(engine, outbox, seq_events(topic, ["s"], 2))
        admit_arrivals(engine)
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM outbox_keys WHERE ordering_key = 's'"))
        sampler.sample_once()
        assert value(r, "outbox_consistency_violations") == 1
    finally:
        sampler.stop()


def test_the_running_relay_samples_in_its_own_thread(
    engine: sa.Engine, relay_for: Callable[..., Relay]
) -> None:
    enqueue_bulk(engine, topic_outbox(), seq_events("orders", ["a", "b", "c"], 9))
    # No broker: the events stay pending while the relay keeps cycling.
    relay = relay_for(DEAD_BROKER, sample_interval=0.2)
    r = relay.metrics.registry
    with running_relay(relay):
        wait_until(lambda: value(r, "outbox_pending_events") == 9, 30, what="a backlog sample")
        enqueue_bulk(engine, topic_outbox(), seq_events("orders", ["d"], 3))
        wait_until(lambda: value(r, "outbox_pending_events") == 12, 30, what="a later sample")
        assert value(r, "outbox_oldest_pending_age_seconds") > 0
        # Cycles keep completing (each send fails fast), so the loop's gauge moves too.
        wait_until(
            lambda: value(r, "outbox_relay_last_cycle_timestamp_seconds") > 0,
            30,
            what="a completed cycle",
        )


def test_a_failed_sample_is_logged_and_counted_and_the_next_one_works(
    engine: sa.Engine, database_url: str, database_switch: DatabaseSwitch
) -> None:
    enqueue_bulk(engine, topic_outbox(), seq_events("orders", ["a"], 2))
    metrics = RelayMetrics()
    sampler = BacklogSampler(
        RelaySettings(database_url, DEAD_BROKER), Observers([metrics, LogObserver()])
    )
    r = metrics.registry
    logger, seen = logging.getLogger("outbox_kafka.sampler"), LogRecords()
    logger.addHandler(seen)
    try:
        assert sampler.sample_once() is not None
        database_switch.down()
        assert sampler.sample_once() is None
        assert value(r, "outbox_database_errors_total") == 1
        failed = [rec for rec in seen.records if getattr(rec, "action", None) == "sample_failed"]
        assert len(failed) == 1 and "sampling the backlog failed" in failed[0].error  # type: ignore[attr-defined]
        assert value(r, "outbox_pending_events") == 2  # the last good sample stays
        database_switch.up()
        assert sampler.sample_once() is not None
    finally:
        logger.removeHandler(seen)
        sampler.stop()


def test_a_backlog_of_more_keys_than_a_slice_is_added_up_over_a_sweep(
    engine: sa.Engine, database_url: str
) -> None:
    outbox = topic_outbox()
    enqueue_bulk(engine, outbox, seq_events("orders", [f"q{i}" for i in range(7)], 21))
    admit_arrivals(engine)  # seven keys in the key queue, three events each
    enqueue_bulk(engine, outbox, seq_events("orders", [f"a{i}" for i in range(5)], 10))
    enqueue_bulk(engine, outbox, seq_events("orders", ["q3"], 2))  # queued, and arrived again
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox SET created_at = now() - interval '300 s' "
                "WHERE ordering_key = 'q5' AND seq = 1"
            )
        )
    metrics = RelayMetrics()
    sampler = BacklogSampler(
        RelaySettings(database_url, DEAD_BROKER),
        metrics,
        monitor=Monitor(engine, NAMES, slice_keys=3),
    )
    r = metrics.registry
    try:
        assert sampler.delay() == 0  # the first sample
        partial = 0
        while (backlog := sampler.sample_once()) is None:
            partial += 1
            assert sampler.delay() == SLICE_PAUSE  # within a sweep
            assert value(r, "outbox_pending_events") == 0  # gauges set once a sweep ends
        assert partial >= 3  # 12 keys, 3 of each table per slice
        assert sampler.delay() == sampler.interval
        assert backlog.pending == 33 == pending_count(engine) == value(r, "outbox_pending_events")
        assert backlog.oldest_age_seconds is not None and backlog.oldest_age_seconds >= 300
        assert value(r, "outbox_oldest_pending_age_seconds") >= 300
        # The monitor reads the same, in one call, as does one slice with room for all.
        whole = Monitor(engine, NAMES).backlog(timeout=10)
        assert (whole.pending, whole.parked_keys) == (33, 0)
        assert whole.oldest_age_seconds is not None and whole.oldest_age_seconds >= 300
    finally:
        sampler.stop()


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def test_samples_never_scan_the_events_table(engine: sa.Engine) -> None:
    """Behind a 30,000-event hot key and 1,000 keys, a sample statement reads one slice."""
    outbox = topic_outbox()
    enqueue_bulk(engine, outbox, seq_events("orders", ["hot"], 30_000))
    enqueue_bulk(engine, outbox, seq_events("orders", [f"k{i}" for i in range(1_000)], 1_000))
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE")
    # A slice of 100 keys of each table: the statement reads that many keys, whatever
    # the backlog, and one event row (its first pending one) per key.
    sql = queries_for(NAMES).sql["backlog_slice"]
    sql = sql.replace(":after_key", "''").replace(":slice_keys", "100")
    for name in ("backlog_slice",):
        with engine.connect() as conn:
            plan = conn.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + sql).scalar_one()[0][
                "Plan"
            ]
        for node in _plan_nodes(plan):
            where = node.get("Relation Name") or node.get("Index Name") or ""
            read = node["Actual Rows"] * node["Actual Loops"] + node.get(
                "Rows Removed by Filter", 0
            )
            assert read <= 250, f"{name}: {node['Node Type']} on {where} reads {read} rows"
            if node.get("Relation Name") == "outbox":
                assert node.get("Index Name") == "outbox_claim_idx", (
                    f"{name} reads the events table: {json.dumps(plan)[:2000]}"
                )


# --------------------------------------------------------------------------- librdkafka


def test_librdkafka_statistics_reach_the_broker_gauges(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_for: Callable[..., Relay],
) -> None:
    topic = new_topic(1)
    enqueue_bulk(engine, topic_outbox(), seq_events(topic, ["a"], 5))
    relay = relay_for(kafka_bootstrap, kafka_config={"statistics.interval.ms": "100"})
    r = relay.metrics.registry

    def rtt_samples() -> list[float]:
        return [
            s.value
            for metric in r.collect()
            if metric.name == "outbox_kafka_broker_rtt_seconds"
            for s in metric.samples
        ]

    with running_relay(relay):
        wait_until(lambda: delivered_count(engine) == 5, 30, what="delivery")
        wait_until(lambda: bool(rtt_samples()), 30, what="librdkafka statistics")
    assert all(0 < v < 10 for v in rtt_samples())
