"""The metrics' own logic, without services: stats parsing, failure reasons, registries."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from sqlalchemy.exc import OperationalError

from outbox_kafka import DuplicateEventId, InvalidKey, UnsafeConnection
from outbox_kafka.producer.instruments import (
    ENQUEUE_FAILURE_REASONS,
    ProducerMetrics,
    counts_enqueue_failures,
    enqueue_failure_reason,
    producer_metrics,
)
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.metrics import RelayMetrics

BASE = {"database_url": "postgresql://u@h/d", "bootstrap_servers": "k:9092"}


def test_librdkafka_statistics_feed_the_queue_and_rtt_gauges() -> None:
    metrics = RelayMetrics()
    stats = {
        "msg_cnt": 17,
        "brokers": {
            "k:9092/bootstrap": {"nodeid": -1, "rtt": {"cnt": 3, "avg": 9_000_000}},
            "k:9092/1": {"nodeid": 1, "rtt": {"cnt": 4, "avg": 2_500}},
            "k2:9092/2": {"nodeid": 2, "rtt": {"cnt": 0, "avg": 0}},
        },
    }
    metrics.observe_librdkafka_stats(json.dumps(stats))
    r = metrics.registry
    assert r.get_sample_value("outbox_kafka_producer_queue_messages") == 17
    assert r.get_sample_value("outbox_kafka_broker_rtt_seconds", {"broker": "1"}) == 0.0025
    # Bootstrap placeholders and brokers without round trips in the window are left out.
    assert r.get_sample_value("outbox_kafka_broker_rtt_seconds", {"broker": "-1"}) is None
    assert r.get_sample_value("outbox_kafka_broker_rtt_seconds", {"broker": "2"}) is None
    metrics.observe_librdkafka_stats("not json")  # ignored, not raised
    assert r.get_sample_value("outbox_kafka_producer_queue_messages") == 17


def test_the_producer_emits_statistics_unless_told_otherwise() -> None:
    assert RelaySettings(**BASE).producer_config()["statistics.interval.ms"] == "15000"
    custom = RelaySettings(**BASE, kafka_config={"statistics.interval.ms": "500"})
    assert custom.producer_config()["statistics.interval.ms"] == "500"
    assert "statistics.interval.ms" not in custom.admin_config()


def test_last_cycle_gauge_is_unix_time_read_at_scrape_time() -> None:
    metrics = RelayMetrics()
    last: list[float | None] = [None]
    metrics.watch_last_cycle(lambda: last[0])
    name = "outbox_relay_last_cycle_timestamp_seconds"
    assert metrics.registry.get_sample_value(name) == 0.0
    last[0] = time.monotonic() - 30.0
    value = metrics.registry.get_sample_value(name)
    assert value is not None
    assert time.time() - 31.0 < value < time.time() - 29.0


def test_backlog_samples_set_the_gauges() -> None:
    metrics = RelayMetrics()
    metrics.observe_backlog(12, 3.5, 2)
    r = metrics.registry
    assert r.get_sample_value("outbox_pending_events") == 12
    assert r.get_sample_value("outbox_oldest_pending_age_seconds") == 3.5
    assert r.get_sample_value("outbox_parked_keys") == 2
    metrics.observe_backlog(0, None, 0)
    assert r.get_sample_value("outbox_oldest_pending_age_seconds") == 0.0


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (InvalidKey("key", "empty"), "validation"),
        (DuplicateEventId("event_id", "taken"), "duplicate_event_id"),
        (UnsafeConnection("autocommit"), "unsafe_connection"),
        (OperationalError("SELECT", {}, Exception("gone")), "database"),
        (KeyError("x"), "other"),
    ],
)
def test_enqueue_failure_reasons_are_short_fixed_names(exc: Exception, reason: str) -> None:
    assert enqueue_failure_reason(exc) == reason
    assert reason in ENQUEUE_FAILURE_REASONS


class _Writer:
    """Something shaped like an Outbox: enqueue calls enqueue_many."""

    def __init__(self, registry: CollectorRegistry, error: Callable[[], Exception] | None) -> None:
        self.producer_metrics = producer_metrics(registry)
        self.error = error

    @counts_enqueue_failures
    def enqueue(self, value: int) -> int:
        return self.enqueue_many([value])[0]

    @counts_enqueue_failures
    def enqueue_many(self, values: list[int]) -> list[int]:
        if self.error is not None:
            raise self.error()
        return values


def _failures(registry: CollectorRegistry, reason: str) -> float | None:
    return registry.get_sample_value("outbox_enqueue_failures_total", {"reason": reason})


def test_a_failure_is_counted_once_however_deep_it_was_raised() -> None:
    registry = CollectorRegistry()
    assert all(_failures(registry, r) is None for r in ENQUEUE_FAILURE_REASONS)
    writer = _Writer(registry, lambda: InvalidKey("key", "empty"))
    assert all(_failures(registry, r) == 0 for r in ENQUEUE_FAILURE_REASONS)
    with pytest.raises(InvalidKey):
        writer.enqueue(1)
    with pytest.raises(InvalidKey):
        writer.enqueue_many([1, 2])
    assert _failures(registry, "validation") == 2
    assert _Writer(registry, None).enqueue(5) == 5
    assert _failures(registry, "validation") == 2


def test_producer_metrics_are_shared_per_registry() -> None:
    registry = CollectorRegistry()
    assert producer_metrics(registry) is producer_metrics(registry)
    assert producer_metrics(registry) is not producer_metrics(CollectorRegistry())
    default = producer_metrics()
    assert isinstance(default, ProducerMetrics) and default.registry is REGISTRY
