"""The relay's Prometheus metrics, in base units, on an injectable registry, and the
backlog reads behind its gauges.

:class:`RelayMetrics` is the subscriber of the relay's announcements
(:mod:`~outbox_kafka.relay.observe`) that counts them.

:class:`Monitor` reads one outbox: a ping for readiness probes
(:mod:`~outbox_kafka.relay.serve`), and the backlog and consistency samples behind
the gauges. Cheap statements, each with a timeout, on a small engine of their own so
that probes never wait behind the relay's work. :class:`BacklogSampler` sets the
gauges (pending events, oldest pending age, parked keys and consistency violations)
every few seconds, in a supervised loop of the relay's
(:class:`~outbox_kafka.relay.loop.SupervisedLoop`) on a connection of its own: the
claim loop never waits for it, and a failed sample (logged, counted in
``outbox_database_errors_total``) only leaves the gauges at their last value."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from sqlalchemy import Engine

from outbox_kafka.database import make_engine, storage_errors
from outbox_kafka.errors import StorageError
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.batch_histogram import BatchHistogram
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.decide import Discard, Hold, OrderViolation, Retry, error_label
from outbox_kafka.relay.observe import RelayObserver
from outbox_kafka.schema.statements import millis, queries_for
from outbox_kafka.version import __version__

if TYPE_CHECKING:
    from outbox_kafka.relay.batch import Claim, ReadBackReport, RecordResult
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
        self._published_by_topic: dict[str, Counter] = {}
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
        self.read_backs = Counter(
            "outbox_read_backs",
            "Claims with keys in doubt whose partitions were read back before sending.",
            registry=r,
        )
        self.read_back_messages = Counter(
            "outbox_read_back_messages",
            "Messages read back from Kafka for keys in doubt.",
            registry=r,
        )
        self.read_back_matched = Counter(
            "outbox_read_back_matched",
            "Events (and dead-letter copies) found on Kafka by a read-back: recorded, "
            "not sent again.",
            registry=r,
        )
        self.read_back_unproven = Counter(
            "outbox_read_back_unproven",
            "Keys in doubt left unsent because a read-back could not prove what is on "
            "Kafka (tried again).",
            registry=r,
        )
        self.read_back_resent = Counter(
            "outbox_read_back_sent_unproven",
            "Keys in doubt sent although unproven (--on-unproven send: at least once).",
            registry=r,
        )
        self.read_back_absent = Counter(
            "outbox_read_back_absent",
            "Events of keys in doubt that a read-back proved are not on Kafka: sent, "
            "for the first time or again.",
            registry=r,
        )
        self.read_back_compacted = Counter(
            "outbox_read_back_compacted",
            "Keys in doubt sent again without a read-back because a topic of theirs is "
            "compacted, where what is missing proves nothing (at least once).",
            registry=r,
        )
        self.read_back_seconds = Histogram(
            "outbox_read_back_seconds",
            "Time to read Kafka back for a claim's keys in doubt.",
            registry=r,
        )
        self.acknowledged_unrecorded_events = Counter(
            "outbox_acknowledged_unrecorded",
            "Events Kafka acknowledged after another relay had taken over their keys "
            "(a frozen relay's late request): they may be on Kafka twice.",
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
        #: One latency per delivered event: observed a batch at a time.
        self.commit_to_ack_seconds = BatchHistogram(
            "outbox_commit_to_ack_seconds",
            "Time from an event's write to its recorded acknowledgement (database clock).",
            _LATENCY_BUCKETS,
            r,
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
        self.settled_all((settlement,))

    def settled_all(self, settlements: Sequence[Settlement]) -> None:
        # Counted once per batch: each topic's counter is looked up once per relay
        # and incremented once per batch.
        published: dict[str, int] = {}
        for settlement in settlements:
            for event in settlement.delivered:
                published[event.topic] = published.get(event.topic, 0) + 1
            if settlement.decisions:
                self._count_decisions(settlement)
        counters = self._published_by_topic
        for topic, count in published.items():
            counter = counters.get(topic)
            if counter is None:
                counter = counters[topic] = self.published.labels(topic=topic)
            counter.inc(count)

    def _count_decisions(self, settlement: Settlement) -> None:
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
        self.commit_to_ack_seconds.observe_many(result.latencies)

    def lease_lost(self, keys: int) -> None:
        self.leases_lost.inc(keys)

    def read_back(self, report: ReadBackReport) -> None:
        self.read_backs.inc()
        self.read_back_messages.inc(report.read)
        self.read_back_matched.inc(report.matched)
        self.read_back_unproven.inc(report.unproven)
        self.read_back_resent.inc(report.resent_unproven)
        self.read_back_absent.inc(report.absent)
        self.read_back_compacted.inc(report.compacted)
        self.read_back_seconds.observe(report.seconds)

    def acknowledged_unrecorded(self, events: int) -> None:
        self.acknowledged_unrecorded_events.inc(events)

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


#: The most keys (of the key queue, and of the arrivals) one backlog statement
#: reads: a larger backlog is read over several statements, SLICE_PAUSE apart.
SLICE_KEYS = 1_000
#: Seconds between the statements of one sweep over a backlog of many keys.
SLICE_PAUSE = 0.2


@dataclass(frozen=True)
class Backlog:
    """One sample of the outbox's backlog."""

    pending: int
    oldest_age_seconds: float | None
    parked_keys: int


