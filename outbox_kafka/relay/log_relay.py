"""The log mode's relay loop: committed transactions read from the outbox's slot
(:mod:`~outbox_kafka.relay.log_reader`), their events produced in stream order with
the idempotent producer, and the slot acknowledged up to the highest end LSN below
which every event has been delivered.

Stream order is commit order, and a key's events all go to one partition, in which
the idempotent producer keeps the order they were produced in: so a key's events
reach Kafka in the order their transactions committed. Nothing waits on a claim,
a lease or a record: the only state is the slot's acknowledged position, kept by
the server.

An event that Kafka does not take (its delivery failed, or the producer refused
it) stalls the stream at its transaction: nothing more is read, what is queued
behind it is purged, what is in flight is waited for, the transactions before it
are acknowledged, and after a backoff the stream is read again from there, until
Kafka takes it. Events after it that had reached Kafka are sent again, after it
(at least once); one of the same key that Kafka took before the failure was
known stays ahead of it on the topic. The relay says so in
its log, its metrics and its readiness; ``drain`` (``relay --drain``) stops at a
stall instead (:class:`LogStalled`). A relay that stops or dies reads on, when
started again, from the last acknowledgement. An event for a topic that is
never made stalls the stream until an operator steps in (see
docs/explanation/log-mode.md).

A producer that fails fatally (its idempotent session is gone: fenced, or a
sequence the broker does not know) is replaced, and the stream is read again from
the last acknowledgement with the new one, without waiting for reports the old
one will never give. So is a producer whose deliveries timed out, when the stream
is read again after the stall: librdkafka's idempotent producer can be left
unable to send after its broker restarts, with no fatal error to say so.

An event Kafka will never take (found by the polling relay's checks before it is
produced, over its topic's ``max.message.bytes`` as the broker tells it, or refused
alone by the producer or the broker) goes to the dead-letter topic,
when there is one, and the stream goes on; without one, or with a copy too large
for it, it stalls the stream like any other failure. The copies are produced by
the loop, never from a delivery report. A record batch the broker refuses names no
message: the stream is read again at once, without a stall, and the transactions up
to the last one with an event in a refused batch are sent one message at a time, so
that the broker's answer names the message it refuses. The polling relay's parking is not part
of this mode yet.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg2
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient
from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from outbox_kafka.database import make_engine, redact_url
from outbox_kafka.log_frames import FramedEvent
from outbox_kafka.relay.batch import ClaimedEvent, Verdict
from outbox_kafka.relay.claim import EventChecks
from outbox_kafka.relay.config import RelaySettings, redact_kafka_config
from outbox_kafka.relay.decide import dead_letter_copy, over_topic_limit
from outbox_kafka.relay.lease import metadata_wait
from outbox_kafka.relay.log_reader import LogReader, LogTransaction, SlotBusy, SlotUnusable
from outbox_kafka.relay.ports import Message
from outbox_kafka.relay.send import broker_problem, classify, needs_rebuild
from outbox_kafka.relay.topic_admin import TopicLimits, TopicLookup, admin_client
from outbox_kafka.schema.statements import queries_for
from outbox_kafka.stored_headers import message_size

log = logging.getLogger("outbox_kafka.relay.log")

_SLOT_UNUSABLE = "the slot cannot be read: lost or missing"

#: What to do about an event over its topic's max.message.bytes, in this mode.
_RAISE_IT = "raise it to publish such events"


class LogStalled(RuntimeError):
    """An event could not be published: the stream stops before it."""


@dataclass
class _InFlight:
    """A transaction whose events are produced and not all delivered yet."""

    end_lsn: int
    size: int
    #: Its events not reported yet (produced or not).
    remaining: int
    #: The delivery of one of its events failed.
    failed: bool = False
    #: Of its events, those whose dead-letter copy was delivered in their place.
    dead_lettered: int = 0
    #: Left behind by a restart: reports on it are ignored.
    abandoned: bool = False


class LogRelayMetrics:
    """The log mode's metrics, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.published = Counter(
            "outbox_log_published",
            "Events delivered to Kafka and acknowledged to the slot",
            registry=self.registry,
        )
        self.strays = Counter(
            "outbox_log_strays",
            "Messages of the slot's stream that were not published, by kind",
            ["kind"],
            registry=self.registry,
        )
        self.dead_lettered = Counter(
            "outbox_log_dead_lettered",
            "Events Kafka will never take, sent to the dead-letter topic instead",
            registry=self.registry,
        )
        self.producer_rebuilds = Counter(
            "outbox_log_producer_rebuilds",
            "Times the Kafka producer was replaced: it failed fatally, or its deliveries timed out",
            registry=self.registry,
        )
        self.stalls = Counter(
            "outbox_log_stalls",
            "Times the stream stalled at an event Kafka did not take (once per stall, "
            "however often it is read again until Kafka takes the event)",
            registry=self.registry,
        )
        self.stalled = Gauge(
            "outbox_log_stalled", "1 while the stream is stalled", registry=self.registry
        )
        self.waiting = Gauge(
            "outbox_log_waiting_for_slot",
            "1 while another session reads the slot",
            registry=self.registry,
        )
        self.acknowledged = Gauge(
            "outbox_log_acknowledged_lsn",
            "The end LSN the slot was last acknowledged up to",
            registry=self.registry,
        )
        self.slot_lag = Gauge(
            "outbox_log_slot_lag_bytes",
            "WAL not yet acknowledged: from the slot's confirmed position to the server's "
            "current one",
            registry=self.registry,
        )
        self.slot_safe_wal = Gauge(
            "outbox_log_slot_safe_wal_bytes",
            "WAL that may still be written before the server gives the slot up "
            "(NaN: max_slot_wal_keep_size is -1, no limit)",
            registry=self.registry,
        )
        self.slot_lost = Gauge(
            "outbox_log_slot_lost",
            "1 when the slot is lost or missing: its events cannot be read",
            registry=self.registry,
        )


