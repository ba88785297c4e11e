"""Sending one claimed batch under its lease, and the Kafka producer that sends it.

The events go out in one send together with the dead-letter copies of events
already known to be discarded; copies of events the broker's answers discarded
follow in a second send. Nothing is sent with less than one delivery timeout of
the lease left (:mod:`~outbox_kafka.relay.lease`), so all of it is delivered or
timed out before another relay can take the keys. The decisions
(:mod:`~outbox_kafka.relay.decide`) are pure; here they are announced to the
relay's observers (:mod:`~outbox_kafka.relay.observe`), which log and count them.

:class:`Publisher` is the relay's Kafka boundary: one idempotent producer, a
batch in flight, one wait. Everything confluent-kafka raises or reports is
translated into a :class:`~outbox_kafka.relay.ports.Delivery` with a
:class:`Verdict`, so nothing else in the relay imports confluent_kafka.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from outbox_kafka.errors import ConfigurationError, StorageError
from outbox_kafka.limits import KAFKA_MESSAGE_MAX_BYTES
from outbox_kafka.logs import librdkafka_logger
from outbox_kafka.relay.batch import Claim, Doubts, EventOutcome, KeyOutcome, Problem, Verdict
from outbox_kafka.relay.claim import Claimed
from outbox_kafka.relay.decide import (
    FoundOnKafka,
    RetryPolicy,
    dead_letter_messages,
    note_copies,
    plan_batch,
)
from outbox_kafka.relay.lease import Lease, metadata_wait
from outbox_kafka.relay.observe import RelayObserver
from outbox_kafka.relay.ports import Delivery, Message, MessagePublisher
from outbox_kafka.relay.recover import READ_BACK_MARGIN, ReadBackError, Recovery
from outbox_kafka.relay.topic_admin import (
    LISTED_BUT_HELD,
    TopicLimits,
    TopicLookup,
    admin_client,
)

if TYPE_CHECKING:
    from outbox_kafka.relay.config import RelaySettings


@dataclass
class SentBatch:
    """A batch after sending: every key's and event's next state, to be recorded."""

    keys: list[KeyOutcome] = field(default_factory=list)
    events: list[EventOutcome] = field(default_factory=list)
    #: Events handed to the producer (dead-letter copies not counted).
    sent: int = 0
    #: What the batch leaves in doubt, and the session's floors to raise (None: the
    #: relay does not read Kafka back).
    doubts: Doubts | None = None


class BatchSender:
    def __init__(
        self,
        publisher: MessagePublisher,
        policy: RetryPolicy,
        observer: RelayObserver,
        *,
        dead_letter_topic: str | None,
        lease: Lease,
        abort: Callable[[], bool],
        recovery: Recovery | None = None,
    ) -> None:
        self.publisher = publisher
        self.policy = policy
        self.observer = observer
        self.dead_letter_topic = dead_letter_topic
        self._lease = lease
        self._send_timeout = lease.delivery_timeout + 5.0
        self._abort = abort
        self.recovery = recovery
        #: The batch being sent: its session, and every message handed to the
        #: publisher with its delivery.
        self._session: uuid.UUID | None = None
        self._handed: list[tuple[Message, Delivery]] = []

    def send_claimed(self, claimed: Claimed) -> tuple[Claim, SentBatch]:
        """The send step of a cycle: send a claimed batch within its lease, timed; its
        outcome is decided but not yet recorded."""
        claim = claimed.claim
        if not claim.keys:
            return claim, SentBatch()
        started = time.monotonic()
        sent = self.send(claim, claimed.problems, self._lease.ends(claimed.asked_at))
        self.observer.sent(claim, time.monotonic() - started)
        return claim, sent

    def send(self, claim: Claim, problems: dict[int, Problem], lease_ends: float) -> SentBatch:
        """Send the claimed events; decide every key's and event's next state.

        Keys in doubt are read back from Kafka first (:mod:`~outbox_kafka.relay.recover`):
        what is found there is recorded as delivered, not sent again."""
        topic_problem = self.publisher.topic_problem
        message_limit = self.publisher.message_limit
        recovery = self.recovery
        found: FoundOnKafka | None = None
        partition_of = None
        if recovery is not None and claim.session is not None:
            if any(k.doubt for k in claim.keys):
                found = self._read_back(recovery, claim, lease_ends)
            partition_of = recovery.partition_of(claim.session)
        self._session, self._handed = claim.session, []
        plan = plan_batch(
            claim,
            problems,
            topic_problem,
            self.policy,
            message_limit,
            found=found,
            partition_of=partition_of,
        )
        results = plan.results
        first = plan.discarded_first
        first_copies = dead_letter_messages(
            first, self.dead_letter_topic, topic_problem, results.copies, message_limit
        )
        if plan.messages or first_copies:
            deliveries = self._send(plan.messages + first_copies, lease_ends)
            sent = deliveries[: len(plan.messages)]
            results.deliveries.update({id(e): d for e, d in zip(plan.events, sent, strict=True)})
            note_copies(first, first_copies, deliveries[len(plan.messages) :], results.copies)

        # One walk per key decides both its next state and the dead-letter copies
        # the broker's answers call for; a key that needs copies is walked again
        # once they are answered.
        limit = claim.per_key_limit
        settlements = [
            self.policy.settle(claimed, due, results, limit, copy_unknown=None)
            for claimed, due in plan.keys
        ]
        later = [discard for settled in settlements for discard in settled.copies_to_send]
        if later:
            later_copies = dead_letter_messages(
                later, self.dead_letter_topic, topic_problem, results.copies, message_limit
            )
            if later_copies:
                note_copies(
                    later, later_copies, self._send(later_copies, lease_ends), results.copies
                )
            settlements = [
                self.policy.settle(claimed, due, results, limit)
                if settled.copies_to_send
                else settled
                for (claimed, due), settled in zip(plan.keys, settlements, strict=True)
            ]

        handed = sum(1 for e in plan.events if results.deliveries[id(e)].sent)
        batch = SentBatch(keys=plan.idle_keys, sent=handed)
        if recovery is not None and claim.session is not None:
            batch.doubts = recovery.doubts(claim.session, claim, self._handed)
        for settled in settlements:
            batch.keys.append(settled.key)
            batch.events.extend(settled.events)
        self.observer.settled_all(settlements)
        return batch

    def _send(self, messages: list[Message], lease_ends: float) -> list[Delivery]:
        """Send ``messages`` within the lease; those the broker refused with their
        record batch are sent again alone (:meth:`_resend_alone`)."""
        return self._resend_alone(messages, self._within_lease(messages, lease_ends), lease_ends)

    def _resend_alone(
        self, messages: list[Message], deliveries: list[Delivery], lease_ends: float
    ) -> list[Delivery]:
        """``deliveries`` with each message the broker refused with its record batch
        sent again on its own, in its key's order, so that only a message refused
        alone is found at fault.

        A message whose producer was reset under it (some brokers fence the producer
        of a refused batch) is sent alone once more on the new producer. A key stops
        at its first message that does not get through alone, and is not
        resent at all where a later message of it got through already (sent now,
        the refused one would land after it; it stays unsent and the order violation
        is counted). What stays refused is left unsent: tried again in a later batch,
        no attempt counted.
        """
        refused = [i for i, d in enumerate(deliveries) if d.verdict == Verdict.BATCH_REJECTED]
        if not refused:
            return deliveries
        self.observer.sending_alone(len(refused))
        out = list(deliveries)
        stopped = {
            messages[i].key
            for i in refused
            for j in range(i + 1, len(messages))
            if messages[j].key == messages[i].key and deliveries[j].verdict == Verdict.DELIVERED
        }
        for i in refused:
            message = messages[i]
            if message.key in stopped or self._abort():
                continue
            (delivery,) = self._within_lease([message], lease_ends)
            if delivery.reported and delivery.verdict == Verdict.RESET and not self._abort():
                # Some brokers fence the producer that sent a refused batch: the
                # message goes alone once more, on the producer built after it.
                (delivery,) = self._within_lease([message], lease_ends)
            if delivery.reported and delivery.verdict == Verdict.BATCH_REJECTED:
                delivery.verdict = Verdict.PERMANENT
                delivery.error = f"{delivery.error} (refused when sent alone)"
            out[i] = delivery
            if delivery.verdict != Verdict.DELIVERED or not delivery.reported:
                stopped.add(message.key)
        return out

    def _within_lease(self, messages: list[Message], lease_ends: float) -> list[Delivery]:
        """Send ``messages`` if the lease outlasts their delivery timeout; else none (unsent).

        Metadata lookups and topic creation before the send count against the
        lease: they have run by now.
        """
        left = self._lease.left(lease_ends)
        if not self._lease.room_to_send(left):
            self.observer.send_skipped(len(messages), left)
            return [Delivery() for _ in messages]
        if self.recovery is not None and self._session is not None:
            try:
                # Committed before anything is produced to a partition new to the session.
                messages = self.recovery.place(self._session, messages, timeout=left / 4)
            except (StorageError, ReadBackError) as exc:
                # Nothing was produced: a failure like any other before the broker
                # took the messages, retried after a backoff.
                error = f"FLOORS_UNAVAILABLE: {exc}"
                return [
                    Delivery(Verdict.RETRIABLE, error=error, sent=True, reported=True)
                    for _ in messages
                ]
        sending = self.observer.before_send(messages)
        deliveries: list[Delivery] = []
        try:
            deliveries = self.publisher.send(sending, timeout=self._send_timeout, abort=self._abort)
        finally:
            # Messages without a delivery (the send raised) count as not sent.
            missing = len(sending) - len(deliveries)
            self.observer.after_send(sending, deliveries + [Delivery() for _ in range(missing)])
        self._handed.extend(zip(messages, deliveries, strict=False))
        return deliveries

    def _read_back(self, recovery: Recovery, claim: Claim, lease_ends: float) -> FoundOnKafka:
        """Read Kafka back for the claim's keys in doubt, leaving the lease room to
        send what is not found; a read-back that fails proves nothing."""
        deadline = lease_ends - self._lease.delivery_timeout - READ_BACK_MARGIN
        try:
            return recovery.read_back(claim, deadline)
        except (StorageError, ReadBackError) as exc:
            log.warning(
                "could not read Kafka back for keys in doubt; they are unproven "
                "(they wait, or with --on-unproven send are sent at least once)",
                extra={"action": "read_back_failed", "error": str(exc)},
            )
            return recovery.unproven(claim, str(exc))


log = logging.getLogger("outbox_kafka.publisher")

#: Batches in a row that timed out, with nothing delivered, while the broker answers
#: metadata requests, after which the producer is replaced (it may be stuck).
STALLED_BATCHES = 3

# Errors no retry can fix: the event is set aside at once.
_PERMANENT_CODES = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_MSG_SIZE,
    KafkaError.TOPIC_EXCEPTION,
    KafkaError._INVALID_ARG,
}

# Errors an operator fixes outside the event (create the topic, grant access):
# the event's key waits, in order, until then; nothing is discarded.
_HELD_CODES = {KafkaError.UNKNOWN_TOPIC_OR_PART, *LISTED_BUT_HELD}

# Errors a broker gives every message of a record batch (or of a whole produce
# request) when it refuses the batch: in a delivery report they do not say
# which message is at fault. produce() raising them names its own message.
_BATCH_CODES = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_MSG_SIZE,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_RECORD,
}


# Errors that leave the idempotent producer's session unusable: the relay
# starts a new producer and retries the events. Some brokers fence a producer
# for good once its epoch was bumped after timed-out requests.
_REBUILD_CODES = {
    KafkaError._FATAL,
    KafkaError.PRODUCER_FENCED,
    KafkaError.INVALID_PRODUCER_EPOCH,
    KafkaError.UNKNOWN_PRODUCER_ID,
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
    KafkaError.INVALID_PRODUCER_ID_MAPPING,
}


# Errors in a delivery report that prove the broker did not append the message:
# it refused it, or it never left the producer. Any other error (a timeout, a
# lost connection, a producer fenced mid-request) leaves it in doubt.
_NOT_APPENDED_CODES = (
    _HELD_CODES
    | _BATCH_CODES
    | _PERMANENT_CODES
    | {
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_REQUIRED_ACKS,
        KafkaError.INVALID_TIMESTAMP,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError._PURGE_QUEUE,
        KafkaError._QUEUE_FULL,
        KafkaError._TIMED_OUT_QUEUE,
    }
)


def needs_rebuild(err: KafkaError) -> bool:
    """Whether ``err`` leaves the producer that gave it unusable: it is to be replaced."""
    return bool(err.fatal()) or err.code() in _REBUILD_CODES


def classify(code: int, *, reported: bool) -> Verdict:
    """The verdict of a Kafka error ``code``: from a delivery report (``reported``),
    or raised by ``produce()`` for the message alone."""
    if code in _REBUILD_CODES:
        return Verdict.RESET  # the producer is rebuilt; the event itself is fine
    if code in _HELD_CODES:
        return Verdict.HELD
    if reported and code in _BATCH_CODES:
        return Verdict.BATCH_REJECTED
    if code in _PERMANENT_CODES:
        return Verdict.PERMANENT
    return Verdict.RETRIABLE


def _verdict(err: KafkaError, *, reported: bool) -> Verdict:
    if err.fatal():
        return Verdict.RESET  # as for the rebuild codes: the producer is rebuilt
    return classify(err.code(), reported=reported)


def _describe(err: KafkaError) -> str:
    return f"{err.name()}: {err.str()}"


class _Reports:
    """One batch's delivery reports: closed when its wait ends, after which they are ignored."""

    __slots__ = ("closed", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False

    def report(self, delivery: Delivery, err: KafkaError | None, msg: Any) -> None:
        """A delivery report, served by whichever loop's wait or poll runs it.

        Ignored once the batch's wait has ended (its deliveries are being
        decided on by then: the message counts as unreported); ``reported``
        is set last, so a waiting loop never sees a report half written.
        """
        with self.lock:
            if self.closed:
                return
            if err is None:
                delivery.verdict = Verdict.DELIVERED
                delivery.partition = msg.partition()
                delivery.offset = msg.offset()
            else:
                delivery.verdict = _verdict(err, reported=True)
                delivery.error = _describe(err)
                delivery.fatal = needs_rebuild(err)
                delivery.may_have_landed = err.code() not in _NOT_APPENDED_CODES
            delivery.reported = True


class Publisher:
    """Sends batches with an idempotent producer and reports each message's fate."""

    def __init__(
        self,
        producer_config: dict[str, str],
        admin_config: dict[str, Any],
        *,
        create_partitions: int | None = None,
        stats_callback: Callable[[str], None] | None = None,
        metadata_timeout: float = 5.0,
        make_producer: Callable[[dict[str, Any]], Producer] = Producer,
    ) -> None:
        """``make_producer`` makes the producer from its configuration (librdkafka's
        ``Producer`` by default); it is called again whenever a fatal error makes the
        publisher replace its producer. Tests pass a producer of their own through it."""
        self._make_producer = make_producer
        self._config = dict(producer_config)
        if stats_callback is not None:
            self._config["stats_cb"] = stats_callback  # type: ignore[assignment]
        # librdkafka's own messages go through logging (served by poll/flush), not to stderr.
        self._config["logger"] = librdkafka_logger()  # type: ignore[assignment]
        self._admin_config = admin_config
        self._metadata_timeout = metadata_timeout
        self.max_message_bytes = int(
            producer_config.get("message.max.bytes", KAFKA_MESSAGE_MAX_BYTES)
        )
        #: Guards replacing the producer and making the admin client: several
        #: relay loops (one per outbox) may share this publisher.
        self._lock = threading.Lock()
        self._producer = self._new_producer()
        self._admin: AdminClient | None = None
        self._topics = TopicLookup(
            lambda topic, timeout: self._producer.list_topics(topic, timeout=timeout),
            self._admin_client,
            create_partitions,
            metadata_timeout,
        )
        self._topic_limits = TopicLimits(self._config, self._admin_client, metadata_timeout)
        #: Batches in a row in which nothing was delivered and a message timed out.
        self._stalled_batches = 0
        #: How many times the producer was replaced (fatal errors and stalls).
        self.rebuilds = 0

    @classmethod
    def for_settings(
        cls, settings: RelaySettings, stats_callback: Callable[[str], None] | None = None
    ) -> Publisher:
        """The publisher of a relay with ``settings`` (one outbox, or several sharing it)."""
        return cls(
            settings.producer_config(),
            settings.admin_config(),
            create_partitions=settings.create_topics,
            stats_callback=stats_callback,
            metadata_timeout=metadata_wait(settings.lease_seconds),
        )

    def _new_producer(self) -> Producer:
        try:
            return self._make_producer(self._config)
        except (KafkaException, ValueError, TypeError) as exc:
            raise ConfigurationError(f"invalid Kafka configuration: {exc}") from None

    def _admin_client(self) -> AdminClient:
        with self._lock:
            if self._admin is None:
                # Its messages go through logging too, served by poll().
                self._admin = admin_client({**self._admin_config, "logger": librdkafka_logger()})
            return self._admin

    # Topics ---------------------------------------------------------------

    def topic_problem(self, topic: str) -> Problem | None:
        """``(verdict, reason)`` if messages to ``topic`` cannot be sent now
        (:class:`~outbox_kafka.relay.topic_admin.TopicLookup`)."""
        return self._topics.problem(topic)

    def partition_count(self, topic: str) -> int | None:
        """How many partitions ``topic`` has; None when its metadata cannot be read."""
        return self._topics.partition_count(topic)

    def message_limit(self, topic: str) -> int | None:
        """The largest message ``topic`` takes, where the broker tells it
        (:class:`~outbox_kafka.relay.topic_admin.TopicLimits`)."""
        return self._topic_limits(topic)

    # Sending --------------------------------------------------------------

    def send(
        self,
        messages: Sequence[Message],
        *,
        timeout: float,
        abort: Callable[[], bool] | None = None,
    ) -> list[Delivery]:
        """Produce every message, wait once for all reports, return one Delivery each.

        When ``produce()`` itself refuses a message, the later messages of the
        same ordering key are not handed over in this batch (their Delivery
        has ``sent=False``), so nothing overtakes it. ``abort`` is
        polled while waiting; when it returns True the wait ends early and
        unreported messages stay unreported.
        """
        deliveries = [Delivery() for _ in messages]
        held: set[bytes] = set()
        # This batch stays on this producer, even if another loop replaces it meanwhile.
        producer = self._producer
        produce: Any = producer.produce
        reports = _Reports()
        on_delivery = reports.report
        for msg, delivery in zip(messages, deliveries, strict=True):
            if msg.key in held:
                continue
            delivery.sent = True
            try:
                try:
                    produce(
                        msg.topic,
                        msg.value,
                        msg.key,
                        partition=-1 if msg.partition is None else msg.partition,
                        headers=msg.headers,
                        on_delivery=partial(on_delivery, delivery),
                    )
                except BufferError:
                    self._produce_one(producer, msg, partial(on_delivery, delivery))
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                delivery.reported = True
                if isinstance(err, KafkaError):
                    delivery.verdict = _verdict(err, reported=False)
                    delivery.error = _describe(err)
                    delivery.fatal = needs_rebuild(err)
                else:
                    delivery.verdict = Verdict.RETRIABLE
                    delivery.error = str(exc)
                held.add(msg.key)
        self._wait(producer, deliveries, timeout, abort, reports)
        for msg, delivery in zip(messages, deliveries, strict=True):
            if delivery.verdict == Verdict.HELD:
                # The topic went away (or its grant) since it was seen: look again,
                # and create it again where the relay creates topics.
                self._topics.forget(msg.topic)
        return deliveries

    @staticmethod
    def _produce_one(producer: Producer, msg: Message, callback: Any) -> None:
        produce: Any = producer.produce
        while True:
            try:
                produce(
                    msg.topic,
                    msg.value,
                    msg.key,
                    partition=-1 if msg.partition is None else msg.partition,
                    headers=msg.headers,
                    on_delivery=callback,
                )
                return
            except BufferError:
                # Local queue full: serve delivery reports to make room.
                producer.poll(0.05)

    def _wait(
        self,
        producer: Producer,
        deliveries: list[Delivery],
        timeout: float,
        abort: Callable[[], bool] | None,
        reports: _Reports,
    ) -> None:
        """Serve delivery reports until each of ``deliveries`` has one, or the time is up.

        Several relay loops may share this publisher (one per outbox): each
        waits for its own messages, not for the whole producer queue, and a
        report may be served by any loop's wait.
        """
        deadline = time.monotonic() + timeout
        # Short slices: the flush also serves reports of other loops sharing the
        # producer, and returns only when its whole queue is empty.
        slice_seconds = 0.05 if abort is not None else timeout
        fatal = False

        def waiting() -> bool:
            return any(d.sent and not d.reported for d in deliveries)

        while waiting() and not fatal:
            left = deadline - time.monotonic()
            if left <= 0 or (abort is not None and abort()):
                break
            fatal = self._flush(producer, min(slice_seconds, left))
        with reports.lock:
            reports.closed = True
        for d in deliveries:
            if d.sent and not d.reported:
                d.error = "NO_REPORT: no delivery report before the relay's wait ran out"
        if fatal or any(d.fatal for d in deliveries):
            self.rebuild(producer)
        else:
            self._watch_for_stall(producer, deliveries)

    def _watch_for_stall(self, producer: Producer, deliveries: list[Delivery]) -> None:
        """Replace a producer that keeps timing out while the broker answers.

        librdkafka's idempotent producer can be left unable to send after its broker
        restarts (waiting for a producer id that never comes), with no fatal error
        to say so: every message then times out locally while metadata requests
        succeed. After :data:`STALLED_BATCHES` batches in a row in which nothing was
        delivered and a message timed out, the producer is rebuilt if the broker
        answers; a broker that is down is waited for as before.
        """
        with self._lock:
            if producer is not self._producer:
                return  # a batch of a producer replaced meanwhile says nothing of this one
            if any(d.verdict == Verdict.DELIVERED for d in deliveries):
                self._stalled_batches = 0
                return
            if not any(d.reported and d.may_have_landed for d in deliveries):
                return  # nothing timed out: refusals, or a wait that was cut short
            self._stalled_batches += 1
            if self._stalled_batches < STALLED_BATCHES:
                return
        problem = self.broker_problem(self._metadata_timeout)
        if problem is not None:
            return  # the broker is away: a new producer would not help
        self.rebuild(
            producer,
            why=f"{STALLED_BATCHES} batches in a row timed out while the broker answers",
        )

    @staticmethod
    def _flush(producer: Producer, timeout: float) -> bool:
        """``flush()``; whether the producer failed fatally (instead of raising).

        confluent-kafka raises a fatal error, such as UNKNOWN_PRODUCER_ID from a
        broker that lost the producer's state in a restart, from ``flush()`` and
        ``poll()``. The producer is unusable then: its unreported messages stay
        unreported (their keys wait a lease) and it is replaced.
        """
        try:
            producer.flush(timeout)
        except KafkaException as exc:
            log.error(
                "the Kafka producer failed fatally",
                extra={"action": "producer_fatal", "error": str(exc)},
            )
            return True
        return False

    def rebuild(self, failed: Producer | None = None, *, why: str = "a fatal error") -> None:
        """Replace a producer that hit a fatal error (its idempotence state is gone),
        or that stalled (``why`` says which, for the log).

        ``failed``: the producer that failed; when another loop has replaced
        it already, nothing is done.
        """
        with self._lock:
            if failed is not None and failed is not self._producer:
                return
            self._stalled_batches = 0
            log.warning(
                "rebuilding the Kafka producer after %s",
                why,
                extra={"action": "rebuild", "reason": why},
            )
            self.rebuilds += 1
            old = self._producer
            self._producer = self._new_producer()
        with contextlib.suppress(KafkaException):
            old.flush(0)

    def poll(self, timeout: float = 0.0) -> None:
        """Serve pending callbacks (statistics, logs, late delivery reports)."""
        admin = self._admin
        if admin is not None:
            with contextlib.suppress(KafkaException):
                admin.poll(0)
        producer = self._producer
        try:
            producer.poll(timeout)
        except KafkaException as exc:
            log.error(
                "the Kafka producer failed fatally",
                extra={"action": "producer_fatal", "error": str(exc)},
            )
            self.rebuild(producer)

    def broker_problem(self, timeout: float) -> str | None:
        """Why no broker answers a metadata request within ``timeout`` seconds, or None.

        Safe to call from another thread than the one sending.
        """
        return broker_problem(self._producer, timeout)

    def close(self, timeout: float = 5.0) -> None:
        with contextlib.suppress(KafkaException):
            self._producer.flush(timeout)


def broker_problem(producer: Any, timeout: float) -> str | None:
    """Why no broker answers ``producer``'s metadata request within ``timeout`` seconds,
    or None; for readiness, from any thread."""
    try:
        metadata = producer.list_topics(timeout=timeout)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        return _describe(err) if isinstance(err, KafkaError) else str(exc)
    if not metadata.brokers:
        return "the cluster metadata lists no brokers"
    return None