@dataclass(frozen=True)
class BacklogSlice:
    """The backlog of one slice of keys (see the backlog_slice statement)."""

    pending: int
    oldest_age_seconds: float | None
    parked_keys: int
    #: The last key of the slice; None when the slice reached the end.
    last_key: str | None


class BacklogSweep:
    """Slices of the backlog added up, in key order, into one :class:`Backlog`.

    The oldest age is kept as the moment the oldest event found was written
    (on this process's monotonic clock, from the database's own age of it), so
    the age the sweep gives at its end includes the time the sweep took.
    """

    def __init__(self) -> None:
        self.after_key = ""
        self.slices = 0
        self._pending = 0
        self._parked = 0
        self._oldest_written: float | None = None

    def add(self, part: BacklogSlice) -> bool:
        """Add the slice read from :attr:`after_key`; whether the sweep is done."""
        self.slices += 1
        self._pending += part.pending
        self._parked += part.parked_keys
        if part.oldest_age_seconds is not None:
            written = time.monotonic() - part.oldest_age_seconds
            if self._oldest_written is None or written < self._oldest_written:
                self._oldest_written = written
        if part.last_key is None:
            return True
        self.after_key = part.last_key
        return False

    def result(self) -> Backlog:
        oldest = self._oldest_written
        return Backlog(
            pending=self._pending,
            oldest_age_seconds=None if oldest is None else max(0.0, time.monotonic() - oldest),
            parked_keys=self._parked,
        )


