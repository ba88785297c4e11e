"""Reading back what reached Kafka, so that an event in doubt is recorded, not sent twice.

A relay that dies between Kafka's acknowledgement and the database record leaves
events that may be on Kafka although the outbox says they are not. The relay that
takes their key over reads the key's partitions back from where the dead session
began writing (its floor) to the end, finds which of the events are there
(:func:`matches`), records those as delivered and sends only the rest.

- :func:`key_partition` (and its cache, :class:`PartitionCache`) names the
  partition a key goes to, as Kafka's Java client and librdkafka's ``murmur2``
  partitioners choose it: the partition to read back for a key.
- :class:`PartitionReader` reads partitions to their end with its own consumer,
  bounded by a deadline; a partition it could not read to the end is *unproven*,
  with the reason, never silently skipped.
- :func:`matches` pairs the messages read with the events in doubt.
- A compacted topic proves nothing by what it lacks (compaction deletes a key's
  older messages), so keys on one are sent again without a read-back: at least
  once, counted (:meth:`PartitionReader.compacted`).

Nothing from confluent_kafka leaves this module: its errors become
:class:`ReadBackError` or an unproven partition.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from outbox_kafka.errors import ConfigurationError, OutboxError
from outbox_kafka.logs import librdkafka_logger
from outbox_kafka.relay.batch import Claim, Doubts, Floor, ReadBackReport, Verdict
from outbox_kafka.relay.decide import FoundOnKafka
from outbox_kafka.relay.ports import Delivery, Found, Message, ReadBack

log = logging.getLogger("outbox_kafka.relay")

if TYPE_CHECKING:
    from outbox_kafka.relay.observe import RelayObserver
    from outbox_kafka.relay.ports import ClaimStore, KafkaReader, MessagePublisher


# --------------------------------------------------------------------------- partitions

_MASK = 0xFFFFFFFF
_M = 0x5BD1E995
_SEED = 0x9747B28C


def murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2`` of ``data``, as Java's ``int`` (signed 32 bits).

    The hash Kafka's Java client and librdkafka's ``murmur2``/``murmur2_random``
    partitioners take of a message key (seed ``0x9747b28c``).
    """
    length = len(data)
    h = _SEED ^ length
    words = length >> 2
    if words:
        for k in struct.unpack_from(f"<{words}I", data):
            k = (k * _M) & _MASK
            k ^= k >> 24
            h = ((h * _M) & _MASK) ^ ((k * _M) & _MASK)
    rest = length & 3
    if rest:
        tail = words << 2
        if rest == 3:
            h ^= data[tail + 2] << 16
        if rest >= 2:
            h ^= data[tail + 1] << 8
        h = ((h ^ data[tail]) * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - 0x100000000 if h & 0x80000000 else h


def key_partition(key: bytes, partitions: int) -> int:
    """The partition of ``partitions`` that a message with ``key`` (not null; empty is a
    key) is sent to by Kafka's Java client and librdkafka's ``murmur2_random`` and
    ``murmur2`` partitioners: ``(murmur2(key) & 0x7FFFFFFF) % partitions``."""
    if partitions <= 0:
        raise ValueError(f"a topic has at least one partition, not {partitions}")
    return (murmur2(key) & 0x7FFFFFFF) % partitions


class PartitionCache:
    """:func:`key_partition` with the answers remembered, for keys seen batch after batch.

    Holds at most ``max_entries`` answers: when full, it is emptied and starts again
    (hot keys come back at once; a bounded memory matters more than the rare miss).
    Not thread-safe: one per relay loop.
    """

    def __init__(self, max_entries: int = 65_536) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, not {max_entries}")
        self.max_entries = max_entries
        self._answers: dict[tuple[bytes, int], int] = {}

    def partition(self, key: bytes, partitions: int) -> int:
        """The same as ``key_partition(key, partitions)``."""
        entry = (key, partitions)
        found = self._answers.get(entry)
        if found is None:
            found = key_partition(key, partitions)
            if len(self._answers) >= self.max_entries:
                self._answers.clear()
            self._answers[entry] = found
        return found

    def __len__(self) -> int:
        return len(self._answers)


# --------------------------------------------------------------------------- what was read


class ReadBackError(OutboxError):
    """Kafka could not be asked, or did not answer in time (read-back side)."""


# --------------------------------------------------------------------------- the reader

#: How long one ``consume`` call waits: it waits that long unless its batch fills, so
#: a longer wait would add itself to every read.
CONSUME_WAIT = 0.05
#: Messages one ``consume`` call takes at most.
CONSUME_BATCH = 10_000

#: Settings of the reader's consumer that the caller's configuration cannot change.
_READER_SETTINGS: dict[str, str] = {
    "enable.auto.commit": "false",
    "enable.auto.offset.store": "false",
    "enable.partition.eof": "true",
    # Whatever reached the log counts, committed or not: a relay's idempotent producer
    # writes no transactions, and librdkafka's consumer default is read_committed.
    "isolation.level": "read_uncommitted",
    # An offset out of range is an error, never a silent jump to another offset.
    "auto.offset.reset": "error",
    "allow.auto.create.topics": "false",
    # A fetch at the end of a partition waits at most this long for more data.
    "fetch.wait.max.ms": "50",
}

#: Codes for an offset the partition does not have (below its log start, or past
#: its end on brokers that say so).
_OUT_OF_RANGE = {KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE}


def reader_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The configuration of a :class:`PartitionReader`'s consumer made from the
    caller's connection settings (``bootstrap.servers``, security): a group id of its
    own that is never committed, no offsets stored, end-of-partition events,
    uncommitted records read, an out-of-range offset an error, librdkafka's logs
    through :func:`~outbox_kafka.logs.librdkafka_logger`."""
    merged: dict[str, Any] = {str(k): v for k, v in config.items()}
    merged.update(_READER_SETTINGS)
    merged["group.id"] = f"outbox-kafka-read-back-{uuid.uuid4().hex}"
    merged["logger"] = librdkafka_logger()
    return merged


def start_problem(start: int, log_start: int | None) -> str | None:
    """Why reading a partition from ``start`` cannot prove what it holds from there,
    given its log start offset where known; None when nothing says so yet.

    A start below the log start names messages already deleted: what they were
    cannot be read back, so the gap is reported, never skipped.
    """
    if start < 0:
        return f"start offset {start} is not an offset"
    if log_start is not None and start < log_start:
        return (
            f"start offset {start} is below the log start {log_start}: "
            "the messages between were deleted"
        )
    return None


class PartitionReader:
    """Reads partitions from given offsets to their end, with one consumer of its own.

    The consumer is made on first use from ``config`` (the relay's Kafka connection
    settings: ``bootstrap.servers``, security; see :func:`reader_config` for what is
    added) by ``make_consumer`` (librdkafka's ``Consumer``; tests pass their own). It
    joins no group: partitions are assigned by hand and no offset is committed.
    Not thread-safe: one reader per relay loop.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        make_consumer: Callable[[dict[str, Any]], Consumer] = Consumer,
        make_admin: Callable[[dict[str, Any]], Any] = AdminClient,
    ) -> None:
        self._config = dict(config)
        self._make_consumer = make_consumer
        self._make_admin = make_admin
        self._consumer: Consumer | None = None
        self._admin: Any = None
        #: By topic: whether it is compacted, and when that was asked (monotonic).
        self._compaction: dict[str, tuple[bool | None, float]] = {}

    def _client(self) -> Consumer:
        if self._consumer is None:
            try:
                self._consumer = self._make_consumer(reader_config(self._config))
            except (KafkaException, ValueError, TypeError) as exc:
                raise ConfigurationError(f"invalid Kafka configuration: {exc}") from None
        return self._consumer

    def end_offsets(self, topic: str, partitions: Sequence[int], timeout: float) -> dict[int, int]:
        """Each partition's end offset (high watermark) as the broker lists it now.

        Never past the true end; some brokers answer below it (the test broker can
        answer the last record batch's base offset + 1), so an offset above it is no
        proof that nothing is there: a read to the end (:meth:`read`) is.

        Raises :class:`ReadBackError` when an offset cannot be had within ``timeout``
        seconds in all (a missing topic or partition, no broker answering);
        :class:`~outbox_kafka.errors.ConfigurationError` for settings librdkafka
        refuses.
        """
        consumer = self._client()
        deadline = time.monotonic() + timeout
        ends: dict[int, int] = {}
        for partition in partitions:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReadBackError(
                        f"timed out after {timeout:g} s reading the end offset of {topic!r} "
                        f"partition {partition}"
                    )
                try:
                    _low, high = consumer.get_watermark_offsets(
                        TopicPartition(topic, partition), timeout=left, cached=False
                    )
                except KafkaException as exc:
                    err = exc.args[0] if exc.args else None
                    if isinstance(err, KafkaError) and err.code() == KafkaError._UNKNOWN_PARTITION:
                        # A topic new to this consumer: its metadata comes first.
                        listed = self._load_metadata(consumer, topic, deadline)
                        if listed is None or partition in listed:
                            continue
                    raise ReadBackError(
                        f"cannot read the end offset of {topic!r} partition {partition}: "
                        f"{_describe(exc)}"
                    ) from None
                except RuntimeError as exc:  # the consumer was closed under us
                    raise ReadBackError(f"cannot read end offsets: {exc}") from None
                ends[partition] = high
                break
        return ends

    @staticmethod
    def _load_metadata(consumer: Consumer, topic: str, deadline: float) -> set[int] | None:
        """Ask for ``topic``'s metadata, so that the consumer knows its partitions, and
        return them; None (after a short pause) when the topic is not listed yet."""
        try:
            listed = consumer.list_topics(topic, timeout=max(0.01, deadline - time.monotonic()))
        except KafkaException as exc:
            raise ReadBackError(
                f"cannot read the metadata of {topic!r}: {_describe(exc)}"
            ) from None
        meta = listed.topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            return None
        return set(meta.partitions)

    def read(
        self,
        starts: Mapping[tuple[str, int], int],
        keys: Collection[bytes],
        deadline: float,
    ) -> ReadBack:
        """Read every (topic, partition) of ``starts`` from its start offset to its
        end; keep the messages whose key is in ``keys``.

        Reads until every partition is complete (its end-of-partition event came) or
        unproven (it does not exist, its start is out of range, its start is below
        the log start, the consumer reported an error for it), or until ``deadline``
        (a ``time.monotonic()`` value): what is still being read then is unproven.
        A start past the end is not complete before the deadline on every broker (the
        test broker gives neither an end nor an error there). Never raises for what
        Kafka answers: every failure is an unproven partition;
        :class:`~outbox_kafka.errors.ConfigurationError` for settings librdkafka
        refuses.
        """
        result = ReadBack()
        if not starts:
            return result
        consumer = self._client()
        pending: dict[tuple[str, int], int] = {}
        for tp, start in starts.items():
            problem = start_problem(start, None)
            if problem is not None:
                result.unproven[tp] = problem
            else:
                pending[tp] = start
        self._drop_missing(consumer, pending, result, deadline)
        if not pending:
            return result
        try:
            consumer.assign([TopicPartition(t, p, start) for (t, p), start in pending.items()])
        except (KafkaException, RuntimeError) as exc:
            self._give_up(pending, result, f"cannot assign: {_describe(exc)}")
            return result
        try:
            self._read_assigned(consumer, pending, frozenset(keys), deadline, result)
        finally:
            try:
                consumer.unassign()
            except (KafkaException, RuntimeError):
                self._discard()
        return result

    def _drop_missing(
        self,
        consumer: Consumer,
        pending: dict[tuple[str, int], int],
        result: ReadBack,
        deadline: float,
    ) -> None:
        """Move the partitions that the broker's metadata says do not exist (or cannot
        be listed by the deadline) from ``pending`` to ``result.unproven``."""
        for topic in sorted({t for t, _ in pending}):
            asked = [tp for tp in pending if tp[0] == topic]
            try:
                metadata = consumer.list_topics(
                    topic, timeout=max(0.1, deadline - time.monotonic())
                )
            except (KafkaException, RuntimeError) as exc:
                reason = f"cannot read the topic's metadata: {_describe(exc)}"
                for tp in asked:
                    result.unproven[tp] = reason
                    del pending[tp]
                continue
            listed = metadata.topics.get(topic)
            error = listed.error if listed is not None else None
            if listed is None or error is not None:
                why = _describe(error) if error is not None else "not in the metadata"
                for tp in asked:
                    result.unproven[tp] = f"topic {topic!r} cannot be read: {why}"
                    del pending[tp]
                continue
            count = len(listed.partitions)
            for tp in asked:
                if tp[1] not in listed.partitions:
                    result.unproven[tp] = (
                        f"partition {tp[1]} of {topic!r} does not exist (it has {count})"
                    )
                    del pending[tp]

    def _read_assigned(
        self,
        consumer: Consumer,
        pending: dict[tuple[str, int], int],
        keys: frozenset[bytes],
        deadline: float,
        result: ReadBack,
    ) -> None:
        """Consume the assigned partitions until none is pending or ``deadline``."""
        found = result.found
        last_error = ""
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch = consumer.consume(CONSUME_BATCH, min(CONSUME_WAIT, left))
            except (KafkaException, RuntimeError) as exc:
                self._give_up(pending, result, f"consumer failed: {_describe(exc)}")
                self._discard()
                return
            events = 0
            for msg in batch:
                # One call and one set lookup for most messages: events (end of
                # partition, errors) have no key, nor do messages sent without one.
                key = msg.key()
                if key is not None:
                    if key in keys and msg.error() is None:
                        found.append(_found(msg, key))
                    continue
                error = msg.error()
                if error is None:
                    continue
                events += 1
                tp = (msg.topic() or "", msg.partition() or 0)
                code = error.code()
                if code == KafkaError._PARTITION_EOF:
                    start = pending.get(tp)
                    offset = msg.offset() or 0
                    if start is not None and offset >= start:
                        del pending[tp]
                        result.complete.add(tp)
                    if tp in result.complete:
                        result.ends[tp] = offset
                elif msg.topic() is not None and tp in pending:
                    del pending[tp]
                    result.unproven[tp] = _partition_error(error)
                elif error.fatal():
                    self._give_up(pending, result, f"consumer failed: {_describe(error)}")
                    self._discard()
                    return
                else:
                    last_error = _describe(error)
            result.read += len(batch) - events
        if pending:
            positions = self._positions(consumer, pending)
            for tp, start in pending.items():
                at = positions.get(tp)
                where = f"at offset {at}" if at is not None and at >= 0 else "before any message"
                reason = f"deadline reached {where} (read from {start}, no end seen)"
                if last_error:
                    reason += f"; last consumer error: {last_error}"
                result.unproven[tp] = reason
            pending.clear()

    @staticmethod
    def _positions(
        consumer: Consumer, pending: Mapping[tuple[str, int], int]
    ) -> dict[tuple[str, int], int]:
        """Each pending partition's next offset to read, where the consumer tells it."""
        try:
            positions = consumer.position([TopicPartition(t, p) for t, p in pending])
        except (KafkaException, RuntimeError):
            return {}
        return {(tp.topic, tp.partition): tp.offset for tp in positions}

    @staticmethod
    def _give_up(pending: dict[tuple[str, int], int], result: ReadBack, reason: str) -> None:
        for tp in pending:
            result.unproven[tp] = reason
        pending.clear()

    def compacted(self, topic: str, timeout: float) -> bool | None:
        """Whether ``topic``'s ``cleanup.policy`` includes ``compact``; None when the
        broker does not say: it answers without the setting, does not know the topic,
        or the relay may not describe it (no DescribeConfigs right). Each answer is
        kept :data:`COMPACTION_CHECK_SECONDS`.

        Raises :class:`ReadBackError` when no answer came within ``timeout`` seconds
        (a broker slow or away): nothing is known then, and nothing is kept."""
        now = time.monotonic()
        cached = self._compaction.get(topic)
        if cached is not None and now - cached[1] < COMPACTION_CHECK_SECONDS:
            return cached[0]
        answer = self._cleanup_policy(topic, timeout)
        compacted = None if answer is None else "compact" in answer.replace(" ", "").split(",")
        if compacted is None and topic not in self._compaction:
            log.warning(
                "the broker does not tell whether topic %r is compacted (no DescribeConfigs "
                "right, or no cleanup.policy in its answer): its keys in doubt are read back "
                "as if it were not",
                topic,
                extra={"action": "cleanup_policy_unknown", "topic": topic},
            )
        self._compaction[topic] = (compacted, now)
        return compacted

    def _cleanup_policy(self, topic: str, timeout: float) -> str | None:
        wait = max(0.1, timeout)
        try:
            if self._admin is None:
                config = {str(k): v for k, v in self._config.items()}
                config["logger"] = librdkafka_logger()
                self._admin = self._make_admin(config)
            resource = ConfigResource("topic", topic)
            futures = self._admin.describe_configs([resource], request_timeout=wait)
            entries = next(iter(futures.values())).result(timeout=wait)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.code() in _POLICY_NOT_TOLD:
                return None
            raise ReadBackError(
                f"cannot read the cleanup policy of topic {topic!r}: {_describe(exc)}"
            ) from None
        except TimeoutError:
            raise ReadBackError(
                f"no answer about the cleanup policy of topic {topic!r} within {wait:g} s"
            ) from None
        except (ValueError, TypeError, RuntimeError, StopIteration) as exc:
            raise ReadBackError(
                f"cannot read the cleanup policy of topic {topic!r}: {exc}"
            ) from None
        entry = entries.get("cleanup.policy") if isinstance(entries, Mapping) else None
        value = getattr(entry, "value", None)
        return value if isinstance(value, str) else None

    def _discard(self) -> None:
        """Drop a consumer that failed: the next call makes a new one."""
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(KafkaException, RuntimeError):
                consumer.close()

    def close(self) -> None:
        """Close the consumer and let the admin client go (later calls make new ones)."""
        self._discard()
        self._admin = None


def _found(msg: Any, key: bytes) -> Found:
    headers = msg.headers()
    return Found(
        msg.topic(),
        msg.partition(),
        msg.offset(),
        key,
        msg.value() or b"",
        [(name, value or b"") for name, value in headers] if headers else [],
    )


def _partition_error(error: KafkaError) -> str:
    """Why a partition the consumer reported ``error`` for is unproven."""
    if error.code() in _OUT_OF_RANGE:
        return (
            "start offset out of range: below the log start (the messages there were "
            f"deleted) or past the end ({_describe(error)})"
        )
    return f"consumer error: {_describe(error)}"


def _describe(error: object) -> str:
    """An error's name and text, without confluent-kafka's wrapping."""
    if isinstance(error, KafkaException) and error.args:
        error = error.args[0]
    if isinstance(error, KafkaError):
        return f"{error.name()}: {error.str()}"
    return str(error)


# --------------------------------------------------------------------------- matching


class Candidate(NamedTuple):
    """An event in doubt, as the relay would send it: the message to look for."""

    event_id: str
    key: bytes
    topic: str
    value: bytes
    headers: list[tuple[str, bytes]]


def matches(found: Iterable[Found], candidates: Iterable[Candidate]) -> dict[str, Found]:
    """Which ``candidates`` are on Kafka, by event id: the message read back for each.

    A message is a candidate's when its topic, key and value bytes are the
    candidate's and it carries the candidate's id: under each header name the
    candidate carries the id in (``ce_id`` in binary mode, the outbox's id header),
    or, for a candidate whose headers do not carry it, in the value (the structured
    envelope's ``id``; the relay checks it is the event id before sending). Another
    outbox's message with the same id but other data, or the same data under another
    id, is not the candidate's.

    Each message is at most one candidate's and each candidate has at most one
    message: the first by offset (a later copy is a duplicate). Among candidates
    that one message could be (same topic, key, value and id carrier), the first
    given takes it. Event ids are unique among ``candidates`` (one outbox's events);
    a repeated id raises ``ValueError``.
    """
    by_message: dict[tuple[str, bytes, bytes], list[tuple[Candidate, list[tuple[str, bytes]]]]]
    by_message = {}
    seen: set[str] = set()
    for candidate in candidates:
        if candidate.event_id in seen:
            raise ValueError(f"event id {candidate.event_id!r} is given twice")
        seen.add(candidate.event_id)
        ident = candidate.event_id.encode()
        carriers = [(name, value) for name, value in candidate.headers if value == ident]
        if not carriers and ident not in candidate.value:
            continue  # nothing a message could carry its id in: it matches none
        entry = (candidate, carriers)
        by_message.setdefault((candidate.topic, candidate.key, candidate.value), []).append(entry)

    result: dict[str, Found] = {}
    for message in sorted(found, key=lambda m: (m.topic, m.partition, m.offset)):
        waiting = by_message.get((message.topic, message.key, message.value))
        if not waiting:
            continue
        for i, (candidate, carriers) in enumerate(waiting):
            if all(carrier in message.headers for carrier in carriers):
                result[candidate.event_id] = message
                del waiting[i]
                break
    return result


# The recovery step ---------------------------------------------------------------

#: How long a relay session lasts at most: its floors are forgotten a day after it
#: ends, once no key names it (see forget_floors in queries.sql).
SESSION_SECONDS = 24 * 3600.0

#: The floors of a session are kept this long at least (and while a key names it).
FLOOR_RETENTION_SECONDS = 2 * SESSION_SECONDS

#: How many of the latest sessions a relay keeps in memory (their batches may still
#: be in flight or being recorded).
_SESSIONS_KEPT = 8

#: Time kept between the end of a read-back and the lease's last moment to send.
READ_BACK_MARGIN = 0.5

#: How long an unproven key waits before its read-back is tried again.
UNPROVEN_RETRY_SECONDS = 5.0

#: How long a topic's cleanup policy is kept before it is asked again.
COMPACTION_CHECK_SECONDS = 300.0

#: DescribeConfigs errors that mean the broker will not tell a topic's cleanup policy
#: (the topic is then taken as not compacted); any other error is no answer yet.
_POLICY_NOT_TOLD = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.UNSUPPORTED_VERSION,
        KafkaError.INVALID_REQUEST,
    }
)


