"""The relay's Prometheus metrics, in base units, on an injectable registry: the
subscriber of the relay's announcements (:mod:`~outbox_kafka.relay.observe`) that
counts them."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from outbox_kafka.relay.decide import Discard, Hold, OrderViolation, Retry, error_label
from outbox_kafka.relay.observe import RelayObserver
from outbox_kafka.version import __version__

if TYPE_CHECKING:
    from outbox_kafka.relay.batch import Claim, RecordResult
    from outbox_kafka.relay.config import RelaySettings
    from outbox_kafka.relay.decide import Settlement

log = logging.getLogger("outbox_kafka.metrics")

_BATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ProducerMetrics:
    """The Kafka producer's librdkafka statistics, as gauges: one set per producer.

    A relay serving several outboxes has one producer for all of them, so one
    set of these, on a registry of its own and served without an ``outbox``
    label; a relay with one outbox keeps them on its own registry.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.queue_messages = Gauge(
            "outbox_kafka_producer_queue_messages",
            "Messages in the producer's local queue (librdkafka statistics).",
            registry=registry,
        )
        self.rtt_seconds = Gauge(
            "outbox_kafka_broker_rtt_seconds",
            "Average broker round-trip time (librdkafka statistics).",
            ["broker"],
            registry=registry,
        )

    def observe_librdkafka_stats(self, payload: str) -> None:
        """The producer's ``stats_cb``: copy a few librdkafka statistics into gauges."""
        try:
            stats = json.loads(payload)
            self.queue_messages.set(float(stats.get("msg_cnt", 0)))
            for broker in stats.get("brokers", {}).values():
                rtt = broker.get("rtt", {})
                if broker.get("nodeid", -1) >= 0 and rtt.get("cnt", 0):
                    self.rtt_seconds.labels(broker=str(broker["nodeid"])).set(
                        rtt.get("avg", 0) / 1_000_000
                    )
        except (ValueError, TypeError, AttributeError) as exc:
            log.debug("unreadable librdkafka statistics: %s", exc)