class Monitor:
    """Monitoring reads of one outbox."""

    def __init__(self, engine: Engine, names: TableNames, *, slice_keys: int = SLICE_KEYS) -> None:
        self._engine = engine
        self._q = queries_for(names)
        #: The most keys of each table one backlog statement reads.
        self.slice_keys = slice_keys

    @classmethod
    def connect(
        cls, database_url: str, names: TableNames, *, connect_timeout: float = 2.0
    ) -> Monitor:
        """A monitor with its own engine (one pooled connection, short connect timeout)."""
        engine = make_engine(
            database_url,
            pool_size=1,
            max_overflow=1,
            connect_args={"connect_timeout": max(1, round(connect_timeout))},
        )
        return cls(engine, names)

    def ping(self, timeout: float) -> None:
        """Run ``SELECT 1`` within ``timeout`` seconds; raise StorageError otherwise."""
        with storage_errors("checking the database"), self._engine.begin() as conn:
            conn.execute(self._q["statement_timeout"], {"milliseconds": millis(timeout)})
            conn.execute(self._q["ping"])

    def backlog_slice(self, after_key: str, timeout: float) -> BacklogSlice:
        """The keys with work just after ``after_key`` ('' to start), at most
        :attr:`slice_keys` of them: their pending events, oldest pending age and
        parked keys, and where the slice ended (None at the end of the sweep).

        Reads the key queue, the key counters and each key's first pending
        event, never the rest of the event rows, and never more than a slice of
        keys, so a statement costs the same at any backlog.
        """
        with storage_errors("sampling the backlog"), self._engine.begin() as conn:
            conn.execute(self._q["statement_timeout"], {"milliseconds": millis(timeout)})
            row = conn.execute(
                self._q["backlog_slice"],
                {"after_key": after_key, "slice_keys": self.slice_keys},
            ).one()
        return BacklogSlice(
            pending=int(row.pending),
            oldest_age_seconds=None if row.oldest_age is None else max(0.0, row.oldest_age),
            parked_keys=int(row.parked),
            last_key=row.last_key,
        )

    def sweep(self, timeout: float) -> BacklogSweep:
        """Every slice of the backlog, one after another (``timeout`` for each)."""
        sweep = BacklogSweep()
        while not sweep.add(self.backlog_slice(sweep.after_key, timeout)):
            pass
        return sweep

    def backlog(self, timeout: float) -> Backlog:
        """The whole backlog, read in one sweep."""
        return self.sweep(timeout).result()

    def consistency_violations(self, timeout: float) -> int:
        """Keys whose pending events no relay will reach, plus broken queue rows.

        One statement: a probe of the claim index per key with pending events
        and a pass over the key queue, so its cost grows with the keys that
        have work, not with the events; 0 in a consistent outbox.
        """
        with storage_errors("counting consistency violations"), self._engine.begin() as conn:
            conn.execute(self._q["statement_timeout"], {"milliseconds": millis(timeout)})
            return int(conn.execute(self._q["consistency_violation_count"]).scalar_one())

    def close(self) -> None:
        self._engine.dispose()


class BacklogSampler:
    """Sets ``outbox_pending_events``, ``outbox_oldest_pending_age_seconds``,
    ``outbox_parked_keys`` and ``outbox_consistency_violations`` every
    ``settings.sample_interval`` seconds, announcing each sample (and each failed
    one) to ``observer``: the metrics set the gauges, the logs say what failed."""

    def __init__(
        self, settings: RelaySettings, observer: RelayObserver, *, monitor: Monitor | None = None
    ) -> None:
        self.interval = settings.sample_interval
        self.observer = observer
        self._monitor = monitor or Monitor.connect(settings.database_url, settings.names)
        # A sample may take at most one interval (and never more than 30 s).
        self._timeout = min(30.0, max(1.0, self.interval))
        self._first = True
        self._sweep = BacklogSweep()

    def sample_once(self) -> Backlog | None:
        """Read the next slice of the backlog; at the end of a sweep, set the gauges.

        Returns the sample when this slice ended a sweep (a backlog of at most
        ``SLICE_KEYS`` keys is one slice), else None; None too (logged and
        counted) when it failed, and the sweep starts over.
        """
        try:
            part = self._monitor.backlog_slice(self._sweep.after_key, self._timeout)
        except StorageError as exc:
            self._sweep = BacklogSweep()
            self.observer.sample_failed("backlog", exc)
            return None
        if not self._sweep.add(part):
            return None
        backlog, self._sweep = self._sweep.result(), BacklogSweep()
        self.observer.sampled(backlog.pending, backlog.oldest_age_seconds, backlog.parked_keys)
        self.count_violations()
        return backlog

    def count_violations(self) -> int | None:
        """Set ``outbox_consistency_violations``; None (logged and counted) when it failed.

        Apart from the backlog sample, so that a slow count on a huge key
        queue never costs the other gauges their value.
        """
        try:
            violations = self._monitor.consistency_violations(self._timeout)
        except StorageError as exc:
            self.observer.sample_failed("consistency", exc)
            return None
        self.observer.violations_counted(violations)
        return violations

    def delay(self) -> float:
        """Seconds to the next sample: none before the first, SLICE_PAUSE within a
        sweep, else the interval."""
        if self._first:
            self._first = False
            return 0.0
        if self._sweep.slices:
            return min(SLICE_PAUSE, self.interval)
        return self.interval

    def stop(self) -> None:
        """Close the sampler's connection (once its supervised loop has stopped)."""
        self._monitor.close()
