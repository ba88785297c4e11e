"""The relay's Kafka boundary: one idempotent producer, a batch in flight, one wait.

Everything confluent-kafka raises or reports is translated here into a
:class:`~outbox_kafka.relay.ports.Delivery` with a :class:`Verdict`, so
the relay loop never imports confluent_kafka.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from outbox_kafka.errors import ConfigurationError
from outbox_kafka.limits import KAFKA_MESSAGE_MAX_BYTES
from outbox_kafka.logs import librdkafka_logger
from outbox_kafka.relay.batch import Problem, Verdict
from outbox_kafka.relay.lease import metadata_wait
from outbox_kafka.relay.ports import Delivery, Message

if TYPE_CHECKING:
    from outbox_kafka.relay.config import RelaySettings

log = logging.getLogger("outbox_kafka.publisher")

#: After a failed metadata fetch, topic checks fail fast for this long.
METADATA_RETRY_SECONDS = 2.0

#: How long a topic's max.message.bytes, as the broker told it, is trusted.
TOPIC_LIMIT_SECONDS = 60.0

#: How long a topic found missing (or not granted) is taken to be so, before the
#: broker is asked again: held keys are looked at every few seconds.
MISSING_TOPIC_SECONDS = 2.0

#: librdkafka's names of the producer's compression setting.
_COMPRESSION_KEYS = ("compression.type", "compression.codec")

# Errors no retry can fix: the event is set aside at once.
_PERMANENT_CODES = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_MSG_SIZE,
    KafkaError.TOPIC_EXCEPTION,
    KafkaError._INVALID_ARG,
}

# Errors an operator fixes outside the event (create the topic, grant access):
# the event's key waits, in order, until then; nothing is discarded.
_HELD_CODES = {
    KafkaError._UNKNOWN_TOPIC,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
}

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


def _needs_rebuild(err: KafkaError) -> bool:
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
        self._create_partitions = create_partitions
        self._known_topics: set[str] = set()
        #: By topic: why it cannot be sent to, and until when that answer is used.
        self._missing_topics: dict[str, tuple[Problem, float]] = {}
        #: By topic: (its max.message.bytes or None where not told, when it was read).
        self._topic_limits: dict[str, tuple[int | None, float]] = {}
        self._metadata_timeout = metadata_timeout
        self._metadata_retry_at = 0.0
        self._metadata_error = ""
        self.max_message_bytes = int(
            producer_config.get("message.max.bytes", KAFKA_MESSAGE_MAX_BYTES)
        )
        #: Guards replacing the producer and making the admin client: several
        #: relay loops (one per outbox) may share this publisher.
        self._lock = threading.Lock()
        #: Held while a topic unknown so far is looked up (and created).
        self._topic_lock = threading.Lock()
        self._producer = self._new_producer()
        self._admin: AdminClient | None = None

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
                try:
                    # Its messages go through logging too, served by poll().
                    config = {**self._admin_config, "logger": librdkafka_logger()}
                    self._admin = AdminClient(config)
                except (KafkaException, ValueError, TypeError) as exc:
                    raise ConfigurationError(f"invalid Kafka configuration: {exc}") from None
            return self._admin

    # Topics ---------------------------------------------------------------

    def topic_problem(self, topic: str) -> Problem | None:
        """``(verdict, reason)`` if messages to ``topic`` cannot be sent now."""
        if topic in self._known_topics:
            return None
        # One loop at a time looks a topic up: loops that find it missing together
        # would each create it, and each log that they did.
        with self._topic_lock:
            return self._look_up(topic)

    def _look_up(self, topic: str) -> Problem | None:
        if topic in self._known_topics:
            return None  # another loop found it, or created it, meanwhile
        now = time.monotonic()
        missing = self._missing_topics.get(topic)
        if missing is not None and now < missing[1]:
            return missing[0]
        if now < self._metadata_retry_at:
            # The last fetch failed moments ago: do not block on it again per event.
            return Verdict.RETRIABLE, self._metadata_error
        try:
            metadata = self._producer.list_topics(timeout=self._metadata_timeout)
        except KafkaException as exc:
            self._metadata_error = f"METADATA_UNAVAILABLE: cannot read topic metadata: {exc}"
            self._metadata_retry_at = time.monotonic() + METADATA_RETRY_SECONDS
            return Verdict.RETRIABLE, self._metadata_error
        for name, meta in metadata.topics.items():
            if meta.error is None:
                self._known_topics.add(name)
        if topic in self._known_topics:
            return None
        problem = self._unavailable(topic, metadata)
        if problem is not None:
            self._missing_topics[topic] = (problem, time.monotonic() + MISSING_TOPIC_SECONDS)
        return problem

    def _unavailable(self, topic: str, metadata: Any) -> Problem | None:
        """Why ``topic``, not among the topics ``metadata`` lists whole, cannot be
        sent to: missing (created here with --create-topics) or not granted."""
        listed = metadata.topics.get(topic)
        error = listed.error if listed is not None else None
        if isinstance(error, KafkaError) and error.code() in _HELD_CODES - {
            KafkaError.UNKNOWN_TOPIC_OR_PART
        }:
            # The topic is there, but this relay may not see or write it.
            return Verdict.HELD, f"{_describe(error)} (topic {topic!r}; its events wait)"
        if self._create_partitions:
            return self._create(topic)
        return (
            Verdict.HELD,
            f"UNKNOWN_TOPIC: topic {topic!r} does not exist and topic creation is off "
            "(create it, or run the relay with --create-topics <partitions>; its events wait)",
        )

    def _create(self, topic: str) -> Problem | None:
        assert self._create_partitions is not None
        futures = self._admin_client().create_topics(
            [NewTopic(topic, self._create_partitions, -1)], request_timeout=10
        )
        try:
            futures[topic].result(timeout=15)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not (isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
                return (
                    Verdict.HELD,
                    f"CREATE_TOPIC_FAILED: cannot create topic {topic!r}: {exc} (its events wait)",
                )
            # Another process created it first: it is there, and that one logged it.
            log.debug("topic already exists", extra={"action": "topic_exists", "topic": topic})
        else:
            log.info(
                "created topic",
                extra={
                    "action": "create_topic",
                    "topic": topic,
                    "partitions": self._create_partitions,
                },
            )
        self._known_topics.add(topic)
        return None

    def message_limit(self, topic: str) -> int | None:
        """The largest message ``topic`` takes (its ``max.message.bytes``), where the
        broker tells it (DescribeConfigs) and the producer does not compress: a
        compressed batch may fit a limit its messages exceed. Read again after a minute,
        so that a limit an operator raises takes effect."""
        if any(self._config.get(k, "none") != "none" for k in _COMPRESSION_KEYS):
            return None
        now = time.monotonic()
        cached = self._topic_limits.get(topic)
        if cached is not None and now - cached[1] < TOPIC_LIMIT_SECONDS:
            return cached[0]
        limit: int | None = None
        try:
            resource = ConfigResource(ResourceType.TOPIC, topic)
            futures = self._admin_client().describe_configs(
                [resource], request_timeout=self._metadata_timeout
            )
            entry = futures[resource].result(self._metadata_timeout + 1).get("max.message.bytes")
            limit = int(entry.value)
        except Exception:
            limit = None  # the broker's answer to the send decides
        self._topic_limits[topic] = (limit, now)
        return limit

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
        on_delivery = partial(self._on_delivery, reports)
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
                    delivery.fatal = _needs_rebuild(err)
                else:
                    delivery.verdict = Verdict.RETRIABLE
                    delivery.error = str(exc)
                held.add(msg.key)
        self._wait(producer, deliveries, timeout, abort, reports)
        for msg, delivery in zip(messages, deliveries, strict=True):
            if delivery.verdict == Verdict.HELD:
                # The topic went away (or its grant) since it was seen: look again,
                # and create it again where the relay creates topics.
                self._known_topics.discard(msg.topic)
        return deliveries

    @staticmethod
    def _produce_one(producer: Producer, msg: Message, callback: Any) -> None:
        produce: Any = producer.produce
        while True:
            try:
                produce(msg.topic, msg.value, msg.key, headers=msg.headers, on_delivery=callback)
                return
            except BufferError:
                # Local queue full: serve delivery reports to make room.
                producer.poll(0.05)

    @staticmethod
    def _on_delivery(
        reports: _Reports, delivery: Delivery, err: KafkaError | None, msg: Any
    ) -> None:
        """A delivery report, served by whichever loop's wait or poll runs it.

        Ignored once the batch's wait has ended (its deliveries are being
        decided on by then: the message counts as unreported); ``reported``
        is set last, so a waiting loop never sees a report half written.
        """
        with reports.lock:
            if reports.closed:
                return
            if err is None:
                delivery.verdict = Verdict.DELIVERED
                delivery.partition = msg.partition()
                delivery.offset = msg.offset()
            else:
                delivery.verdict = _verdict(err, reported=True)
                delivery.error = _describe(err)
                delivery.fatal = _needs_rebuild(err)
            delivery.reported = True

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

    def rebuild(self, failed: Producer | None = None) -> None:
        """Replace a producer that hit a fatal error (its idempotence state is gone).

        ``failed``: the producer that failed; when another loop has replaced
        it already, nothing is done.
        """
        with self._lock:
            if failed is not None and failed is not self._producer:
                return
            log.warning(
                "rebuilding the Kafka producer after a fatal error", extra={"action": "rebuild"}
            )
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
        try:
            metadata = self._producer.list_topics(timeout=timeout)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            return _describe(err) if isinstance(err, KafkaError) else str(exc)
        if not metadata.brokers:
            return "the cluster metadata lists no brokers"
        return None

    def close(self, timeout: float = 5.0) -> None:
        with contextlib.suppress(KafkaException):
            self._producer.flush(timeout)
