"""What the relay asks of the broker about topics.

- Whether a topic is there to send to (:class:`TopicLookup`, from the cluster's
  metadata): found, missing (made here under ``--create-topics``), or there but
  not granted; and how many partitions it has.
- Each topic's largest message: the topic's ``max.message.bytes``
  (DescribeConfigs), which may be below the producer's ``message.max.bytes``. A
  message over it is refused by the broker, in a delivery report that names its
  whole record batch; found before producing, it is refused alone.
- Creating a topic that is missing, under ``--create-topics``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from outbox_kafka.errors import ConfigurationError
from outbox_kafka.relay.batch import Problem, Verdict

log = logging.getLogger("outbox_kafka.publisher")

#: How long a topic's max.message.bytes, as the broker told it, is trusted: read
#: again after that, so that a limit an operator raises takes effect.
TOPIC_LIMIT_SECONDS = 60.0

#: After a failed metadata request, lookups fail fast for this long.
METADATA_RETRY_SECONDS = 2.0

#: How long a topic found missing (or not granted) is taken to be so, before the
#: broker is asked again.
MISSING_TOPIC_SECONDS = 2.0

#: Errors of a topic the metadata lists that the relay may not send to, as it is (not
#: visible, not granted): its events wait, whether or not topics are created.
LISTED_BUT_HELD = {
    KafkaError._UNKNOWN_TOPIC,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
}

#: librdkafka's names of the producer's compression setting.
_COMPRESSION_KEYS = ("compression.type", "compression.codec")


class TopicLimits:
    """``limits(topic)``: the largest message ``topic`` takes, or None where the broker
    does not tell it or the producer compresses (a compressed batch may fit a limit its
    messages exceed). Threads may share it: at worst two of them ask the broker at once."""

    def __init__(
        self,
        producer_config: dict[str, Any],
        admin_client: Callable[[], AdminClient],
        timeout: float,
    ) -> None:
        self._compressed = any(producer_config.get(k, "none") != "none" for k in _COMPRESSION_KEYS)
        self._admin_client = admin_client
        self._timeout = timeout
        #: By topic: (its max.message.bytes or None where not told, when it was read).
        self._limits: dict[str, tuple[int | None, float]] = {}

    def __call__(self, topic: str) -> int | None:
        if self._compressed:
            return None
        now = time.monotonic()
        cached = self._limits.get(topic)
        if cached is not None and now - cached[1] < TOPIC_LIMIT_SECONDS:
            return cached[0]
        limit: int | None = None
        try:
            resource = ConfigResource(ResourceType.TOPIC, topic)
            futures = self._admin_client().describe_configs(
                [resource], request_timeout=self._timeout
            )
            entry = futures[resource].result(self._timeout + 1).get("max.message.bytes")
            limit = int(entry.value)
        except Exception:
            limit = None  # the broker's answer to the send decides
        self._limits[topic] = (limit, now)
        return limit


def admin_client(config: dict[str, Any]) -> AdminClient:
    """An admin client with ``config``; :class:`ConfigurationError` for settings the
    client refuses."""
    try:
        return AdminClient(config)
    except (KafkaException, ValueError, TypeError) as exc:
        raise ConfigurationError(f"invalid Kafka configuration: {exc}") from None


class TopicLookup:
    """``problem(topic)``: why ``topic`` cannot be sent to now, or None; thread-safe.

    ``list_topics(topic, timeout)`` asks the cluster's metadata (every topic when
    ``topic`` is None), through whichever producer the relay has at the time. Topics
    found whole are remembered until :meth:`forget`; a topic found missing or not
    granted is taken to be so for :data:`MISSING_TOPIC_SECONDS`; after a failed
    request every lookup fails fast (RETRIABLE) for :data:`METADATA_RETRY_SECONDS`
    rather than waiting again per event. With ``create_partitions`` a missing topic
    is made (:func:`create_topic`).
    """

    def __init__(
        self,
        list_topics: Callable[[str | None, float], Any],
        admin_client: Callable[[], AdminClient],
        create_partitions: int | None,
        timeout: float,
    ) -> None:
        self._list_topics = list_topics
        self._admin_client = admin_client
        self._create_partitions = create_partitions
        self._timeout = timeout
        self._known: set[str] = set()
        #: By topic: why it cannot be sent to, and until when that answer is used.
        self._missing: dict[str, tuple[Problem, float]] = {}
        #: By topic: (its partition count, when it was read).
        self._partitions: dict[str, tuple[int, float]] = {}
        self._retry_at = 0.0
        self._metadata_error = ""
        #: Held while a topic unknown so far is looked up (and created): lookups that
        #: found it missing together would each create it, and each log that they did.
        self._lock = threading.Lock()

    def problem(self, topic: str) -> Problem | None:
        """``(verdict, reason)`` if messages to ``topic`` cannot be sent now."""
        if topic in self._known:
            return None
        with self._lock:
            return self._look_up(topic)

    def forget(self, topic: str | None = None) -> None:
        """Look ``topic`` (every topic, when None) up again before its next message:
        it went away since it was seen, or an operator may have mended it."""
        if topic is None:
            self._known.clear()
            self._missing.clear()
            self._retry_at = 0.0  # asked again at once, whatever the last request did
        else:
            self._known.discard(topic)

    def _look_up(self, topic: str) -> Problem | None:
        if topic in self._known:
            return None  # another thread found it, or created it, meanwhile
        now = time.monotonic()
        missing = self._missing.get(topic)
        if missing is not None and now < missing[1]:
            return missing[0]
        if now < self._retry_at:
            # The last request failed moments ago: do not block on it again per event.
            return Verdict.RETRIABLE, self._metadata_error
        try:
            metadata = self._list_topics(None, self._timeout)
        except KafkaException as exc:
            self._failed(exc)
            return Verdict.RETRIABLE, self._metadata_error
        for name, meta in metadata.topics.items():
            if meta.error is None:
                self._known.add(name)
                self._partitions[name] = (len(meta.partitions), time.monotonic())
        if topic in self._known:
            return None
        problem = self._unavailable(topic, metadata)
        if problem is not None:
            self._missing[topic] = (problem, time.monotonic() + MISSING_TOPIC_SECONDS)
        return problem

    def _failed(self, exc: KafkaException) -> None:
        self._metadata_error = f"METADATA_UNAVAILABLE: cannot read topic metadata: {exc}"
        self._retry_at = time.monotonic() + METADATA_RETRY_SECONDS

    def _unavailable(self, topic: str, metadata: Any) -> Problem | None:
        """Why ``topic``, not among the topics ``metadata`` lists whole, cannot be
        sent to: missing (made here with ``create_partitions``) or not granted."""
        listed = metadata.topics.get(topic)
        if listed is None:
            # The cluster's list leaves out what this principal may not describe:
            # asked by name, the broker says whether it is missing or not granted.
            try:
                listed = self._list_topics(topic, self._timeout).topics.get(topic)
            except KafkaException:
                listed = None
            if listed is not None and listed.error is None:
                self._known.add(topic)
                return None
        error = listed.error if listed is not None else None
        if isinstance(error, KafkaError) and error.code() in LISTED_BUT_HELD:
            # The topic is there, but this relay may not see or write it.
            return (
                Verdict.HELD,
                f"{error.name()}: {error.str()} (topic {topic!r}; its events wait)",
            )
        if not self._create_partitions:
            return (
                Verdict.HELD,
                f"UNKNOWN_TOPIC: topic {topic!r} does not exist and topic creation is off "
                "(create it, or run the relay with --create-topics <partitions>; its "
                "events wait)",
            )
        try:
            admin = self._admin_client()
        except ConfigurationError:
            raise  # settings the relay refuses: said as such, not waited on
        except Exception as exc:
            return _cannot_create(topic, f"{type(exc).__name__}: {exc}")
        problem = create_topic(admin, topic, self._create_partitions)
        if problem is None:
            self._known.add(topic)
        return problem

    def partition_count(self, topic: str) -> int | None:
        """How many partitions ``topic`` has (read again after a minute, so that
        partitions an operator adds are used); None when its metadata cannot be read."""
        now = time.monotonic()
        cached = self._partitions.get(topic)
        if cached is not None and now - cached[1] < TOPIC_LIMIT_SECONDS:
            return cached[0]
        if now < self._retry_at:
            # The last request failed moments ago: do not block on it again per key.
            return None if cached is None else cached[0]
        try:
            metadata = self._list_topics(topic, self._timeout)
        except KafkaException as exc:
            self._failed(exc)
            return None if cached is None else cached[0]
        listed = metadata.topics.get(topic)
        if listed is None or listed.error is not None or not listed.partitions:
            return None if cached is None else cached[0]
        self._partitions[topic] = (len(listed.partitions), now)
        return len(listed.partitions)


def _cannot_create(topic: str, why: str) -> Problem:
    """Why ``topic`` was not made: its events wait (HELD)."""
    return (
        Verdict.HELD,
        f"CREATE_TOPIC_FAILED: cannot create topic {topic!r}: {why} (its events wait)",
    )


def create_topic(admin: AdminClient, topic: str, partitions: int) -> Problem | None:
    """Create ``topic`` with ``partitions`` partitions (the broker's replication factor);
    None once it exists (made here, or by another process first), else why not: its
    events wait (HELD). A request that times out, or that the client refuses, is such
    a why, not an exception."""
    try:
        futures = admin.create_topics([NewTopic(topic, partitions, -1)], request_timeout=10)
        futures[topic].result(timeout=15)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if not (isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
            return _cannot_create(topic, str(exc))
        # Another process created it first: it is there, and that one logged it.
        log.debug("topic already exists", extra={"action": "topic_exists", "topic": topic})
    except Exception as exc:  # a timeout, or a request the client refused outright
        return _cannot_create(topic, f"{type(exc).__name__}: {exc}")
    else:
        log.info(
            "created topic",
            extra={"action": "create_topic", "topic": topic, "partitions": partitions},
        )
    return None