class LogRelay:
    """One outbox's log-mode relay loop; ``stop`` may be called from any thread, the
    rest from the loop's own. Not public API."""

    def __init__(
        self,
        settings: RelaySettings,
        *,
        producer_factory: Callable[[dict[str, str]], Any] = Producer,
        metrics: LogRelayMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or LogRelayMetrics()
        self.reader = LogReader(settings.database_url, settings.names)
        config = settings.producer_config()
        self._producer_factory = producer_factory
        self._producer_config = config
        self._producer = producer_factory(config)
        #: Why the producer is to be replaced before the stream is read again, or None.
        self._replace_producer: str | None = None
        #: The producer failed fatally: what it has in flight will never be reported.
        self._producer_dead = False
        #: Times the producer was replaced since the relay started.
        self.rebuilds = 0
        self._admin: AdminClient | None = None
        self._metadata_timeout = metadata_wait(settings.lease_seconds)
        #: Each topic's max.message.bytes, where the broker tells it.
        self._limits = TopicLimits(config, self._admin_client, self._metadata_timeout)
        #: Whether each topic is there (or made): asked once, and again after a stall.
        self._topics = TopicLookup(
            lambda topic, timeout: self._producer.list_topics(topic, timeout=timeout),
            self._admin_client,
            settings.create_topics,
            self._metadata_timeout,
        )
        #: The highest end LSN acknowledged since the relay started (the reader's own
        #: count starts again with each session).
        self._acknowledged_lsn = 0
        #: The end LSN of the last transaction with an event in a record batch the
        #: broker refused, until the stream is read again.
        self._refused_through: int | None = None
        #: Transactions up to this end LSN are sent one message at a time.
        self._alone_through: int | None = None
        #: By (its transaction's end LSN, event id): why Kafka will never take the event.
        #: The verdict outlives the producer: a broker may fence a producer after
        #: refusing one of its messages, and the stream, read again after a rebuild or a
        #: refused batch, must not send the event to be refused again. Forgotten once
        #: acknowledged, and at a stall (an operator may mend what refused it).
        self._never: dict[tuple[int, uuid.UUID], str] = {}
        #: The first failure of the round is a record batch the broker refused.
        self._failure_is_refusal = False
        #: After the stream is read again: the end LSN of the last transaction that was
        #: in flight before (0 once read again), so that a drain does not take the
        #: wait before the first re-read transaction for quiet.
        self._catch_up_to = 0
        #: What is checked of each event before it is produced (as the polling relay does).
        self._checks = EventChecks(int(config["message.max.bytes"]))
        self._in_flight: deque[_InFlight] = deque()
        #: Dead-letter copies to produce (never from a delivery report: produce() and
        #: poll() may not be called there), each with its transaction.
        self._copies: list[tuple[Message, _InFlight, FramedEvent, str]] = []
        #: At most this many events produced and not yet acknowledged.
        self._max_in_flight = max(1, settings.batch_size) * 4
        self._events_in_flight = 0
        self._reading = False
        #: Why an event in flight was not delivered (the first), until the restart.
        self._failure: str | None = None
        self._purged = False
        #: Events delivered and acknowledged since the relay started.
        self.published = 0
        #: Events whose dead-letter copy was delivered and acknowledged in their place.
        self.dead_lettered = 0
        #: Why the stream is stalled (an event Kafka did not take), or None.
        self.stalled: str | None = None
        self._retry_at = 0.0
        self._backoff = settings.backoff_base
        self._stop = threading.Event()
        #: ``time.monotonic()`` of the loop's last completed step (liveness).
        self.last_cycle_at: float | None = None
        #: What keeps the relay from publishing now (readiness), or None.
        self.problem: str | None = None
        #: ``problem`` in a few words, without details: what ``/readyz`` says.
        self._problem_kind = ""
        #: A lost or missing slot, as the last sample found it.
        self._slot_problem: str | None = None
        self._strays_counted = (0, 0, 0)
        self._queries = queries_for(settings.names)
        self._engine: Engine | None = None
        self._sampled_at = 0.0

    # The loop ------------------------------------------------------------------

    def open(self) -> None:
        """Start reading the slot (:class:`~outbox_kafka.relay.log_reader.SlotBusy` while
        another session reads it)."""
        self.reader.open()
        self._reading = True

    def run(self) -> None:
        """Publish until :meth:`stop`: waits while another session reads the slot, and
        reads again from the last acknowledgement after a database failure, backing off."""
        backoff = self.settings.backoff_base
        #: The slot could not be read: once it is, it is sampled at once (the gauge).
        unusable = False
        log.info(
            "log relay started",
            extra={
                "action": "start",
                "database": redact_url(self.settings.database_url),
                "slot": self.settings.names.log_slot,
                "kafka": redact_kafka_config(self._producer_config),
            },
        )
        try:
            while not self._stop.is_set():
                try:
                    self.step(self.settings.poll_interval)
                    self.metrics.waiting.set(0)
                    self._sample_when_due(force=unusable)
                    unusable = False
                    backoff = self.settings.backoff_base
                    if self.stalled is None and self._reading:
                        # Not while it waits to read again: what made it is still so.
                        self.problem = None
                except SlotBusy as exc:
                    self.metrics.waiting.set(1)
                    self.problem, self._problem_kind = str(exc), "another relay reads the slot"
                    self.last_cycle_at = time.monotonic()
                    self._stop.wait(self.settings.poll_interval)
                except SlotUnusable as exc:
                    # Only an operator mends it; tried again, so that the relay reads a
                    # slot made again without a restart.
                    self.metrics.waiting.set(0)
                    self.metrics.slot_lost.set(1)
                    unusable = True
                    self.problem, self._problem_kind = str(exc), _SLOT_UNUSABLE
                    self.last_cycle_at = time.monotonic()
                    log.error("log relay: " + str(exc), extra={"action": "log_slot_unusable"})
                    self._stop.wait(backoff)
                    backoff = min(self.settings.backoff_cap, backoff * 2)
                except psycopg2.Error as exc:
                    self.problem = f"the database failed: {exc}".strip()
                    self._problem_kind = "the database failed; reading again"
                    log.error(
                        "log relay: the database failed; reading again from the last "
                        "acknowledgement",
                        extra={"action": "log_reconnect", "error": str(exc).strip()},
                    )
                    self._abandon()
                    self._rebuild_if_due()
                    self._sample_when_due(force=True)
                    self._stop.wait(backoff)
                    backoff = min(self.settings.backoff_cap, backoff * 2)
        finally:
            self.close(self.settings.shutdown_timeout)
            log.info(
                "log relay stopped",
                extra={"action": "stop", "acknowledged_lsn": lsn_text(self._acknowledged_lsn)},
            )

    def stop(self) -> None:
        self._stop.set()

    def step(self, timeout: float) -> int:
        """Read what has committed (waiting up to ``timeout`` when nothing is in flight),
        send it, and acknowledge what is delivered; the events acknowledged.

        After a failure, nothing more is read: what is queued is purged, what is in
        flight is waited for, the transactions before the failed one are acknowledged,
        and the stream is read again from there after a backoff (at least once)."""
        if not self._reading:
            wait = self._retry_at - time.monotonic()
            if wait > 0:
                self._stop.wait(min(wait, timeout))
                return 0
            self.open()
        if self._failure is None:
            room = self._max_in_flight - self._events_in_flight
            if room > 0:
                wait = 0.0 if self._in_flight else timeout
                for transaction in self.reader.read(wait, max_events=room):
                    if self._failure is not None or self._producer_dead:
                        # Read again after the failure, from the last acknowledgement.
                        self._catch_up_to = max(self._catch_up_to, transaction.end_lsn)
                        continue
                    self._send(transaction)
                self._count_strays()
        elif not self._purged:
            # Queued behind the failure, not sent yet: they would only be sent again.
            self._producer.purge(in_queue=True, in_flight=False, blocking=False)
            self._purged = True
        self._poll(0.05 if self._in_flight else 0)
        self._produce_copies()
        done = self._acknowledge()
        if self._producer_dead:
            self._read_again_with_a_new_producer()
        elif self._failure is not None:
            if all(entry.remaining <= 0 for entry in self._in_flight):
                self._restart_after(self._failure)
        elif not self._in_flight and self.reader.idle_lsn > self.reader.acknowledged:
            self.reader.acknowledge(self.reader.idle_lsn)
        if self._reading:
            self.reader.keep_alive()
        self.last_cycle_at = time.monotonic()
        return done

    def drain(self, idle: float = 1.0, deadline: float = 60.0) -> int:
        """Publish until no event of this outbox has committed for ``idle`` seconds and
        every one read is acknowledged; the events acknowledged. Raises
        :class:`LogStalled` at a stall."""
        published = 0
        quiet_since = time.monotonic()
        give_up = time.monotonic() + deadline
        while time.monotonic() < give_up:
            got = self.step(min(idle, 0.2))
            if self.stalled is not None:
                raise LogStalled(self.stalled)
            published += got
            # Quiet is about this outbox's events: transactions of other prefixes'
            # messages may stream on without end.
            if got or not self._reading or any(entry.size for entry in self._in_flight):
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= idle and not self._catch_up_to:
                return published
        raise LogStalled(f"the stream did not go quiet within {deadline:.0f} s")

    def close(self, timeout: float = 10.0) -> None:
        """Wait (up to ``timeout``) for what is in flight, acknowledge what was delivered,
        and stop reading."""
        try:
            deadline = time.monotonic() + timeout
            while (
                self._in_flight
                and self._reading
                and not self._producer_dead
                and time.monotonic() < deadline
            ):
                self._poll(0.05)
                self._produce_copies()
                self._acknowledge()
                if self._in_flight and self._in_flight[0].failed:
                    break
        finally:
            self.reader.close()
            self._reading = False
            with contextlib.suppress(KafkaException):
                self._producer.flush(0)
            if self._engine is not None:
                self._engine.dispose()
                self._engine = None

    def sample(self) -> None:
        """Read the slot's lag, safe WAL size and status into the gauges; a slot lost
        or missing is said loudly (readiness, the log, ``outbox_log_slot_lost``)."""
        if self._engine is None:
            self._engine = make_engine(self.settings.database_url)
        with self._engine.connect() as conn:
            row = conn.execute(
                self._queries["log_slot_state"], {"slot": self.settings.names.log_slot}
            ).one_or_none()
        self._sampled_at = time.monotonic()
        slot = self.settings.names.log_slot
        if row is None or row.wal_status == "lost":
            self.metrics.slot_lost.set(1)
            self._slot_problem = (
                f"replication slot {slot} is missing: run outbox-kafka log-setup"
                if row is None
                else f"replication slot {slot} is lost: the server gave it up "
                "(max_slot_wal_keep_size), and the events it held are gone"
            )
            log.error("log relay: " + self._slot_problem, extra={"action": "log_slot_lost"})
            return
        self._slot_problem = None
        self.metrics.slot_lost.set(0)
        self.metrics.slot_lag.set(row.lag_bytes or 0)
        self.metrics.slot_safe_wal.set(
            float("nan") if row.safe_wal_size is None else row.safe_wal_size
        )

    def _sample_when_due(self, *, force: bool = False) -> None:
        due = time.monotonic() - self._sampled_at >= self.settings.sample_interval
        if not (force or due):
            return
        try:
            self.sample()
        except SQLAlchemyError as exc:
            self._sampled_at = time.monotonic()
            log.warning(
                "log relay: the slot could not be sampled",
                extra={"action": "log_sample_failed", "error": str(exc).strip()},
            )

    # Health --------------------------------------------------------------------

    def loop_problem(self, timeout: float) -> str | None:
        """For readiness: why the relay does not publish now (a stall, a busy slot, a
        lost or missing slot)."""
        return self.problem or self._slot_problem

    def problem_kind(self) -> str:
        """For ``/readyz``: what :meth:`loop_problem` says, in a few words and without its
        details (the log has them)."""
        if self.problem is not None and self._problem_kind:
            return self._problem_kind
        if self._slot_problem is not None:
            return _SLOT_UNUSABLE
        return "not publishing"

    def kafka_problem(self, timeout: float) -> str | None:
        """For readiness: whether the producer reaches a broker."""
        return broker_problem(self._producer, timeout)

    # Sending and acknowledging ---------------------------------------------------

    def _send(self, transaction: LogTransaction) -> None:
        size = len(transaction.events)
        # Counted down by the delivery reports: an event not produced (an exception
        # part-way) keeps its transaction from ever being acknowledged.
        entry = _InFlight(transaction.end_lsn, size, size)
        self._in_flight.append(entry)
        self._events_in_flight += size
        if self._catch_up_to and transaction.end_lsn >= self._catch_up_to:
            self._catch_up_to = 0
        alone = self._alone_through is not None and transaction.end_lsn <= self._alone_through
        for index, event in enumerate(transaction.events):
            if self._failure is not None or self._producer_dead:
                # Known to fail: the rest is not produced (it would overtake the failed
                # event), and the transaction is read again with it.
                self._not_produced(entry, size - index)
                break
            self.reader.keep_alive()  # the checks may wait for the broker
            key = event.key.encode("utf-8")
            known = self._never.get((transaction.end_lsn, event.event_id))
            problem = (
                (Verdict.PERMANENT, known)
                if known is not None
                else self._checks.problem(_as_claimed(event), key)
                or self._topics.problem(event.topic)
                or over_topic_limit(
                    Message(event.topic, key, event.value, event.headers),
                    self._limits,
                    _RAISE_IT,
                )
            )
            if problem is not None:
                self._not_taken(event, entry, *problem)
            elif alone:
                # Nothing else in its record batch: the broker's answer is about it.
                self._wait_for_reports()
                if len(self._producer) or self._failure is not None or self._producer_dead:
                    # Not alone after all (stopping, or reports overdue), or known to
                    # fail: the rest waits for the stream to be read again.
                    if self._failure is None and not self._producer_dead:
                        self._fail(event, entry, "its one-at-a-time send found others")
                        self._not_produced(entry, size - index - 1)
                    else:
                        self._not_produced(entry, size - index)
                    break
                self._produce(event, entry, alone=True)
                self._wait_for_reports()
            else:
                self._produce(event, entry)
        self._produce_copies()

    @staticmethod
    def _not_produced(entry: _InFlight, events: int) -> None:
        """``events`` of ``entry``'s transaction are not produced: it is read again."""
        entry.failed = True
        entry.remaining -= events

    def _wait_for_reports(self) -> None:
        """Serve delivery reports until every message produced has one (or the delivery
        timeout has passed), telling the server the session lives meanwhile."""
        deadline = time.monotonic() + self.settings.effective_delivery_timeout_ms / 1000 + 1
        while (
            len(self._producer)
            and not self._producer_dead
            and not self._stop.is_set()
            and time.monotonic() < deadline
        ):
            self._poll(0.05)
            self.reader.keep_alive()

    def _produce(self, event: FramedEvent, entry: _InFlight, *, alone: bool = False) -> None:
        """Produce ``event``; ``alone``: nothing else is in its record batch, so that a
        refusal of the batch is a refusal of the event."""

        def report(err: Any, _msg: Any) -> None:
            if entry.abandoned:
                return
            if err is None:
                entry.remaining -= 1
                return
            self._producer_failed(err)
            verdict, why = _verdict(err), str(err)
            if verdict == Verdict.BATCH_REJECTED:
                if alone:
                    verdict, why = Verdict.PERMANENT, f"{why} (refused when sent alone)"
                else:
                    self._refused_through = max(self._refused_through or 0, entry.end_lsn)
            self._not_taken(event, entry, verdict, why)

        while True:
            try:
                self._producer.produce(
                    event.topic,
                    event.value,
                    event.key.encode("utf-8"),
                    headers=event.headers,
                    on_delivery=report,
                )
                return
            except BufferError:
                self._poll(0.1)
                if self._producer_dead:
                    self._fail(event, entry, "the Kafka producer failed fatally")
                    return
                if self._failure is not None:
                    self._not_produced(entry, 1)  # it would overtake the failed event
                    return
            except KafkaException as exc:
                err = exc.args[0] if exc.args else exc
                self._producer_failed(err)
                self._not_taken(event, entry, _verdict(err, reported=False), str(err))
                return

    def _not_taken(self, event: FramedEvent, entry: _InFlight, verdict: Verdict, why: str) -> None:
        """An event Kafka did not take, or would not (a check before producing): its
        dead-letter copy goes out in its place when Kafka never will take it and there is
        a dead-letter topic; else the stream stalls at it. Called from delivery reports:
        the copy is only queued here."""
        if entry.abandoned:
            return
        if verdict == Verdict.PERMANENT:
            self._never[(entry.end_lsn, event.event_id)] = why
        dead_letter = self.settings.dead_letter_topic
        if verdict == Verdict.PERMANENT and dead_letter and self._failure is None:
            copy = dead_letter_copy(
                dead_letter,
                str(event.event_id),
                event.key,
                event.topic,
                event.value,
                event.headers,
                why,
            )
            size = message_size(copy.key, copy.value, copy.headers)
            if size <= self._checks.max_message_bytes:
                # The transaction waits for the copy in the event's place.
                self._copies.append((copy, entry, event, why))
                return
            why += f"; its dead-letter copy ({size} bytes) is too large as well"
        self._fail(event, entry, why, refused_batch=verdict == Verdict.BATCH_REJECTED)

    def _fail(
        self, event: FramedEvent, entry: _InFlight, why: str, *, refused_batch: bool = False
    ) -> None:
        """``event`` was not published: the stream stops before its transaction."""
        if self._failure is None:
            self._failure = (
                f"event {event.event_id} (key {event.key!r}, topic {event.topic!r}): {why}"
            )
            self._failure_is_refusal = refused_batch
        entry.failed = True
        entry.remaining -= 1

    def _produce_copies(self) -> None:
        """Produce the dead-letter copies queued; each is its event's report. A copy
        over the dead-letter topic's own limit fails its event."""
        copies, self._copies = self._copies, []
        for copy, entry, event, why in copies:
            if entry.abandoned:
                continue
            problem = self._topics.problem(copy.topic) or over_topic_limit(
                copy, self._limits, _RAISE_IT
            )
            if problem is None:
                self._dead_letter(copy, entry, event, why)
            else:
                self._fail(event, entry, f"{why}; its dead-letter copy: {problem[1]}")

    def _dead_letter(self, copy: Message, entry: _InFlight, event: FramedEvent, why: str) -> None:
        """Produce ``copy``, the dead-letter copy of ``event``: its delivery is the
        event's report."""
        topic = copy.topic
        log.error(
            "log relay: an event Kafka will never take goes to the dead-letter topic",
            extra={
                "action": "log_dead_lettered",
                "event_id": str(event.event_id),
                "key": event.key,
                "topic": event.topic,
                "dead_letter_topic": topic,
                "error": why,
            },
        )

        def report(err: Any, _msg: Any) -> None:
            if entry.abandoned:
                return
            if err is None:
                entry.dead_lettered += 1
            else:
                self._producer_failed(err)
                entry.failed = True
                if self._failure is None:
                    self._failure = (
                        f"the dead-letter copy of event {event.event_id} (key {event.key!r}, "
                        f"topic {event.topic!r}: {why}) was not taken by {topic!r}: {err}"
                    )
            entry.remaining -= 1

        while True:
            try:
                self._producer.produce(
                    copy.topic, copy.value, copy.key, headers=copy.headers, on_delivery=report
                )
                return
            except BufferError:
                self._poll(0.1)
                if self._producer_dead:
                    report(KafkaError(KafkaError._FATAL, "the Kafka producer failed fatally"), None)
                    return
            except KafkaException as exc:
                err = exc.args[0] if exc.args else exc
                self._producer_failed(err)
                report(err, None)
                return

    def _acknowledge(self) -> int:
        """Acknowledge the transactions at the front whose events are all delivered."""
        done = 0
        set_aside = 0
        last: int | None = None
        while self._in_flight and self._in_flight[0].remaining <= 0:
            head = self._in_flight[0]
            if head.failed:
                break
            self._in_flight.popleft()
            self._events_in_flight -= head.size
            done += head.size
            set_aside += head.dead_lettered
            last = head.end_lsn
        if last is not None:
            self.reader.acknowledge(last)
            self._acknowledged_lsn = max(self._acknowledged_lsn, last)
            if self.stalled is None:
                self._backoff = self.settings.backoff_base
            if self._alone_through is not None and last >= self._alone_through:
                self._alone_through = None
            if self._never:
                self._never = {k: v for k, v in self._never.items() if k[0] > last}
            self.published += done - set_aside
            self.dead_lettered += set_aside
            self.metrics.published.inc(done - set_aside)
            self.metrics.dead_lettered.inc(set_aside)
            self.metrics.acknowledged.set(self.reader.acknowledged)
            if self.stalled is not None and self._failure is None:
                self._unstall()
        return done

    def _restart_after(self, failure: str) -> None:
        """Everything in flight is reported and what preceded the failure acknowledged:
        read again from there, after a backoff; at once when the broker refused a record
        batch (its messages are sent again one at a time: no stall yet)."""
        if self._refused_through is not None and self._failure_is_refusal:
            log.warning(
                "log relay: the broker refused a record batch; its events are sent again "
                "one at a time",
                extra={"action": "send_alone", "error": failure},
            )
            self._abandon(keep_stall=True)
            self._rebuild_if_due()
            self._retry_at = time.monotonic()
            return
        if self.stalled is None:
            self.metrics.stalls.inc()
            self.metrics.stalled.set(1)
            log.error(
                "log relay stalled: an event was not published; the stream is read again "
                "from the last acknowledgement until Kafka takes it",
                extra={"action": "log_stalled", "error": failure},
            )
        done = self._acknowledged_lsn
        self.stalled = f"{failure}; the stream stops before it, " + (
            f"acknowledged up to LSN {lsn_text(done)}"
            if done
            else "nothing acknowledged since the relay started"
        )
        self.problem = f"stalled: {self.stalled}"
        self._problem_kind = "stalled at an event Kafka does not take"
        self._abandon(keep_stall=True)
        # An operator may mend what failed: a limit raised, a topic made again.
        self._never.clear()
        self._topics.forget()
        self._rebuild_if_due()
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self.settings.backoff_cap, self._backoff * 2)

    def _admin_client(self) -> AdminClient:
        if self._admin is None:
            self._admin = admin_client(dict(self.settings.admin_config()))
        return self._admin

    def _poll(self, timeout: float) -> None:
        """Serve delivery reports; a producer that failed fatally is marked for replacing
        (``poll()`` raises it rather than reporting it)."""
        try:
            self._producer.poll(timeout)
        except KafkaException as exc:
            self._producer_failed(exc.args[0] if exc.args else exc)

    def _producer_failed(self, err: Any) -> None:
        """Note what a Kafka error says of the producer itself. A fatal error, or one that
        ends its idempotent session, leaves it dead: what it holds will never be reported,
        and the stream is read again by a new one. A delivery that timed out stalls the
        stream as any failure does, and the stream is read again by a new producer."""
        if not isinstance(err, KafkaError):
            return
        if needs_rebuild(err):
            if not self._producer_dead:
                self._producer_dead = True
                self._replace_producer = f"a fatal error ({err.name()})"
                log.error(
                    "log relay: the Kafka producer failed fatally; a new one reads the "
                    "stream again from the last acknowledgement",
                    extra={"action": "producer_fatal", "error": str(err)},
                )
        elif err.code() == KafkaError._MSG_TIMED_OUT and self._replace_producer is None:
            self._replace_producer = "deliveries that timed out"

    def _read_again_with_a_new_producer(self) -> None:
        """After a fatal error: what was delivered is acknowledged (by the step), the
        rest is read again from there, after a backoff, by a new producer."""
        self.problem = (
            f"the Kafka producer failed fatally ({self._replace_producer}); the stream is "
            "read again by a new one"
        )
        self._problem_kind = "the Kafka producer failed; reading again with a new one"
        self._abandon(keep_stall=True)
        self._rebuild_if_due()
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self.settings.backoff_cap, self._backoff * 2)

    def _rebuild_if_due(self) -> None:
        """Replace the producer if an error said it is to be replaced."""
        why = self._replace_producer
        if why is None:
            return
        log.warning(
            "log relay: rebuilding the Kafka producer after %s",
            why,
            extra={"action": "rebuild", "reason": why},
        )
        old = self._producer
        try:
            self._producer = self._producer_factory(self._producer_config)
        except (KafkaException, ValueError, TypeError) as exc:
            # Tried again when the stream is next read again, after a backoff.
            log.error(
                "log relay: a new Kafka producer could not be made",
                extra={"action": "rebuild_failed", "error": str(exc)},
            )
            return
        self._replace_producer = None
        self._producer_dead = False
        self.rebuilds += 1
        self.metrics.producer_rebuilds.inc()
        with contextlib.suppress(KafkaException):
            old.purge(in_queue=True, in_flight=True, blocking=False)
        with contextlib.suppress(KafkaException):
            old.flush(0)

    def _unstall(self) -> None:
        log.warning("log relay: the stream goes on", extra={"action": "log_resumed"})
        self.stalled = None
        self.problem = None
        self._backoff = self.settings.backoff_base
        self.metrics.stalled.set(0)

    def _abandon(self, *, keep_stall: bool = False) -> None:
        """Forget what is in flight and stop reading (the next step reads it again from
        the last acknowledgement)."""
        self.reader.close()
        self._reading = False
        if self._in_flight:
            self._catch_up_to = max(self._catch_up_to, self._in_flight[-1].end_lsn)
        for entry in self._in_flight:
            entry.abandoned = True  # their late reports change nothing now
        self._in_flight.clear()
        self._copies.clear()
        self._events_in_flight = 0
        self._failure = None
        self._failure_is_refusal = False
        if self._refused_through is not None:
            self._alone_through = max(self._alone_through or 0, self._refused_through)
            self._refused_through = None
        self._purged = False
        if self.stalled is not None and not keep_stall:
            self._unstall()

    def _count_strays(self) -> None:
        strays = self.reader.strays
        now = (strays.non_transactional, strays.foreign, strays.malformed)
        for kind, before, after in zip(
            ("non_transactional", "foreign", "malformed"), self._strays_counted, now, strict=True
        ):
            if after > before:
                self.metrics.strays.labels(kind).inc(after - before)
                if kind == "malformed":
                    log.error(
                        "log relay: a frame of this outbox could not be read; it is skipped",
                        extra={"action": "log_malformed", "error": strays.malformed_reasons[-1]},
                    )
        self._strays_counted = now


def _as_claimed(event: FramedEvent) -> ClaimedEvent:
    """``event`` as the checks the polling relay makes of a claimed event read it."""
    try:
        text: str | None = event.value.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    return ClaimedEvent(
        str(event.event_id),
        event.key,
        0,
        event.topic,
        event.type,
        event.value,
        event.headers,
        0,
        True,
        0.0,
        text,
    )


def _verdict(err: Any, *, reported: bool = True) -> Verdict:
    """What a Kafka error means for the event: PERMANENT when Kafka will never take it."""
    if isinstance(err, KafkaError):
        if err.fatal():
            return Verdict.RESET
        return classify(err.code(), reported=reported)
    return Verdict.RETRIABLE


def lsn_text(lsn: int) -> str:
    """``lsn`` as PostgreSQL writes it (``pg_lsn``): two hexadecimal halves, ``16/B374D848``."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"