class Session:
    """One relay loop's producer session: its id, the partition count it produces each
    topic under, and the partitions it has opened floors on.

    A session is closed (its floors are never raised again) once one of its messages
    may be on Kafka unrecorded while the relay goes on: an outcome in doubt, a lease
    lost, a topic whose partition count changed. The relay's next claims then belong
    to a new session.
    """

    def __init__(self, started: float) -> None:
        self.id = uuid.uuid4()
        self.started = started
        #: By topic: the partition count the session computes partitions with.
        self.partitions: dict[str, int] = {}
        #: By (topic, partition): the floor the session wrote there.
        self.opened: dict[tuple[str, int], int] = {}
        self.closed = False


class Recovery:
    """Exactly once across crashes: the relay's sessions, their floors, and the
    read-back of keys in doubt before they are sent again."""

    def __init__(
        self,
        store: ClaimStore,
        publisher: MessagePublisher,
        reader: KafkaReader,
        *,
        observer: RelayObserver,
        dead_letter_topic: str | None,
        resend_unproven: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._observer = observer
        self._store = store
        self._publisher = publisher
        self._reader = reader
        self._dead_letter_topic = dead_letter_topic
        self._resend_unproven = resend_unproven
        self._clock = clock
        self._partitions = PartitionCache()
        self._current = Session(clock())
        #: The sessions batches in flight may belong to, by id.
        self._sessions: dict[uuid.UUID, Session] = {self._current.id: self._current}
        self._lock = threading.Lock()

    # Sessions ------------------------------------------------------------------

    def session(self) -> uuid.UUID:
        """The session a new claim belongs to: a new one once the last is closed or old."""
        with self._lock:
            current = self._current
            if current.closed or self._clock() - current.started > SESSION_SECONDS:
                current.closed = True
                current = self._current = Session(self._clock())
                self._sessions[current.id] = current
                # A batch in flight belongs to one of the last sessions at most (its
                # claim was read ahead by one cycle): older ones are let go.
                for old in list(self._sessions)[:-_SESSIONS_KEPT]:
                    del self._sessions[old]
            return current.id

    def close(self, session: uuid.UUID | None) -> None:
        """Raise ``session``'s floors no more: one of its messages may be on Kafka
        unrecorded."""
        if session is None:
            return
        with self._lock:
            found = self._sessions.get(session)
            if found is not None:
                found.closed = True

    def is_open(self, session: uuid.UUID | None) -> bool:
        with self._lock:
            found = self._sessions.get(session) if session is not None else None
            return found is not None and not found.closed

    # Before a send -------------------------------------------------------------

    def partition_of(self, session: uuid.UUID | None) -> Callable[[str, bytes], int | None]:
        """How the batch of ``session`` places a key's messages on a topic's partitions:
        with the partition count the session produces the topic under."""
        found = self._sessions.get(session) if session is not None else None
        if found is None:
            return lambda topic, key: None
        counts = found.partitions
        #: By topic, for this batch: the count its keys are placed under (asked once).
        batch_counts: dict[str, int | None] = {}
        place_key = self._partitions.partition

        def partition(topic: str, key: bytes) -> int | None:
            if topic in batch_counts:
                count = batch_counts[topic]
            else:
                count = counts.get(topic)
                now = self._publisher.partition_count(topic)
                if count is None:
                    if now is not None:
                        count = counts[topic] = now
                elif now is not None and now != count:
                    found.closed = True  # the next session produces under the new count
                batch_counts[topic] = count
            return None if count is None else place_key(key, count)

        return partition

    def place(
        self, session: uuid.UUID | None, messages: Sequence[Message], timeout: float
    ) -> list[Message]:
        """``messages`` each with its partition (those planned without one, such as
        dead-letter copies, placed now), after ``session``'s floors on the partitions
        new to it are written and committed: they are produced only then. Raises
        :class:`ReadBackError` or :class:`~outbox_kafka.errors.StorageError` when that
        cannot be done: the messages must not be sent then."""
        found = self._sessions.get(session) if session is not None else None
        if found is None:
            return list(messages)
        placed = list(messages)
        if {(m.topic, m.partition) for m in placed} <= found.opened.keys():
            # The common case: every message planned on a partition opened already (a
            # message without a partition, (topic, None), is never among them).
            return placed
        partition_of = self.partition_of(session)
        new: dict[str, set[int]] = {}
        for i, message in enumerate(placed):
            partition = message.partition
            if partition is None:
                partition = partition_of(message.topic, message.key)
                if partition is None:
                    raise ReadBackError(
                        f"cannot place messages on topic {message.topic!r}: its partition "
                        "count is not known (no metadata)"
                    )
                placed[i] = message._replace(partition=partition)
            if (message.topic, partition) not in found.opened:
                new.setdefault(message.topic, set()).add(partition)
        if not new:
            return placed
        floors: list[Floor] = []
        for topic, partitions in new.items():
            ends = self._reader.end_offsets(topic, sorted(partitions), timeout)
            count = found.partitions[topic]
            floors.extend(
                Floor(str(found.id), topic, p, count, ends[p]) for p in sorted(partitions)
            )
        self._store.open_floors(found.id, floors)
        found.opened.update(((f.topic, f.partition), f.offset) for f in floors)
        return placed

    def unproven(self, claim: Claim, why: str) -> FoundOnKafka:
        """Every key in doubt of ``claim`` unproven, for ``why``."""
        found = FoundOnKafka(retry_seconds=UNPROVEN_RETRY_SECONDS)
        doubtful = [k for k in claim.keys if k.doubt]
        if not self._resend_unproven:
            found.unproven.update((k.key, why) for k in doubtful)
        self._observer.read_back(
            ReadBackReport(
                keys=len(doubtful),
                unproven=len(found.unproven),
                resent_unproven=len(doubtful) - len(found.unproven),
                why_unproven=why,
            )
        )
        return found

    def read_back(self, claim: Claim, deadline: float) -> FoundOnKafka:
        """Read Kafka back for the claim's keys in doubt, until ``deadline``."""
        recovered = FoundOnKafka(retry_seconds=UNPROVEN_RETRY_SECONDS)
        doubtful = [k for k in claim.keys if k.doubt]
        report = ReadBackReport(keys=len(doubtful))
        if not doubtful:
            return recovered
        started = self._clock()
        candidates: list[Candidate] = []
        copies: list[Candidate] = []
        topics: set[str] = set()
        for key in doubtful:
            key_bytes = key.key.encode()
            for event in key.events:
                candidates.append(
                    Candidate(
                        event.event_id, key_bytes, event.topic, event.value, event.headers or []
                    )
                )
                topics.add(event.topic)
                if self._dead_letter_topic is not None:
                    # A copy carries the event's id in its outbox_event_id header.
                    copied = [("outbox_event_id", event.event_id.encode())]
                    copies.append(
                        Candidate(
                            event.event_id, key_bytes, self._dead_letter_topic, event.value, copied
                        )
                    )
        if self._dead_letter_topic is not None and candidates:
            topics.add(self._dead_letter_topic)
        compacted = {
            topic
            for topic in sorted(topics)
            if self._reader.compacted(topic, deadline - self._clock())
        }
        if compacted:
            # What a compacted topic lacks proves nothing: those keys are sent
            # again whole, in order, as an at-least-once relay would.
            skipped = {
                k.key
                for k in doubtful
                if self._dead_letter_topic in compacted
                or any(e.topic in compacted for e in k.events)
            }
            report.compacted = len(skipped)
            doubtful = [k for k in doubtful if k.key not in skipped]
            candidates = [c for c in candidates if c.key.decode() not in skipped]
            copies = [c for c in copies if c.key.decode() not in skipped]
        sessions = sorted({s for key in doubtful for s in key.doubt})
        floors = self._store.read_floors(sessions, sorted(topics))
        by_session_topic: dict[tuple[str, str], dict[int, Floor]] = {}
        for floor in floors:
            by_session_topic.setdefault((floor.session, floor.topic), {})[floor.partition] = floor
        starts: dict[tuple[str, int], int] = {}
        where: dict[str, set[tuple[str, int]]] = {}
        for key in doubtful:
            key_bytes = key.key.encode()
            places = where.setdefault(key.key, set())
            for session in key.doubt:
                for topic in topics:
                    opened = by_session_topic.get((session, topic))
                    if not opened:
                        continue  # the session never produced to the topic
                    count = next(iter(opened.values())).partitions
                    partition = self._partitions.partition(key_bytes, count)
                    start = opened.get(partition)
                    if start is None:
                        continue  # nor to the key's partition
                    pair = (topic, partition)
                    places.add(pair)
                    starts[pair] = min(starts.get(pair, start.offset), start.offset)
        back = (
            self._reader.read(starts, {k.key.encode() for k in doubtful}, deadline)
            if starts
            else ReadBack()
        )
        report.partitions = len(starts)
        report.read = back.read
        found = matches(back.found, candidates)
        found_copies = matches(back.found, copies) if copies else {}
        for key in doubtful:
            unproven = [back.unproven[p] for p in where[key.key] if p in back.unproven]
            if unproven and not self._resend_unproven:
                recovered.unproven[key.key] = unproven[0]
                continue
            if unproven:
                report.resent_unproven += 1
                report.why_unproven = report.why_unproven or unproven[0]
            for event in key.events:
                on_topic = found.get(event.event_id)
                if on_topic is not None:
                    recovered.deliveries[event.event_id] = _delivered(on_topic)
                elif not unproven:
                    report.absent += 1
                if self._dead_letter_topic is not None:
                    copy = found_copies.get(event.event_id)
                    if copy is not None:
                        recovered.copies[event.event_id] = _delivered(copy)
        report.matched = len(recovered.deliveries) + len(recovered.copies)
        report.unproven = len(recovered.unproven)
        report.why_unproven = next(iter(recovered.unproven.values()), None)
        report.seconds = self._clock() - started
        self._observer.read_back(report)
        return recovered

    # After a send --------------------------------------------------------------

    def doubts(
        self,
        session: uuid.UUID,
        claim: Claim,
        handed: Sequence[tuple[Message, Delivery]],
    ) -> Doubts:
        """What a batch leaves in doubt (``handed``: every message handed to the
        publisher, with its delivery), and how far the session's floors may rise.

        A key with a message that may be on Kafka unacknowledged is in doubt about
        the session up to the last of its events claimed (the doubt ends once the
        key's next_seq has passed it)."""
        # One pass over the batch (it runs for every batch): the keys with a message
        # in doubt (Delivery.in_doubt), and the end of what was delivered on each
        # partition.
        in_doubt: set[bytes] = set()
        ends: dict[tuple[str, int], int] = {}
        delivered = Verdict.DELIVERED
        for m, d in handed:
            if d.verdict == delivered:
                offset, partition = d.offset, d.partition
                if offset is not None and partition is not None:
                    pair = (m.topic, partition)
                    if offset >= ends.get(pair, 0):
                        ends[pair] = offset + 1
            elif d.sent and (not d.reported or d.may_have_landed):
                in_doubt.add(m.key)
        doubtful = (
            {k.key: k.events[-1].seq for k in claim.keys if k.events and k.key.encode() in in_doubt}
            if in_doubt
            else {}
        )
        floors: dict[tuple[str, int], int] = {}
        if doubtful:
            self.close(session)
        else:
            floors = ends
            found = self._sessions.get(session)
            opened = found.opened if found is not None else {}
            if any(offset <= opened.get(pair, 0) for pair, offset in floors.items()):
                # The partition's log went back below the session's floor (a broker
                # that lost its data, a topic made again): the floor proves nothing
                # there any more, and a new session starts from the log's new end.
                self.close(session)
        return Doubts(session, doubtful, floors)

    def forget_floors(self, older_seconds: float = FLOOR_RETENTION_SECONDS) -> None:
        """Forget the floors of old sessions no key names any more."""
        self._store.forget_floors(older_seconds)

    def close_reader(self) -> None:
        self._reader.close()


def _delivered(found: Found) -> Delivery:
    return Delivery(
        Verdict.DELIVERED, found.partition, found.offset, None, sent=True, reported=True
    )
