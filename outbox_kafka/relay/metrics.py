"""The relay's Prometheus metrics, in base units, on an injectable registry."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Concatenate, ParamSpec, Protocol, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info
from sqlalchemy.exc import SQLAlchemyError

from outbox_kafka.errors import DuplicateEventId, EventError, UnsafeConnection

if TYPE_CHECKING:
    from outbox_kafka.relay.settings import RelaySettings

log = logging.getLogger("outbox_kafka.metrics")

_BATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RelayMetrics:
    """Every metric the relay exports; pass a registry to keep tests isolated."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
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
        self.order_violations = Counter(
            "outbox_order_violations",
            "Events Kafka took while an earlier event of their key, in the same batch, "
            "failed (a broker rejected one record batch and took a later one).",
            ["topic"],
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
        self.mark_seconds = Histogram(
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
        self.kafka_queue_messages = Gauge(
            "outbox_kafka_producer_queue_messages",
            "Messages in the producer's local queue (librdkafka statistics).",
            registry=r,
        )
        self.kafka_rtt_seconds = Gauge(
            "outbox_kafka_broker_rtt_seconds",
            "Average broker round-trip time (librdkafka statistics).",
            ["broker"],
            registry=r,
        )
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
        from outbox_kafka import __version__

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
        try:
            stats = json.loads(payload)
            self.kafka_queue_messages.set(float(stats.get("msg_cnt", 0)))
            for broker in stats.get("brokers", {}).values():
                rtt = broker.get("rtt", {})
                if broker.get("nodeid", -1) >= 0 and rtt.get("cnt", 0):
                    self.kafka_rtt_seconds.labels(broker=str(broker["nodeid"])).set(
                        rtt.get("avg", 0) / 1_000_000
                    )
        except (ValueError, TypeError, AttributeError) as exc:
            log.debug("unreadable librdkafka statistics: %s", exc)


# --------------------------------------------------------------------------- producer side

#: Every ``reason`` of ``outbox_enqueue_failures_total``; all start at 0.
ENQUEUE_FAILURE_REASONS = (
    "validation",
    "duplicate_event_id",
    "unsafe_connection",
    "database",
    "other",
)


def enqueue_failure_reason(exc: BaseException) -> str:
    """The ``reason`` label for an exception raised by ``enqueue``/``enqueue_many``."""
    if isinstance(exc, DuplicateEventId):
        return "duplicate_event_id"
    if isinstance(exc, EventError):
        return "validation"
    if isinstance(exc, UnsafeConnection):
        return "unsafe_connection"
    if isinstance(exc, SQLAlchemyError):
        return "database"
    return "other"


class ProducerMetrics:
    """The producer side's metrics; one instance per registry (see :func:`producer_metrics`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.enqueue_failures = Counter(
            "outbox_enqueue_failures",
            "enqueue/enqueue_many calls that raised, by kind of error.",
            ["reason"],
            registry=registry,
        )
        for reason in ENQUEUE_FAILURE_REASONS:
            self.enqueue_failures.labels(reason=reason)

    def enqueue_failed(self, exc: BaseException) -> None:
        # enqueue may call enqueue_many: count each exception once, at the innermost call.
        if getattr(exc, "_outbox_counted", False):
            return
        with contextlib.suppress(AttributeError):
            exc._outbox_counted = True  # type: ignore[attr-defined]
        self.enqueue_failures.labels(reason=enqueue_failure_reason(exc)).inc()


_producer_metrics: weakref.WeakKeyDictionary[CollectorRegistry, ProducerMetrics] = (
    weakref.WeakKeyDictionary()
)
_producer_metrics_lock = threading.Lock()


def producer_metrics(registry: CollectorRegistry | None = None) -> ProducerMetrics:
    """The producer metrics on ``registry`` (default: prometheus_client's global one).

    Every ``Outbox`` on one registry shares one set of metrics, since a
    registry refuses a metric name twice.
    """
    target = REGISTRY if registry is None else registry
    with _producer_metrics_lock:
        found = _producer_metrics.get(target)
        if found is None:
            found = _producer_metrics[target] = ProducerMetrics(target)
        return found


class _CountsEnqueueFailures(Protocol):
    producer_metrics: ProducerMetrics


S = TypeVar("S", bound=_CountsEnqueueFailures)
P = ParamSpec("P")
R = TypeVar("R")


def counts_enqueue_failures(
    method: Callable[Concatenate[S, P], R],
) -> Callable[Concatenate[S, P], R]:
    """Count the exceptions ``method`` raises in ``outbox_enqueue_failures_total``.

    The success path pays one extra call and nothing else.
    """

    @functools.wraps(method)
    def counted(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            self.producer_metrics.enqueue_failed(exc)
            raise

    return counted