class RelayMetrics(RelayObserver):
    """Every metric the relay exports; pass a registry to keep tests isolated.

    It subscribes to the relay's announcements: a relay counts into the metrics
    it is given (``Relay(settings, metrics=...)``) or into metrics of its own.

    ``producer``: the gauges of a producer shared with other relay loops
    (kept on its own registry); by default the loop's own, on ``registry``.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        producer: ProducerMetrics | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.published = Counter(
            "outbox_events_published", "Events Kafka acknowledged.", ["topic"], registry=r
        )
        self.retried = Counter(
            "outbox_events_retried",
            "Failed sends that will be retried after a backoff.",
            ["topic", "reason"],
            registry=r,
        )
        self.discarded = Counter(
            "outbox_events_discarded",
            "Events set aside as undeliverable.",
            ["topic", "reason"],
            registry=r,
        )
        self.held = Counter(
            "outbox_events_held",
            "Sends held back until an operator acts: the topic is missing or access to it "
            "is not granted. The event's key waits, in order; it is tried again every few "
            "seconds.",
            ["topic", "reason"],
            registry=r,
        )
        self.order_violations = Counter(
            "outbox_order_violations",
            "Events Kafka took while an earlier event of their key, in the same batch, "
            "failed (a broker rejected one record batch and took a later one).",
            ["topic"],
            registry=r,
        )
        self.loop_failures = Counter(
            "outbox_relay_loop_failures",
            "Unexpected errors that ended the relay loop of an outbox of a relay serving "
            "several outboxes; a new loop takes its place after a backoff.",
            registry=r,
        )
        self.leases_lost = Counter(
            "outbox_leases_lost",
            "Keys whose lease another relay took over while this relay was sending.",
            registry=r,
        )
        self.db_errors = Counter(
            "outbox_database_errors",
            "Database errors the relay met: retried steps of the loop and failed backlog samples.",
            registry=r,
        )
        self.purged = Counter(
            "outbox_events_purged",
            "Delivered or discarded events removed by retention.",
            registry=r,
        )
        self.background_errors = Counter(
            "outbox_background_errors",
            "Unexpected errors in the relay's background tasks (retention, sampling); "
            "the task goes on at its next interval.",
            ["task"],
            registry=r,
        )
        self.claim_seconds = Histogram(
            "outbox_claim_duration_seconds",
            "Time to claim one batch.",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.publish_seconds = Histogram(
            "outbox_publish_duration_seconds",
            "Time from handing a batch to the producer to its last delivery report.",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.record_seconds = Histogram(
            "outbox_mark_duration_seconds",
            "Time to record one batch's outcome.",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.commit_to_ack_seconds = Histogram(
            "outbox_commit_to_ack_seconds",
            "Time from an event's write to its recorded acknowledgement (database clock).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.producer = producer if producer is not None else ProducerMetrics(r)
        self.pending_events = Gauge(
            "outbox_pending_events",
            "Events waiting to be published, from the key queue (sampled).",
            registry=r,
        )
        self.oldest_pending_age_seconds = Gauge(
            "outbox_oldest_pending_age_seconds",
            "Age of the oldest pending event, delayed ones included; 0 when none (sampled).",
            registry=r,
        )
        self.parked_keys = Gauge(
            "outbox_parked_keys",
            "Keys parked after a discard, waiting for an operator (sampled).",
            registry=r,
        )
        self.consistency_violations = Gauge(
            "outbox_consistency_violations",
            "Keys with pending events no relay will reach, and broken key-queue rows; "
            "0 unless something is wrong (sampled; outbox-kafka check --consistency lists them).",
            registry=r,
        )
        self.last_cycle_timestamp_seconds = Gauge(
            "outbox_relay_last_cycle_timestamp_seconds",
            "Unix time at which the relay last completed a cycle; 0 before the first.",
            registry=r,
        )
        self.info = Info("outbox_relay", "Relay version and settings digest.", registry=r)

    def set_info(self, settings: RelaySettings) -> None:
        self.info.info(
            {
                "version": __version__,
                "settings_digest": settings.digest(),
                "table": settings.names.qualified_events,
                "on_exhausted": settings.on_exhausted,
            }
        )

    def watch_last_cycle(self, last_cycle_at: Callable[[], float | None]) -> None:
        """Export the end of the last cycle, read at scrape time.

        ``last_cycle_at`` returns a ``time.monotonic()`` value (or None); it is
        turned into Unix time when scraped, so the loop pays nothing per cycle.
        """

        def unix_time() -> float:
            at = last_cycle_at()
            return 0.0 if at is None else time.time() - (time.monotonic() - at)

        self.last_cycle_timestamp_seconds.set_function(unix_time)

    def observe_backlog(self, pending: int, oldest_age_seconds: float | None, parked: int) -> None:
        """Record one backlog sample."""
        self.pending_events.set(pending)
        self.oldest_pending_age_seconds.set(oldest_age_seconds or 0.0)
        self.parked_keys.set(parked)

    def observe_librdkafka_stats(self, payload: str) -> None:
        """The producer's ``stats_cb``: copy a few librdkafka statistics into gauges."""
        self.producer.observe_librdkafka_stats(payload)

    # The announcements it counts ---------------------------------------------

    def claimed(self, claim: Claim, seconds: float) -> None:
        self.claim_seconds.observe(seconds)

    def sent(self, claim: Claim, seconds: float) -> None:
        self.publish_seconds.observe(seconds)

    def settled(self, settlement: Settlement) -> None:
        published: dict[str, int] = {}
        for event in settlement.delivered:
            published[event.topic] = published.get(event.topic, 0) + 1
        for topic, count in published.items():
            self.published.labels(topic=topic).inc(count)
        for decision in settlement.decisions:
            if isinstance(decision, OrderViolation):
                self.order_violations.labels(topic=decision.later.topic).inc()
            elif isinstance(decision, Hold):
                label = error_label(decision.error)
                self.held.labels(topic=decision.event.topic, reason=label).inc()
            elif isinstance(decision, Retry) and not decision.copy_failed:
                label = error_label(decision.error)
                self.retried.labels(topic=decision.event.topic, reason=label).inc()
            elif isinstance(decision, Discard):
                label = error_label(decision.error)
                self.discarded.labels(topic=decision.event.topic, reason=label).inc()

    def recorded(self, result: RecordResult, seconds: float) -> None:
        self.record_seconds.observe(seconds)
        for latency in result.latencies:
            self.commit_to_ack_seconds.observe(latency)

    def lease_lost(self, keys: int) -> None:
        self.leases_lost.inc(keys)

    def database_retry(self, attempt: int, error: BaseException | None) -> None:
        self.db_errors.inc()

    def background_failed(self, task: str, error: Exception) -> None:
        self.background_errors.labels(task=task).inc()

    def purge_done(self, events: int) -> None:
        self.purged.inc(events)

    def sampled(self, pending: int, oldest_age_seconds: float | None, parked_keys: int) -> None:
        self.observe_backlog(pending, oldest_age_seconds, parked_keys)

    def violations_counted(self, violations: int) -> None:
        self.consistency_violations.set(violations)

    def sample_failed(self, what: str, error: Exception) -> None:
        self.db_errors.inc()
